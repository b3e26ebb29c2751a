"""The benchmarks' code paths, at tiny sizes: the GPU check (run for real only on a GPU) and the
rollout-throughput measurement."""

import json
import subprocess
import sys
from pathlib import Path

from utils import models

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_with_tiny_configs_on_cpu():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny"], cwd=ROOT,
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    plans, rows = [r for r in rows if "planned_peak_gib" in r], [
        r for r in rows if "planned_peak_gib" not in r]
    assert [r["preset"] for r in rows] == ["tiny-full", "tiny-lora", "sd3.5-medium+lora"]
    assert [r["preset"] for r in plans] == ["tiny-full", "tiny-lora"]  # printed before each job
    assert all(r.get("update_tokens_per_s", r.get("update_images_per_s", 0)) > 0 for r in rows)
    assert all(r["rollout_s"] > 0 and r["update_s"] > 0 for r in rows)  # each phase's seconds


def test_gpu_check_plans_the_real_jobs_within_one_h200():
    """The plan (weights, gradients and AdamW, KV cache, one micro-batch's activations and logits)
    of the full-size jobs at the presets' micro-batch budgets stays under 141 GB."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--plan"], cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    plans = [json.loads(line)["planned_peak_gib"] for line in done.stdout.splitlines()]
    assert len(plans) == 2 and all(0 < plan["total"] < 141e9 / 2**30 for plan in plans), plans


def test_rollout_throughput_counts_the_generated_tokens():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollouts_and_memory

    assert rollouts_and_memory.generation_throughput(64, 2, new_tokens=4) > 0


def test_trl_comparison_times_flowrls_own_loop_and_its_floor(tmp_path):
    """bench_vs_trl's own side is flowrl.train's loop (its logged phase times) and the floor
    (TRL's side needs .venv-bench): every phase is timed and positive."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vs_trl

    words = "What is a + ? Reply with only the number.".split() + [str(n) for n in range(100)]
    tokenizer = models.make_tokenizer(words)
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    result = bench_vs_trl.compare(bench_vs_trl.case(str(tmp_path), steps=1), with_trl=False)
    assert set(result["ours_s"]) == {"generation", "scoring", "update"}
    assert min(result["ours_s"].values()) > 0 and min(result["floor_s"].values()) > 0
    assert set(result["floor_s"]) == {"generate", "forward_backward_adamw"}
