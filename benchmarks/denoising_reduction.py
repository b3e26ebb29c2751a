"""Denoising reduction (Flow-GRPO §1.5): cost of one training epoch (rollouts + update) at 10 vs 40 steps.

    python benchmarks/denoising_reduction.py            # toy, CPU; prints the per-epoch times and their ratio

Time per epoch is read from metrics.jsonl (the gap between consecutive epochs, evaluation excluded).
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import flow_grpo  # noqa: E402


def seconds_per_epoch(train_steps, epochs=20):
    with tempfile.TemporaryDirectory() as tmp:
        args = common.parse_args(flow_grpo.Args, flow_grpo.PRESETS, [
            "--quiet", "--epochs", str(epochs), "--eval-every", "1000", "--eval-per-prompt", "2",
            "--train-steps", str(train_steps), "--out-dir", tmp])
        flow_grpo.train(args)
        secs = [json.loads(line)["sec"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return (secs[-1] - secs[1]) / (len(secs) - 2)  # skip the first epoch (warm-up)


if __name__ == "__main__":
    fast, full = seconds_per_epoch(10), seconds_per_epoch(40)
    result = {"sec_per_epoch_10_steps": round(fast, 4), "sec_per_epoch_40_steps": round(full, 4),
              "ratio": round(full / fast, 2)}
    print(json.dumps(result))
