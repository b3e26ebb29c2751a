"""The memory plans (benchmarks/memory_plan.py) against PyTorch's MemTracker on the scripts' own
steps at scaled shapes: every preset kind's phases within 15 % of the tracked peak; a plan without
the unsharded FSDP gradients, and the old parameter count (q and o as 4h²), are not."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_plan  # noqa: E402


@pytest.fixture(scope="module")
def checks():
    return memory_plan.scaled_checks()  # about 25 s of CPU: one process, two gloo ranks


@pytest.mark.long
def test_every_phase_is_planned_within_15_percent_of_the_tracked_peak(checks):
    """flowrl full (rollout, update) at two shapes, full-7b under --fsdp on 2 gloo ranks (load,
    rollout, update), rc_grpo bfcl's two adapters and agentflow full's one (rollout, update),
    flow_grpo sd3's VAE decode (prepare) and trained step (update)."""
    rows = {
        (name, phase): round(row["ratio"], 3)
        for name, result in checks.items()
        for phase, row in result.items()
    }
    assert len(rows) == 13
    assert all(0.85 <= ratio <= 1.15 for ratio in rows.values()), rows


@pytest.mark.long
def test_a_plan_without_the_unsharded_fsdp_gradients_misses_by_more_than_15_percent(checks):
    """The test can fail: the old plan had no term for the fp32 gradients FSDP2 keeps unsharded
    while gradient sync is off; at the FSDP shape the corrected plan without that term falls
    outside 15 % of the tracked update peak."""
    update = checks["flowrl full-7b: fsdp, 2 ranks (b, weights)"]["update"]
    without = update["planned"] - update["terms"]["unsharded_fp32_grads"]
    assert without / update["tracked"] < 0.85, without / update["tracked"]


def test_parameter_counts_are_exact():
    """param_counts is what transformers builds (on the meta device: no memory), for the two
    published Qwen2.5 configs; the old count (q and o as 4h²) was 9 % high on 7B."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    for config in memory_plan.QWEN.values():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
        assert memory_plan.param_counts(config)[0] == sum(p.numel() for p in model.parameters())
    assert memory_plan.param_counts(memory_plan.QWEN["qwen2.5-7b"])[0] == 7_615_616_512
