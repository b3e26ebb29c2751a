"""One GRPO step, ours vs TRL's `GRPOTrainer`, side by side at equal shapes (same model, tokenizer,
prompts, G, completion length, reward and optimiser), and both against the step's floor.

    python -m venv .venv-bench && .venv-bench/bin/pip install -r benchmarks/requirements.txt
    .venv-bench/bin/python benchmarks/bench_vs_trl.py          # or: make bench-trl

A step = generate G completions per prompt, reward, group advantages, clipped loss, backward, AdamW
step. Both sides sample at temperature 1 with EOS stopping, β = 0 (no reference model), one
optimiser step per batch; the first step of each side is a warm-up and is not timed. Each step is
split into generation / scoring (rewards, advantages, packing) / update (forward, backward, AdamW);
TRL's split comes from its own profiling contexts. The floor is `generate` alone plus one forward
and backward alone on the same batch: what any GRPO step must spend.

Models: tiny random Qwen2s (hidden 64 and 256, a word tokenizer) and the real SmolLM2-135M-Instruct
(bundled; one-digit addition prompts through its chat template, 12 new tokens).
"""

import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import flowrl  # noqa: E402
from envs import flowrl_tasks  # noqa: E402
from utils import models  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
GROUP, LR = 8, 1e-5


def word_reward(texts):
    return [t.split().count("w1") / max(1, len(t.split())) for t in texts]


def addition_reward(texts, sums):
    return [flowrl_tasks.integer_reward(t, {s}, first=True) for t, s in zip(texts, sums)]


def tiny_case(hidden):
    """A random tiny Qwen2 on word prompts: 8 prompts, 32 new tokens, 5 timed steps."""
    tokenizer = models.make_tokenizer(WORDS)
    model = models.tiny_causal_lm(len(tokenizer), hidden_size=hidden, num_heads=4, seed=0)
    prompts = [" ".join(WORDS[(7 * i + j) % 60] for j in range(8)) for i in range(8)]
    return dict(
        name=f"tiny Qwen2, hidden {hidden}", tokenizer=tokenizer, model=model, prompts=prompts,
        reward=lambda texts, rows: word_reward(texts), new_tokens=32, steps=5)


def smollm2_case():
    """The real SmolLM2-135M-Instruct on 4 addition questions (the smollm2-addition preset's
    shapes): 4 prompts × G 8, 12 new tokens, 2 timed steps."""
    tokenizer, model = models.load_causal_lm("smollm2", torch.device("cpu"))
    pairs = [(3, 4), (5, 2), (6, 1), (2, 7)]
    prompts = [
        flowrl_tasks.chat_prompt(tokenizer, f"What is {a} + {b}?" + flowrl_tasks.REPLY)
        for a, b in pairs
    ]
    sums = {p: a + b for p, (a, b) in zip(prompts, pairs)}
    return dict(
        name="SmolLM2-135M-Instruct", tokenizer=tokenizer, model=model, prompts=prompts,
        reward=lambda texts, rows: addition_reward(texts, [sums[p] for p in rows]), new_tokens=12,
        steps=2)


def fresh(case):
    """A copy of the case's model, so every side starts from the same weights."""
    import copy

    return copy.deepcopy(case["model"])


def ours(case):
    """Seconds per step of our GRPO step, split into generation / scoring / update."""
    model, tokenizer = fresh(case), case["tokenizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    prompts = [p for p in case["prompts"] for _ in range(GROUP)]
    split = defaultdict(float)
    for step in range(case["steps"] + 1):
        t0 = time.perf_counter()
        samples = common.sample_completions(model, tokenizer, prompts, case["new_tokens"])
        t1 = time.perf_counter()
        rewards = torch.tensor(case["reward"]([text for text, _, _ in samples], prompts))
        advantages = common.group_advantages(rewards, GROUP)
        ids, attn, mask = common.pack_completions(
            tokenizer, prompts, [s[1] for s in samples], model.device)
        t2 = time.perf_counter()
        model.train()
        logp = common.completion_logprobs(model, ids, attn, mask.shape[1])
        # One update per batch: the sampling policy is the current one, so old_logp = logp.detach()
        # (ratio ≡ 1, the same gradient) and no separate no-grad scoring pass is needed; TRL does
        # the same.
        loss, _ = flowrl.grpo_loss(logp, logp.detach(), advantages, mask, 0.2, mask.sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t3 = time.perf_counter()
        if step:  # step 0 is the warm-up
            for phase, seconds in [
                ("generation", t1 - t0), ("scoring", t2 - t1), ("update", t3 - t2)]:
                split[phase] += seconds / case["steps"]
    return dict(split)


def floor(case):
    """`generate` alone (no logits processor, no decoding) plus one forward and backward alone, on
    the same prompts and completion length: the least a GRPO step can cost."""
    model, tokenizer = fresh(case), case["tokenizer"]
    prompts = [p for p in case["prompts"] for _ in range(GROUP)]
    config = common.generation_config(model, tokenizer, case["new_tokens"], 1.0)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    times = defaultdict(float)
    for step in range(case["steps"] + 1):
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(**enc, generation_config=config)
        t1 = time.perf_counter()
        attn = torch.cat(
            [enc["attention_mask"], torch.ones_like(seq[:, enc["input_ids"].shape[1] :])], 1)
        model.train()
        t2 = time.perf_counter()
        common.completion_logprobs(
            model, seq, attn, seq.shape[1] - enc["input_ids"].shape[1]).sum().backward()
        t3 = time.perf_counter()
        model.zero_grad()
        if step:
            times["generate"] += (t1 - t0) / case["steps"]
            times["forward_backward"] += (t3 - t2) / case["steps"]
    return dict(times)


def trl(case):
    """Seconds per step of TRL's GRPOTrainer, split from its profiling contexts: generation =
    `transformers.generate`; scoring = the rest of `_prepare_inputs` (rewards, advantages,
    tokenisation); update = the rest of the step (forward, backward, AdamW)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    model, tokenizer = fresh(case), case["tokenizer"]
    stamps, phases = [], defaultdict(list)

    def record(context, duration):
        phases[context.name].append(duration)

    profiling.ProfilingContext._log_metrics = record

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=len(case["prompts"]) * GROUP,
            num_generations=GROUP, max_completion_length=case["new_tokens"],
            max_steps=case["steps"] + 1, learning_rate=LR, beta=0.0, temperature=1.0,
            num_iterations=1, gradient_accumulation_steps=1, logging_steps=1000, save_strategy="no",
            report_to=[], use_cpu=True, bf16=False, seed=0)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda prompts, completions, **kw: case["reward"](completions, prompts),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": case["prompts"] * (case["steps"] + 1)}),
            processing_class=tokenizer, callbacks=[Clock()])
        trainer.train()
    timed = slice(1, case["steps"] + 1)  # the first step is the warm-up
    step = sum(b - a for a, b in zip(stamps[timed.start - 1 :], stamps[timed])) / case["steps"]
    if "transformers.generate" not in phases:  # this TRL version timed its phases under other names
        return {"step": step}
    mean = lambda name: sum(phases[name][timed]) / case["steps"]
    generation = mean("transformers.generate")
    scoring = mean("_prepare_inputs") - generation
    return {"generation": generation, "scoring": scoring, "update": step - generation - scoring}


def compare(case):
    """One case: ours, TRL and the floor, as seconds per step and samples per second."""
    mine, theirs, least = ours(case), trl(case), floor(case)
    samples = len(case["prompts"]) * GROUP
    total = lambda split: sum(split.values())
    return {
        "model": case["name"], "samples_per_step": samples,
        "ours_s": {k: round(v, 3) for k, v in mine.items()},
        "trl_s": {k: round(v, 3) for k, v in theirs.items()},
        "floor_s": {k: round(v, 3) for k, v in least.items()},
        "ours_samples_per_s": round(samples / total(mine), 1),
        "trl_samples_per_s": round(samples / total(theirs), 1),
        "ratio": round(total(theirs) / total(mine), 2),
        "ours_over_floor": round(total(mine) / total(least), 3),
        "trl_over_floor": round(total(theirs) / total(least), 3)}


if __name__ == "__main__":
    torch.manual_seed(0)
    cases = sys.argv[1:] or ["tiny64", "tiny256", "smollm2"]
    for name in cases:
        case = smollm2_case() if name == "smollm2" else tiny_case(int(name.removeprefix("tiny")))
        print(json.dumps(compare(case)), flush=True)
