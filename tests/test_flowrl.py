"""flowrl.py: the TB loss on hand numbers, its optimum, exact enumeration, and the two presets end
to end."""

import dataclasses
import itertools
import json

import pytest
import torch

import common
import flowrl
from envs import flowrl_tasks
from utils import cli, models


def toy_args(tmp_path, *extra):
    return cli.parse_args(
        flowrl.Args, flowrl.PRESETS, ["--quiet", "--out-dir", str(tmp_path), *extra]
    )


def test_trajectory_balance_loss_hand_numbers():
    log_z = torch.tensor([0.5, 0.5])
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    log_ratio = torch.tensor([0.0, -10.0])  # π_θ/π_old = 1 and e⁻¹⁰: w = 1 and 0.5 (clipped)
    loss, stats = flowrl.trajectory_balance_loss(
        log_z, logp, ref, torch.tensor([1.0, 0.0]), 2.0, log_ratio=log_ratio, clip_eps=0.5
    )
    # residuals: 0.5 − 1 − 2 + 1.5 = −1 ; 0.5 − 2 − 0 + 1 = −0.5 → mean(1·1, 0.5·0.25) = 0.5625
    torch.testing.assert_close(stats["residual_abs"], torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(stats["w_mean"], torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(stats["log_z"], log_z)
    assert stats["ratio_dev"] == pytest.approx(1.0, abs=1e-4)  # |e⁻¹⁰ − 1|, unclipped
    assert loss.item() == pytest.approx(0.5625)


def test_loss_and_gradient_vanish_at_the_target_with_the_true_normaliser():
    torch.manual_seed(0)
    length, beta = 3, 1.5
    ref_seq = torch.log_softmax(torch.randn(64), 0)  # log π_ref(y) over an enumerable space
    reward = (torch.rand(64) > 0.8).float()
    log_target = torch.log_softmax(ref_seq + beta * length * reward, 0)  # π = p*
    log_z = (torch.logsumexp(ref_seq + beta * length * reward, 0) / length).requires_grad_()
    logp = (log_target / length).clone().requires_grad_()  # length-normalised
    on_policy = {"log_ratio": torch.zeros(64), "clip_eps": 0.2}  # w = 1
    loss, stats = flowrl.trajectory_balance_loss(
        log_z, logp, ref_seq / length, reward, beta, **on_policy
    )
    loss.backward()
    assert stats["residual_abs"].max() < 1e-5 and loss.item() < 1e-10
    assert logp.grad.abs().max() < 1e-6 and log_z.grad.abs() < 1e-5
    # and a wrong normaliser is not an optimum
    loss_off, _ = flowrl.trajectory_balance_loss(
        log_z.detach() + 0.1, logp.detach(), ref_seq / length, reward, beta, **on_policy
    )
    assert loss_off.item() > 1e-3


def test_importance_weight_is_clipped_and_detached():
    log_ratio = torch.tensor([0.0, 1.0, -1.0], requires_grad=True)  # log π_θ/π_old
    w = flowrl.importance_weight(log_ratio, 0.2)
    torch.testing.assert_close(w, torch.tensor([1.0, 1.2, 0.8]))
    assert not w.requires_grad


def test_exact_enumeration_equals_brute_force(tmp_path):
    args = toy_args(tmp_path)
    tokenizer, model, task = flowrl_tasks.build_toy(args)
    model.eval()
    metrics = flowrl_tasks.exact_metrics(model, model, tokenizer, task, beta=1.0)
    texts, pi, target, reward = metrics["dists"][0]
    assert sum(pi) == pytest.approx(1.0, abs=1e-4) and sum(target) == pytest.approx(1.0, abs=1e-4)
    prompt = tokenizer(task.prompts[0], add_special_tokens=False)["input_ids"]
    vocab = len(tokenizer)
    with torch.no_grad():
        for j in [0, 5, 777, vocab**3 - 1]:
            answer = list(itertools.product(range(vocab), repeat=3))[j]
            prob = 1.0
            for t in range(3):
                probs = torch.softmax(
                    model(input_ids=torch.tensor([prompt + list(answer[:t])])).logits[0, -1], -1
                )
                prob *= probs[answer[t]].item()
            assert pi[j] == pytest.approx(prob, rel=1e-4)
    # KL(π_ref‖p*) in closed form: log E_ref[e^{3βr}] − 3β·E_ref[r]
    r = torch.tensor(reward)
    p = torch.tensor(pi, dtype=torch.float64)
    closed = torch.log((p * torch.exp(3.0 * r)).sum()) - 3.0 * (p * r).sum()
    assert closed.item() == pytest.approx(_kl(pi, target), abs=1e-4)
    assert metrics["kl_policy_to_target"] == pytest.approx(
        sum(_kl(*d[1:3]) for d in metrics["dists"]) / 4, abs=1e-4
    )
    # what summary.json keeps of prompt x0: every rewarded answer's r, π and p*; π's top answer
    kept = metrics["prompts"][0]
    assert len(kept["rewarded"]) == sum(r > 0 for r in reward)
    for answer, row in kept["rewarded"].items():
        j = texts.index(answer)
        assert (row["pi"], row["p*"]) == (pi[j], target[j]) and row["r"] == pytest.approx(reward[j])
    assert kept["pi_top"]["pi"] == max(pi)


def _kl(p, q):
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    return (p * (p.log() - q.log())).sum().item()


def test_toy_with_lora_runs_and_scores_what_it_sampled(tmp_path):
    """A smoke test of the LoRA path on the toy (π_ref = the adapter off): it runs, and training
    scores what the sampler drew."""
    summary = flowrl.train(
        toy_args(
            tmp_path, "--lora-rank", "8", "--steps", "2", "--eval-every", "2", "--group-size", "16"
        )
    )
    assert summary["sampler_logprob_max_dev"] < 1e-3


@pytest.mark.slow
def test_toy_flowrl_matches_the_target_and_grpo_does_not(tmp_path):
    # evaluated at the start and the end only (the exact metrics draw nothing: the same run)
    flow_args = toy_args(tmp_path / "flowrl", "--seed", "1", "--steps", "150")
    grpo_args = toy_args(tmp_path / "grpo", "--seed", "1", "--algo", "grpo", "--steps", "50")
    flow_args.eval_every, grpo_args.eval_every = 150, 50
    flow, grpo = flowrl.train(flow_args), flowrl.train(grpo_args)
    start = flow["before"]["kl_policy_to_target"]  # 0.48 at π = π_ref
    # Margin: seed 1 reaches KL 0.11 at 150 batches (one thread), under half of 0.5 × start
    # (≈ 0.24). Over the five-seed sweep (300 batches) the worst seed ends at 0.033, so the
    # threshold sits a little past half-way from start to worst (≈ 0.26).
    assert flow["kl_policy_to_target"] < 0.5 * start
    # GRPO has collapsed onto the best answers by batch 25 (KL > 2 on every seed of the sweep).
    assert grpo["kl_policy_to_target"] > 1.0 > 4 * flow["kl_policy_to_target"]
    assert flow["modes_covered"] > grpo["modes_covered"]


MATH_PAIRS = [  # (completion, reference answer, reward)
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{x^{2}}", "x^{2}", 1.0),
    ("\\boxed{x^2}", "x^{2}", 1.0),
    ("I think 41, no, 42", "42", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("", "42", 0.0),
    ("I don't know", "\\text{Monday}", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\boxed{\\text{Tuesday}}", "\\text{Monday}", 0.0),
    ("\\boxed{123456789}", "123456700", 0.0),
    ("\\boxed{123456789}", "123456789", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{\\tfrac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.75}", "\\frac34", 1.0),
    ("\\boxed{0.7}", "\\frac34", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{x=4}", "4", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{(2,1)}", "(1, 2)", 0.0),
    ("The answer is $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{5} but later \\boxed{6}", "6", 1.0),
    ("\\boxed{5} but later \\boxed{6}", "5", 0.0),
    ("\\boxed{1/3}", "0.333", 0.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{2x+1}", "1+2x", 1.0),
    ("\\boxed{2x-1}", "1+2x", 0.0),
]


@pytest.mark.parametrize("completion, answer, reward", MATH_PAIRS)
def test_math_answer_checker(completion, answer, reward):
    assert flowrl_tasks.math_reward(completion, answer) == reward


def test_full_preset_path_with_a_tiny_random_qwen2(tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer = models.make_tokenizer(
        "What is 1 + 2 3 ? Half of Please reason step by step".split() + list("0123456789")
    )
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    args = cli.parse_args(
        flowrl.Args,
        flowrl.PRESETS,
        [
            "--preset",
            "full",
            "--model",
            str(tmp_path / "tiny"),
            "--data",
            "tests/data/math_tiny.jsonl",
            "--eval-data",
            "tests/data/math_tiny.jsonl",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "6",
            "--eval-k",
            "2",
            "--quiet",
            "--out-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
        ],
    )
    # FlowRL's paper defaults
    assert args.beta == 15.0 and args.reward_norm == "group" and args.lr == 1e-6
    summary = flowrl.train(args)
    assert "avg_at_k" in summary and summary["sampler_logprob_max_dev"] < 1e-3
    # loads without the log Z head
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy")
    assert not any("net." in k for k in policy.state_dict())
    # --eval-only, the original's separate test: the run's first evaluation of the same model
    only = dataclasses.replace(args, eval_only=True, data="")
    assert flowrl.evaluate_only(only) == {"avg_at_k": summary["before"]["avg_at_k"]}


def test_report_to_tensorboard_logs_the_same_numbers_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flowrl.train(
        toy_args(tmp_path, "--steps", "2", "--group-size", "4", "--report-to", "tensorboard")
    )
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [(e.step, e.value) for e in events.Scalars("reward")]
    assert rewards == [(r["step"], pytest.approx(r["reward"])) for r in logged]


# ----------------------------------------------------------------------------- the laptop tasks


@pytest.mark.parametrize(
    "reply, correct, first, reward",
    [
        ("7", {7}, True, 1.0),
        ("7 is the answer, not 8", {7}, True, 1.0),
        ("3 + 4 = 7", {7}, True, 0.0),  # addition reads the first number written
        ("3 + 4 = 7.", {7}, False, 1.0),
        ("A prime number less than 30 is 29", {29, 2}, False, 1.0),
        ("A multiple of 7 less than 100", set(range(7, 100, 7)), False, 0.0),  # ends on 100
        ("seven", {7}, False, 0.0),
        ("", {7}, True, 0.0),
    ],
)
def test_integer_reward_reads_the_first_or_the_last_integer(reply, correct, first, reward):
    assert flowrl_tasks.integer_reward(reply, correct, first) == reward


def test_answer_spread_counts_distinct_correct_answers_and_their_entropy(monkeypatch):
    replies = ["2", "It is 3", "3", "2", "4"] + ["5", "5", "x", "5", "5"]  # 5 per question

    def fake_sample(model, tokenizer, prompts, *args, **kwargs):
        assert prompts == ["p0"] * 5 + ["p1"] * 5
        return [(text, [], None) for text in replies]

    monkeypatch.setattr(common, "sample_completions", fake_sample)
    task = flowrl_tasks.Task("numbers", ["p0", "p1"], [{2, 3, 5}, {5, 10}])
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, ["--spread-samples", "5"])
    spread = flowrl_tasks.answer_spread(None, None, task, args)
    assert spread["spread_reward"] == pytest.approx((4 / 5 + 4 / 5) / 2)
    assert spread["distinct_correct"] == 3  # {2, 3} and {5}
    # question 0: 2 and 3 twice each → ln 2; question 1: one answer → 0
    assert spread["correct_entropy"] == pytest.approx(torch.log(torch.tensor(2.0)).item() / 2)
    assert spread["counts"] == [{"2": 2, "3": 2}, {"5": 4}]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random causal LM saved as an HF folder whose vocabulary covers the laptop prompts."""
    folder = tmp_path_factory.mktemp("tiny_chat")
    words = "What is a + ? Reply with only the number.".split() + [str(n) for n in range(100)]
    tokenizer = models.make_tokenizer(words)
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("task, algo", [("numbers", "flowrl"), ("addition", "grpo")])
def test_laptop_tasks_run_end_to_end(tmp_path, tiny_chat_model, task, algo):
    """A smoke test of the laptop presets' path with a tiny random model: it runs, scores what it
    sampled and writes its plots and policy (the spread's and Avg@k's numbers are checked by
    test_answer_spread_… and test_avg_at_k_… on hand-made replies)."""
    preset = f"smollm2-{task}"
    summary = flowrl.train(
        toy_args(
            tmp_path,
            "--preset",
            preset,
            "--model",
            str(tiny_chat_model),
            "--algo",
            algo,
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--group-size",
            "2",
            "--spread-samples",
            "4",
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
        )
    )
    assert summary["sampler_logprob_max_dev"] < 1e-3
    if task == "numbers":
        assert len(summary["counts"]) == len(flowrl_tasks.NUMBER_QUESTIONS)
        assert {"spread_reward", "distinct_correct", "correct_entropy"} <= set(summary["before"])
        assert (tmp_path / "answers.png").stat().st_size > 0
    else:  # greedy accuracy on the 64 held-out sums, logged at every evaluation
        assert "avg_at_k" in summary and "avg_at_k" in summary["before"]
        assert (tmp_path / "eval.png").stat().st_size > 0
    assert (tmp_path / "policy" / "config.json").exists()


def test_addition_split_holds_out_64_sums_the_same_on_every_seed(tiny_chat_model):
    splits = []
    for seed in ("0", "3"):
        args = toy_args("unused", "--preset", "smollm2-addition", "--model", str(tiny_chat_model))
        args.seed = int(seed)
        _, _, task = flowrl_tasks.build_laptop(args, torch.device("cpu"))
        splits.append((task.prompts, [p for p, _ in task.eval_rows]))
        assert len(task.prompts) == 36 and len(task.eval_rows) == 64
        assert not set(task.prompts) & {p for p, _ in task.eval_rows}
    assert splits[0] == splits[1]


def test_spread_sweep_row_and_claim():
    def summary(reward, distinct, entropy):
        return {"spread_reward": reward, "distinct_correct": distinct, "correct_entropy": entropy}

    summaries = {
        "flowrl": summary(0.5, 8, 1.2) | {"before": summary(0.2, 6, 1.0)},
        "grpo": summary(0.7, 4, 0.6),
    }
    row = flowrl_tasks.spread_row(summaries)
    assert row == {
        "reward_start": 0.2,
        "reward_flowrl": 0.5,
        "reward_grpo": 0.7,
        "distinct_start": 6,
        "distinct_flowrl": 8,
        "distinct_grpo": 4,
        "entropy_start": 1.0,
        "entropy_flowrl": 1.2,
        "entropy_grpo": 0.6,
    }
    assert flowrl_tasks.spread_claim(row)
    assert not flowrl_tasks.spread_claim(row | {"entropy_flowrl": 0.5})
    assert not flowrl_tasks.spread_claim(row | {"reward_flowrl": 0.1})


def test_train_takes_args_built_in_python(tmp_path):
    summary = flowrl.train(flowrl.Args(steps=2, eval_every=2, quiet=True, out_dir=str(tmp_path)))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["preset"] == "toy" and config["steps"] == 2 and config["eval_every"] == 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert (
        summary["kl_policy_to_target"]
        == json.loads((tmp_path / "summary.json").read_text())["kl_policy_to_target"]
    )


def test_shuffle_sampling_passes_over_the_prompts_without_replacement():
    """--sampling shuffle, as the original's loader: each pass a fresh order, every prompt at most
    once per pass (a last partial batch dropped), recomputed from (seed, pass) without the rollout
    generator (a resumed run continues it); --total-epochs E makes E·⌊prompts/B⌋ rollout batches.
    --sampling replacement (the toys) is torch.randint on the rollout generator, as before."""

    args = flowrl.Args(sampling="shuffle", prompts_per_step=4, total_epochs=2)
    assert flowrl.rollout_batches(args, 10) == 4  # two passes of ⌊10/4⌋ = 2 batches
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    draws = [flowrl.draw_prompts(step, 10, args, gen).tolist() for step in range(1, 5)]
    assert torch.equal(gen.get_state(), state)
    for one_pass in (draws[:2], draws[2:]):
        seen = one_pass[0] + one_pass[1]
        assert len(set(seen)) == 8 and set(seen) <= set(range(10))
    assert draws[:2] != draws[2:]
    assert flowrl.draw_prompts(3, 10, args, torch.Generator()).tolist() == draws[2]
    seed_1 = flowrl.Args(sampling="shuffle", prompts_per_step=4, total_epochs=2, seed=1)
    assert [flowrl.draw_prompts(s, 10, seed_1, gen).tolist() for s in (1, 2)] != draws[:2]
    with pytest.raises(SystemExit, match="more than the 3 prompts"):
        flowrl.rollout_batches(args, 3)
    toy = flowrl.Args()
    drawn = flowrl.draw_prompts(1, 10, toy, torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(3)
    expected = torch.randint(10, (toy.prompts_per_step,), generator=generator)
    assert torch.equal(drawn, expected) and flowrl.rollout_batches(toy, 10) == toy.steps


def test_full_7b_runs_one_pass_at_the_originals_batch_and_evaluation_cadence(tmp_path):
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, ["--preset", "full-7b", "--data", "x"])
    assert (args.sampling, args.total_epochs, args.eval_every) == ("shuffle", 1, 5)
    assert (args.eval_k, args.eval_temperature) == (1, 0.0)  # the original's greedy validation
    assert args.prompts_per_step == 512 and args.warmup_steps == 10
    # ⌊rows/512⌋, the last partial batch dropped
    assert flowrl.rollout_batches(args, 34 * 512) == 34
    assert flowrl.rollout_batches(args, 35 * 512 - 1) == 34
    # a run's length follows from its prompts: the toy's 4, one pass of B = 2 → 2 rollout batches
    summary = flowrl.train(
        toy_args(
            tmp_path, "--sampling", "shuffle", "--total-epochs", "1", "--prompts-per-step", "2"
        )
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["steps"] == 2 and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "kl_policy_to_target" in summary


def test_avg_at_k_draws_per_row_seeds_the_same_for_any_number_of_ranks(tmp_path, monkeypatch):
    """Avg@k's rows are seeded per (question, sample): the k samples of a question differ, and two
    ranks' shards draw exactly what one process draws for the same rows."""
    import types

    import accelerate.utils

    tokenizer = models.make_tokenizer(
        "What is 1 + 2 3 ? Half of Please reason step by step".split() + list("0123456789")
    )
    model = models.tiny_causal_lm(len(tokenizer))
    args = toy_args(
        tmp_path,
        "--preset",
        "full",
        "--model",
        "tiny",
        "--data",
        "x.jsonl",
        "--eval-k",
        "4",
        "--max-new-tokens",
        "6",
        "--mixed-precision",
        "fp32",
    )
    task = types.SimpleNamespace(
        kind="math", eval_rows=[("What is 1 + 2 ?", "3"), ("Half of 4 ?", "2")]
    )
    drawn = []
    sample = common.sample_completions

    def recording(*a, **kw):
        out = sample(*a, **kw)
        drawn.append([text for text, _, _ in out])
        return out

    monkeypatch.setattr(common, "sample_completions", recording)
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda scores: scores)

    def ranks(n):
        results = []
        for rank in range(n):
            accelerator = types.SimpleNamespace(process_index=rank, num_processes=n)
            results.append(flowrl_tasks.avg_at_k(model, tokenizer, task, args, accelerator))
        return results

    ranks(1)
    ranks(2)
    one, rank0, rank1 = drawn
    assert one[0::2] == rank0 and one[1::2] == rank1  # row r on rank r mod 2, the same draw
    assert len(set(one[:4])) > 1  # one question's 4 samples are not one sample repeated


@pytest.mark.parametrize("what", ["loss", "gradient norm"])
def test_a_non_finite_loss_or_gradient_stops_the_run_before_the_weights_step(
    tmp_path, tiny_chat_model, poison, what
):
    taken = poison(flowrl, "tb_loss", what)
    argv = ["--preset", "smollm2-numbers", "--model", str(tiny_chat_model), "--steps", "1"]
    argv += ["--group-size", "2", "--spread-samples", "2", "--max-new-tokens", "2"]
    with pytest.raises(SystemExit, match=f"non-finite {what} at step 1;"):
        flowrl.train(toy_args(tmp_path, *argv, "--device", "cpu"))
    assert not taken


def test_the_toys_target_is_a_flag_and_the_summary_says_which_modes_each_prompt_kept(tmp_path):
    """--valleys 1,0.6,0.3: three rewarded answers per prompt at those rewards; summary.json lists
    per prompt the modes π keeps (π ≥ ½ p*, best first), and valleys.png draws every prompt."""
    summary = flowrl.train(
        toy_args(tmp_path, "--valleys", "1,0.6,0.3", "--steps", "2", "--eval-every", "2")
    )
    assert summary["modes_total"] == 3 * 4 and len(summary["prompts"]) == 4
    for row in summary["prompts"]:
        assert sorted(v["r"] for v in row["rewarded"].values()) == [0.3, 0.6, 1.0]
        covered = [a for a, v in row["rewarded"].items() if v["pi"] >= 0.5 * v["p*"]]
        assert sorted(row["kept"]) == sorted(covered)
    assert sum(len(row["kept"]) for row in summary["prompts"]) == summary["modes_covered"]
    assert (tmp_path / "valleys.png").stat().st_size > 0
