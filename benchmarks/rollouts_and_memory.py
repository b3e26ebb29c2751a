"""Rollout throughput (tokens/s vs batch size, KV cache on) and peak RSS of each toy preset.

    python benchmarks/rollouts_and_memory.py   # about 6 minutes on 2 CPU cores (every toy once)

Throughput: common.sample_completions on the toy-size Qwen2 (hidden 64, 2 layers) and a 4× wider
one, 64 new tokens per sample. Memory: each toy script runs in its own process with default flags;
its peak resident set size is read from the kernel (ru_maxrss of the finished child).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from utils import models  # noqa: E402


def generation_throughput(hidden, batch, new_tokens=64):
    tokenizer = models.make_tokenizer([f"w{i}" for i in range(60)])
    model = models.tiny_causal_lm(len(tokenizer), hidden_size=hidden, num_heads=4).eval()
    prompts = [" ".join(f"w{(i + j) % 60}" for j in range(8)) for i in range(batch)]
    with torch.no_grad():
        common.sample_completions(model, tokenizer, prompts[:2], 4, stop_at_eos=False)  # warm-up
        start = time.time()
        completions = common.sample_completions(
            model, tokenizer, prompts, new_tokens, stop_at_eos=False
        )
    return sum(len(ids) for _, ids, _ in completions) / (time.time() - start)


def peak_rss_mib(script):
    """Peak RSS of one toy run, from the kernel's accounting of that child alone (os.wait4)."""
    with tempfile.TemporaryDirectory() as out:
        child = subprocess.Popen(
            [sys.executable, str(ROOT / script), "--quiet", "--out-dir", out],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"error: {script} exited with {child.returncode}")
    return round(usage.ru_maxrss / 1024, 1)  # ru_maxrss is in KiB on Linux


if __name__ == "__main__":
    for hidden in (64, 256):
        for batch in (1, 8, 32, 128):
            print(
                json.dumps(
                    {
                        "hidden": hidden,
                        "batch": batch,
                        "tokens_per_s": round(generation_throughput(hidden, batch)),
                    }
                ),
                flush=True,
            )
    for script in ["flowrl.py", "flow_grpo.py", "agentflow.py", "rc_grpo.py"]:
        print(json.dumps({"toy": script, "peak_rss_mib": peak_rss_mib(script)}), flush=True)
