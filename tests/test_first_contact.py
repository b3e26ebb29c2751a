"""What a first run on a real GPU depends on, checked on CPU: bf16 forwards with π_old from the
trainer, activation checkpointing, token budgets that hold, and mini-batches that go off-policy."""

import dataclasses
import json
import random
import shutil

import pytest
import torch

import agentflow
import common
import flowrl
import rc_grpo
from utils import cli, models

# one short run of each LLM script's toy: (module, flags, metrics file under out_dir)
TOYS = {
    "flowrl": (flowrl, ["--steps", "1", "--inner-steps", "1", "--eval-every", "100"],
               "metrics.jsonl"),
    "agentflow": (agentflow, ["--steps", "1", "--inner-steps", "1", "--warm-start-steps", "100",
                              "--no-ablation", "--queries-per-step", "4", "--eval-every", "100"],
                  "metrics.jsonl"),
    "rc_grpo": (rc_grpo, ["--steps", "1", "--arms", "rctp+rc-grpo", "--toy-tasks", "60",
                          "--toy-test-tasks", "5", "--tasks-per-step", "4", "--failure-rollouts",
                          "1"], "rctp+rc-grpo/metrics.jsonl"),
}


def first_step(tmp_path, name, *extra, stage_one_from=None):
    """The first logged step of a toy run. stage_one_from: an rc_grpo run folder whose stage 1
    (the same flags) this run loads with --resume instead of training it again."""
    module, flags, metrics = TOYS[name]
    if stage_one_from:
        tmp_path.mkdir(parents=True)
        shutil.copy(stage_one_from / "stage1.safetensors", tmp_path / "stage1.safetensors")
        extra = (*extra, "--resume")
    args = cli.parse_args(module.Args, module.PRESETS,
                          [*flags, *extra, "--quiet", "--out-dir", str(tmp_path)])
    module.train(args)
    return json.loads((tmp_path / metrics).read_text().splitlines()[0])


@pytest.mark.parametrize("name", list(TOYS))
def test_on_policy_ratio_is_exactly_one_under_bf16(tmp_path, name):
    """bf16 autocast on the CPU (the GPU's precision path): π_old is the trainer's own forward, so
    the first update's ratio is exactly 1, while the sampler's gap is still reported."""
    step = first_step(tmp_path, name, "--mixed-precision", "bf16")
    assert step.get("ratio_dev_first", step.get("ratio_dev")) == 0.0
    assert step["sampler_logprob_max_dev"] > 0  # generate's bf16 rounding, a diagnostic only


# rc_grpo's first step has a varied group at 1 or 2 threads and under avx2 after its full stage 1
VARIED = {"rc_grpo": ["--toy-tasks", "240", "--tasks-per-step", "8"]}


@pytest.mark.parametrize("name", list(TOYS))
def test_gradient_checkpointing_gives_the_same_gradient(tmp_path, name):
    """The first update's gradient norm with and without recomputation (rc_grpo: stage 2's, both
    runs from one stage 1)."""
    varied = VARIED.get(name, [])
    plain = first_step(tmp_path / "off", name, *varied, "--no-gradient-checkpointing")
    shared = tmp_path / "off" if name == "rc_grpo" else None
    recomputed = first_step(tmp_path / "on", name, *varied, "--gradient-checkpointing",
                            stage_one_from=shared)
    assert plain["grad_norm"] > 0
    assert abs(recomputed["grad_norm"] - plain["grad_norm"]) <= 1e-5 * plain["grad_norm"]


def test_the_second_mini_batch_is_off_policy(tmp_path):
    """With two mini-batches the second is scored after the first update: w != 1 there, w = 1 on
    the first (FlowRL's importance weight acts only across mini-batches)."""
    step = first_step(tmp_path, "flowrl", "--minibatches", "2")
    assert step["ratio_dev_first"] == 0.0 and step["ratio_dev"] > 1e-3


@pytest.mark.parametrize("name", ["flowrl", "agentflow", "rc_grpo"])
def test_loss_and_ratio_dev_are_the_steps_whatever_the_micro_batches(tmp_path, name,
                                                                    monkeypatch):
    """`loss` (the mean over the step's optimiser steps of each one's whole loss) and `ratio_dev`
    (max |ρ − 1| over the whole update) are the same whether a mini-batch runs as one micro-batch
    or as several. Two mini-batches (flowrl, agentflow): flowrl's second is off-policy, so its
    ratio_dev is not 0. flowrl runs its GRPO arm: the log Z head's dropout draws other masks when
    the rows are split otherwise, so TB's loss differs by its noise, not by how it is logged.
    rc_grpo's stage 1 also runs in micro-batches (other roundings, other weights), so only its
    stage 2 gets the budget, and the second run loads the first one's stage 1."""
    two = {"flowrl": ["--minibatches", "2", "--algo", "grpo"],
           "agentflow": ["--minibatch-rows", "8"]}.get(name, [])
    varied = VARIED.get(name, [])
    logged = {}
    for label, budget in (("one", 100000), ("several", 40)):
        if name == "rc_grpo":
            def stage_2(args, *rest, budget=budget, grpo_arm=rc_grpo.grpo_arm, **kwargs):
                budgeted = dataclasses.replace(args, micro_batch_tokens=budget)
                return grpo_arm(budgeted, *rest, **kwargs)

            monkeypatch.setattr(rc_grpo, "grpo_arm", stage_2)
            shared = tmp_path / "one" if label == "several" else None
            logged[label] = first_step(tmp_path / label, name, *varied, stage_one_from=shared)
            monkeypatch.undo()
        else:
            logged[label] = first_step(
                tmp_path / label, name, *two, *varied, "--micro-batch-tokens", str(budget))
    one, several = logged["one"], logged["several"]
    assert one["loss"] != 0
    for key in ("loss", "ratio_dev"):
        assert abs(several[key] - one[key]) <= 1e-5 * max(1.0, abs(one[key])), (key, one, several)
    if name == "flowrl":
        assert one["ratio_dev"] > 1e-4


def test_micro_batches_never_exceed_their_token_budget():
    """Property: over random prompt and completion lengths, each micro-batch as packed (rows ×
    (longest prompt + longest completion)) fits the budget, unless it is one over-long row."""
    rng = random.Random(0)
    tokenizer = models.make_tokenizer([f"w{i}" for i in range(50)])
    for trial in range(200):
        rows = rng.randint(1, 12)
        prompts = [" ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(1, 40)))
                   for _ in range(rows)]
        completions = [[5] * rng.randint(0, 30) for _ in range(rows)]
        budget = rng.randint(1, 300)
        packing = common.Scoring(tokenizer, budget, "cpu")
        batches = common.scored_micro_batches(
            prompts, completions, sampler_logps=None, scoring=packing)
        assert sorted(r for mb in batches for r in mb.rows) == list(range(rows))
        for mb in batches:
            assert mb.ids.numel() <= budget or len(mb.rows) == 1, (trial, mb.ids.shape, budget)


def test_minibatches_split_rows_disjointly():
    parts = common.split_minibatches(10, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2] and sum(parts, []) == list(range(10))
    assert common.split_minibatches(1, 3) == [[0], [], []]  # every rank still takes 3 steps


def test_the_vectorised_row_sampler_draws_what_a_multinomial_per_row_draws():
    """SampledLogprobs draws every row's token with one exponential per row and one argmax; a loop
    of torch.multinomial calls, each on its row's own generator, draws the same tokens step after
    step."""
    seeds = list(range(16))
    sampler = common.SampledLogprobs(0.7, row_seeds=seeds)
    loop_rngs = [torch.Generator().manual_seed(s) for s in seeds]
    scores_rng = torch.Generator().manual_seed(1)
    ids = torch.zeros(16, 1, dtype=torch.long)
    for _ in range(12):
        scores = torch.randn(16, 300, generator=scores_rng) * 4
        kept = sampler(ids, scores.clone())
        drawn = kept.argmax(dim=-1)  # every other token is at -inf
        probs = torch.softmax(scores / 0.7, dim=-1)
        expected = torch.cat([torch.multinomial(p, 1, generator=g)
                              for p, g in zip(probs, loop_rngs)])
        assert torch.equal(drawn, expected)
        ids = torch.cat([ids, drawn[:, None]], dim=1)


def test_generate_chunks_keep_their_token_budget():
    """Property: over random prompt lengths, every chunk holds at most `batch_rows` rows and
    rows × (longest prompt + new tokens) ≤ the budget, unless it is one over-long prompt; the
    chunks cover every prompt once, in order."""
    rng = random.Random(0)
    for trial in range(300):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 40))]
        new_tokens, rows, budget = rng.randint(1, 64), rng.randint(1, 16), rng.randint(1, 4000)
        chunks = common.generation_chunks(lengths, new_tokens, rows, budget)
        assert [i for chunk in chunks for i in chunk] == list(range(len(lengths)))
        for chunk in chunks:
            width = max(lengths[i] for i in chunk) + new_tokens
            assert len(chunk) <= rows, trial
            assert len(chunk) * width <= budget or len(chunk) == 1, trial


@pytest.mark.parametrize("name", ["rc_grpo", "agentflow"])
def test_no_generate_call_of_a_run_exceeds_its_token_budget(tmp_path, name, monkeypatch):
    """A short run of each script with --gen-tokens 300: every `generate` call it makes (rollouts,
    evaluation, stage 1's failures) holds at most 300 padded tokens unless it is one row."""
    from transformers import GenerationMixin

    generate, shapes = GenerationMixin.generate, []

    def recording(self, *args, **kwargs):
        ids = kwargs["input_ids"]
        shapes.append((ids.shape[0], ids.shape[1] + kwargs["generation_config"].max_new_tokens))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    first_step(tmp_path, name, "--gen-tokens", "300")
    assert shapes and all(rows * width <= 300 or rows == 1 for rows, width in shapes)
    assert any(rows > 1 for rows, _ in shapes)  # the budget still batches
