"""Run plumbing: the logger (config, JSONL metrics, summary, plots, TensorBoard) and checkpoints
that are atomic and resume where the run stopped (bit-exactly on a CPU; on GPUs up to their
kernels' own nondeterminism)."""

import collections
import contextlib
import dataclasses
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import common
from utils import distributed

RUN_FILES = (  # a run is in the folder
    "metrics.jsonl",
    "summary.json",
    "checkpoint.safetensors",
    "stage1.safetensors",
)
FLAT_STEPS = 3  # steps in a row whose groups all have equal rewards before a run says so


def write_atomically(path, text):
    """Replace `path` with `text` through a temporary file and a rename: a crash leaves the old file
    or the new one, never a truncated one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Phases:
    """A step's seconds per phase, logged for the benchmarks to read: `with phases.time("rollout"):`
    around a phase of the loop; `phases.seconds()` → {time_rollout: s, …} in the order the phases
    ran, and the next step's count starts from zero."""

    def __init__(self):
        self.spent = {}

    @contextlib.contextmanager
    def time(self, name):
        start = time.perf_counter()
        yield
        key = f"time_{name}"
        self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - start

    def seconds(self):
        spent, self.spent = self.spent, {}
        return spent


class StepMetrics:
    """A step's loss statistics, added once per micro-batch and reduced once by `means()`: the loss
    summed over the step's `num_updates` optimiser steps (÷ num_updates: their mean), the largest
    |ρ − 1| (and the first update's, when `add` is told the update's index), the largest gap
    between π_old and the sampler (when `add` is given it), and every other statistic as a mean
    over rows: a tensor per row, or one number per micro-batch weighted by its rows."""

    def __init__(self, num_updates=1):
        self.num_updates = num_updates
        self.loss, self.ratio_dev, self.ratio_dev_first, self.sampler_gap = 0.0, 0.0, None, None
        self.sums, self.rows = collections.defaultdict(float), 0

    def add(self, rows, loss, ratio_dev, update=None, sampler_gap=None, **stats):
        self.loss += loss / self.num_updates
        self.ratio_dev = max(self.ratio_dev, ratio_dev)
        if sampler_gap is not None:  # π_old against the sampler (common.sampler_gap): a max
            self.sampler_gap = max(self.sampler_gap or 0.0, sampler_gap)
        if update == 0:  # on-policy: exactly 0
            self.ratio_dev_first = self.ratio_dev
        self.rows += rows
        for name, value in stats.items():
            mean = value.float().mean() if torch.is_tensor(value) else value
            self.sums[name] += mean * rows

    def means(self):
        maxima = {"ratio_dev": self.ratio_dev}
        if self.ratio_dev_first is not None:
            maxima["ratio_dev_first"] = self.ratio_dev_first
        if self.sampler_gap is not None:
            maxima["sampler_gap"] = self.sampler_gap
        row_means = {name: float(total / max(1, self.rows)) for name, total in self.sums.items()}
        return {"loss": self.loss, **maxima, **row_means}

    def record(self, rewards, group_size, grad_norm, phases):
        """The step's record: these means, the rollout batch's reward (`rewards`: every rank's),
        its spread and share of flat groups, the last optimiser step's gradient norm and each
        phase's seconds."""
        return self.means() | {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "zero_var_frac": common.zero_variance_fraction(rewards, group_size),
            "grad_norm": grad_norm.item(),
            **phases.seconds(),
        }


def largest(records, key):
    """The largest `key` over a run's records (0 where none has it): e.g. the run's sampler gap."""
    return max((record[key] for record in records if key in record), default=0.0)


def latest(records, prefix):
    """The keys under `prefix` of the last record holding any, the prefix dropped ({} where none
    does): e.g. a run's last held-out evaluation, logged as eval_accuracy, eval_mean_turns, …"""
    for record in reversed(records):
        found = {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}
        if found:
            return found
    return {}


def token_counts(completions, micro_batches, epochs=1):
    """{tokens_rollout: this rank's generated tokens, tokens_update: the tokens its update's
    forward passes compute (each distinct prefix once, `common.MicroBatch.tokens`) over `epochs`
    passes}."""
    update = sum(mb.tokens for mb in micro_batches)
    return {"tokens_rollout": sum(len(c) for c in completions), "tokens_update": epochs * update}


class RunLogger:
    """Writes config.json, metrics.jsonl (one line per step), summary.json and PNG curves under
    out_dir; shows a tqdm bar and one compact stdout line per logged step. With
    config["report_to"] == "tensorboard" the same numbers also go to out_dir/tensorboard.

    `records` are the metrics of a resumed run's steps so far: metrics.jsonl is replaced by them
    (through a temporary file) and then appended to, never truncated in place."""

    def __init__(
        self, out_dir, config, total_steps, desc, quiet=False, main_process=True, records=()
    ):
        from tqdm import tqdm

        self.out_dir = Path(out_dir)
        self.records = list(records)
        self.warned = False  # the flat-group warning, said once
        self.quiet = quiet or not main_process
        self.main_process = main_process  # other ranks keep the records in memory and write nothing
        self.metrics_file = io.StringIO()
        if main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(
                self.out_dir / "config.json", json.dumps(config, indent=2, default=str)
            )
            lines = "".join(json.dumps(record) + "\n" for record in self.records)
            write_atomically(self.out_dir / "metrics.jsonl", lines)
            self.metrics_file = open(self.out_dir / "metrics.jsonl", "a")
        self.bar = tqdm(
            total=total_steps, desc=desc, disable=self.quiet, leave=False, file=sys.stderr
        )
        self.bar.update(self.records[-1]["step"] if self.records else 0)
        self.start = time.time()
        self.tensorboard = None
        if main_process and config.get("report_to") == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.out_dir / "tensorboard"))
        if not self.quiet:
            print(f"[{desc}] config: {json.dumps(config, default=str)}")

    def log(self, step, **metrics):
        record = {"step": step, "sec": round(time.time() - self.start, 2), **metrics}
        self.records.append(record)
        if self.main_process and not self.warned and flat_streak(self.records) == FLAT_STEPS:
            self.warned = True  # once per run: zero_var_frac in metrics.jsonl shows every step
            print(
                f"warning: every group had equal rewards for {FLAT_STEPS} steps in a row, so the "
                "reward is teaching this run nothing there: the policy always or never earns it "
                "(collapsed onto one answer, or a task too easy or too hard for it); "
                "zero_var_frac in metrics.jsonl shows each step",
                file=sys.stderr,
            )
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.tensorboard:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
        self.bar.update(step - self.bar.n)
        if not self.quiet:
            line = " | ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
            )
            self.bar.write(line)

    def finish(self, summary, plots=()):
        """Write summary.json and one PNG per (filename, keys, title) in `plots`, from the logged
        records."""
        self.bar.close()
        self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
        import resource

        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        summary = {
            **summary,
            "wall_seconds": round(time.time() - self.start, 2),
            "peak_rss_mb": round(peak_rss_mb),
        }
        if not self.main_process:
            return summary
        write_atomically(self.out_dir / "summary.json", json.dumps(summary, indent=2))
        for filename, keys, title in plots:
            plot_curves(
                {k: [(r["step"], r[k]) for r in self.records if k in r] for k in keys},
                self.out_dir / filename,
                title,
            )
        return summary


def flat_streak(records):
    """How many of the last records in a row have zero_var_frac 1: no group had two rewards."""
    streak = 0
    for record in reversed(records):
        if record.get("zero_var_frac") != 1.0:
            break
        streak += 1
    return streak


def plot_curves(curves, path, title, ylabel="", logy=False):
    """One line per name in `curves` ({name: [(x, y), ...]}) saved as a small PNG.

    Drawn on a bare matplotlib Figure, not pyplot: nothing changes the backend or the figures a
    notebook is showing."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2), dpi=100)
    ax = fig.subplots()
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def save_checkpoint(path, tensors, state):
    """Atomically write one safetensors file: `tensors` (name → tensor) plus JSON-able `state` in
    its metadata. Written to a temp file in the same folder, fsynced, then os.replace'd: a crash
    mid-write leaves the previous checkpoint intact."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            tmp,
            metadata={"state": json.dumps(state)},
        )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def checkpoint_state(path):
    """The JSON state of a file written by `save_checkpoint`, from its header alone (safetensors
    checks there that the file holds every tensor it lists: a truncated file fails here)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["state"])


def load_checkpoint(path, everything=True):
    """(tensors, state) from a file written by `save_checkpoint`; without `everything`, only its
    RNG states (a sharded run's other ranks: rank 0 sends them their weights)."""
    from safetensors import safe_open

    state = checkpoint_state(path)
    with safe_open(str(path), framework="pt") as f:
        keys = [k for k in f.keys() if everything or k.startswith("rng/")]
        return {k: f.get_tensor(k) for k in keys}, state


def trained_tensors(modules, optimizers):
    """({name: tensor} of the trainable weights and the optimiser moments, {optimiser: its
    param_groups}), parameters numbered in the optimiser's order. Sharded modules (FSDP) are
    gathered whole to rank 0's CPU: every rank must call, and the other ranks get ({}, {})."""
    box = torch.nn.ModuleDict(modules)
    trainable = [name for name, p in box.named_parameters() if p.requires_grad]
    flat, groups = {}, {}
    if not any(distributed.is_sharded(p) for p in box.parameters()):
        weights = {name: p for name, p in box.named_parameters()}
        states = {name: optimizer.state_dict() for name, optimizer in optimizers.items()}
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(box, options=options)
        states = {
            name: numbered(get_optimizer_state_dict(box, optimizer, options=options))
            for name, optimizer in optimizers.items()
        }
    flat = {
        f"module/{name.replace('.', '/', 1)}": weights[name]
        for name in trainable
        if name in weights
    }
    for name, sd in states.items():
        if sd:
            groups[name] = sd["param_groups"]
        for idx, slots in sd.get("state", {}).items():
            flat |= {f"optim/{name}/{idx}/{k}": torch.as_tensor(v) for k, v in slots.items()}
    return flat, groups


def numbered(state_dict):
    """An optimiser state dict keyed by parameter names (FSDP's full state dict) → keyed by the
    parameters' positions, as `optimizer.state_dict()` keys them."""
    if not state_dict:
        return {}
    order = [name for group in state_dict["param_groups"] for name in group["params"]]
    position = {name: k for k, name in enumerate(order)}
    groups = [
        group | {"params": [position[n] for n in group["params"]]}
        for group in state_dict["param_groups"]
    ]
    return {
        "state": {position[n]: v for n, v in state_dict["state"].items()},
        "param_groups": groups,
    }


def rng_states():
    """This process's torch generators: the CPU one, and its current GPU's (where each rank of a
    multi-GPU run draws its dropout masks), so every rank saves and restores its own."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def save_training_state(path, step, modules, optimizers, generators, extra, write=True):
    """Everything a run needs to continue bit-exactly, in one atomic checkpoint: trainable weights
    (only the adapter under LoRA), optimiser moments, the torch/python/numpy RNGs and named
    `torch.Generator`s, the step, and a JSON `extra` (metrics so far, first-evaluation results).
    Sharded modules are gathered first, so every rank calls; only `write` writes the file."""
    flat, groups = trained_tensors(modules, optimizers)
    rank_rngs = [rng_states()]
    if torch.distributed.is_initialized():  # each rank's own (its dropout masks are its own)
        rank_rngs = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rank_rngs, rng_states())
    if not write:
        return
    flat |= {f"rng/{name}": g.get_state() for name, g in generators.items()}
    for rank, states in enumerate(rank_rngs):  # rng/torch/<rank>, rng/cuda/<rank>
        flat |= {f"rng/{kind}/{rank}": state for kind, state in states.items()}
    flat["rng/torch"] = rank_rngs[0]["torch"].clone()
    numpy_state = np.random.get_state()
    state = {
        "step": step,
        "extra": extra,
        "param_groups": groups,
        "python_rng": random.getstate(),
        "numpy_rng": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    save_checkpoint(path, flat, state)


def load_training_state(path, modules, optimizers, generators):
    """Restore what `save_training_state` wrote into the given objects; returns (step, extra).
    Sharded modules: rank 0 reads the weights and moments and sends each rank its shards."""
    box = torch.nn.ModuleDict(modules)
    sharded = any(distributed.is_sharded(p) for p in box.parameters())
    rank0 = not sharded or torch.distributed.get_rank() == 0
    flat, state = load_checkpoint(path, everything=rank0)
    saved = {
        k[len("module/") :].replace("/", ".", 1): v
        for k, v in flat.items()
        if k.startswith("module/")
    }
    trainable = {name for name, p in box.named_parameters() if p.requires_grad}
    missing = trainable - set(saved)
    if rank0 and missing:
        raise SystemExit(
            f"error: {path} does not match this run's weights ({len(missing)} missing); "
            "resume with the same flags, or start without --resume"
        )
    names = {id(p): name for name, p in box.named_parameters()}
    for name, optimizer in optimizers.items():
        slots = {}
        for key, value in flat.items():
            if key.startswith(f"optim/{name}/"):
                _, _, idx, slot = key.split("/", 3)
                slots.setdefault(int(idx), {})[slot] = value
        sd = {"state": slots, "param_groups": state["param_groups"][name]}
        if not sharded:
            optimizer.load_state_dict(sd)
            continue
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        named = {
            "state": {order[k]: v for k, v in slots.items()},
            "param_groups": [
                group | {"params": [order[k] for k in group["params"]]}
                for group in sd["param_groups"]
            ],
        }
        set_model_state_dict(box, saved if rank0 else {}, options=options)
        set_optimizer_state_dict(box, optimizer, named if rank0 else {}, options=options)
    if not sharded:
        box.load_state_dict(saved, strict=False)
    for name, generator in generators.items():
        generator.set_state(flat[f"rng/{name}"])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.set_rng_state(flat.get(f"rng/torch/{rank}", flat["rng/torch"]))
    if torch.cuda.is_available() and f"rng/cuda/{rank}" in flat:  # this rank's own GPU
        torch.cuda.set_rng_state(flat[f"rng/cuda/{rank}"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return state["step"], state["extra"]


def check_out_dir(out_dir, args, accelerator):
    """Before any model is built: `out_dir` is a folder this user can write, and a run already in
    it is never overwritten by accident. Without --resume or --overwrite a folder holding a run is
    refused; --overwrite deletes that run's files; --resume needs a readable checkpoint, beside
    every metrics.jsonl that holds steps (an empty folder starts fresh, and says so). Every refusal
    is one line naming the flag. Every rank checks the same folder (nothing is written before all
    have); then the main process deletes."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"error: --out-dir {str(out_dir)!r} is a file, not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as err:
        raise SystemExit(
            f"error: --out-dir {str(out_dir)!r} is not a folder this user can write "
            f"({err.strerror or type(err).__name__})"
        ) from None
    files = [p for name in RUN_FILES for p in out_dir.rglob(name)]
    # what --resume continues from: a step's checkpoint, or rc_grpo's finished stage 1
    checkpoints = [p for p in files if p.name in ("checkpoint.safetensors", "stage1.safetensors")]
    if files and not (args.resume or args.overwrite):
        raise SystemExit(
            f"error: --out-dir {str(out_dir)!r} already holds a run; --resume continues it, "
            "--overwrite replaces it, or choose another --out-dir"
        )
    if args.resume and args.overwrite:
        raise SystemExit("error: --resume and --overwrite exclude each other")
    if args.resume and files and not checkpoints:
        raise SystemExit(
            f"error: --resume: {str(out_dir)!r} holds a run but no checkpoint "
            "(--save-every 0?); --overwrite starts it again"
        )
    if args.resume and not files:
        print(f"note: --resume: {str(out_dir)!r} holds no run yet; starting fresh", file=sys.stderr)
    # a run continues from its checkpoint alone: starting it again would cut its logged steps
    for metrics in [p for p in files if p.name == "metrics.jsonl" and args.resume]:
        if metrics.stat().st_size and not (metrics.parent / "checkpoint.safetensors").exists():
            raise SystemExit(
                f"error: --resume: {str(metrics)!r} holds steps but no checkpoint beside it to "
                "continue them from; delete that folder to start it again (--overwrite starts "
                "the whole run again)"
            )
    for path in checkpoints:
        if args.resume:
            unreadable_checkpoint_exits(path, checkpoint_state)  # the header: no tensor read twice
    accelerator.wait_for_everyone()
    if args.overwrite and accelerator.is_main_process:
        for path in files:
            path.unlink(missing_ok=True)
    accelerator.wait_for_everyone()  # no rank sees a file of the replaced run after this


def unreadable_checkpoint_exits(path, load):
    """load(path), or one line saying why the checkpoint cannot be resumed (nothing is touched)."""
    try:
        return load(path)
    except SystemExit:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file: one line, not a traceback
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise SystemExit(
            f"error: {path} is unreadable ({reason}); delete it or run without --resume"
        ) from None


class Run:
    """One training run's plumbing, not a trainer (the loop stays in the script): the RunLogger
    and an atomic checkpoint of the `modules`, `optimizers` and `generators` every `save_every`
    steps and at the last step, from which `resume` continues: bit-exactly on a CPU (a test), and
    on GPUs with the same weights, moments and each rank's RNG states.

    Nothing in out_dir is written before `resume()` has loaded the checkpoint: a checkpoint that
    fails to load leaves the run's files as they were. Only the main process writes; every
    process keeps the records."""

    def __init__(
        self,
        out_dir,
        args,
        *,
        desc,
        total_steps,
        modules,
        optimizers,
        generators,
        main_process=True,
        config=None,
    ):
        self.out_dir, self.args, self.desc = Path(out_dir), args, desc
        self.checkpoint = self.out_dir / "checkpoint.safetensors"
        self.state = (modules, optimizers, generators)
        self.total_steps, self.main_process = total_steps, main_process
        self.config = config or dataclasses.asdict(args)
        if self.config.get("mixed_precision") == "auto":  # what it resolved to on this machine
            device = next(next(iter(modules.values())).parameters()).device
            self.config = self.config | {"precision": common.resolved_precision(device)}
        self.logger = None

    @property
    def records(self):
        return self.logger.records

    def resume(self):
        """(first step to run, the `extra` saved with the checkpoint); (1, {}) for a fresh run.
        Then, and only then, the logger opens out_dir's files."""
        start, extra = 1, {}
        if self.args.resume and self.checkpoint.exists():
            done, extra = unreadable_checkpoint_exits(
                self.checkpoint, lambda path: load_training_state(path, *self.state)
            )
            start = done + 1
        self.logger = RunLogger(
            self.out_dir,
            self.config,
            self.total_steps,
            self.desc,
            self.args.quiet,
            self.main_process,
            records=extra.pop("records", []),
        )
        return start, extra

    def log(self, step, record, extra=None):
        """Log one step's metrics; checkpoint when it is time, with JSON-able `extra`."""
        self.logger.log(step, **record)
        save_every = self.args.save_every
        due = step % save_every == 0 or step == self.total_steps if save_every else False
        if due:  # every rank: a sharded model is gathered to rank 0, which writes
            save_training_state(
                self.checkpoint,
                step,
                *self.state,
                extra=(extra or {}) | {"records": self.logger.records},
                write=self.main_process,
            )

    def finish(self, summary, plots=()):
        return self.logger.finish(summary, plots)
