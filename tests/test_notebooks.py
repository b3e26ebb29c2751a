"""Every notebook runs top to bottom with small settings (NOTEBOOK_QUICK=1), every cell tagged
"figure" draws one, every cell the sizes do not reach prints what is stored, full-scale cells
only print their command without a GPU, and the SmolLM2 runs of AgentFlow's and RC-GRPO's laptop
presets that two REAL cells train pass the real-model checks (marker `long`).
Without running them (fast): every source and preset a notebook's stored outputs print is the
current one, so a change to a printed function or preset fails until `make notebooks` runs."""

import ast
import importlib
import inspect
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from utils import cli

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
PRINTED_SOURCE = re.compile(r"inspect\.getsource\(([\w.]+)\)")  # e.g. flowrl.grpo_loss
PRINTED_PRESET = re.compile(r'(\w+)\.PRESETS\["([\w-]+)"\]')  # the full-scale cell's preset


def current(dotted):
    """The object a dotted name such as `flowrl.grpo_loss` names in the current code."""
    module, *attributes = dotted.split(".")
    obj = importlib.import_module(module)
    for name in attributes:
        obj = getattr(obj, name)
    return obj


def stored_stdout(cell):
    return "".join(o.text for o in cell.outputs if o.get("name") == "stdout")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_print_the_current_code(path):
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    sources = [(c, name) for c in cells for name in PRINTED_SOURCE.findall(c.source)]
    stale = [
        name for c, name in sources if inspect.getsource(current(name)) not in stored_stdout(c)
    ]
    presets = {  # (module, preset): the cell that prints it
        m: c for c in cells if "full scale:" in c.source for m in PRINTED_PRESET.findall(c.source)
    }
    for (module, preset), cell in presets.items():
        line = next(l for l in stored_stdout(cell).splitlines() if l.startswith("full scale:"))
        if (
            ast.literal_eval(line.removeprefix("full scale:").strip())
            != current(module).PRESETS[preset]
        ):
            stale.append(f"{module}.PRESETS[{preset!r}]")
    assert sources and presets  # each notebook prints its loss and its full-scale preset
    assert not stale, f"{path.name} prints an older {', '.join(stale)}: run `make notebooks`"


def unsized_cells(book):
    """The code cells whose output the run sizes cannot change: neither they nor any cell they
    take a name from uses TOY or REAL (the tests' sizes differ from the reader's)."""
    sized, cells = {"TOY", "REAL"}, []
    for cell in (c for c in book.cells if c.cell_type == "code"):
        nodes = list(ast.walk(ast.parse(cell.source)))
        used = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if used & sized:
            sized |= {
                n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
        else:
            cells.append(cell)
    return cells


def use_flow_grpo_cache(path, monkeypatch, request):
    """The flow_grpo notebook reads the session's toy cache (FLOW_GRPO_CACHE); the others never ask
    for it, so none of them waits while another worker trains it."""
    if path.stem == "flow_grpo":
        monkeypatch.setenv("FLOW_GRPO_CACHE", str(request.getfixturevalue("flow_grpo_cache")))


def first_step_has_a_gradient_iff_a_group_varies(metrics):
    """With β = 0 the only gradient is the policy gradient: 0 exactly when every group is flat.
    Returns the first step's record."""
    step = json.loads(metrics.read_text().splitlines()[0])
    assert (step["grad_norm"] > 0) if step["zero_var_frac"] < 1 else step["grad_norm"] == 0
    return step


def check_agentflow_real_run(folder):
    """The smollm2-lookup preset at its smallest (one query, G = 2, one turn, one step): the
    sampler scored what the trainer scores, the adapter saved, and (the preset's β = 0) a gradient
    exactly when a group varies."""
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["sampler_logprob_max_dev"] <= 1e-3
    assert (folder / "planner" / "adapter_model.safetensors").exists()
    step = first_step_has_a_gradient_iff_a_group_varies(folder / "metrics.jsonl")
    assert step["turn_samples"] == 2 and step["mean_turns"] == 1


def check_rc_grpo_real_run(folder):
    """The smollm2-bfcl preset on two real BFCL entries, one LoRA arm: one held-out task, the
    sampler scored what the trainer scores, the stage-2 adapter (B = 0 at its start: π = π_ref)
    has a gradient exactly when a group varies, and the saved policy merges stages 1 and 2."""
    summary = json.loads((folder / "summary.json").read_text())
    arm = summary["rctp+rc-grpo"]
    assert summary["test_tasks"] == 1 and arm["sampler_logprob_max_dev"] <= 1e-3
    first_step_has_a_gradient_iff_a_group_varies(folder / "rctp+rc-grpo" / "metrics.jsonl")
    assert (folder / "rctp+rc-grpo" / "policy" / "model.safetensors").exists()


# The SmolLM2 runs of the laptop presets: the notebooks' REAL cells train them (tiny sizes:
# harness.TINY), and the runs are checked here instead of training them a second time.
REAL_RUNS = {
    "agentflow": ("nb_agentflow_smollm2", check_agentflow_real_run),
    "rc_grpo": ("nb_rc_grpo_smollm2", check_rc_grpo_real_run),
}


# a notebook whose REAL cell trains SmolLM2 is `real` too
EXECUTED = [
    pytest.param(path, marks=pytest.mark.real if "smollm2" in path.read_text() else ())
    for path in NOTEBOOKS
]


@pytest.mark.long
@pytest.mark.parametrize("path", EXECUTED, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch, request):
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")
    # NOTE: one OpenMP thread in the kernel: with two on two busy cores, a tiny model's step was
    # measured 40× slower under ipykernel than in a script.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    use_flow_grpo_cache(path, monkeypatch, request)
    book = nbformat.read(path, as_version=4)
    stored = {id(c): stored_stdout(c) for c in book.cells if c.cell_type == "code"}
    workdir = tmp_path / "notebooks"  # runs/ written by the notebook stay in the temporary folder
    workdir.mkdir()
    (workdir / "harness.py").symlink_to(path.parent / "harness.py")
    for name in os.listdir(path.parents[1]):
        # the scripts, what they import, and the data files under tests/
        if name.endswith(".py") or name in ("envs", "utils", "tests"):
            (tmp_path / name).symlink_to(path.parents[1] / name)
    NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    errors = [
        o
        for cell in book.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "error"
    ]
    assert not errors
    # a cell that no run size reaches prints what the stored notebook shows (make notebooks ran it)
    changed = [c.source[:60] for c in unsized_cells(book) if stored_stdout(c) != stored[id(c)]]
    assert not changed, f"{path.name}: stored outputs differ from the current code's: {changed}"
    # every cell tagged "figure" must have drawn one (a backend change can silently blank plots)
    figure_cells = [c for c in book.cells if "figure" in c.metadata.get("tags", [])]
    blank = [
        c.source[:60]
        for c in figure_cells
        if not any("image/png" in o.get("data", {}) for o in c.outputs)
    ]
    assert figure_cells and not blank, blank
    assert len(NOTEBOOKS) == 4
    if path.stem in REAL_RUNS:
        folder, check = REAL_RUNS[path.stem]
        check(workdir / "runs" / folder)


EXERCISE_FLAGS = re.compile(r"`(--[\w-]+(?: [^`]+)?)`")  # e.g. `--careless 0`, `--valleys 1,0.6`


def exercises(path):
    """[(flags, refused)]: each backticked command in the notebook's Exercises cell, and whether its
    sentence says the script refuses it ("read the error")."""
    cell = next(c for c in nbformat.read(path, as_version=4).cells if "## Exercises" in c.source)
    return [
        (flags.split(), "read the error" in sentence)
        for sentence in re.split(r"(?<=\.) ", cell.source)
        for flags in EXERCISE_FLAGS.findall(sentence)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_is_a_command_the_script_takes(path):
    """Each exercise's flags parse and pass the script's checks (or, where the exercise says to
    read the error, give the one-line refusal), without running."""
    module = importlib.import_module(path.stem)
    commands = exercises(path)
    assert len(commands) >= 3
    for flags, refused in commands:
        args = cli.parse_args(module.Args, module.PRESETS, flags)
        if refused:
            with pytest.raises(SystemExit, match="error: --"):
                module.validate(args)
        else:
            module.validate(args)


@pytest.mark.long
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_runs_at_a_small_size(path, tmp_path, monkeypatch, request):
    """Each exercise's command trains its toy for one step at the notebook tests' sizes."""
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")
    use_flow_grpo_cache(path, monkeypatch, request)
    harness = importlib.reload(importlib.import_module("notebooks.harness"))
    module = importlib.import_module(path.stem)
    tiny = harness.sizes(path.stem)[0] | {"steps": 1, "epochs": 1, "eval_every": 1}
    small = [f"--{k.replace('_', '-')}={v}" for k, v in tiny.items() if hasattr(module.Args, k)]
    out = ["--quiet", "--no-ablation"] if path.stem == "agentflow" else ["--quiet"]

    def parse(flags, n):
        return cli.parse_args(
            module.Args, module.PRESETS, [*small, *out, *flags, "--out-dir", str(tmp_path / str(n))]
        )

    for n, (flags, refused) in enumerate(exercises(path)):
        if not refused and parse(flags, n) != parse([], n):  # a default named in the text: no run
            module.train(parse(flags, n))
