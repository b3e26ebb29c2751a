"""Bad input, all of it: every case gets one clear `error:` line and a non-zero exit, before any
model is built where it can be (the table in docs/testing.md). The matrix over the four scripts
first, then each script's own flags, model ids, data and prompt files and rewards. A bad --resume
is in test_resume.py, beside the resume it protects."""

import importlib
import json

import pytest
import torch

import agentflow
import common
import flow_grpo
import flowrl
import rc_grpo
from test_agentflow import tiny_planner
from test_flow_grpo import sd3_args
from utils import cli, models, tracking

SCRIPTS = {"flowrl": flowrl, "flow_grpo": flow_grpo, "agentflow": agentflow, "rc_grpo": rc_grpo}
CLIP_FLAG = {
    "flowrl": "--clip-eps",
    "flow_grpo": "--clip-range",
    "agentflow": "--clip-eps",
    "rc_grpo": "--clip-eps",
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_lists_every_flag(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all("--" + f.replace("_", "-") in out for f in SCRIPTS[name].Args.__dataclass_fields__)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(
    "argv", [["--no-such-flag"], ["--group-size", "abc"], ["--preset", "nonsense"]]
)
def test_unknown_flags_and_bad_types_exit_with_argparse_usage(name, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(SCRIPTS[name].Args, SCRIPTS[name].PRESETS, argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("case", ["group", "lr", "clip"])
def test_out_of_range_values_get_one_clear_message(name, case, tmp_path):
    argv = {"group": ["--group-size", "1"], "lr": ["--lr", "-1"], "clip": [CLIP_FLAG[name], "0"]}[
        case
    ]
    args = cli.parse_args(
        SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--quiet", "--out-dir", str(tmp_path), *argv]
    )
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[name].train(args)
    message = str(exit_info.value)
    assert message.startswith("error:") and argv[0] in message and "\n" not in message


def test_flow_grpo_refuses_to_train_on_the_ode(tmp_path):
    args = cli.parse_args(
        flow_grpo.Args,
        flow_grpo.PRESETS,
        ["--quiet", "--noise-level", "0", "--out-dir", str(tmp_path)],
    )
    with pytest.raises(SystemExit, match="ODE"):
        flow_grpo.train(args)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_function_in_the_equation_map_exists_and_has_a_docstring(name):
    import re

    module = SCRIPTS[name]
    doc = module.__doc__
    assert "arXiv" in doc and "REFERENCES" not in doc and "Deviations" in doc
    equation_map = doc[doc.index("Equation map") : doc.index("Deviations")]
    names = [
        n.strip()
        for line in equation_map.splitlines()[1:]
        if "→" in line
        for n in line.split("→")[-1].split(",")
        if re.fullmatch(r"\s*(\w+\.)?\w+\s*", n)
    ]
    assert len(names) >= 4
    for entry in names:  # a name of the script, of common, or of a module in envs/
        owner, _, attr = entry.rpartition(".")
        home = {"": module, "common": common}.get(owner) or importlib.import_module(f"envs.{owner}")
        assert (getattr(home, attr).__doc__ or "").strip(), entry


# ------------------------------------------------------------------------------ the output folder


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_out_dir_that_cannot_be_written_is_one_line(name, tmp_path):
    (tmp_path / "file").write_text("x")
    for out_dir, message in [
        (tmp_path / "file", "is a file"),
        ("/sys/not-writable", "not a folder this user can write"),
    ]:
        args = cli.parse_args(
            SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--quiet", "--out-dir", str(out_dir)]
        )
        with pytest.raises(SystemExit, match=message) as exit_info:
            SCRIPTS[name].train(args)
        assert "--out-dir" in str(exit_info.value) and "\n" not in str(exit_info.value)


# --------------------------------------------------------- every bad number: one line naming it

BAD_NUMBERS = {
    "flowrl": [
        ["--seed", "-1"],
        ["--eval-every", "0"],
        ["--minibatches", "0"],
        ["--prompts-per-step", "0"],
        ["--max-new-tokens", "0"],
        ["--beta", "-1"],
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--save-every", "-2"],
        ["--timeout", "0"],
    ],
    "flow_grpo": [
        ["--seed", "-1"],
        ["--eval-every", "0"],
        ["--minibatches", "0"],
        ["--prompts-per-epoch", "0"],
        ["--adv-clip", "-1"],
        ["--resolution", "7"],
        ["--ema", "1.5"],
        ["--beta", "nan"],
    ],
    "agentflow": [
        ["--seed", "-1"],
        ["--eval-every", "0"],
        ["--minibatch-rows", "-1"],
        ["--queries-per-step", "0"],
        ["--max-new-tokens", "0"],
        ["--warm-start-demos", "0"],
        ["--tool-timeout", "-1"],
        ["--tool-timeout", "nan"],
        ["--careless", "2"],
    ],
    "rc_grpo": [
        ["--seed", "-1"],
        ["--tasks-per-step", "0"],
        ["--max-new-tokens", "0"],
        ["--lr", "inf"],
        ["--rare-share", "2"],
        ["--max-tasks", "-1"],
        ["--beta", "-1"],
    ],
}


@pytest.mark.parametrize("name, argv", [(n, a) for n, cases in BAD_NUMBERS.items() for a in cases])
def test_every_bad_number_is_one_line_naming_its_flag(name, argv, tmp_path):
    args = cli.parse_args(
        SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--quiet", "--out-dir", str(tmp_path), *argv]
    )
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[name].train(args)
    message = str(exit_info.value)
    assert message.startswith("error:") and argv[0] in message and "\n" not in message, message


@pytest.mark.parametrize(
    "argv",
    [["--max-new-tokens", "-1"], ["--temperature", "nan"], ["--temperature", "-1"], ["--n", "0"]],
)
def test_sample_refuses_bad_numbers_before_loading(argv, tmp_path):
    from utils import sample

    with pytest.raises(SystemExit, match="error: --"):
        sample.sample_trained([str(tmp_path), "hello", *argv])


# ------------------------------------------------------ bad files: one line naming file and row


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not UTF-8 text"),
        (b"", "holds no rows"),
        (b'{"question": "q", "answer": null}\n', "rows.jsonl:1: 'answer' must be a non-empty"),
        (b'{"question": "q", "answer": NaN}\n', "rows.jsonl:1: 'answer' must be a non-empty"),
        (b'{"question": "q", "answer": "  "}\n', "rows.jsonl:1: 'answer' must be a non-empty"),
        (b'{"question": "q", "answer": "a"}\n["q", "a"]\n', "rows.jsonl:2: expected a JSON object"),
        (b'{"question": "q", "answer": "a"}\n{oops\n', "rows.jsonl:2: not JSON"),
    ],
)
def test_data_files_with_bad_rows_get_one_line(content, message, tmp_path):
    from envs import agent_tools

    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(SystemExit, match=message):
        agent_tools.load_qa_jsonl(path)


def test_each_loader_names_its_flag_and_row(tmp_path):
    from envs import agent_tools, flowrl_tasks, sd3

    (tmp_path / "math.jsonl").write_text('{"problem": null, "answer": "2"}\n')
    with pytest.raises(SystemExit, match="math.jsonl:1: 'prompt|problem' must"):
        flowrl_tasks.load_math_jsonl(tmp_path / "math.jsonl")
    (tmp_path / "prompts.txt").write_bytes(b"\xff\xfe\x00a cat")
    with pytest.raises(SystemExit, match="--prompts .* is not UTF-8"):
        sd3.load_prompts(tmp_path / "prompts.txt")
    (tmp_path / "corpus.jsonl").write_text("")
    with pytest.raises(SystemExit, match="--corpus .* holds no rows"):
        agent_tools.make_retriever(tmp_path / "corpus.jsonl")
    (tmp_path / "corpus.jsonl").write_text('{"text": "a b ! c"}\n')  # no word of 2+ letters
    with pytest.raises(SystemExit, match="--corpus .*empty vocabulary"):
        agent_tools.make_retriever(tmp_path / "corpus.jsonl")


def test_an_empty_gold_answer_matches_nothing():
    from envs import agent_tools

    assert not agent_tools.answers_match("Paris.", "")
    assert not agent_tools.answers_match("Paris.", "  ")
    assert agent_tools.answers_match("Paris.", "paris")


def test_a_corrupt_toy_cache_is_rebuilt_and_a_file_cache_dir_is_refused(tmp_path, capsys):
    from envs import digits

    cache = tmp_path / "digits.safetensors"
    cache.write_bytes(b"not a checkpoint")
    assert not digits.cached_models(cache, None, None)
    assert "unreadable" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    args = cli.parse_args(
        flow_grpo.Args,
        flow_grpo.PRESETS,
        ["--quiet", "--out-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "file")],
    )
    with pytest.raises(SystemExit, match="--cache-dir .* is not a folder"):
        flow_grpo.train(args)


# ------------------------------------------------------------------------------------- flowrl.py


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "full", "--data", ""], "needs --data"),
        (["--task", "numbers"], "needs --model"),
        (["--model", "smollm2"], "valleys toy builds its own model"),
        (["--preset", "smollm2-numbers", "--data", "x.jsonl"], "the other tasks take none"),
        (["--valleys", "1,two"], "--valleys must list"),
        (["--valleys", "1,0"], "--valleys must list"),
        (["--preset", "smollm2-addition", "--valleys", "1"], "its own rewards"),
    ],
)
def test_flowrl_bad_flags_get_one_clear_message(tmp_path, argv, message):
    args = cli.parse_args(
        flowrl.Args, flowrl.PRESETS, ["--quiet", "--out-dir", str(tmp_path), *argv]
    )
    with pytest.raises(SystemExit, match=message):
        flowrl.train(args)


def test_flowrl_bad_model_and_data_files_get_one_clear_message(tmp_path):
    tokenizer = models.make_tokenizer(["a"])
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": "1"}\nnot json\n')
    cases = [
        (
            str(tmp_path / "no-such-model"),
            "tests/data/math_tiny.jsonl",
            "could not load.*--preset toy",
        ),
        (str(tmp_path / "tiny"), str(tmp_path / "missing.jsonl"), "is not a file"),
        (str(tmp_path / "tiny"), str(tmp_path / "bad.jsonl"), "bad.jsonl:2: not JSON"),
    ]
    for model, data, message in cases:
        args = cli.parse_args(
            flowrl.Args,
            flowrl.PRESETS,
            [
                "--preset",
                "full",
                "--model",
                model,
                "--data",
                data,
                "--quiet",
                "--out-dir",
                str(tmp_path / "run"),
            ],
        )
        with pytest.raises(SystemExit, match=message):
            flowrl.train(args)


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "4"]], ids=["one-process", "lora"])
def test_fsdp_in_one_process_or_with_lora_is_one_line(extra, tmp_path):
    args = cli.parse_args(
        flowrl.Args,
        flowrl.PRESETS,
        ["--fsdp", "--quiet", "--device", "cpu", "--out-dir", str(tmp_path), *extra],
    )
    with pytest.raises(SystemExit) as exit_info:
        flowrl.train(args)
    message = str(exit_info.value)
    assert message.startswith("error: --fsdp") and "\n" not in message, message


# ---------------------------------------------------------------------------------- flow_grpo.py


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--noise-level", "0"], "ODE"),
        (["--group-size", "1"], "group-size"),
        (["--prompts", "/nonexistent.txt"], "not a file"),
        (["--reward", "no_such_module:score"], "--reward"),
        (["--model", "/nonexistent/sd3"], "could not load"),
    ],
)
def test_flow_grpo_sd3_bad_input_gets_one_clear_message(tmp_path, tiny_sd3, extra, message):
    with pytest.raises(SystemExit, match=message):
        flow_grpo.train(sd3_args(tmp_path, tiny_sd3, *extra))


def nan_reward(images, prompts):
    return torch.full((len(prompts),), float("nan"))


def raising_reward(images, prompts):
    raise RuntimeError("reward server down")


@pytest.mark.parametrize(
    "fn, message", [("nan_reward", "finite score"), ("raising_reward", "reward server down")]
)
def test_a_reward_that_returns_nan_or_raises_gets_one_clear_message(
    tmp_path, tiny_sd3, fn, message
):
    with pytest.raises(SystemExit, match=message):
        flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--reward", f"test_bad_input:{fn}"))


def test_flow_grpo_empty_and_malformed_prompt_files(tmp_path, tiny_sd3):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    for name, message in [("empty.txt", "holds no rows"), ("bad.jsonl", "'prompt' must be")]:
        with pytest.raises(SystemExit, match=message):
            flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--prompts", str(tmp_path / name)))


# ------------------------------------------------------------------------------------ rc_grpo.py


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--arms", "sft+ppo"], "--arms"),
        (["--p-high", "1.5"], "p-high"),
        (["--preset", "bfcl", "--model", "/nonexistent/model"], "could not load"),
    ],
)
def test_rc_grpo_bad_input_gets_one_clear_message(tmp_path, extra, message):
    args = cli.parse_args(
        rc_grpo.Args, rc_grpo.PRESETS, ["--quiet", "--out-dir", str(tmp_path), *extra]
    )
    with pytest.raises(SystemExit, match=message):
        rc_grpo.train(args)


# ---------------------------------------------------------------------------------- agentflow.py


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "0"], "temperature"),
        (["--preset", "full", "--data", ""], "needs --data"),
        (
            ["--preset", "full", "--data", "/nonexistent.jsonl", "--model", "/nonexistent/model"],
            "could not load",
        ),
    ],
)
def test_agentflow_bad_input_gets_one_clear_message(tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        agentflow.train(
            cli.parse_args(
                agentflow.Args, agentflow.PRESETS, ["--quiet", "--out-dir", str(tmp_path), *extra]
            )
        )


def test_agentflow_missing_and_malformed_data_files(tmp_path):
    model = tiny_planner(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    for data, message in [("missing.jsonl", "not a file"), ("bad.jsonl", "bad.jsonl:1")]:
        with pytest.raises(SystemExit, match=message):
            agentflow.train(
                cli.parse_args(
                    agentflow.Args,
                    agentflow.PRESETS,
                    [
                        "--quiet",
                        "--out-dir",
                        str(tmp_path),
                        "--preset",
                        "full",
                        "--model",
                        str(model),
                        "--lora-rank",
                        "4",
                        "--data",
                        str(tmp_path / data),
                    ],
                )
            )


def test_a_resume_whose_stage_2_checkpoint_is_gone_is_one_line_and_keeps_the_metrics(tmp_path):
    """rc_grpo --resume into a run whose stage-1 file remains but whose arm has logged steps and
    lost its checkpoint: one line before any model is built, and the arm's metrics.jsonl (an
    earlier run's steps) is byte-identical."""
    stage1 = {"summary": {}, "shown": []}  # a stage-1 file that loads (with no weight to set)
    tracking.save_checkpoint(tmp_path / "stage1.safetensors", {"rctp/w": torch.zeros(1)}, stage1)
    metrics = tmp_path / "rctp+rc-grpo" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3)))
    before = metrics.read_bytes()
    tiny = ["--arms", "rctp+rc-grpo", "--steps", "1", "--tasks-per-step", "1", "--toy-tasks", "4"]
    args = cli.parse_args(
        rc_grpo.Args,
        rc_grpo.PRESETS,
        [*tiny, "--toy-test-tasks", "1", "--quiet", "--resume", "--out-dir", str(tmp_path)],
    )
    with pytest.raises(SystemExit) as exit_info:
        rc_grpo.train(args)
    message = str(exit_info.value)
    assert message.startswith("error: --resume") and "\n" not in message, message
    assert "no checkpoint" in message and metrics.read_bytes() == before


DIVERGING_RUNS = {  # --lr 1e308: the first optimiser step makes the weights inf
    "flowrl": ["--steps", "3"],
    "flow_grpo": ["--epochs", "2"],
    "agentflow": ["--steps", "3", "--warm-start-steps", "2", "--no-ablation"],
    "rc_grpo": [
        *("--arms", "rctp+rc-grpo", "--steps", "3", "--tasks-per-step", "2", "--toy-tasks", "8"),
        *("--toy-test-tasks", "2", "--rctp-epochs", "1", "--failure-rollouts", "1"),
    ],
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_learning_rate_that_makes_the_weights_non_finite_is_one_line(name, tmp_path, request):
    """The next forward after the diverged step stops the run in one line, wherever it comes
    first: the update's loss (common.check_finite) or, in rc_grpo, the next rollout, whose NaN
    logits generate's last logits processor refuses."""
    cache = (
        ["--cache-dir", str(request.getfixturevalue("flow_grpo_cache"))]
        if name == "flow_grpo"
        else []
    )
    flags = [*DIVERGING_RUNS[name], *cache, "--lr", "1e308", "--quiet", "--out-dir", str(tmp_path)]
    args = cli.parse_args(SCRIPTS[name].Args, SCRIPTS[name].PRESETS, flags)
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[name].train(args)
    message = str(exit_info.value)
    assert message.startswith("error:") and "lower --lr" in message and "\n" not in message
