"""The benchmarks' code paths, at tiny sizes: the GPU check (run for real only on a GPU) and the
rollout-throughput measurement."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from utils import models

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_gpu_check_runs_each_scripts_own_train_with_tiny_configs_on_cpu():
    """A smoke test: each job's figures are read from the step its script logged (phase seconds,
    token counts): flowrl's (one process, and --fsdp on one rank under torchrun), flow_grpo's and
    rc_grpo's own `train`, their presets, random weights. It runs, in that order, and reports every
    figure (their values are the GPU's to judge). The flowrl jobs pad: their prompts differ in
    length and their completions stop early on average while the longest runs to the limit (the
    generate call's decode steps); the --fsdp job shards every decoder layer and the root of both
    the policy and π_ref."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["job"] for r in rows] == [  # the longest last, for a timeout to cut
        "flowrl --preset full",
        "flow_grpo --preset sd3",
        "flowrl --preset full-7b --fsdp on 1 rank",
        "rc_grpo --preset bfcl",
    ]
    tokens = ["rollout_s", "update_s", "rollout_tokens_per_s", "update_tokens_per_s"]
    figures = [
        tokens,
        ["rollout_s", "update_s", "rollout_images_per_s", "update_images_per_s"],
        tokens,
        tokens,
    ]
    for row, keys in zip(rows, figures):
        assert "error" not in row and all(math.isfinite(row[key]) for key in keys), row
    layers = 2  # gpu_check's tiny config
    for row in (rows[0], rows[2]):
        shortest, longest = row["prompt_words"]
        assert shortest < longest, row
        assert row["mean_completion_tokens"] < row["max_new_tokens"] == row["decode_steps"], row
    assert rows[0]["fsdp_units"] == [] and rows[2]["fsdp_units"] == [layers + 1] * 2, rows


def test_gpu_check_reads_the_peak_of_each_phase_and_of_the_whole_run(monkeypatch):
    """phase_peaks over a fake CUDA allocator (GiB: 1 resident, then per step a rollout of +3 and
    an update of +2, freed after; an evaluation of +5 between the steps; reserved = 2 × allocated):
    each phase's peak is the largest over the steps (rollout 4, update 3), the run's includes what
    ran outside the phases (6), and the one-position forwards of the last rollout are counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    import gpu_check
    from utils import tracking

    gib, memory = 2**30, {"now": 0, "peak": 0}

    def allocate(n):
        memory["now"] += n * gib
        memory["peak"] = max(memory["peak"], memory["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: memory["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 2 * memory["peak"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device: memory.update(peak=memory["now"])
    )
    counts = {"decode": 0}
    with gpu_check.phase_peaks(torch.device("cuda"), counts) as peaks:
        allocate(1)
        phases = tracking.Phases()
        for step, rollout in enumerate([3, 1]):
            with phases.time("rollout"):
                allocate(rollout)
                counts["decode"] += 7 + step
                allocate(-rollout)
            with phases.time("update"):
                allocate(2)
                allocate(-2)
            allocate(5)
            allocate(-5)
    assert peaks == {"run": [6, 12], "rollout": [4, 8], "update": [3, 6], "decode_steps": 8}


def test_gpu_check_plans_every_full_scale_llm_preset_within_one_h200():
    """The plan (weights, gradients and AdamW, the reference, the KV cache, one micro-batch's
    activations and logits) of flowrl's full and rc_grpo's bfcl on one GPU, and of flowrl's
    full-7b per GPU of 8 under FSDP in both its phases, stays under 141 GB."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    plans = {
        json.loads(line)["preset"]: json.loads(line)["planned_peak_gib"]
        for line in done.stdout.splitlines()
    }
    sharded = plans.pop("flowrl full-7b (qwen2.5-7b, fsdp, per gpu of 8)")
    totals = [plan["total"] for plan in [*plans.values(), sharded["update"], sharded["rollout"]]]
    assert len(totals) == 4 and all(0 < total < 141e9 / 2**30 for total in totals), plans


def test_denoising_bench_times_the_sde_rollouts_as_flow_grpo_calls_them():
    """benchmarks/denoising_reduction.py wraps flow_grpo.rollout and keeps the seconds of the SDE
    rollouts only: called as flow_grpo calls it (its later arguments by keyword), an ODE rollout is
    not logged and an SDE one is."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import denoising_reduction
    import flow_grpo

    log = []
    rollout = denoising_reduction.timed(flow_grpo.rollout, log, keep=denoising_reduction.is_sde)
    velocity = lambda x, sigma, cond: -x
    noise, sigmas = torch.randn(2, 3), torch.linspace(1.0, 0.0, 4)
    rollout(velocity, noise, sigmas, cond=None, empty=None, guidance=1.0, noise_level=0.0)
    assert len(log) == 0
    rollout(velocity, noise, sigmas, cond=None, empty=None, guidance=1.0, noise_level=0.7)
    assert len(log) == 1


def test_rollout_throughput_counts_the_generated_tokens(monkeypatch):
    """2 prompts × 4 new tokens (no EOS stop) over a clock that reads 10 s then 12 s: 4 tokens/s."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollouts_and_memory

    clock = iter([10.0, 12.0])
    monkeypatch.setattr(rollouts_and_memory, "time", SimpleNamespace(time=lambda: next(clock)))
    assert rollouts_and_memory.generation_throughput(64, 2, new_tokens=4) == 4.0


def test_trl_comparison_times_flowrls_own_loop_and_a_plain_step(tmp_path):
    """A smoke test: bench_vs_trl's own side is flowrl.train's loop (its logged phase times) and the
    plain step (TRL's side needs .venv-bench): every phase is timed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vs_trl

    words = "What is a + ? Reply with only the number.".split() + [str(n) for n in range(100)]
    tokenizer = models.make_tokenizer(words)
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    result = bench_vs_trl.compare(bench_vs_trl.case(str(tmp_path), steps=1), with_trl=False)
    assert set(result["ours_s"]) == {"generation", "scoring", "update"}
    assert all(math.isfinite(t) for t in [*result["ours_s"].values(), *result["plain_s"].values()])
    assert set(result["plain_s"]) == {"generate", "forward_backward_adamw"}


def test_laptop_bench_counts_each_shared_prefix_once_as_needed(tmp_path):
    """benchmarks/laptop.py: the tokens a forward needs are its rows' distinct prefixes (hand
    numbers), and around a FlowRL toy run (two steps) the hooks count every computed token and
    matmul FLOP by call: the prefix-tree forwards (update, π_ref, the exact evaluation) compute
    exactly what they need, sampling at least what it needs (a group's prompt prefilled once), and
    the toy's own pretraining counts as computed, not needed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import flowrl
    import laptop
    from utils import cli

    assert laptop.prefix_tokens([[1, 2, 3], [1, 2, 4], [5], [1, 2]]) == 5
    # attention, 2 rows × 3 heads × head_dim 4: 4·4 FLOPs a pair, 6 causal pairs of 3 queries,
    # 3 × 5 pairs under a mask (3 queries on 5 keys), three times that with a gradient
    hand = laptop.Count()
    hand.attention(torch.zeros(2, 3, 3, 4), torch.zeros(2, 3, 3, 4), is_causal=True)
    assert hand.flops == hand.attention_flops == 16 * 6 * 6
    query = torch.zeros(2, 3, 3, 4, requires_grad=True)
    hand.attention(query, torch.zeros(2, 1, 5, 4), is_causal=False)
    assert hand.flops == 16 * 6 * 6 + 3 * 16 * 15 * 6
    # and as a transformers model calls it (sdpa; the toys run eager attention, uncounted)
    model = models.tiny_causal_lm(11, seed=0)  # 2 layers, 4 heads of 16
    model.set_attn_implementation("sdpa")
    with laptop.counted(laptop.Count()) as count, torch.no_grad():
        model(torch.ones(2, 5, dtype=torch.long))
    assert count.attention_flops == 2 * 2 * 4 * (4 * 16) * 15
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, ["--steps", "2", "--quiet"])
    args.out_dir = str(tmp_path)
    with laptop.counted(laptop.Count()) as count:
        flowrl.train(args)
    tree, sampling = count.calls["micro_batch_forward"], count.calls["sample_completions"]
    assert tree[0] == tree[1] > 0 and sampling[0] >= sampling[1] > 0
    assert count.calls["other"][0] > 0 == count.calls["other"][1]
    assert count.flops > 0
