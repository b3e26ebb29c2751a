"""Resume and determinism: a toy run killed with SIGKILL part-way and resumed ends exactly where an
uninterrupted run ends (so a run is also bit-reproducible across processes), a sharded one too; a
resumed run does not evaluate its start again; and a failed --resume, a rerun into a run or a
--resume without a checkpoint loses nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import agentflow
import flowrl
import rc_grpo
from envs import flowrl_tasks
from utils import cli, tracking

ROOT = Path(__file__).resolve().parents[1]


def metrics(folder):
    folder = folder / "rctp+rc-grpo" if (folder / "rctp+rc-grpo").exists() else folder
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if k not in ("sec", "restored") and not k.startswith("time_")
        }  # wall-clock seconds
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


def summary(folder):
    def strip(value):  # wall-clock times and peak memory differ; everything else must not
        return (
            {k: strip(v) for k, v in value.items() if k not in ("wall_seconds", "peak_rss_mb")}
            if isinstance(value, dict)
            else value
        )

    return strip(json.loads((folder / "summary.json").read_text()))


def check_whole_run(script, folder):
    """What an uninterrupted toy run leaves: training scored exactly what the sampler drew (the
    sampler's log-probs re-scored by the trainer), and each script's summary keys and files."""
    done = json.loads((folder / "summary.json").read_text())
    if script == "flowrl.py":
        assert done["sampler_logprob_max_dev"] < 1e-3
        assert {"summary.json", "kl.png", "valleys.png", "config.json"} <= {
            p.name for p in folder.iterdir()
        }
    elif script == "flow_grpo.py":
        assert done["sampler_ratio_max_dev"] < 1e-6  # the SDE step re-scored exactly
        assert {
            "accuracy_before",
            "accuracy_after",
            "reward_before",
            "reward_after",
            "diversity_before",
            "diversity_after",
            "wall_seconds",
        } <= set(done)
        assert done["reward_model_test_accuracy"] >= 0.95
        assert (folder / "samples.png").stat().st_size > 0
    elif script == "agentflow.py":
        assert done["sampler_logprob_max_dev"] < 1e-3  # the re-padded turns
        assert {
            "accuracy_before",
            "accuracy_after",
            "mean_turns",
            "tool_error_rate",
            "wall_seconds",
        } <= set(done)
        assert done["accuracy_after"] == metrics(folder)[-1]["eval_accuracy"]
        assert "turn 1:" in (folder / "rollouts.txt").read_text()
    else:
        assert done["rctp+rc-grpo"]["sampler_logprob_max_dev"] < 1e-3
        assert {"token_gap", "wall_seconds"} <= set(done) | set(done["rctp+rc-grpo"])


@pytest.mark.long
@pytest.mark.parametrize(
    "script, flags",
    [
        (
            "flowrl.py",
            ["--steps", "4", "--group-size", "8", "--eval-every", "4", "--save-every", "1"],
        ),
        (
            "flow_grpo.py",
            [
                "--epochs",
                "12",
                "--eval-per-prompt",
                "4",
                "--eval-every",
                "12",
                "--save-every",
                "3",
                "--ema",
                "0.9",
            ],
        ),  # the EMA (evaluated and saved weights) continues
        (
            "agentflow.py",
            [
                "--steps",
                "4",
                "--eval-every",
                "4",
                "--save-every",
                "1",
                "--no-ablation",
                "--queries-per-step",
                "2",
                "--warm-start-steps",
                "20",
            ],
        ),
        (
            "rc_grpo.py",
            [
                "--steps",
                "4",
                "--arms",
                "rctp+rc-grpo",
                "--toy-tasks",
                "20",
                "--toy-test-tasks",
                "5",
                "--tasks-per-step",
                "2",
                "--failure-rollouts",
                "1",
                "--save-every",
                "1",
            ],
        ),
    ],
)
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, request, script, flags):
    flags = (  # flow_grpo's toy cache asked for by its run only: no other run waits for it
        [*flags, "--quiet", "--cache-dir", str(request.getfixturevalue("flow_grpo_cache"))]
        if script == "flow_grpo.py"
        else [*flags, "--quiet"]
    )

    def run(out, *extra):
        return [sys.executable, str(ROOT / script), *flags, "--out-dir", str(out), *extra]

    subprocess.run(run(tmp_path / "whole"), check=True, cwd=ROOT, capture_output=True)
    check_whole_run(script, tmp_path / "whole")

    killed = subprocess.Popen(
        run(tmp_path / "killed"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoint = (
        tmp_path
        / "killed"
        / ("rctp+rc-grpo/" if script == "rc_grpo.py" else "")
        / "checkpoint.safetensors"
    )
    while not checkpoint.exists() and killed.poll() is None:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    tensors, state = tracking.load_checkpoint(checkpoint)
    assert state["step"] < int(flags[1]), (
        "the run finished before it could be killed; make it longer"
    )
    # mark the saved metrics: only a run that really continues from this file can show the mark
    state["extra"]["records"][0]["restored"] = True
    tracking.save_checkpoint(checkpoint, tensors, state)
    subprocess.run(run(tmp_path / "killed", "--resume"), check=True, cwd=ROOT, capture_output=True)

    path = (
        tmp_path / "killed" / ("rctp+rc-grpo" if script == "rc_grpo.py" else "") / "metrics.jsonl"
    )
    assert json.loads(path.read_text().splitlines()[0]).get("restored") is True

    # bit for bit: the same metrics and summary (so the same seed gives the same run in any process)
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "whole")
    assert summary(tmp_path / "killed") == summary(tmp_path / "whole")


@pytest.mark.long
def test_two_runs_in_one_process_are_identical(tmp_path):
    """No state leaks from one `train` call into the next in the same process (global RNGs,
    cached models): the second run logs what the first logged. The GRPO arm, whose sampler gap is
    checked here (the flowrl arm's in the resume test above)."""
    flags = ["--algo", "grpo", "--steps", "3", "--eval-every", "3", "--quiet"]
    runs = []
    for name in ("a", "b"):
        done = flowrl.train(
            cli.parse_args(flowrl.Args, flowrl.PRESETS, [*flags, "--out-dir", str(tmp_path / name)])
        )
        assert done["sampler_logprob_max_dev"] < 1e-3
        runs.append((metrics(tmp_path / name), summary(tmp_path / name)))
    assert runs[0] == runs[1]


@pytest.mark.long
def test_a_resumed_flowrl_run_does_not_evaluate_its_start_again(tmp_path, monkeypatch):
    """The start's evaluation (Avg@16 takes about an hour at full scale) is saved with the
    checkpoint: resuming reads it back instead of evaluating the trained weights as the start."""
    calls = []
    evaluate = flowrl_tasks.evaluate
    monkeypatch.setattr(
        flowrl_tasks, "evaluate", lambda *a, **k: calls.append(1) or evaluate(*a, **k)
    )
    flags = [
        "--steps",
        "2",
        "--inner-steps",
        "1",
        "--eval-every",
        "100",
        "--save-every",
        "1",
        "--quiet",
        "--out-dir",
        str(tmp_path),
    ]
    fresh = flowrl.train(cli.parse_args(flowrl.Args, flowrl.PRESETS, flags))
    assert len(calls) == 2  # the start and the end
    resumed = flowrl.train(cli.parse_args(flowrl.Args, flowrl.PRESETS, [*flags, "--resume"]))
    assert len(calls) == 3  # the end only
    assert resumed["before"] == fresh["before"]


@pytest.mark.long
def test_a_resumed_agentflow_run_does_not_evaluate_its_start_again(tmp_path, monkeypatch):
    """The start's evaluation and its shown rollout are saved with the checkpoint: resuming reads
    them back instead of evaluating the trained planner as the start; a finished run's last
    evaluation is in its records, so it is not evaluated again either (only the one query shown in
    rollouts.txt, which a fresh run takes from its last evaluation)."""
    calls = []  # the queries of each evaluation
    evaluate = agentflow.evaluate
    monkeypatch.setattr(
        agentflow, "evaluate", lambda *a, **k: calls.append(len(a[1])) or evaluate(*a, **k)
    )
    flags = [
        "--steps",
        "2",
        "--inner-steps",
        "1",
        "--eval-every",
        "100",
        "--save-every",
        "1",
        "--warm-start-steps",
        "20",
        "--no-ablation",
        "--quiet",
        "--out-dir",
        str(tmp_path),
    ]
    fresh = agentflow.train(cli.parse_args(agentflow.Args, agentflow.PRESETS, flags))
    shown = (tmp_path / "rollouts.txt").read_text()
    whole = calls[0]  # the start, then the last step's (its first rollout shown in rollouts.txt)
    assert whole > 1 and calls == [whole, whole]
    resumed = agentflow.train(
        cli.parse_args(agentflow.Args, agentflow.PRESETS, [*flags, "--resume"])
    )
    assert calls[2:] == [1]  # the shown query only: the start and the end are read back
    assert resumed["accuracy_before"] == fresh["accuracy_before"]
    assert resumed["accuracy_after"] == fresh["accuracy_after"]
    assert (tmp_path / "rollouts.txt").read_text().split("after training:")[0] == shown.split(
        "after training:"
    )[0]


@pytest.mark.long
def test_a_resumed_rc_grpo_run_does_not_run_stage_1_again(tmp_path, monkeypatch):
    """Stage 1 is saved (out_dir/stage1.safetensors): a resumed run loads it and runs no
    supervised fine-tuning, and ends with the stage-1 accuracies of the first run."""
    flags = [
        "--steps",
        "2",
        "--arms",
        "rctp+rc-grpo",
        "--toy-tasks",
        "60",
        "--toy-test-tasks",
        "4",
        "--tasks-per-step",
        "4",
        "--failure-rollouts",
        "1",
        "--save-every",
        "1",
        "--quiet",
        "--out-dir",
        str(tmp_path),
    ]
    first = rc_grpo.train(cli.parse_args(rc_grpo.Args, rc_grpo.PRESETS, flags))
    calls = []
    finetune = rc_grpo.supervised_finetune
    monkeypatch.setattr(
        rc_grpo, "supervised_finetune", lambda *a, **k: calls.append(1) or finetune(*a, **k)
    )
    resumed = rc_grpo.train(cli.parse_args(rc_grpo.Args, rc_grpo.PRESETS, [*flags, "--resume"]))
    assert calls == []
    assert resumed["rctp_accuracy"] == first["rctp_accuracy"]
    assert resumed["token_gap"] == first["token_gap"]


# ------------------------------------------------------------------------------ a sharded run


@pytest.mark.long
def test_a_killed_sharded_run_resumes_to_the_same_end_and_saves_what_it_trained(tmp_path):
    """flowrl --fsdp on two gloo ranks, the flowrl arm (log Z head replicated, the policy sharded),
    bf16 compute: SIGKILL once a checkpoint exists, then --resume; the summary and metrics equal an
    uninterrupted run's, and the saved policy reloads with from_pretrained to the trained
    weights."""
    from transformers import AutoModelForCausalLM

    import common
    from test_fsdp import MATH, save_tiny_math_model

    save_tiny_math_model(tmp_path / "tiny")
    flags = [
        "--preset",
        "full",
        "--model",
        str(tmp_path / "tiny"),
        "--data",
        MATH,
        "--eval-data",
        MATH,
        "--eval-k",
        "2",
        "--steps",
        "4",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--minibatches",
        "2",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-3",
        "--logz-lr",
        "1e-2",
        "--warmup-steps",
        "0",
        "--eval-every",
        "100",
        "--save-every",
        "1",
        "--mixed-precision",
        "bf16",
        "--fsdp",
        "--quiet",
        "--device",
        "cpu",
    ]

    def run(name, *extra):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "ddp_driver.py"),
            "flowrl",
            str(tmp_path / name),
            *flags,
            "--out-dir",
            str(tmp_path / f"{name}-run"),
            *extra,
        ]

    env = os.environ | {"OMP_NUM_THREADS": "1"}
    whole = subprocess.run(
        run("whole"), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert whole.returncode == 0, whole.stderr[-3000:]

    killed = subprocess.Popen(
        run("killed"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    checkpoint = tmp_path / "killed-run" / "checkpoint.safetensors"
    deadline = time.time() + 300
    while not checkpoint.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)  # torchrun and both ranks
    killed.wait()
    assert tracking.checkpoint_state(checkpoint)["step"] < 4, "finished before it was killed"
    resumed = subprocess.run(
        run("killed", "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(tmp_path / "killed-run") == metrics(tmp_path / "whole-run")
    assert summary(tmp_path / "killed-run") == summary(tmp_path / "whole-run")
    # the saved policy is the trained model: the driver's gathered weights, loaded into the
    # reloaded architecture, score what the reloaded policy scores
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "whole-run" / "policy")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "whole-run" / "policy")
    weights = torch.load(tmp_path / "whole.rank0.pt")
    with torch.no_grad():
        for p, w in zip(trained.parameters(), weights):
            p.copy_(w)
    ids = torch.tensor([list(range(4, 20))])
    reloaded = common.completion_logprobs(saved, ids, torch.ones_like(ids), 8)
    in_memory = common.completion_logprobs(trained, ids, torch.ones_like(ids), 8)
    assert (reloaded - in_memory).abs().max() <= 1e-5


# ------------------------------------------------ nothing lost: resume, rerun and the output folder


class OneProcess:
    """What check_out_dir needs of an Accelerator, for one process."""

    is_main_process = True

    def wait_for_everyone(self):
        pass


def run_folder(folder):
    """A run's files as a finished run leaves them: config, two lines of metrics, a summary."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"steps": 2}\n')
    (folder / "metrics.jsonl").write_text(
        '{"step": 1, "reward": 0.1}\n{"step": 2, "reward": 0.2}\n'
    )
    (folder / "summary.json").write_text('{"reward": 0.2}\n')
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def other_scripts_checkpoint(path):
    """A readable checkpoint of another run: weights this script's model does not have."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    tracking.save_training_state(
        path,
        1,
        {"policy": model},
        {"optimizer": optimizer},
        {"rollouts": torch.Generator()},
        {"records": []},
    )


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "empty", "a folder", "another run's"])
def test_a_failed_resume_leaves_the_run_as_it_was(kind, tmp_path, capsys):
    """Every kind of unresumable checkpoint: one `error:` line, and metrics.jsonl and config.json
    byte-identical (the history of a long run is never lost to a failed --resume)."""
    folder = tmp_path / "run"
    before = run_folder(folder)
    checkpoint = folder / "checkpoint.safetensors"
    if kind == "a folder":
        checkpoint.mkdir()
    elif kind == "another run's":
        other_scripts_checkpoint(checkpoint)
    else:
        other_scripts_checkpoint(checkpoint)
        data = checkpoint.read_bytes()
        checkpoint.write_bytes(
            {"corrupt": b"\x00garbage" * 50, "empty": b"", "truncated": data[: len(data) // 2]}[
                kind
            ]
        )
    before = {name: (folder / name).read_bytes() for name in before}
    args = cli.parse_args(
        flowrl.Args,
        flowrl.PRESETS,
        ["--quiet", "--steps", "2", "--resume", "--out-dir", str(folder)],
    )
    with pytest.raises(SystemExit) as exit_info:
        flowrl.train(args)
    message = str(exit_info.value)
    assert message.startswith("error:") and "\n" not in message, message
    expected = "does not match" if kind == "another run's" else "is unreadable"
    assert expected in message and "without --resume" in message, message
    assert {name: (folder / name).read_bytes() for name in before} == before


def test_a_rerun_into_a_run_is_refused_and_overwrite_replaces_it(tmp_path):
    folder = tmp_path / "run"
    before = run_folder(folder)
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, ["--quiet", "--out-dir", str(folder)])
    with pytest.raises(SystemExit, match="already holds a run; --resume continues it"):
        flowrl.train(args)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    args.overwrite = True
    tracking.check_out_dir(folder, args, OneProcess())
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_resume_without_a_checkpoint(tmp_path, capsys):
    """--resume of a run that saved no checkpoint is refused (nothing would be continued); of an
    empty folder it starts fresh and says so."""
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, ["--resume"])
    run_folder(tmp_path / "run")
    with pytest.raises(SystemExit, match="holds a run but no checkpoint"):
        tracking.check_out_dir(tmp_path / "run", args, OneProcess())
    tracking.check_out_dir(tmp_path / "new", args, OneProcess())
    assert "starting fresh" in capsys.readouterr().err
    args.overwrite = True
    with pytest.raises(SystemExit, match="exclude each other"):
        tracking.check_out_dir(tmp_path / "new", args, OneProcess())
