"""The benchmarks' code paths, at tiny sizes: the GPU check (run for real only on a GPU) and the
rollout-throughput measurement."""

import json
import subprocess
import sys
from pathlib import Path

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
    assert all(r.get("train_tokens_per_s", r.get("update_images_per_s", 0)) > 0 for r in rows)


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


def test_trl_comparison_splits_our_step_and_times_its_floor():
    """bench_vs_trl's own side and the floor (TRL's side needs .venv-bench): every phase is timed
    and positive, and the case's prompts are sampled G times each."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vs_trl

    case = bench_vs_trl.tiny_case(64) | {"steps": 1, "new_tokens": 4}
    ours, floor = bench_vs_trl.ours(case), bench_vs_trl.floor(case)
    assert set(ours) == {"generation", "scoring", "update"} and min(ours.values()) > 0
    assert set(floor) == {"generate", "forward_backward"} and min(floor.values()) > 0
