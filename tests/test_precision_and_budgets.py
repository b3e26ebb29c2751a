"""Precision, token budgets and the row sampler, checked on CPU: π_old under bf16 autocast is the
update's own forward (ratio exactly 1), activation checkpointing gives the same gradient, micro-
batches and `generate` chunks keep their token budgets, mini-batches split rows disjointly and go
off-policy after the first, and the vectorised sampler draws what `torch.multinomial` draws.

The mechanisms shared by the scripts (`common.py`, `utils/models.py`) are proven here once on a tiny
model; the short script runs check what each loop adds on top (what it logs, what it passes on)."""

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
from envs import agent_toy, bfcl, bfcl_toy, flowrl_tasks
from utils import cli, models

# one short run of each LLM script's toy: (module, flags, metrics file under out_dir)
TOYS = {
    "flowrl": (
        flowrl,
        ["--steps", "1", "--inner-steps", "1", "--eval-every", "100"],
        "metrics.jsonl",
    ),
    "agentflow": (
        agentflow,
        [
            "--steps",
            "1",
            "--inner-steps",
            "1",
            "--warm-start-steps",
            "100",
            "--no-ablation",
            "--queries-per-step",
            "4",
            "--eval-every",
            "100",
        ],
        "metrics.jsonl",
    ),
    "rc_grpo": (
        rc_grpo,
        [
            "--steps",
            "1",
            "--arms",
            "rctp+rc-grpo",
            "--toy-tasks",
            "60",
            "--toy-test-tasks",
            "5",
            "--tasks-per-step",
            "4",
            "--failure-rollouts",
            "1",
        ],
        "rctp+rc-grpo/metrics.jsonl",
    ),
}


def first_step(tmp_path, name, *extra, stage_one_from=None):
    """The first logged step of a toy run. stage_one_from: an rc_grpo run folder whose stage 1
    (the same flags) this run loads with --resume instead of training it again."""
    module, flags, metrics = TOYS[name]
    if stage_one_from:
        tmp_path.mkdir(parents=True)
        shutil.copy(stage_one_from / "stage1.safetensors", tmp_path / "stage1.safetensors")
        extra = (*extra, "--resume")
    args = cli.parse_args(
        module.Args, module.PRESETS, [*flags, *extra, "--quiet", "--out-dir", str(tmp_path)]
    )
    module.train(args)
    return json.loads((tmp_path / metrics).read_text().splitlines()[0])


def tiny_batch():
    """A tiny random Qwen2, its tokenizer, three prompts of different lengths and one sampled
    completion each (fp32)."""
    tokenizer = models.make_tokenizer(list("abcdefgh"))
    model = models.tiny_causal_lm(len(tokenizer))
    prompts = ["a b c d", "e", "f g"]
    torch.manual_seed(0)
    samples = common.sample_completions(model, tokenizer, prompts, 6, stop_at_eos=False)
    return tokenizer, model, prompts, samples


# ------------------------------------------------------------------------------------ precision


def test_pi_old_under_bf16_is_the_updates_own_forward_and_the_samplers_gap_is_reported():
    """bf16 autocast on the CPU (the GPU's precision path): π_old as the scripts score it (no grad,
    `scored_micro_batches`) is bit for bit the update's forward (with grad) in the same precision,
    so an on-policy ratio is exactly 1. `generate`'s log-probs round otherwise: their gap is
    reported, never used as π_old."""
    tokenizer, model, prompts, _ = tiny_batch()
    torch.manual_seed(0)
    samples = common.sample_completions(
        model, tokenizer, prompts, 6, stop_at_eos=False, precision="bf16"
    )
    completions, sampler_logps = [s[1] for s in samples], [s[2] for s in samples]
    model.train()
    scoring = common.Scoring(
        tokenizer, 10**6, model.device, model=model, precision="bf16", with_reference=False
    )
    (mb,) = common.scored_micro_batches(
        prompts, completions, sampler_logps=sampler_logps, scoring=scoring
    )
    with common.training_autocast(model.device, "bf16"):
        logp = common.micro_batch_logprobs(model, mb)
    fp32 = common.micro_batch_logprobs(model, mb)
    assert logp.requires_grad and torch.equal(logp.detach() * mb.mask, mb.old_logp * mb.mask)
    assert ((fp32.detach() - mb.old_logp) * mb.mask).abs().max() > 1e-4  # bf16 really ran
    assert common.sampler_gap(mb, mb.old_logp) > 0  # generate's bf16 rounding: a diagnostic only


def test_flowrls_on_policy_ratio_is_exactly_one_under_bf16(tmp_path):
    """One loop end to end under bf16 autocast: the first update's ratio is exactly 1 while the
    sampler's gap is still logged (agentflow's and rc_grpo's loops take π_old the same way,
    `mb.old_logp = logp.detach()`, and score with the same `common` functions)."""
    step = first_step(tmp_path, "flowrl", "--mixed-precision", "bf16")
    assert step["ratio_dev_first"] == 0.0
    assert step["sampler_gap"] > 0  # generate's bf16 rounding, a diagnostic only


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_gives_the_same_gradient(lora):
    """The scripts' loaders turn recomputation on (`tiny_causal_lm`, `load_causal_lm`): the
    gradient of a policy-gradient loss through `completion_logprobs` is the one without it, on
    every trainable weight. With LoRA the layers' inputs need no gradient (the embeddings are
    frozen), where re-entrant checkpointing would drop the adapters' gradients."""
    tokenizer, _, prompts, samples = tiny_batch()
    ids, attn, mask = common.pack_completions(tokenizer, prompts, [s[1] for s in samples], "cpu")
    advantages = torch.tensor([[1.0], [-0.5], [2.0]])
    gradients = {}
    for checkpointing in (False, True):
        model = models.tiny_causal_lm(len(tokenizer), gradient_checkpointing=checkpointing)
        assert model.is_activation_checkpointing == checkpointing
        if lora:
            model = models.add_lora(model, 4)
            with torch.no_grad():  # lora_B starts at 0, where lora_A gets no gradient
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        model.train()
        logp = common.completion_logprobs(model, ids, attn, mask.shape[1])
        (-(logp * advantages * mask).sum() / mask.sum()).backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert all(p.grad is not None for p in trainable)
        gradients[checkpointing] = torch.cat([p.grad.flatten() for p in trainable])
    plain, recomputed = gradients[False], gradients[True]
    assert plain.abs().max() > 0
    torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-7)


def test_each_toy_passes_its_checkpointing_flag_to_the_model(monkeypatch):
    """--gradient-checkpointing reaches `tiny_causal_lm` in each LLM toy's builder (which turns it
    on, as the test above checks; the full-scale loaders pass the same flag to `load_causal_lm`).
    The builders stop at the model: nothing is pretrained."""

    class Built(Exception):
        pass

    def recording(*args, gradient_checkpointing=False, **kwargs):
        raise Built(gradient_checkpointing)

    monkeypatch.setattr(models, "tiny_causal_lm", recording)
    builders = {
        flowrl: lambda args: flowrl_tasks.build_toy(args),
        agentflow: lambda args: agent_toy.build_toy(args, torch.device("cpu")),
        rc_grpo: lambda args: bfcl_toy.build_toy(args, torch.device("cpu"), rc_grpo.REWARD_TOKENS),
    }
    for module, build in builders.items():
        for flag, expected in (
            ("--gradient-checkpointing", True),
            ("--no-gradient-checkpointing", False),
        ):
            with pytest.raises(Built) as built:
                build(cli.parse_args(module.Args, module.PRESETS, [flag]))
            assert built.value.args == (expected,), (module.__name__, flag)


# ----------------------------------------------------------------------- mini- and micro-batches


def test_minibatches_split_rows_disjointly():
    parts = common.split_minibatches(10, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2] and sum(parts, []) == list(range(10))
    assert common.split_minibatches(1, 3) == [[0], [], []]  # every rank still takes 3 steps


def test_the_second_mini_batch_is_off_policy(tmp_path):
    """With two mini-batches the second is scored after the first update: w != 1 there, w = 1 on
    the first (FlowRL's importance weight acts only across mini-batches)."""
    step = first_step(tmp_path, "flowrl", "--minibatches", "2")
    assert step["ratio_dev_first"] == 0.0 and step["ratio_dev"] > 1e-3


def varied_rewards(monkeypatch):
    """rc_grpo's rollouts score 1, 0, 1, 0, … in turn: every group of stage 2 varies (a loss and a
    gradient to compare), whatever the toy's stage 1 taught."""
    real = bfcl.run_rollouts

    def alternating(*args, **kwargs):
        runs = real(*args, **kwargs)
        for k, run in enumerate(runs):
            run["reward"] = float(k % 2 == 0)
        return runs

    monkeypatch.setattr(bfcl, "run_rollouts", alternating)


@pytest.mark.long
@pytest.mark.parametrize("name", ["flowrl", "agentflow", "rc_grpo"])
def test_loss_and_ratio_dev_are_the_steps_whatever_the_micro_batches(tmp_path, name, monkeypatch):
    """`loss` (the mean over the step's optimiser steps of each one's whole loss) and `ratio_dev`
    (max |ρ − 1| over the whole update) are the same whether a mini-batch runs as one micro-batch
    or as several. Two mini-batches (flowrl, agentflow): flowrl's second is off-policy, so its
    ratio_dev is not 0. flowrl runs its GRPO arm: the log Z head's dropout draws other masks when
    the rows are split otherwise, so TB's loss differs by its noise, not by how it is logged.
    rc_grpo's stage 1 and agentflow's warm start also run in micro-batches (other roundings, other
    weights), so only the RL step gets the budget; rc_grpo's second run loads the first one's
    stage 1."""
    two = {
        "flowrl": ["--minibatches", "2", "--algo", "grpo"],
        "agentflow": ["--minibatch-rows", "8"],
    }.get(name, [])
    if name == "rc_grpo":
        varied_rewards(monkeypatch)
    logged = {}
    for label, budget in (("one", 100000), ("several", 40)):
        if name == "flowrl":
            logged[label] = first_step(
                tmp_path / label, name, *two, "--micro-batch-tokens", str(budget)
            )
            continue
        module, arm = (rc_grpo, "grpo_arm") if name == "rc_grpo" else (agentflow, "train_arm")
        real_arm = getattr(module, arm)

        def rl_arm(args, *rest, budget=budget, real_arm=real_arm, **kwargs):
            return real_arm(dataclasses.replace(args, micro_batch_tokens=budget), *rest, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(module, arm, rl_arm)
            shared = tmp_path / "one" if name == "rc_grpo" and label == "several" else None
            logged[label] = first_step(tmp_path / label, name, *two, stage_one_from=shared)
    one, several = logged["one"], logged["several"]
    assert one["loss"] != 0
    for key in ("loss", "ratio_dev"):
        assert abs(several[key] - one[key]) <= 1e-5 * max(1.0, abs(one[key])), (key, one, several)
    if name == "flowrl":
        assert one["ratio_dev"] > 1e-4


def test_micro_batches_never_exceed_their_token_budget():
    """Property: over random prompt and completion lengths, with prompts that repeat (a group's),
    each micro-batch as packed (distinct prompts × longest prompt + rows × longest completion)
    fits the budget, unless it is one over-long row."""
    rng = random.Random(0)
    tokenizer = models.make_tokenizer([f"w{i}" for i in range(50)])
    for trial in range(200):
        rows = rng.randint(1, 12)
        pool = [
            " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(1, 40)))
            for _ in range(rng.randint(1, rows))
        ]
        prompts = sorted(rng.choice(pool) for _ in range(rows))
        completions = [[5] * rng.randint(0, 30) for _ in range(rows)]
        budget = rng.randint(1, 300)
        packing = common.Scoring(tokenizer, budget, "cpu")
        batches = common.scored_micro_batches(
            prompts, completions, sampler_logps=None, scoring=packing
        )
        assert sorted(r for mb in batches for r in mb.rows) == list(range(rows))
        for mb in batches:
            assert mb.tokens <= budget or len(mb.rows) == 1, (trial, mb.tokens, budget)


# --------------------------------------------------------------------------- generate's budget


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


@pytest.mark.parametrize("name", [pytest.param("rc_grpo", marks=pytest.mark.long), "agentflow"])
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


# ------------------------------------------------------------------------------ the row sampler


def test_the_vectorised_row_sampler_draws_what_a_multinomial_per_row_draws():
    """SampledLogprobs draws every row's token with one exponential per vocabulary entry and one
    argmax; a loop of torch.multinomial calls, each on its row's own generator, draws the same
    tokens step after step."""
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
        expected = torch.cat(
            [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, loop_rngs)]
        )
        assert torch.equal(drawn, expected)
        ids = torch.cat([ids, drawn[:, None]], dim=1)


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    """ "auto" resolves to bf16 on a CPU with AVX512-BF16 or AMX and to fp32 on one without (where
    bf16 matmuls are emulated, far slower than fp32); an explicit choice is kept."""
    cpu = torch.device("cpu")
    for avx512_bf16, amx, expected in [
        (True, False, "bf16"),
        (False, True, "bf16"),
        (0, 0, "fp32"),
    ]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert common.resolved_precision(cpu) == expected
        autocast = common.training_autocast(cpu, "auto")
        assert isinstance(autocast, torch.autocast) == (expected == "bf16")
        assert common.resolved_precision(cpu, "fp32") == "fp32"
    with pytest.raises(ValueError):
        common.resolved_precision(cpu, "fp16")
