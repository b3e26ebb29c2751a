"""Run plumbing: the logger (config, JSONL metrics, summary, plots, TensorBoard) and checkpoints
that are atomic and resume bit-exactly."""

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


class RunLogger:
    """Writes config.json, metrics.jsonl (one line per step), summary.json and PNG curves under
    out_dir; shows a tqdm bar and one compact stdout line per logged step. With
    config["report_to"] == "tensorboard" the same numbers also go to out_dir/tensorboard."""

    def __init__(self, out_dir, config, total_steps, desc, quiet=False, main_process=True):
        from tqdm import tqdm

        self.out_dir = Path(out_dir)
        self.records = []
        self.quiet = quiet or not main_process
        self.main_process = main_process  # other ranks keep the records in memory and write nothing
        if main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.metrics_file = (
            open(self.out_dir / "metrics.jsonl", "w") if main_process else io.StringIO()
        )
        self.bar = tqdm(
            total=total_steps, desc=desc, disable=self.quiet, leave=False, file=sys.stderr)
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

    def restore(self, records):
        """Continue a resumed run: the metrics logged before the checkpoint are written again
        first."""
        for record in records:
            self.records.append(record)
            self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self.bar.update(records[-1]["step"] if records else 0)

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
            **summary, "wall_seconds": round(time.time() - self.start, 2),
            "peak_rss_mb": round(peak_rss_mb)}
        if not self.main_process:
            return summary
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        for filename, keys, title in plots:
            plot_curves(
                {k: [(r["step"], r[k]) for r in self.records if k in r] for k in keys},
                self.out_dir / filename, title)
        return summary


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
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
            metadata={"state": json.dumps(state)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """(tensors, state) from a file written by `save_checkpoint`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        state = json.loads(f.metadata()["state"])
    return load_file(str(path)), state


def save_training_state(path, step, modules, optimizers, generators, extra):
    """Everything a run needs to continue bit-exactly, in one atomic checkpoint: trainable weights
    (only the adapter under LoRA), optimiser moments, the torch/python/numpy RNGs and named
    `torch.Generator`s, the step, and a JSON `extra` (metrics so far, first-evaluation results)."""
    flat = {}
    for name, module in modules.items():
        flat |= {f"module/{name}/{k}": v for k, v in module.named_parameters() if v.requires_grad}
    groups = {}
    for name, optimizer in optimizers.items():
        sd = optimizer.state_dict()
        groups[name] = sd["param_groups"]
        for idx, slots in sd["state"].items():
            flat |= {f"optim/{name}/{idx}/{k}": torch.as_tensor(v) for k, v in slots.items()}
    flat |= {f"rng/{name}": g.get_state() for name, g in generators.items()}
    flat["rng/torch"] = torch.get_rng_state()
    numpy_state = np.random.get_state()
    state = {
        "step": step, "extra": extra, "param_groups": groups, "python_rng": random.getstate(),
        "numpy_rng": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]]}
    save_checkpoint(path, flat, state)


def load_training_state(path, modules, optimizers, generators):
    """Restore what `save_training_state` wrote into the given objects; returns (step, extra)."""
    flat, state = load_checkpoint(path)
    for name, module in modules.items():
        prefix = f"module/{name}/"
        saved = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        missing = {k for k, v in module.named_parameters() if v.requires_grad} - set(saved)
        if missing:
            raise SystemExit(
                f"error: {path} does not match this run's {name} ({len(missing)} weights missing); "
                "resume with the same flags, or start without --resume"
            )
        module.load_state_dict(saved, strict=False)
    for name, optimizer in optimizers.items():
        slots = {}
        for key, value in flat.items():
            if key.startswith(f"optim/{name}/"):
                _, _, idx, slot = key.split("/", 3)
                slots.setdefault(int(idx), {})[slot] = value
        optimizer.load_state_dict({"state": slots, "param_groups": state["param_groups"][name]})
    for name, generator in generators.items():
        generator.set_state(flat[f"rng/{name}"])
    torch.set_rng_state(flat["rng/torch"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return state["step"], state["extra"]


class Run:
    """One training run's plumbing, not a trainer (the loop stays in the script): the RunLogger
    and an atomic checkpoint of `state` = (modules, optimizers, generators) every `save_every`
    steps and at the last step, from which `resume` continues bit-exactly.

    Only the main process writes; every process keeps the records."""

    def __init__(self, out_dir, config, total_steps, desc, state, args, main_process=True,
                 checkpoint=None):
        self.logger = RunLogger(out_dir, config, total_steps, desc, args.quiet, main_process)
        self.checkpoint = Path(checkpoint or Path(out_dir) / "checkpoint.safetensors")
        self.state, self.total_steps, self.main_process = state, total_steps, main_process
        self.save_every, self.resuming = args.save_every, args.resume

    @property
    def records(self):
        return self.logger.records

    def resume(self):
        """(first step to run, the `extra` saved with the checkpoint); (1, {}) for a fresh run."""
        if not (self.resuming and self.checkpoint.exists()):
            return 1, {}
        done, extra = load_training_state(self.checkpoint, *self.state)
        self.logger.restore(extra.pop("records"))
        return done + 1, extra

    def log(self, step, record, extra=None):
        """Log one step's metrics; checkpoint when it is time, with JSON-able `extra`."""
        self.logger.log(step, **record)
        due = step % self.save_every == 0 or step == self.total_steps if self.save_every else False
        if due and self.main_process:
            save_training_state(self.checkpoint, step, *self.state,
                                extra=(extra or {}) | {"records": self.logger.records})

    def finish(self, summary, plots=()):
        return self.logger.finish(summary, plots)
