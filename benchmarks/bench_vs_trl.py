"""One GRPO step, ours vs TRL's `GRPOTrainer`, side by side: same tiny Qwen2, tokenizer, prompts, G,
completion length, reward and optimiser. Reports samples/s (completions per second of full steps).

    python -m venv .venv-bench && .venv-bench/bin/pip install -r benchmarks/requirements.txt
    .venv-bench/bin/python benchmarks/bench_vs_trl.py          # or: make bench-trl

A step = generate G completions per prompt, reward, group advantages, clipped loss, backward, AdamW
step. Both sides sample at temperature 1 with EOS stopping, β = 0 (no reference model), one
optimiser step per batch; the first step of each side is a warm-up and is not timed.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import flowrl  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
PROMPTS = [" ".join(WORDS[(7 * i + j) % 60] for j in range(8)) for i in range(8)]
GROUP, NEW_TOKENS, STEPS, LR = 8, 32, 5, 1e-5


def reward(texts):
    return [t.split().count("w1") / max(1, len(t.split())) for t in texts]


def build(hidden):
    tokenizer = common.make_tokenizer(WORDS)
    return tokenizer, common.tiny_causal_lm(len(tokenizer), hidden_size=hidden, num_heads=4, seed=0)


def ours(hidden):
    tokenizer, model = build(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    times = []
    for _ in range(STEPS + 1):
        start = time.time()
        samples = common.sample_completions(model, tokenizer, prompts, NEW_TOKENS)
        rewards = torch.tensor(reward([text for text, _, _ in samples]))
        ids, attn, mask = common.pack_completions(
            tokenizer, prompts, [s[1] for s in samples], model.device
        )
        model.train()
        logp = common.completion_logprobs(model, ids, attn, mask.shape[1])
        # One update per batch: the sampling policy is the current one, so old_logp = logp.detach()
        # (ratio ≡ 1, the same gradient) and no separate no-grad scoring pass is needed; TRL does
        # the same.
        loss, _ = flowrl.grpo_loss(
            logp, logp.detach(), common.group_advantages(rewards, GROUP), mask, 0.2, mask.sum()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.time() - start)
    return len(prompts) / (sum(times[1:]) / STEPS)


def trl(hidden):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, model = build(hidden)
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.time())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(PROMPTS) * GROUP,
            num_generations=GROUP,
            max_completion_length=NEW_TOKENS,
            max_steps=STEPS + 1,
            learning_rate=LR,
            beta=0.0,
            temperature=1.0,
            num_iterations=1,
            gradient_accumulation_steps=1,
            logging_steps=1000,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: reward(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * (STEPS + 2)}),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return len(PROMPTS) * GROUP / (sum(steps) / len(steps))


if __name__ == "__main__":
    torch.manual_seed(0)
    for hidden in (64, 256):
        ours_rate, trl_rate = ours(hidden), trl(hidden)
        print(
            json.dumps(
                {
                    "hidden": hidden,
                    "ours_samples_per_s": round(ours_rate, 1),
                    "trl_samples_per_s": round(trl_rate, 1),
                    "ratio": round(ours_rate / trl_rate, 2),
                }
            ),
            flush=True,
        )
