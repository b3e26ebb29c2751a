"""Flow-GRPO's denoising reduction: cost of one training epoch at 10 vs 40 rollout steps, its split,
and whether the final quality of a whole run matches.

    python benchmarks/denoising_reduction.py
    # toy, CPU: per-epoch times, ratio and split, then the final accuracy of whole runs at 10 vs
    # 40 steps

Time per epoch is read from metrics.jsonl (the gap between consecutive epochs, evaluation excluded);
the split times the script's own `rollout` (SDE rollouts only) and `score` (training calls only)
functions, and the update is the rest of the epoch. The first epoch is a warm-up and is left out.
"""

import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flow_grpo  # noqa: E402
from utils import cli  # noqa: E402


def timed(fn, log, keep=lambda arguments: True):
    """`fn`, appending each call's seconds to `log` where `keep` takes its arguments (by name,
    however the caller passed them)."""
    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if keep(signature.bind(*args, **kwargs).arguments):
            log.append(time.perf_counter() - start)
        return out

    return wrapper


def is_sde(arguments):
    """A training rollout (SDE steps), not the evaluation's ODE."""
    return arguments["noise_level"] > 0


def epoch_costs(train_steps, epochs=20):
    rollouts, rewards = [], []
    original = flow_grpo.rollout, flow_grpo.score
    flow_grpo.rollout = timed(flow_grpo.rollout, rollouts, keep=is_sde)
    flow_grpo.score = timed(flow_grpo.score, rewards)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = cli.parse_args(
                flow_grpo.Args,
                flow_grpo.PRESETS,
                [
                    "--quiet",
                    "--epochs",
                    str(epochs),
                    "--eval-every",
                    "1000",
                    "--eval-per-prompt",
                    "2",
                    "--train-steps",
                    str(train_steps),
                    "--out-dir",
                    tmp,
                ],
            )
            flow_grpo.train(args)
            secs = [
                json.loads(line)["sec"]
                for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()
            ]
    finally:
        flow_grpo.rollout, flow_grpo.score = original
    epoch = (secs[-1] - secs[1]) / (len(secs) - 2)
    # epochs 3.. end where secs[1] .. secs[-1] measure
    rollout = sum(rollouts[2:]) / (len(rollouts) - 2)
    # the first and last calls score the evaluations
    reward = sum(rewards[3:-1]) / (len(rewards) - 4)
    return {
        "epoch": round(epoch, 4),
        "rollout": round(rollout, 4),
        "reward": round(reward, 4),
        "update": round(epoch - rollout - reward, 4),
    }


def final_quality(train_steps, seed):
    """The paper's claim is speed without a quality loss: a whole toy run (150 epochs) rolled out
    with `train_steps` SDE steps, evaluated with the same 40-step ODE; its final accuracy and
    reward."""
    with tempfile.TemporaryDirectory() as tmp:
        args = cli.parse_args(
            flow_grpo.Args,
            flow_grpo.PRESETS,
            [
                "--quiet",
                "--train-steps",
                str(train_steps),
                "--seed",
                str(seed),
                "--eval-every",
                "1000",
                "--out-dir",
                tmp,
            ],
        )
        summary = flow_grpo.train(args)
    return {
        "accuracy_after": round(summary["accuracy_after"], 3),
        "reward_after": round(summary["reward_after"], 3),
        "wall_seconds": summary["wall_seconds"],
    }


if __name__ == "__main__":
    fast, full = epoch_costs(10), epoch_costs(40)
    print(
        json.dumps(
            {"10_steps": fast, "40_steps": full, "ratio": round(full["epoch"] / fast["epoch"], 2)}
        )
    )
    for seed in (0, 1):
        print(
            json.dumps(
                {
                    "seed": seed,
                    "final_10_steps": final_quality(10, seed),
                    "final_40_steps": final_quality(40, seed),
                }
            ),
            flush=True,
        )
