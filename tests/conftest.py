"""Tests never touch the hub: offline mode is set before transformers/diffusers are imported.

Where a new test goes (docs/testing.md maps every file):
- an equation, a reward, a task or a script's own path on hand numbers → test_<script>.py
  (test_common.py for common.py and utils/);
- a bad flag, file, model or reward that must end in one `error:` line → test_bad_input.py;
- anything about --resume, a killed run or a checkpoint → test_resume.py;
- more than one process → test_distributed.py (DDP) or test_fsdp.py (--fsdp);
- precision, token budgets, mini-/micro-batches or the row sampler → test_precision_and_budgets.py;
- the Python tool's isolation → test_python_tool.py; line length, imports → test_style.py;
- SmolLM2 → test_real_model.py (marker `real`; a notebook's REAL run → test_notebooks.py);
  an "it learns" claim → its script's file, `slow`.

`make test-fast` leaves out the markers `slow`, `real` and `long`: mark `long` any test that trains
for more than a few seconds or starts other processes (pytest --durations=20 shows them).
"""

import fcntl
import itertools
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs 2 workers: one thread each
    os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def flow_grpo_cache(tmp_path_factory):
    """One cache of flow_grpo's toy base model and reward classifier (seed 0, ~20 s to train) for
    the whole session, shared by the xdist workers: the first to get the lock trains it, the other
    waits and reads the file."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "flow_grpo_cache"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / "ready").exists():
            import torch

            import flow_grpo
            from envs import digits

            args = flow_grpo.Args(cache_dir=str(folder))
            digits.DigitsTask(args, torch.device("cpu"))  # trains and saves, or loads
            (folder / "ready").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """diffusers' tiny SD3 components and a tiny CLIP reward model, saved once, with three prompts:
    (SD3 folder, CLIP folder, prompts file)."""
    from tiny_sd3 import save_tiny_sd3

    folder = tmp_path_factory.mktemp("tiny_sd3")
    sd3, clip = save_tiny_sd3(folder)
    prompts = folder / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\na green bird\n")
    return sd3, clip, prompts


@pytest.fixture
def poison(monkeypatch):
    """poison(module, name, what): the loss function `module.name` returns a NaN loss (what="loss")
    or a finite loss whose gradient is inf (what="gradient norm"). Returns the list of AdamW steps
    taken after the first poisoned loss, for the tests that a non-finite value stops a run before
    its weights step."""
    import torch

    taken, poisoned = [], []
    adamw_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        if poisoned:
            taken.append(self)
        return adamw_step(self, *args, **kwargs)

    def apply(module, name, what):
        loss_fn = getattr(module, name)

        def poisoned_loss(*args, **kwargs):
            loss, *rest = loss_fn(*args, **kwargs)
            poisoned.append(what)
            if what == "loss":
                return (loss * float("nan"), *rest)
            loss.register_hook(lambda grad: grad * float("inf"))
            return (loss, *rest)

        monkeypatch.setattr(module, name, poisoned_loss)
        monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
        return taken

    return apply


def pytest_terminal_summary(terminalreporter):
    """Where the Python tool cannot be isolated its isolation tests do not run: say so loudly, not
    as one skip among many."""
    from envs import sandbox

    problem = sandbox.isolation_problem()
    if problem:
        terminalreporter.write_line(
            f"NOT ISOLATED HERE: {problem}. The Python tool is disabled on this machine and its "
            "isolation tests did not run (tests/test_python_tool.py).",
            red=True,
            bold=True,
        )


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    """Each xdist worker's share of the tests starts with its part of those that train or start
    processes (slow, real, long), a file's together (a module fixture is built once), and ends
    with quick ones. `--dist worksteal` hands worker k the k-th contiguous block of this list and an
    idle worker steals from the end of another's, so the workers end together on quick tests
    instead of one finishing a long test alone."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    shares, quick = [[] for _ in range(workers)], []
    for _, tests in itertools.groupby(items, key=lambda item: item.path):
        tests = list(tests)
        heavy = [t for t in tests if {"slow", "real", "long"} & {m.name for m in t.iter_markers()}]
        min(shares, key=len).extend(heavy)  # the file's heavy tests to the least loaded share
        quick += [t for t in tests if t not in heavy]
    ordered = []
    for k, share in enumerate(shares):
        size = (len(items) - len(ordered)) // (workers - k)  # worksteal's first block for worker k
        fill = max(0, size - len(share))
        ordered += share + quick[:fill]
        quick = quick[fill:]
    items[:] = ordered + quick
