"""One GRPO step of flowrl.py's own training loop vs TRL's `GRPOTrainer`, at equal shapes, and both
against a plain step.

    python -m venv .venv-bench && .venv-bench/bin/pip install -r benchmarks/requirements.txt
    .venv-bench/bin/python benchmarks/bench_vs_trl.py          # or: make bench-trl

Ours is `flowrl.train` itself (`--preset smollm2-addition --algo grpo`: 4 one-digit addition prompts
× G 8 through the chat template, 12 new tokens, one optimiser step per batch, so π_old is the
update's own log-probs), timed by the per-phase seconds it logs in metrics.jsonl: rollout (the
sampler with per-row seeds and log-probs), prepare (rewards, packing, advantages), update (forward,
backward, AdamW). On every side the first WARMUP steps are not timed (the allocator and the kernels
warm up). TRL gets the same model, tokenizer, four prompts, G, completion length, reward, learning
rate and β = 0; its split comes from its own profiling contexts. The plain step is `generate` alone
plus one forward and backward and one AdamW step alone on the same padded batch, every row computing
its prompt: what a step costs when nothing shares a group's prompt (ours computes it once per group,
in sampling and in the update).

Model: the real SmolLM2-135M-Instruct (bundled), or any HF folder whose vocabulary covers the
prompts (`python benchmarks/bench_vs_trl.py PATH`; the tests pass a tiny random one).
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
from utils import cli, models  # noqa: E402

LR = 1e-5
WARMUP = 2  # untimed steps first, on every side


def case(model="smollm2", steps=4):
    """The preset's args (`steps` timed steps after WARMUP), and its task: prompts and reward."""
    out_dir = tempfile.mkdtemp(prefix="bench_vs_trl_")
    args = cli.parse_args(
        flowrl.Args,
        flowrl.PRESETS,
        [
            "--preset",
            "smollm2-addition",
            "--algo",
            "grpo",
            "--model",
            model,
            "--lr",
            str(LR),
            "--steps",
            str(steps + WARMUP),
            "--eval-every",
            "1000",
            "--save-every",
            "0",
            "--device",
            "cpu",
            "--quiet",
            "--out-dir",
            out_dir,
        ],
    )
    tokenizer, model, task = flowrl_tasks.build_laptop(args, torch.device("cpu"))
    prompts = task.prompts[: args.prompts_per_step]
    return dict(
        args=args, steps=steps, tokenizer=tokenizer, model=model, task=task, prompts=prompts
    )


def ours(bench):
    """Seconds per step of flowrl.train's own loop, from the phase times it logs."""
    args = bench["args"]
    flowrl.train(args)
    lines = (Path(args.out_dir) / "metrics.jsonl").read_text().splitlines()
    timed = [json.loads(line) for line in lines][WARMUP:]
    phases = {"generation": "time_rollout", "scoring": "time_prepare", "update": "time_update"}
    return {name: sum(r[key] for r in timed) / len(timed) for name, key in phases.items()}


def plain_step(bench):
    """`generate` alone (no logits processor, no decoding) plus one forward and backward and one
    AdamW step alone, on the same prompts, padded, and completion length: a step that computes
    each row's prompt itself."""
    args, tokenizer = bench["args"], bench["tokenizer"]
    _, model = models.load_causal_lm(args.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=args.weight_decay)
    prompts = [p for p in bench["prompts"] for _ in range(args.group_size)]
    config = common.generation_config(model, tokenizer, args.max_new_tokens, 1.0)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    times = defaultdict(float)
    for step in range(bench["steps"] + WARMUP):
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(**enc, generation_config=config)
        t1 = time.perf_counter()
        new = seq[:, enc["input_ids"].shape[1] :]
        attn = torch.cat([enc["attention_mask"], torch.ones_like(new)], 1)
        model.train()
        t2 = time.perf_counter()
        logp = common.completion_logprobs(model, seq, attn, new.shape[1])
        logp.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if step >= WARMUP:
            times["generate"] += (t1 - t0) / bench["steps"]
            times["forward_backward_adamw"] += (t3 - t2) / bench["steps"]
    return dict(times)


def trl(bench):
    """Seconds per step of TRL's GRPOTrainer, split from its profiling contexts where this TRL
    version names them (generation = `transformers.generate`, scoring = the rest of
    `_prepare_inputs`, update = the rest of the step), else the step alone."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    args, task, steps = bench["args"], bench["task"], bench["steps"]
    _, model = models.load_causal_lm(args.model, torch.device("cpu"))
    index = {prompt: i for i, prompt in enumerate(task.prompts)}
    stamps, phases = [], defaultdict(list)

    def reward(prompts, completions, **kwargs):
        return [task.reward(index[p], text) for p, text in zip(prompts, completions)]

    def record(context, duration):
        phases[context.name].append(duration)

    profiling.ProfilingContext._log_metrics = record

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(bench["prompts"]) * args.group_size,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            max_steps=steps + WARMUP,
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
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": bench["prompts"] * (steps + WARMUP)}),
            processing_class=bench["tokenizer"],
            callbacks=[Clock()],
        )
        trainer.train()
    step = (stamps[-1] - stamps[WARMUP - 1]) / steps
    if "transformers.generate" not in phases:
        return {"step": step}
    mean = lambda name: sum(phases[name][WARMUP:]) / steps
    generation = mean("transformers.generate")
    scoring = mean("_prepare_inputs") - generation
    return {"generation": generation, "scoring": scoring, "update": step - generation - scoring}


def compare(bench, with_trl=True):
    """Ours, the plain step and (with_trl) TRL, as seconds per step and their ratios."""
    mine, plain = ours(bench), plain_step(bench)
    total = lambda split: sum(split.values())
    result = {
        "samples_per_step": len(bench["prompts"]) * bench["args"].group_size,
        "ours_s": {k: round(v, 3) for k, v in mine.items()},
        "plain_s": {k: round(v, 3) for k, v in plain.items()},
        "ours_over_plain": round(total(mine) / total(plain), 3),
    }
    if with_trl:
        theirs = trl(bench)
        result |= {
            "trl_s": {k: round(v, 3) for k, v in theirs.items()},
            "trl_over_ours": round(total(theirs) / total(mine), 2),
            "trl_over_plain": round(total(theirs) / total(plain), 3),
        }
    return result


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(compare(case(*sys.argv[1:2]))), flush=True)
