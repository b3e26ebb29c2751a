"""`flowrl.py --fsdp` on two CPU processes (torchrun, gloo, FSDP2's fully_shard): the sharded run
trains what one unsharded process trains, ranks with different numbers of micro-batches finish, and
a run killed after a checkpoint resumes to the same end.

The one-process runs have the same global batch. The logged loss is rank 0's share, so the curve
compared is the gradient norm, which both compute over the whole batch. FlowRL's log Z head has
dropout whose draws depend on the process layout, so the comparisons with one process use the GRPO
arms; the resume test runs the flowrl arm against an uninterrupted two-rank run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import flowrl
from envs import flowrl_tasks
from test_distributed import distance, train_and_load
from utils import cli, models

ROOT = Path(__file__).resolve().parents[1]
MATH = str(ROOT / "tests" / "data" / "math_tiny.jsonl")


def curve(run_dir, key="grad_norm"):
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(tmp_path, flags, initial):
    """2 FSDP ranks vs 1 process without FSDP: identical ranks, the same weights to rounding (far
    below how far training moved them), the same gradient-norm curve."""
    (one,) = train_and_load(tmp_path, "one", 1, flags)
    rank0, rank1 = train_and_load(tmp_path, "two", 2, [*flags, "--fsdp"])
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), "the ranks drifted apart"
    moved = distance(one, [p.detach() for p in initial.parameters()])
    assert moved > 1e-3, "training did not change the parameters; the comparison would be empty"
    assert distance(one, rank0) < 1e-4 * moved
    assert curve(tmp_path / "one-run") == pytest.approx(curve(tmp_path / "two-run"), rel=1e-4)


def test_sharded_toy_trains_what_one_process_trains(tmp_path):
    """The valleys toy (a Qwen2ForCausalLM), the GRPO-KL control: π_old and π_ref scored by
    sharded models, fp32."""
    flags = ["flowrl", "--algo", "grpo-kl", "--steps", "2", "--prompts-per-step", "2",
             "--group-size", "16", "--eval-every", "100", "--mixed-precision", "fp32"]
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, flags[1:])
    assert_same_training(tmp_path, flags, flowrl_tasks.build_toy(args)[1])


def test_sharded_smollm2_with_uneven_micro_batches_finishes_and_matches(tmp_path):
    """SmolLM2 on the full preset's path (chat template, EOS, checkpointing). The ranks' rows are 59
    and 62 tokens wide, so a 120-token budget packs rank 0's two rows in 1 micro-batch and rank
    1's in 2: rank 0 runs an empty one, or rank 1's second all-gather would wait forever (the
    subprocess timeout fails the test instead)."""
    flags = ["flowrl", "--preset", "full", "--model", "smollm2", "--data", MATH, "--algo", "grpo",
             "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--minibatches", "1",
             "--max-new-tokens", "6", "--micro-batch-tokens", "120", "--lr", "1e-5",
             "--eval-every", "100", "--save-every", "0", "--mixed-precision", "fp32"]
    _, initial = models.load_causal_lm("smollm2", torch.device("cpu"))
    assert_same_training(tmp_path, flags, initial)


def save_tiny_math_model(folder):
    """A tiny random Qwen2 with a word vocabulary over the math prompts, saved to `folder`."""
    words = [*flowrl_tasks.MATH_SUFFIX.split(), *(
        word for line in Path(MATH).read_text().splitlines()
        for word in json.loads(line).get("prompt", json.loads(line).get("problem")).split())]
    tokenizer = models.make_tokenizer(words + [str(n) for n in range(10)])
    models.tiny_causal_lm(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_a_killed_sharded_run_resumes_to_the_same_end_and_saves_what_it_trained(tmp_path):
    """flowrl arm (log Z head replicated, the policy sharded), bf16 compute: SIGKILL once a
    checkpoint exists, then --resume; the summary and metrics equal an uninterrupted run's, and
    the saved policy reloads with from_pretrained to the trained weights."""
    save_tiny_math_model(tmp_path / "tiny")
    flags = ["--preset", "full", "--model", str(tmp_path / "tiny"), "--data", MATH,
             "--eval-data", MATH, "--eval-k", "2", "--steps", "4", "--prompts-per-step", "2",
             "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "6", "--lr", "1e-3",
             "--logz-lr", "1e-2", "--warmup-steps", "0", "--eval-every", "100", "--save-every",
             "1", "--mixed-precision", "bf16", "--fsdp", "--quiet", "--device", "cpu"]
    run = lambda name, *extra: [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "tests" / "ddp_driver.py"), "flowrl", str(tmp_path / name), *flags,
        "--out-dir", str(tmp_path / f"{name}-run"), *extra]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run(run("whole"), check=True, cwd=ROOT, capture_output=True, timeout=300, env=env)

    killed = subprocess.Popen(run("killed"), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    checkpoint = tmp_path / "killed-run" / "checkpoint.safetensors"
    deadline = time.time() + 300
    while not checkpoint.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)  # torchrun and both ranks
    killed.wait()
    from utils import tracking

    assert tracking.checkpoint_state(checkpoint)["step"] < 4, "finished before it was killed"
    subprocess.run(run("killed", "--resume"), check=True, cwd=ROOT, capture_output=True,
                   timeout=300, env=env)

    def ended(name):
        summary = json.loads((tmp_path / f"{name}-run" / "summary.json").read_text())
        lines = (tmp_path / f"{name}-run" / "metrics.jsonl").read_text().splitlines()
        records = [{k: v for k, v in json.loads(line).items()
                    if k != "sec" and not k.startswith("time_")}  # wall-clock seconds
                   for line in lines]
        summary = {k: v for k, v in summary.items() if k not in ("wall_seconds", "peak_rss_mb")}
        return summary, records

    assert ended("killed") == ended("whole")
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


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "4"]], ids=["one-process", "lora"])
def test_fsdp_in_one_process_or_with_lora_is_one_line(extra, tmp_path):
    args = cli.parse_args(flowrl.Args, flowrl.PRESETS, [
        "--fsdp", "--quiet", "--device", "cpu", "--out-dir", str(tmp_path), *extra])
    with pytest.raises(SystemExit) as exit_info:
        flowrl.train(args)
    message = str(exit_info.value)
    assert message.startswith("error: --fsdp") and "\n" not in message, message
