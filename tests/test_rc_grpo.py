"""rc_grpo.py: the BFCL environment and rewards on the real 800 entries, hostile model output,
reward tokens, the variance bound, the toy end to end and the full-scale path with a tiny random
Qwen2."""

import dataclasses
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import rc_grpo
from envs import bfcl, bfcl_toy
from utils import cli, distributed, models


@pytest.fixture(scope="module")
def entries():
    return bfcl.load_bfcl_entries()


def test_all_800_entries_load_and_split_720_80(entries):
    assert len(entries) == 800
    assert {e["category"] for e in entries} == set(bfcl.CATEGORIES)
    train, test = bfcl.split_entries(entries)
    assert len(train) == 720 and len(test) == 80
    assert {c: sum(e["category"] == c for e in test) for c in bfcl.CATEGORIES} == dict.fromkeys(
        bfcl.CATEGORIES, 20
    )


@pytest.mark.long
def test_ground_truth_replay_scores_one_on_every_entry_for_both_rewards(entries):
    assert [e["id"] for e in entries if bfcl.trajectory_reward(e, e["ground_truth"]) != 1.0] == []
    assert [e["id"] for e in entries if bfcl.bfcl_check(e, e["ground_truth"]) != 1.0] == []


def test_dropping_a_state_changing_call_scores_zero(entries):
    entry = next(e for e in entries if e["id"] == "multi_turn_base_0")
    dropped = [list(turn) for turn in entry["ground_truth"]]
    dropped[0].remove("mkdir(dir_name='temp')")  # the mv then fails: the folder never exists
    assert bfcl.trajectory_reward(entry, dropped) == 0.0
    assert bfcl.bfcl_check(entry, dropped) == 0.0
    assert bfcl.bfcl_check(entry, entry["ground_truth"][:-1]) == 0.0  # a missing last turn


def toy_entry(files):
    contents = {
        "docs": {
            "type": "directory",
            "contents": {f: {"type": "file", "content": f"{f} text"} for f in files},
        }
    }
    return {
        "id": "t_0",
        "category": "toy",
        "involved_classes": ["GorillaFileSystem"],
        "initial_config": {
            "GorillaFileSystem": {"root": {"w": {"type": "directory", "contents": contents}}}
        },
        "question": [[{"role": "user", "content": "x"}]],
    }


def test_reordering_independent_calls_and_extra_calls_keep_the_action_reward():
    entry = toy_entry(["a.txt"]) | {
        "ground_truth": [["cd(folder='docs')", "cat(file_name='a.txt')", "ls()"]]
    }
    assert (
        bfcl.trajectory_reward(
            entry, [["cd(folder='docs')", "ls()", "pwd()", "cat(file_name='a.txt')"]]
        )
        == 1.0
    )
    # a ground-truth call is missing
    assert bfcl.trajectory_reward(entry, [["cd(folder='docs')", "ls()"]]) == 0.0


def test_positional_and_keyword_arguments_both_dispatch_and_compare_equal():
    entry = toy_entry(["a.txt"]) | {"ground_truth": [["cd(folder='docs')", "rm('a.txt')"]]}
    env = bfcl.BFCLEnv(entry)
    assert env.execute(bfcl.parse_calls("[cd('docs')]")) == env.execute(
        bfcl.parse_calls("[cd(folder='.')]")
    )
    assert "a.txt" in env.execute(bfcl.parse_calls("ls()"))[0]
    assert bfcl.trajectory_reward(entry, [["cd('docs')", "rm(file_name='a.txt')"]]) == 1.0


HOSTILE = [
    "[__import__('os').system('touch {marker}')]",
    "[cd(folder=__import__('os').system('touch {marker}'))]",
    "[os.system('touch {marker}')]",
    "[cd(folder='a').__class__]",
    "[cd(folder=(lambda: 1)())]",
    "[cd(folder=[x for x in 'ab'])]",
    "[cd(folder=1 + 2)]",
    "[cd(folder=9 ** 9 ** 9)]",
    "[_load_scenario({{}})]",
    "[__init__()]",
    "[cd(*['a'])]",
    "[cd(**{{'folder': 'a'}})]",
    "[cd(folder=ls())]",
    "[" * 5000 + "]" * 5000,
    "[cd(folder='" + "a" * 20000 + "')]",
    "[exec('print(1)') for _ in 'a']",
]


def test_hostile_output_is_rejected_without_side_effects(tmp_path):
    marker = tmp_path / "pwned"
    for template in HOSTILE:
        with pytest.raises(ValueError):
            bfcl.parse_calls(
                template.format(marker=marker)
                if "{marker}" in template
                else template.replace("{{", "{").replace("}}", "}")
            )
    assert not marker.exists()
    # names that parse but are not allow-listed methods: an error result, not a call
    env = bfcl.BFCLEnv(toy_entry(["a.txt"]))
    calls = bfcl.parse_calls(
        f"[open({str(marker)!r}, 'w'), eval('1'), system('ls'), no_such_method()]"
    )
    assert all(r.startswith("Error during execution") for r in env.execute(calls))
    assert not marker.exists()


DEEP = [
    "[" + "1+" * 800 + "1]",
    "f(a=" + "1+" * 1500 + "1)",
    "[" + "(" * 3000 + ")" * 3000 + "]",
    "[f(" + "[" * 2000 + "]" * 2000 + ")]",
    "[" + "-" * 5000 + "1]",
    "[f(a={" + "1:{" * 1000 + "}" * 1001 + ")]",
]


@pytest.mark.parametrize("text", DEEP)
def test_deep_or_long_output_is_a_parse_failure_never_another_exception(text):
    with pytest.raises(ValueError):
        bfcl.parse_calls(text)
    assert bfcl.decode_calls(text) == []  # in a rollout: the turn ends


def scripted_world(monkeypatch, outputs):
    """A World whose `generate` is replaced by a script of outputs (the model is never called)."""
    script = iter(outputs)
    monkeypatch.setattr(
        common,
        "sample_completions",
        lambda model, tok, prompts, *a, **k: [(next(script), [], torch.zeros(0)) for _ in prompts],
    )
    tokenizer = models.make_tokenizer(["user", "asst", "tool"])  # counts prompt length only
    return bfcl.World(
        [], [], tokenizer, None, text_format=bfcl_toy.ToyFormat(), end_text="done", limits=LIMITS
    )


LIMITS = bfcl.Limits(
    max_new_tokens=8,
    gen_batch=8,
    gen_tokens=0,
    max_steps=10,
    max_prompt_tokens=10**6,
    mixed_precision="fp32",
)


def test_hostile_output_ends_the_turn_without_side_effects_and_the_rollout_finishes(
    tmp_path, monkeypatch
):
    marker = tmp_path / "pwned"
    entry = toy_entry(["a.txt"]) | {
        "ground_truth": [["cd(folder='docs')", "rm(file_name='a.txt')"]]
    }
    hostile = [
        f"[__import__('os').system('touch {marker}')]",
        DEEP[0],
        DEEP[1],
        "[cd(folder=1 + 2)]",
    ]
    for text in hostile:  # BFCL: a failed decode ends the turn; the one-turn entry is then over
        (run,) = bfcl.run_rollouts(scripted_world(monkeypatch, [text]), [entry], [None], 1.0)
        assert run["reward"] == 0.0 and len(run["steps"]) == 1 and run["calls_per_turn"] == [[]]
    assert not marker.exists()
    world = scripted_world(monkeypatch, ["[cd(folder='docs')]", "[rm(file_name='a.txt')]", "[]"])
    (run,) = bfcl.run_rollouts(world, [entry], [None], 1.0)
    assert run["reward"] == 1.0 and len(run["steps"]) == 3  # `[]` ended the turn


def test_a_seeded_dialogue_samples_the_same_alone_or_batched_with_others():
    """Sampled evaluation seeds each entry (rc_grpo.evaluate): a dialogue draws the same tokens at
    every step whatever it is batched with, so N ranks' shards sample what one process does."""
    tokenizer = models.make_tokenizer(["user", "asst", "tool", "x", "[", "]"])
    model = models.tiny_causal_lm(len(tokenizer), seed=3)
    world = bfcl.World(
        [], [], tokenizer, model, text_format=bfcl_toy.ToyFormat(), end_text="done", limits=LIMITS
    )
    one_turn = toy_entry(["a.txt"]) | {"ground_truth": [["ls()"]]}
    two_turns = one_turn | {
        "question": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "x x"}]],
        "ground_truth": [["ls()"], ["pwd()"]],
    }
    entries = [one_turn, two_turns, one_turn]
    together = bfcl.run_rollouts(world, entries, [None] * 3, 1.0, seeds=[7, 8, 9])
    (alone,) = bfcl.run_rollouts(world, entries[1:2], [None], 1.0, seeds=[8])
    steps = lambda run: [step["ids"] for step in run["steps"]]
    assert len(steps(alone)) == 2 and steps(alone) == steps(together[1])
    assert steps(together[0]) != steps(together[2])  # other seeds, other draws


def test_a_turn_ends_on_an_empty_decode_and_too_many_steps_abandon_the_entry(monkeypatch):
    entry = toy_entry(["a.txt"]) | {
        "question": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]],
        "ground_truth": [["ls()"], ["pwd()"]],
    }
    (run,) = bfcl.run_rollouts(
        scripted_world(monkeypatch, ["[]", "[pwd()]", "ok"]), [entry], [None], 1.0
    )
    assert run["calls_per_turn"] == [[], ["pwd()"]] and len(run["steps"]) == 3
    world = scripted_world(monkeypatch, ["[ls()]"] * 10)
    world.limits = dataclasses.replace(LIMITS, max_steps=3)
    (run,) = bfcl.run_rollouts(world, [entry], [None], 1.0)
    # 4 > 3 steps in turn 0: abandoned
    assert len(run["steps"]) == 4 and run["calls_per_turn"][1] == []


def test_a_dialogue_past_the_prompt_cap_is_abandoned_and_scored_as_it_stands(monkeypatch):
    entry = toy_entry(["a.txt"]) | {
        "ground_truth": [["cd(folder='docs')", "rm(file_name='a.txt')"]]
    }
    world = scripted_world(monkeypatch, ["[cd(folder='docs')]"] * 10)
    first = len(
        world.tokenizer(
            bfcl.render(world, bfcl.user_messages(world, entry, 0, None)), add_special_tokens=False
        )["input_ids"]
    )
    world.limits = dataclasses.replace(LIMITS, max_prompt_tokens=first + 12)
    (run,) = bfcl.run_rollouts(world, [entry], [None], 1.0)
    assert run["abandoned"] and 1 <= len(run["steps"]) < 10  # stopped by the cap, not the step cap
    assert run["calls_per_turn"][0][0] == "cd(folder='docs')" and run["reward"] == 0.0


def test_work_done_on_the_wrong_turn_scores_zero(entries):
    entry = next(e for e in entries if e["id"] == "multi_turn_base_1")
    truth = entry["ground_truth"]
    early = [truth[0] + truth[1], [], truth[2], truth[3]]  # turn 2's cd + mv done during turn 1
    assert bfcl.bfcl_check(entry, truth) == 1.0
    assert bfcl.bfcl_check(entry, early) == 0.0


def test_backend_calls_have_a_time_limit_and_a_result_cap():
    entry = toy_entry(["a.txt"]) | {"involved_classes": ["GorillaFileSystem", "MathAPI"]}
    env = bfcl.BFCLEnv(entry)
    start = time.time()
    (result,) = env.execute(bfcl.parse_calls("[power(base=9, exponent=999999999)]"))
    assert "longer than" in result and time.time() - start < bfcl.CALL_SECONDS + 2
    assert env.execute(bfcl.parse_calls("[add(a=2, b=3)]")) == ['{"result": 5}']
    (echoed,) = env.execute(bfcl.parse_calls(f"[echo(content={'x' * 9000!r})]"))
    assert len(echoed) > 9000  # whole for the checker; cut where the model reads it
    world = bfcl.World(
        [], [], None, None, text_format=bfcl.ChatFormat(None), end_text="", limits=LIMITS
    )
    assert len(bfcl.observation(world, [echoed])) <= min(2000, bfcl.MAX_RESULT_CHARS)


def bfcl_harness(monkeypatch):
    """bfcl-eval's harness functions (`model_handler/utils.py`), imported with stand-ins for what
    that module imports and the prompt never calls: the Java/JS call parsers (tree-sitter) and the
    API retry decorators (tenacity), dependencies this project does not install."""
    import sys
    import types

    stand_ins = {
        "bfcl_eval.model_handler.parser.java_parser": ["parse_java_function_call"],
        "bfcl_eval.model_handler.parser.js_parser": ["parse_javascript_function_call"],
        "tenacity": [
            "retry",
            "retry_if_exception_message",
            "retry_if_exception_type",
            "wait_random_exponential",
        ],
    }
    for name, attributes in stand_ins.items():
        if name not in sys.modules:
            module = types.ModuleType(name)
            for attribute in attributes:
                setattr(module, attribute, lambda *a, **k: None)
            monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "bfcl_eval.model_handler.utils", raising=False)
    import bfcl_eval.model_handler.utils as harness

    monkeypatch.delitem(sys.modules, "bfcl_eval.model_handler.utils")  # not kept with stand-ins
    return harness


def test_full_scale_prompt_is_what_bfcl_evals_harness_sends_on_every_entry(entries, monkeypatch):
    """The system prompt and first user turn, and every miss_func reveal, against the harness's own
    functions on its own loading of all 800 entries: `load_dataset_entry` (docs with the language
    hint, held-out docs apart), `system_prompt_pre_processing_chat_model` (which calls
    `formulate_system_prompt` for the entry's format) and the prompting loop's reveal message.
    Equal strings, so equal tokens under any tokenizer."""
    import copy

    from bfcl_eval.constants.default_prompts import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    )
    from bfcl_eval.utils import load_dataset_entry

    harness = bfcl_harness(monkeypatch)
    ours = {e["id"]: e for e in entries}
    world = bfcl.World(
        [], [], None, None, text_format=bfcl.ChatFormat(None), end_text="", limits=LIMITS
    )
    checked, reveals = 0, 0
    for category in bfcl.CATEGORIES:
        for sent in load_dataset_entry(f"multi_turn_{category}"):
            entry = ours[sent["id"]]
            first_turn = harness.system_prompt_pre_processing_chat_model(
                copy.deepcopy(sent["question"][0]), sent["function"], sent["id"]
            )
            assert (
                bfcl.system_messages(world, entry) + bfcl.user_messages(world, entry, 0, None)
                == first_turn
            ), sent["id"]
            for turn, held_out in sent.get("missed_function", {}).items():
                reveal = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                    functions=held_out
                )
                (message,) = bfcl.user_messages(world, entry, int(turn), None)
                assert message == {"role": "user", "content": reveal}, sent["id"]
                reveals += 1
            checked += 1
    assert checked == 800 and reveals >= 200
    (system,) = bfcl.system_messages(world, entries[0])
    assert "You SHOULD NOT include any other text" in system["content"]
    docs = json.dumps(bfcl.function_docs(entries[0])[0])
    (short,) = bfcl.ChatFormat(None, "short").system_messages(entries[0])
    assert short["content"].endswith(docs) and len(short["content"]) < len(system["content"])


def test_task_subsets_are_stratified_over_the_categories(entries):
    picked = bfcl.stratified(entries, 8)
    assert sorted(e["category"] for e in picked) == sorted(bfcl.CATEGORIES * 2)


def test_two_rollouts_of_one_task_do_not_share_state():
    entry = toy_entry(["a.txt"])
    first, second = bfcl.BFCLEnv(entry), bfcl.BFCLEnv(entry)
    first.execute(bfcl.parse_calls("[cd(folder='docs'), rm(file_name='a.txt')]"))
    second.execute(bfcl.parse_calls("[cd(folder='docs')]"))
    assert "a.txt" in second.execute(bfcl.parse_calls("[ls()]"))[0]
    assert first.state() != second.state()
    assert "a.txt" in json.dumps(entry["initial_config"])  # the entry itself is untouched


def test_miss_func_descriptions_wait_for_their_turn_the_functions_do_not(entries):
    """As the official harness: the held-out functions' docs arrive on their turn; the functions
    themselves are callable throughout (a model that guesses one is scored as the checker does)."""
    entry = next(e for e in entries if e["category"] == "miss_func")
    ((turn, names),) = entry["missed_function"].items()
    assert names[0] in bfcl.BFCLEnv(entry).methods
    shown, later = bfcl.function_docs(entry)
    assert (
        names[0] not in [d["name"] for d in shown]
        and [d["name"] for d in later[int(turn)]] == names
    )


def test_reward_token_sits_at_the_end_of_the_first_user_message_and_is_never_scored():
    train, _ = bfcl_toy.toy_entries(10, 0, 0.15)
    tokenizer = models.make_tokenizer(
        ["user", "asst", "tool", "delete", *bfcl_toy.TOY_FILES], rc_grpo.REWARD_TOKENS
    )
    world = bfcl.World(
        [], [], tokenizer, None, text_format=bfcl_toy.ToyFormat(), end_text="done", limits=LIMITS
    )
    samples = bfcl.trajectory_samples(
        world, train[0], rc_grpo.reward_goal(rc_grpo.HIGH), train[0]["ground_truth"]
    )
    assert samples[0]["prompt"].endswith("[Reward Goal: <|high_reward|>] asst")
    token_ids = set(tokenizer.convert_tokens_to_ids(list(rc_grpo.REWARD_TOKENS)))
    ids, attn, mask = common.pack_completions(
        tokenizer, [s["prompt"] for s in samples], [s["ids"] for s in samples], "cpu"
    )
    scored = ids[:, -mask.shape[1] :][mask.bool()]
    assert token_ids & set(ids.flatten().tolist()) and not token_ids & set(scored.tolist())


def test_reward_tokens_are_iid_with_probability_p():
    tokens = rc_grpo.sample_reward_tokens(20000, 0.3, torch.Generator().manual_seed(0))
    assert tokens.count(rc_grpo.HIGH) / len(tokens) == pytest.approx(0.3, abs=0.01)


def test_p_high_1_is_grpo_under_the_high_token():
    # the notebook's exercise 1, `--p-high 1.0`: accepted, and every rollout draws the high token
    args = cli.parse_args(rc_grpo.Args, rc_grpo.PRESETS, ["--p-high", "1.0"])
    assert rc_grpo.validate(args)
    tokens = rc_grpo.sample_reward_tokens(1000, args.p_high, torch.Generator().manual_seed(0))
    assert set(tokens) == {rc_grpo.HIGH}


def test_variance_bound_of_proposition_4_3_holds_in_simulation():
    # E[σ_g²] ≥ ((G−1)/G)·p(1−p)·ε² with success P(high) = 0.9, P(low) = 0.3 → ε = 0.6 (RC-GRPO,
    # Prop. 4.3)
    gen = torch.Generator().manual_seed(0)
    G, p, s_high, s_low = 5, 0.5, 0.9, 0.3
    high = torch.rand(200000, G, generator=gen) < p
    success = torch.rand(200000, G, generator=gen) < torch.where(high, s_high, s_low)
    mean_var = success.float().var(dim=1, unbiased=False).mean().item()
    assert mean_var >= (G - 1) / G * p * (1 - p) * (s_high - s_low) ** 2
    peaked = (
        (torch.rand(200000, G, generator=gen) < 0.9)
        .float()
        .var(dim=1, unbiased=False)
        .mean()
        .item()
    )
    assert peaked < mean_var  # without tokens a peaked policy's groups have less variance


def test_with_beta_zero_a_row_without_advantage_adds_nothing_to_the_gradient():
    """grpo_arm leaves such rows unscored: exact only because their gradient is 0. The ratios stay
    inside the clip range (|log ρ| ≤ 0.05), where every token of a row with A ≠ 0 has a gradient."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=gen).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(3, 5, generator=gen).clamp(-5, 5)
    advantages, mask = torch.tensor([0.0, 1.0, -1.0]), torch.ones(3, 5)
    loss, stats = rc_grpo.rc_grpo_loss(
        logp, old, None, advantages, mask, clip_eps=0.2, beta=0.0, token_count=15
    )
    loss.backward()
    assert logp.grad[0].abs().max() == 0 and logp.grad[1:].abs().min() > 0 and stats["kl"] == 0
    with_kl, _ = rc_grpo.rc_grpo_loss(
        logp, old, old, advantages, mask, clip_eps=0.2, beta=0.1, token_count=15
    )
    assert torch.autograd.grad(with_kl, logp)[0][0].abs().max() > 0  # β > 0: every row counts


@pytest.mark.slow
def test_toy_sft_grpo_groups_collapse_more_than_rctp_rc_grpo(tmp_path):
    args = cli.parse_args(
        rc_grpo.Args,
        rc_grpo.PRESETS,
        [
            *("--quiet", "--seed", "1", "--arms", "sft+grpo,rctp+rc-grpo"),
            # the claim is about training's groups: a small held-out set (its accuracy is not asked)
            *("--toy-test-tasks", "10", "--out-dir", str(tmp_path)),
        ],
    )
    s = rc_grpo.train(args)
    # Margin: over the five-seed sweep (docs/rc_grpo.md, one thread) SFT+GRPO sits at 0.65-0.98
    # and RCTP+RC-GRPO at 0.35-0.49; the worst seed's gap is this seed's, 0.16, and the test asks
    # for half of it.
    zv_sft, zv_rc = (s[arm]["zero_variance_fraction"] for arm in ("sft+grpo", "rctp+rc-grpo"))
    assert zv_sft > zv_rc + 0.08
    # No token-gap assertion: RCTP-FT's ε is 0.87-0.90 on four seeds and 0 on this one, and no
    # accuracy assertion: the sweep's accuracy gain holds on one seed of five (docs/rc_grpo.md).


def save_tiny_bfcl_model(folder):
    """A tiny random Qwen2 whose word vocabulary covers a real BFCL entry, saved to `folder`."""
    words = json.dumps(bfcl.load_bfcl_entries(["base"])[0]).split()[:2000]
    tokenizer = models.make_tokenizer(words)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant:"
    )
    models.tiny_causal_lm(len(tokenizer), max_positions=16384).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.long
def test_full_preset_path_with_a_tiny_random_qwen2_on_real_entries(tmp_path):
    save_tiny_bfcl_model(tmp_path / "tiny")
    args = cli.parse_args(
        rc_grpo.Args,
        rc_grpo.PRESETS,
        [
            "--preset",
            "bfcl",
            "--model",
            str(tmp_path / "tiny"),
            "--max-tasks",
            "2",
            "--steps",
            "1",
            "--tasks-per-step",
            "1",
            "--group-size",
            "2",
            "--failure-rollouts",
            "1",
            "--max-steps",
            "2",
            "--no-gradient-checkpointing",
            "--max-new-tokens",
            "4",
            "--lora-rank",
            "4",
            "--rctp-epochs",
            "1",
            "--device",
            "cpu",
            "--quiet",
            "--out-dir",
            str(tmp_path / "run"),
        ],
    )
    # paper defaults, flags win
    assert args.beta == 0.1 and args.p_high == 0.5 and args.max_steps == 2
    trained = {}

    def spy(args, world, *rest, **kwargs):  # the trained policy's log-probs, before saving
        result = real_arm(args, world, *rest, **kwargs)
        ids = torch.tensor([list(range(5, 25))])
        trained["logp"] = common.completion_logprobs(world.model, ids, torch.ones_like(ids), 19)
        return result

    real_arm = rc_grpo.grpo_arm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rc_grpo, "grpo_arm", spy)
        summary = rc_grpo.train(args)
    assert summary["test_tasks"] == 2 and summary["rctp+rc-grpo"]["sampler_logprob_max_dev"] < 1e-3
    # the saved policy is stage 1 + stage 2: reloaded, it scores what the trained one scored
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "rctp+rc-grpo" / "policy")
    ids = torch.tensor([list(range(5, 25))])
    reloaded = common.completion_logprobs(saved, ids, torch.ones_like(ids), 19)
    assert (reloaded - trained["logp"]).abs().max() <= 1e-4
    # what the policy called on the first test entry, before and after, beside the expected calls
    shown = (tmp_path / "run" / "rollouts.txt").read_text()
    assert shown.startswith("base model:") and "after rctp+rc-grpo:" in shown
    assert shown.count("expected [") >= 2


def perturbations(truth, rng):
    """Wrong and right variants of a ground truth (lists of call strings per turn): a call dropped,
    duplicated, moved a turn later, two calls swapped, one literal argument changed."""
    calls = [(t, i) for t, turn in enumerate(truth) for i in range(len(turn))]
    if not calls:
        return []
    copy_of = lambda: [list(turn) for turn in truth]  # noqa: E731
    out = []
    t, i = rng.choice(calls)
    dropped = copy_of()
    del dropped[t][i]
    duplicated = copy_of()
    duplicated[t].insert(i, truth[t][i])
    out += [dropped, duplicated]
    if t + 1 < len(truth):
        moved = copy_of()
        moved[t + 1].insert(0, moved[t].pop(i))
        out.append(moved)
    if len(truth[t]) > 1:
        swapped = copy_of()
        swapped[t][0], swapped[t][-1] = swapped[t][-1], swapped[t][0]
        out.append(swapped)
    ((name, args, kwargs),) = bfcl.parse_calls(truth[t][i])
    if kwargs:
        key = sorted(kwargs)[0]
        value = kwargs[key]
        changed = (
            value + 1
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else value + "x"
            if isinstance(value, str)
            else None
        )
        if changed is not None:
            edited = copy_of()
            edited[t][i] = bfcl.format_call(name, args, kwargs | {key: changed})
            out.append(edited)
    return out


def test_bfcl_check_agrees_with_the_official_multi_turn_checker(entries):
    """bfcl_check (no eval) against bfcl-eval's own multi_turn_checker (which evals the strings:
    here only strings this test formats from ground-truth literals), on ground truths and their
    perturbations drawn from every category."""
    import random

    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    rng, cases, disagree = random.Random(0), 0, []
    for category in bfcl.CATEGORIES:
        for entry in rng.sample([e for e in entries if e["category"] == category], 4):
            truth = entry["ground_truth"]
            for variant in [truth, *perturbations(truth, rng)]:
                cases += 1
                official = multi_turn_checker(
                    [[[call] for call in turn] for turn in variant],
                    truth,
                    entry,
                    entry["id"].rsplit("_", 1)[0],
                    f"agreement_{cases}",
                )["valid"]  # fresh state
                if bfcl.bfcl_check(entry, variant) != float(official):
                    disagree.append((entry["id"], variant))
    assert cases >= 60 and not disagree, disagree[:3]


def test_results_json_cannot_encode_are_written_as_the_official_harness_does():
    from decimal import Decimal

    assert bfcl.format_result({"result": Decimal("1.5")}) == "{'result': Decimal('1.5')}"
    assert bfcl.format_result({"result": 2}) == '{"result": 2}' and bfcl.format_result(3) == "3"


@pytest.mark.long
def test_lora_on_a_bf16_base_keeps_stage_1_exactly_and_saves_what_was_trained(tmp_path):
    """A bf16 base (as on a GPU) with fp32 LoRA adapters: stage 2 starts from exactly the model
    stage 1 trained (its adapter stays, frozen; a second one trains on top), and the saved fp32
    policy, reloaded, scores a fixed set of sequences as the trained one does. Merging stage 1's
    adapter into the bf16 base instead moves the scores by more than these tolerances (measured
    beside)."""
    import copy

    save_tiny_bfcl_model(tmp_path / "tiny")
    args = cli.parse_args(
        rc_grpo.Args,
        rc_grpo.PRESETS,
        [
            "--preset",
            "bfcl",
            "--model",
            str(tmp_path / "tiny"),
            "--max-tasks",
            "2",
            "--steps",
            "2",
            "--tasks-per-step",
            "1",
            "--group-size",
            "2",
            "--failure-rollouts",
            "1",
            "--max-steps",
            "2",
            "--no-gradient-checkpointing",
            "--max-new-tokens",
            "4",
            "--lora-rank",
            "4",
            "--rctp-epochs",
            "3",
            "--sft-lr",
            "3e-2",
            "--lr",
            "3e-2",
            "--mixed-precision",
            "bf16",
            "--device",
            "cpu",
            "--quiet",
            "--out-dir",
            str(tmp_path / "run"),
        ],
    )
    ids = torch.tensor([list(range(5, 45))])

    def exact(model):  # fp32 scoring of an fp32 copy: the bf16 base upcast, the adapters as trained
        upcast = copy.deepcopy(model).float()
        return common.completion_logprobs(upcast, ids, torch.ones_like(ids), 39)

    seen = {}
    stack, add_lora, real_arm = models.stack_adapter, models.add_lora, rc_grpo.grpo_arm

    def stacking(model, name):
        seen["stage_1"] = exact(model)
        bf16_merge = copy.deepcopy(model).merge_and_unload()  # what a merge into bf16 keeps
        seen["bf16_merge"] = common.completion_logprobs(
            bf16_merge.float(), ids, torch.ones_like(ids), 39
        )
        frozen = stack(model, name)
        seen["stage_2_start"] = exact(model)
        return frozen

    def arm(args, world, *rest, **kwargs):
        result = real_arm(args, world, *rest, **kwargs)
        seen["trained"] = exact(world.model)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "add_lora", lambda m, *a, **k: add_lora(m.bfloat16(), *a, **k))
        patch.setattr(models, "stack_adapter", stacking)
        patch.setattr(rc_grpo, "grpo_arm", arm)
        rc_grpo.train(args)
    torch.testing.assert_close(seen["stage_2_start"], seen["stage_1"], rtol=0, atol=1e-6)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "rctp+rc-grpo" / "policy")
    assert saved.dtype == torch.float32
    reloaded = common.completion_logprobs(saved, ids, torch.ones_like(ids), 39)
    assert (reloaded - seen["trained"]).abs().max() <= 1e-5  # measured: 1e-6 (the issue: 1e-3)
    # the tolerances above tell the two apart: a bf16 merge of stage 1 moves the scores by 1.2e-4
    assert (seen["bf16_merge"] - seen["stage_1"]).abs().max() > 2e-5


@pytest.mark.parametrize("what", ["loss", "gradient norm"])
def test_a_non_finite_loss_or_gradient_stops_the_run_before_the_weights_step(
    tmp_path, poison, what
):
    """Stage 2, whose loop holds the checks, straight from the toy's untrained base (no stage 1)."""
    taken = poison(rc_grpo, "rc_grpo_loss", what)
    argv = ["--quiet", "--steps", "1", "--toy-tasks", "8", "--tasks-per-step", "2"]
    args = cli.parse_args(rc_grpo.Args, rc_grpo.PRESETS, argv)
    accelerator, device = distributed.setup_accelerator("cpu")
    world, _ = bfcl_toy.build_toy(args, device, rc_grpo.REWARD_TOKENS)
    with pytest.raises(SystemExit, match=f"non-finite {what} at step 1 of rc-grpo;"):
        rc_grpo.grpo_arm(
            args,
            world,
            "rc-grpo",
            use_tokens=True,
            reward_conditioned=True,
            out_dir=tmp_path,
            accelerator=accelerator,
        )
    assert not taken
