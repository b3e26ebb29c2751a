"""A toy run killed with SIGKILL part-way and resumed ends exactly where an uninterrupted run
ends."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils import tracking

ROOT = Path(__file__).resolve().parents[1]


def metrics(folder):
    folder = folder / "rctp+rc-grpo" if (folder / "rctp+rc-grpo").exists() else folder
    return [
        {k: v for k, v in json.loads(line).items()
         if k not in ("sec", "restored") and not k.startswith("time_")}  # wall-clock seconds
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


def summary(folder):
    def strip(value):  # wall-clock times and peak memory differ; everything else must not
        return (
            {k: strip(v) for k, v in value.items() if k not in ("wall_seconds", "peak_rss_mb")}
            if isinstance(value, dict)
            else value
        )

    return strip(json.loads((folder / "summary.json").read_text()))


@pytest.mark.parametrize(
    "script, flags",
    [
        (
            "flowrl.py",
            ["--steps", "8", "--group-size", "8", "--eval-every", "8", "--save-every", "2"]),
        (
            "flow_grpo.py",
            ["--epochs", "12", "--eval-per-prompt", "4", "--eval-every", "12", "--save-every", "3",
             "--ema", "0.9"],  # the EMA (evaluated and saved weights) continues across the resume
        ),
        (
            "agentflow.py",
            [
                "--steps", "8", "--eval-every", "8", "--save-every", "2", "--no-ablation",
                "--queries-per-step", "2", "--warm-start-steps", "20"],
        ),
        (
            "rc_grpo.py",
            [
                "--steps", "8", "--arms", "rctp+rc-grpo", "--toy-tasks", "20", "--toy-test-tasks",
                "5", "--tasks-per-step", "2", "--failure-rollouts", "1", "--save-every", "2"],
        ),
    ],
)
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, flow_grpo_cache, script, flags):
    flags = (
        [*flags, "--quiet", "--cache-dir", str(flow_grpo_cache)]
        if script == "flow_grpo.py"
        else [*flags, "--quiet"]
    )
    run = lambda out, *extra: [
        sys.executable,
        str(ROOT / script),
        *flags,
        "--out-dir",
        str(out),
        *extra,
    ]  # noqa: E731
    subprocess.run(run(tmp_path / "whole"), check=True, cwd=ROOT, capture_output=True)

    killed = subprocess.Popen(
        run(tmp_path / "killed"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = (
        tmp_path
        / "killed"
        / ("rctp+rc-grpo/" if script == "rc_grpo.py" else "")
        / "checkpoint.safetensors"
    )
    while not checkpoint.exists() and killed.poll() is None:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    tensors, state = tracking.load_checkpoint(checkpoint)
    assert state["step"] < int(flags[1]), (
        "the run finished before it could be killed; make it longer"
    )
    # mark the saved metrics: only a run that really continues from this file can show the mark
    state["extra"]["records"][0]["restored"] = True
    tracking.save_checkpoint(checkpoint, tensors, state)
    subprocess.run(run(tmp_path / "killed", "--resume"), check=True, cwd=ROOT, capture_output=True)

    path = (
        tmp_path / "killed" / ("rctp+rc-grpo" if script == "rc_grpo.py" else "") / "metrics.jsonl"
    )
    assert json.loads(path.read_text().splitlines()[0]).get("restored") is True

    assert metrics(tmp_path / "killed") == metrics(tmp_path / "whole")
    assert summary(tmp_path / "killed") == summary(tmp_path / "whole")
