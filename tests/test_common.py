"""common.py: every function on hand-computed numbers or an independent reference."""

import json
import math
import os

import pytest
import torch

import common
import flow_grpo
import flowrl
from utils import cli, models, sweep, tracking


def test_group_advantages_hand_numbers():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    a = common.group_advantages(r, group_size=3, eps=0.0)
    # group 1: mean 1/3, sample std sqrt(((2/3)^2 + 2·(1/3)^2)/2) = sqrt(1/3)
    s1 = math.sqrt(1 / 3)
    torch.testing.assert_close(a[:3], torch.tensor([(2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1]))
    torch.testing.assert_close(a[3:], torch.tensor([-1.0, 0.0, 1.0]))  # mean 2, sample std 2
    torch.testing.assert_close(
        common.group_advantages(r, 3, scale="none"),
        torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]),
    )
    # the population std (RC-GRPO's σ_g, App. A.2): group 2's is sqrt(8/3), so A = ∓sqrt(3/2)
    population = common.group_advantages(r, 3, unbiased=False, eps=0.0)
    torch.testing.assert_close(population[3:], torch.tensor([-(1.5**0.5), 0.0, 1.5**0.5]))


def test_degenerate_group_is_exact_zero_without_nan_in_value_or_grad():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], requires_grad=True)
    a = common.group_advantages(r, 3)
    assert torch.equal(a, torch.zeros(6))
    a.sum().backward()
    assert torch.isfinite(r.grad).all()
    assert common.zero_variance_fraction(
        torch.tensor([1.0, 1, 0, 1, 0.5, 0.5]), 2
    ) == pytest.approx(2 / 3)


@pytest.mark.parametrize("bad", [dict(group_size=1), dict(group_size=4)])
def test_group_advantages_rejects_bad_shapes(bad):
    with pytest.raises(ValueError):
        common.group_advantages(torch.ones(6), **bad)


def test_group_advantages_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        common.group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_token_logprobs_equals_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(common.token_logprobs(logits, labels), ref)
    torch.testing.assert_close(
        common.token_logprobs(logits.bfloat16(), labels), ref, atol=0.05, rtol=0
    )


def test_masked_mean_and_sequence_logprob():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert common.masked_mean(x, m).item() == 1.5
    torch.testing.assert_close(common.masked_mean(x, m, dim=-1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(flowrl.sequence_logprob(x, m), torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(
        flowrl.sequence_logprob(x, m, length_normalize=True), torch.tensor([1.5, 0.0])
    )


def test_gaussian_logprob_equals_normal_log_prob_averaged():
    torch.manual_seed(0)
    x, mean = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    ref = torch.distributions.Normal(mean, 0.3).log_prob(x).flatten(1).mean(1)
    torch.testing.assert_close(flow_grpo.gaussian_logprob(x, mean, 0.3), ref)


def script_losses():
    """Each script writes its own clipped surrogate in place; here the three LLM ones, as (logp,
    old, A, mask) → loss."""
    import agentflow
    import flowrl
    import rc_grpo

    return {
        "flowrl.grpo_loss": lambda lp, old, adv, m, eps=0.2: flowrl.grpo_loss(
            lp, old, adv, m, eps, m.sum()
        ),
        "rc_grpo.rc_grpo_loss": lambda lp, old, adv, m, eps=0.2: rc_grpo.rc_grpo_loss(
            lp, old, lp.detach(), adv, m, clip_eps=eps, beta=0.0, token_count=m.sum()
        ),
        "agentflow.flow_grpo_loss": lambda lp, old, adv, m, eps=0.2: agentflow.flow_grpo_loss(
            lp,
            old,
            lp.detach(),
            adv,
            m,
            clip=agentflow.Clip(low=eps, high=eps),
            beta=0.0,
            token_count=m.sum(),
        ),
    }


@pytest.mark.parametrize(
    "name", ["flowrl.grpo_loss", "rc_grpo.rc_grpo_loss", "agentflow.flow_grpo_loss"]
)
def test_clipped_loss_at_ratio_one_is_minus_advantage(name):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.3]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, stats = script_losses()[name](logp, logp.detach(), adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert stats["clipfrac"] == 0.0
    loss.backward()  # d(−ρA)/dlogp = −A·ρ/4 at ρ = 1
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))


@pytest.mark.parametrize(
    "name", ["flowrl.grpo_loss", "rc_grpo.rc_grpo_loss", "agentflow.flow_grpo_loss"]
)
def test_clipped_loss_gradient_vanishes_where_clip_binds(name):
    old = torch.zeros(4, 1)
    # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped), 1.5 (A<0: not clipped), 0.5 (A<0: clipped)
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.5], [0.5]])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = script_losses()[name](logp, old, adv, torch.ones(4, 1))
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[3, 0] == 0
    assert logp.grad[1, 0] != 0 and logp.grad[2, 0] != 0
    assert stats["clipfrac"] == 0.5


def test_token_mean_over_micro_batches_equals_the_one_shot_gradient():
    import flowrl

    torch.manual_seed(0)
    logp = torch.randn(6, 5, requires_grad=True)
    old, adv = logp.detach() + 0.1 * torch.randn(6, 5), torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    loss, _ = flowrl.grpo_loss(logp, old, adv, mask, 0.2, mask.sum())
    (one_shot,) = torch.autograd.grad(loss, logp)
    accumulated = torch.zeros_like(logp)
    for rows in ([0, 1], [2, 3, 4], [5]):  # micro-batches normalised by the step's token count
        part, _ = flowrl.grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], 0.2, mask.sum())
        accumulated += torch.autograd.grad(part, logp)[0]
    torch.testing.assert_close(accumulated, one_shot)


def test_micro_batches_stay_within_the_token_budget():
    tok = models.make_tokenizer(list("abcdef"))
    prompts = ["a b", "a b c d e f", "c", "d e", "f"]
    completions = [[1, 2], [3], [4, 5, 6], [1], [2, 3, 4, 5]]
    batches = common.micro_batches(tok, prompts, completions, token_budget=8)
    assert sorted(r for b in batches for r in b) == list(range(5))
    for rows in batches:
        longest = max(len(prompts[r].split()) + len(completions[r]) for r in rows)
        assert len(rows) == 1 or len(rows) * longest <= 8


def test_k3_nonnegative_zero_at_equality_and_unbiased():
    torch.manual_seed(0)
    d = torch.randn(1000) * 3
    assert (common.kl_penalty(torch.zeros(1000), d) >= 0).all()
    assert common.kl_penalty(torch.ones(4), torch.ones(4)).abs().max() == 0
    far = common.kl_penalty(torch.zeros(2), torch.tensor([-20.0, 20.0]), limit=10.0)
    assert far.tolist() == [10.0, 10.0]  # verl's low_var_kl clamp: e^20 − 21 and 19 → 10
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    exact = (p * (p / q).log()).sum()
    y = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    est = common.kl_penalty(p.log()[y], q.log()[y], "k3").mean()
    assert est.item() == pytest.approx(exact.item(), abs=0.01)
    assert common.kl_penalty(p.log()[y], q.log()[y], "k1").mean().item() == pytest.approx(
        exact.item(), abs=0.01
    )


def test_k3_log_ratio_clamp_keeps_a_far_token_finite_as_verl():
    """verl's low_var_kl clamps d = log π_ref − log π_θ to ±20 before e^d: a token 100 nats away
    gives k3 = 10 and a zero gradient; without that clamp e^100 overflows fp32 and the gradient
    through the ±10 clamp is NaN. Inside ±20 the clamp changes nothing."""

    def k3_and_grad(**limits):
        logp = torch.tensor([0.0, -1.0], requires_grad=True)
        kl = common.kl_penalty(logp, torch.tensor([100.0, -0.5]), "k3", limit=10.0, **limits)
        kl.sum().backward()
        return kl.detach(), logp.grad

    kl, grad = k3_and_grad(log_ratio_limit=20.0)
    assert kl[0] == 10.0 and torch.isfinite(grad).all() and grad[0] == 0
    _, unclamped_grad = k3_and_grad()
    assert torch.isnan(unclamped_grad[0]) and unclamped_grad[1] == grad[1]
    d = torch.randn(1000) * 5
    inside = d.clamp(-19.9, 19.9)
    assert torch.equal(
        common.kl_penalty(torch.zeros(1000), inside, limit=10.0),
        common.kl_penalty(torch.zeros(1000), inside, limit=10.0, log_ratio_limit=20.0),
    )


def test_checkpoint_round_trip_is_exact(tmp_path):
    t = {"w": torch.randn(3, 4), "rng": torch.get_rng_state()}
    tracking.save_checkpoint(tmp_path / "ckpt.safetensors", t, {"step": 7, "metrics": [1.5]})
    loaded, state = tracking.load_checkpoint(tmp_path / "ckpt.safetensors")
    assert state == {"step": 7, "metrics": [1.5]}
    assert all(torch.equal(t[k], loaded[k]) for k in t)


def test_interrupted_checkpoint_write_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    tracking.save_checkpoint(path, {"w": torch.zeros(2)}, {"step": 1})

    def crash(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        tracking.save_checkpoint(path, {"w": torch.ones(2)}, {"step": 2})
    loaded, state = tracking.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(loaded["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]  # no temp file left


def test_tiny_tokenizer_and_model_round_trip():
    tok = models.make_tokenizer(["a", "b", "c"], special_tokens=["<|high_reward|>"])
    ids = tok("a <|high_reward|> c b")["input_ids"]
    assert tok.decode(ids) == "a <|high_reward|> c b"
    assert len(ids) == 4
    model = models.tiny_causal_lm(len(tok))
    out = model(input_ids=torch.tensor([ids]))
    assert out.logits.shape == (1, 4, len(tok))


def test_completion_logprobs_match_generate_scores_under_left_padding():
    tok = models.make_tokenizer(list("abcdef"))
    model = models.tiny_causal_lm(len(tok)).eval()
    tok.padding_side = "left"
    enc = tok(["a b c", "d"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(
        **enc,
        do_sample=True,
        max_new_tokens=4,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None,
    )
    seq = out.sequences
    mask = torch.cat([enc["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)
    with torch.no_grad():
        logp = common.completion_logprobs(model, seq, mask, 4)
    gen_logp = torch.stack(
        [
            torch.log_softmax(s, -1).gather(-1, seq[:, -4 + i, None]).squeeze(-1)
            for i, s in enumerate(out.scores)
        ],
        1,
    )
    torch.testing.assert_close(logp, gen_logp, atol=1e-4, rtol=0)


def test_parse_args_presets_and_errors():
    import dataclasses

    @dataclasses.dataclass
    class Args:
        lr: float = dataclasses.field(default=0.1, metadata={"help": "learning rate"})
        model: str = "toy"
        lora: bool = False

    Args.__module__ = __name__
    a = cli.parse_args(
        Args,
        {"full": {"model": "Qwen/Qwen2.5-0.5B", "lr": 1e-6}},
        ["--preset", "full", "--lr", "0.5"],
    )
    assert (a.model, a.lr, a.lora, a.preset) == ("Qwen/Qwen2.5-0.5B", 0.5, False, "full")
    with pytest.raises(SystemExit):
        cli.parse_args(Args, {}, ["--no-such-flag"])
    with pytest.raises(SystemExit, match="lr must be <= 0.1"):
        cli.check_args([(a.lr <= 0.1, "lr must be <= 0.1"), (True, "unused")])


def test_preset_builds_what_the_command_line_builds():
    argv = ["--preset", "smollm2-addition", "--steps", "8", "--algo", "grpo"]
    assert cli.preset(flowrl, "smollm2-addition", steps=8, algo="grpo") == cli.parse_args(
        flowrl.Args, flowrl.PRESETS, argv
    )


def test_load_causal_lm_offline_error_points_at_toy():
    with pytest.raises(SystemExit, match="--preset toy"):
        models.load_causal_lm("no-such-org/no-such-model-xyz", torch.device("cpu"))


def test_parse_seeds_ranges_lists_and_errors():
    assert sweep.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert sweep.parse_seeds("1,3,7") == [1, 3, 7]
    for bad in ["", "a-b", "3-1", "-1"]:
        with pytest.raises(SystemExit, match="--seeds"):
            sweep.parse_seeds(bad)


def test_seed_sweep_runs_every_arm_per_seed_and_counts_the_claim(tmp_path):
    import dataclasses

    @dataclasses.dataclass
    class Args:
        seed: int = 0
        seeds: str = "0-2"
        out_dir: str = ""
        quiet: bool = False
        algo: str = "a"
        preset: str = "toy"

    calls = []

    def train(args):
        calls.append((args.seed, args.algo, args.out_dir, args.seeds))
        return {"score": float(args.seed) + (0.5 if args.algo == "b" else 0.0)}

    args = Args()
    result = sweep.seed_sweep(
        train,
        args,
        [("a", {"algo": "a"}), ("b", {"algo": "b"})],
        lambda s: {"gap": s["b"]["score"] - s["a"]["score"], "a": s["a"]["score"]},
        lambda row: row["a"] >= 1,  # holds on seeds 1 and 2
        tmp_path / "sweep",
    )
    assert [(c[0], c[1]) for c in calls] == [(s, arm) for s in range(3) for arm in "ab"]
    assert all(c[3] == "" and c[2].endswith(f"seed{c[0]}/{c[1]}") for c in calls)
    assert result["claim_holds_on"] == 2 and result["stats"]["a"]["mean"] == 1.0
    assert result["stats"]["gap"] == {"mean": 0.5, "sd": 0.0}
    table = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "| 2 | 0.500 | 2.000 | yes |" in table and "2/3" in table
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0


def test_demo_table_reads_each_runs_own_claim(tmp_path):
    for name, summary in [
        ("a", {"claim": {"text": "A goes up", "before": 0.25, "after": 0.75}, "wall_seconds": 3}),
        ("b", {"wall_seconds": 1}),  # no claim: not a demo row
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    lines = sweep.demo_table(tmp_path).splitlines()
    assert len(lines) == 2
    assert lines[1].split() == ["a", "A", "goes", "up", "0.250", "→", "0.750", "3"]


# --------------------------------------------- a shared prompt computed once, as each row whole


def shared_rows():
    """Six rows over three prompts of different lengths (a group of 2, one alone, a group of 3),
    completions of different lengths: what a rollout batch looks like."""
    tok = models.make_tokenizer(list("abcdefgh"))
    prompts = ["a b c d", "a b c d", "e", "f g", "f g", "f g"]
    completions = [[5, 6, 7], [5], [3, 4, 5, 6], [2, 2], [7, 1, 3], [4]]
    return tok, prompts, completions


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_shared_prompt_gives_each_rows_loss_and_gradient(checkpointed):
    """micro_batch_forward runs the rows' prefix tree, each distinct prefix once: the log-probs, a
    loss and its gradient (LoRA and full weights), and the prompt states log Z reads, are those of
    packing every row whole, within 1e-5 (float rounding), with activation checkpointing too; the
    tree computes fewer tokens than the rows hold."""
    tok, prompts, completions = shared_rows()
    torch.manual_seed(0)
    model = models.add_lora(models.tiny_causal_lm(len(tok)), 4)
    for p in model.parameters():
        p.requires_grad_(True)
    if checkpointed:
        models.checkpoint_activations(model)
    model.train()
    weights = torch.randn(6, 4)

    def loss_and_grads(logp, mask):
        loss = (logp * mask * weights).sum()
        model.zero_grad()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    mb = common.pack_micro_batch(tok, prompts, completions, "cpu", range(6))
    logp, states = common.micro_batch_forward(model, mb, prompt_states=True)
    shared_loss, shared_grads = loss_and_grads(logp, mb.mask)
    ids, attn, mask = common.pack_completions(tok, prompts, completions, "cpu")
    plain_logp, out = common.completion_forward(model, ids, attn, 4, output_hidden_states=True)
    plain_loss, plain_grads = loss_and_grads(plain_logp, mask)
    assert torch.equal(mb.mask, mask)
    torch.testing.assert_close(logp * mask, plain_logp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_loss, plain_loss, atol=1e-5, rtol=1e-6)
    for shared, plain in zip(shared_grads, plain_grads):
        torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-4)
    plain_states = out.hidden_states[-1][:, :-4][
        attn[:, :-4].bool()
    ]  # real prompt tokens, in order
    torch.testing.assert_close(states[mb.prompt_mask.bool()], plain_states, atol=1e-5, rtol=1e-4)
    distinct = {
        tuple(tok(p, add_special_tokens=False)["input_ids"] + c)[:k]
        for p, c in zip(prompts, completions)
        for k in range(1, 12)
    }
    assert mb.tokens == len(distinct) < int(attn.sum())  # each distinct prefix once


@pytest.mark.parametrize("system", ["", "h g h g h g h g h "])
def test_generate_prefills_each_distinct_prompt_once_and_samples_as_before(system):
    """sample_completions prefills a group's prompt once and copies its cache to the G rows, and a
    prefix every prompt shares (a `system` turn) once for all: the greedy completions are
    `generate`'s on the rows packed whole, and seeded rows draw the same tokens with the same
    log-probs (within rounding) as each row generated alone. The prefill computes no padding: the
    shared prefix once, then each distinct prompt's rest but its last token."""
    from transformers import LogitsProcessorList

    tok, prompts, _ = shared_rows()
    prompts = [system + p for p in prompts]
    ids = tok(list(dict.fromkeys(prompts)), add_special_tokens=False)["input_ids"]
    shared = common.shared_prefix_length(ids)
    assert (shared >= common.SHARED_PREFIX_MIN) == bool(system)
    model = models.tiny_causal_lm(len(tok)).eval()
    computed = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: computed.append(args[0].numel())
    )
    common.prompt_cache(model, ids, tok.pad_token_id, torch.tensor([0, 0, 1, 2, 2, 2]))
    hook.remove()
    shared = shared if system else 0
    assert sum(computed) == shared + sum(len(row) - shared - 1 for row in ids)
    greedy = common.sample_completions(model, tok, prompts, 6, temperature=0.0, stop_at_eos=False)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    config = common.generation_config(model, tok, 6, 0.0, stop_at_eos=False)
    whole = model.generate(**enc, generation_config=config)[:, enc["input_ids"].shape[1] :]
    assert [ids for _, ids, _ in greedy] == whole.tolist()
    seeds = [11, 12, 13, 14, 15, 16]
    shared = common.sample_completions(model, tok, prompts, 6, stop_at_eos=False, row_seeds=seeds)
    for prompt, seed, (_, ids, logp) in zip(prompts, seeds, shared):
        alone = tok([prompt], return_tensors="pt", add_special_tokens=False)
        recorder = common.SampledLogprobs(1.0, [seed])
        config = common.generation_config(model, tok, 6, 1.0, stop_at_eos=False)
        seq = model.generate(
            **alone, generation_config=config, logits_processor=LogitsProcessorList([recorder])
        )
        recorder.collect(seq)
        assert ids == seq[0, alone["input_ids"].shape[1] :].tolist()
        torch.testing.assert_close(logp, torch.stack(recorder.picked, 1)[0], atol=1e-5, rtol=0)


def test_a_dialogues_next_step_computes_only_its_new_tokens_and_samples_as_before(monkeypatch):
    """sample_completions with `dialogues`: a dialogue's next prompt (its last prompt, two of the
    tokens it sampled, then new text) runs only the tokens after those, on the keys and values
    its last call kept, beside a prompt new to the call (the shared system prefix once); greedy
    and with rows seeded one by one it draws the tokens it draws without `dialogues`, with the
    same log-probs (within rounding)."""
    tok = models.make_tokenizer(list("abcdefgh"))
    model = models.tiny_causal_lm(len(tok), seed=1).eval()
    system = "h g h g h g h g "
    first = [system + "a b c", system + "d", system + "d"]
    dialogues = [{}, {}, {}]
    drawn = common.sample_completions(
        model, tok, first, 5, temperature=0.0, stop_at_eos=False, dialogues=dialogues
    )
    encode = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]
    # each dialogue goes on with two of its tokens and new text; a new dialogue joins
    steps = [encode([p])[0] + ids[:2] for p, (_, ids, _) in zip(first, drawn)]
    nxt = [tok.decode(ids) + " e f" for ids in steps] + [system + "g"]
    assert [ids[: len(s)] for ids, s in zip(encode(nxt), steps)] == steps  # the text is the tokens
    assert all(ids[2] != encode(["e"])[0][0] for _, ids, _ in drawn)  # kept: no more than steps
    computed, prompt_cache = [], common.prompt_cache

    def counted(model, prompts, *args):
        hook = model.get_input_embeddings().register_forward_hook(
            lambda module, inputs, out: computed.append(inputs[0].numel())
        )
        try:
            return prompt_cache(model, prompts, *args)
        finally:
            hook.remove()

    monkeypatch.setattr(common, "prompt_cache", counted)
    dialogues.append({})
    for seeds in [None, [5, 6, 7, 8]]:
        temperature = 1.0 if seeds else 0.0
        kept = [dict(d) for d in dialogues]
        computed.clear()
        reused = common.sample_completions(
            model,
            tok,
            nxt,
            5,
            temperature=temperature,
            stop_at_eos=False,
            row_seeds=seeds,
            dialogues=kept,
        )
        # dialogue 0, and dialogues 1 and 2 (one prompt): " e f" but its last token (the two sampled
        # tokens were computed in the last call); the new prompt: the shared prefix, then its
        # one token but the last (none)
        assert computed == [len(encode([system])[0]), 1, 1]
        plain = common.sample_completions(
            model, tok, nxt, 5, temperature=temperature, stop_at_eos=False, row_seeds=seeds
        )
        for (_, ids, logp), (_, plain_ids, plain_logp) in zip(reused, plain):
            assert ids == plain_ids
            torch.testing.assert_close(logp, plain_logp, atol=1e-5, rtol=0)
    # a call's budget bounds what the dialogues keep: the first row its prompt and the 4 of its 5
    # tokens fed back (19 of 20), the rows past the budget nothing
    common.sample_completions(
        model, tok, nxt, 5, stop_at_eos=False, token_budget=20, dialogues=kept
    )
    assert [len(d.get("ids", [])) for d in kept] == [len(encode(nxt[:1])[0]) + 4, 0, 0, 0]


def tiny_sliding_window_model(window):
    """A tiny random Qwen2 whose every layer attends over the last `window` tokens only."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = models.make_tokenizer(list("abcdefgh"))
    config = Qwen2Config(
        **models.tiny_causal_lm(len(tok)).config.to_dict()
        | dict(
            use_sliding_window=True, sliding_window=window, max_window_layers=0, layer_types=None
        )
    )
    torch.manual_seed(1)
    return tok, AutoModelForCausalLM.from_config(config).eval()


def test_a_model_with_a_sliding_window_runs_its_prompts_whole_and_keeps_no_dialogue():
    """A cache layer with a sliding window (Gemma 2, Mistral 7B v0.1, Qwen2 with use_sliding_window)
    cannot take the laid-out prompt cache: sample_completions runs such a model's prompts whole,
    left-padded (a shared prefix laid out first would put padding inside a row's window), and draws
    what each prompt alone draws, with the same log-probs, over a window shorter than the rows;
    its dialogues keep nothing."""
    tok, model = tiny_sliding_window_model(window=6)
    assert not common.keeps_every_position(model)
    system = "h g h g h g h g h g "  # past SHARED_PREFIX_MIN tokens
    prompts = [system + "a b c", system + "d", system + "d e"]
    dialogues = [{}, {}, {}]
    kwargs = dict(temperature=1.0, stop_at_eos=False)
    drawn = common.sample_completions(
        model, tok, prompts, 4, row_seeds=[1, 2, 3], dialogues=dialogues, **kwargs
    )
    for seed, prompt, (_, ids, logp) in zip([1, 2, 3], prompts, drawn):
        [(_, alone_ids, alone_logp)] = common.sample_completions(
            model, tok, [prompt], 4, row_seeds=[seed], **kwargs
        )
        assert ids == alone_ids
        torch.testing.assert_close(logp, alone_logp, atol=1e-5, rtol=0)
    assert dialogues == [{}, {}, {}]


def test_greedy_sampling_draws_nothing_with_row_seeds():
    """T = 0 is greedy with or without `row_seeds`: the seeds seed draws, and greedy draws none."""
    tok = models.make_tokenizer(list("abcdefgh"))
    model = models.tiny_causal_lm(len(tok), seed=2).eval()
    prompts = ["a b c", "d e", "f"]
    kwargs = dict(temperature=0.0, stop_at_eos=False)
    seeded = common.sample_completions(model, tok, prompts, 8, row_seeds=[1, 2, 3], **kwargs)
    assert [ids for _, ids, _ in seeded] == [
        ids for _, ids, _ in common.sample_completions(model, tok, prompts, 8, **kwargs)
    ]


def test_the_tree_forward_refuses_attention_it_does_not_compute(monkeypatch):
    """The prefix tree's mask lets a token see every ancestor: within a model's sliding window that
    is what the model computes (the log-probs of packing each row whole); a row past the window,
    or a cache layer of another kind, is refused with one line rather than scored wrongly."""
    from transformers.cache_utils import DynamicLayer

    tok, model = tiny_sliding_window_model(window=6)
    scoring = common.Scoring(tok, 1000, model.device)
    b = tok(["b"], add_special_tokens=False)["input_ids"][0]

    def tree_and_whole(prompts):
        [mb] = common.scored_micro_batches(
            prompts, [b + b] * len(prompts), sampler_logps=None, scoring=scoring
        )
        ids, attn, mask = common.pack_completions(tok, prompts, [b + b] * len(prompts), "cpu")
        with torch.no_grad():
            whole = common.completion_logprobs(model, ids, attn, mask.shape[1])
            return common.micro_batch_logprobs(model, mb), whole

    torch.testing.assert_close(*tree_and_whole(["h g a", "h g d"]), atol=1e-5, rtol=0)  # 5 tokens
    with pytest.raises(SystemExit, match="a row of 8 tokens needs attention over every earlier"):
        tree_and_whole(["h g a b c d", "h g d"])
    # a cache layer of another kind (chunked, linear attention): refused however short the rows
    monkeypatch.setattr(common, "cache_layer_kinds", lambda model: {DynamicLayer, object})
    with pytest.raises(SystemExit, match="a row of 5 tokens needs attention over every earlier"):
        tree_and_whole(["h g a", "h g d"])
