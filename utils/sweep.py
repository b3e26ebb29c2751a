"""Seed sweeps (every arm on every seed, one table and plot) and the demo table of `make demo`.

`python -m utils.sweep [runs]` prints the demo table: one row per runs/*/summary.json that carries a
`claim` (its text, the metric before and after), so the table needs no knowledge of any script.
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from utils import cli


def parse_seeds(text):
    """ "0-4" → [0, 1, 2, 3, 4]; "1,3,7" → [1, 3, 7]; a clear error otherwise."""
    try:
        if "-" in text:
            lo, hi = (int(part) for part in text.split("-"))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(
            f"error: --seeds takes a range like 0-4 or a list like 1,3,7 (got {text!r})"
        ) from None
    if not seeds or min(seeds) < 0:
        raise SystemExit(f"error: --seeds gives no non-negative seed (got {text!r})")
    if max(seeds) > cli.SEED_MAX:
        raise SystemExit(f"error: --seeds must lie in 0 … 2^32 − 1 = {cli.SEED_MAX} (got {text!r})")
    return seeds


def seed_sweep(train, args, arms, row, claim, out_dir):
    """Run every arm on every seed of `args.seeds`, then write the sweep's table and plot.

    arms: [(name, {field: value})] — one `train` call each per seed (one ("", {}) when a single
    call trains all arms). row({arm: summary}) → {column: number} for that seed; claim(row) says
    whether the paper's claim held on that seed. Writes out_dir/sweep.json, sweep.md (per seed,
    then mean ± sd and the count of seeds where the claim held) and sweep.png."""
    out_dir = Path(out_dir)
    seeds, rows = parse_seeds(args.seeds), []
    for seed in seeds:
        summaries = {}
        for name, overrides in arms:
            run_dir = out_dir / f"seed{seed}" / name if name else out_dir / f"seed{seed}"
            run_args = dataclasses.replace(
                args, seed=seed, out_dir=str(run_dir), seeds="", quiet=True, **overrides
            )
            summaries[name] = train(run_args)
        rows.append({"seed": seed, **row(summaries)})
        rows[-1]["claim_holds"] = bool(claim(rows[-1]))
        print(
            f"seed {seed}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items() if isinstance(v, float)),
            flush=True,
        )
    columns = [k for k in rows[0] if k not in ("seed", "claim_holds")]
    values = {c: np.array([r[c] for r in rows], dtype=float) for c in columns}
    stats = {
        c: {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
        for c, v in values.items()
    }
    holds = sum(r["claim_holds"] for r in rows)
    result = {"seeds": seeds, "rows": rows, "stats": stats, "claim_holds_on": holds}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2))
    table = sweep_table(result)
    (out_dir / "sweep.md").write_text(table + "\n")
    plot_sweep(values, seeds, out_dir / "sweep.png", f"{out_dir.name}: {holds}/{len(rows)} seeds")
    print(table)
    return result


def sweep_table(result):
    """The sweep as a markdown table: one row per seed (counts as integers, the rest to 3 decimals),
    then mean ± sd per column and on how many seeds the claim held."""
    rows, stats = result["rows"], result["stats"]
    columns = [k for k in rows[0] if k not in ("seed", "claim_holds")]
    lines = [
        "| seed | " + " | ".join(columns) + " | claim holds |",
        "|---" * (len(columns) + 2) + "|",
    ]
    lines += [
        f"| {r['seed']} | "
        + " | ".join(str(r[c]) if isinstance(r[c], int) else f"{r[c]:.3f}" for c in columns)
        + f" | {'yes' if r['claim_holds'] else 'no'} |"
        for r in rows
    ]
    lines.append(
        "| mean ± sd | "
        + " | ".join(f"{stats[c]['mean']:.3f} ± {stats[c]['sd']:.3f}" for c in columns)
        + f" | {result['claim_holds_on']}/{len(rows)} |"
    )
    return "\n".join(lines)


def plot_sweep(values, seeds, path, title):
    """One panel per column: its value on each seed (dots) and the mean (line)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.6 * len(values), 2.8), dpi=100)
    for ax, (name, v) in zip(np.atleast_1d(fig.subplots(1, len(values))), values.items()):
        ax.plot(seeds, v, "o")
        ax.axhline(v.mean(), color="gray", lw=1)
        ax.set(title=name, xlabel="seed", xticks=seeds)
        ax.title.set_fontsize(8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def demo_table(runs_dir="runs"):
    """One row per run under runs_dir whose summary.json carries a `claim` ({text, before, after}):
    the metric that shows its paper's claim, before → after, and the wall time."""
    rows = []
    for path in sorted(Path(runs_dir).glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if "claim" in summary:
            c = summary["claim"]
            change = f"{c['before']:.3f} → {c['after']:.3f}"
            rows.append((path.parent.name, c["text"], change, summary["wall_seconds"]))
    width = max([len(r[0]) for r in rows] + [10])
    lines = [f"{'run':<{width}}  {'claim':<48}  {'before → after':<28}  wall s"]
    lines += [f"{a:<{width}}  {b:<48}  {c:<28}  {d:.0f}" for a, b, c, d in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(demo_table(sys.argv[1] if len(sys.argv) > 1 else "runs"))
