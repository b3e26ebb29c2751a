"""The benchmarks' code paths, at tiny sizes: the GPU check (run for real only on a GPU) and the
rollout-throughput measurement."""

import json
import subprocess
import sys
from pathlib import Path

from utils import models

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_each_scripts_own_train_with_tiny_configs_on_cpu():
    """Each job's figures are read from the step its script logged (phase seconds, token counts):
    flowrl's, rc_grpo's and flow_grpo's own `train`, their presets, random weights."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny"], cwd=ROOT,
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["job"] for r in rows] == [
        "flowrl --preset full", "rc_grpo --preset bfcl", "flow_grpo --preset sd3"]
    assert all(r["rollout_s"] > 0 and r["update_s"] > 0 for r in rows)  # each phase's seconds
    assert all(r["rollout_tokens_per_s"] > 0 and r["update_tokens_per_s"] > 0 for r in rows[:2])
    assert rows[2]["rollout_images_per_s"] > 0 and rows[2]["update_images_per_s"] > 0


def test_gpu_check_plans_every_full_scale_llm_preset_within_one_h200():
    """The plan (weights, gradients and AdamW, the reference, the KV cache, one micro-batch's
    activations and logits) of flowrl's full and rc_grpo's bfcl on one GPU, and of flowrl's
    full-7b per GPU of 8 under FSDP in both its phases, stays under 141 GB."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--plan"], cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    plans = {json.loads(line)["preset"]: json.loads(line)["planned_peak_gib"]
             for line in done.stdout.splitlines()}
    sharded = plans.pop("flowrl full-7b (qwen2.5-7b, fsdp, per gpu of 8)")
    totals = [plan["total"] for plan in [*plans.values(), sharded["update"], sharded["rollout"]]]
    assert len(totals) == 4 and all(0 < total < 141e9 / 2**30 for total in totals), plans


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
