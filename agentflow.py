"""AgentFlow's Flow-GRPO: train the planner inside a planner/executor/verifier/generator loop.

Paper: "In-the-Flow Agentic System Optimization for Effective Planning and Tool Use",
Li et al. 2025, arXiv 2510.05592 ("official" below = the authors' released code).
NOT the image "Flow-GRPO" (Liu et al. 2025, arXiv 2505.05470), which turns a flow-matching ODE into
an SDE: that algorithm is flow_grpo.py. Same name, unrelated method.

An agentic system answers a query q with a toolset K and an evolving memory M. Each turn the planner
π_θ (the only trained module) reads (q, K, M^t) and emits a sub-goal and a tool; a frozen executor
turns them into a tool call and runs it; a frozen verifier says STOP or CONTINUE; a frozen generator
writes the final answer from M. One outcome reward R(τ) judges that answer. Flow-GRPO broadcasts it:
every planner turn of τ_i becomes an independent single-turn sample carrying the same
group-normalised advantage A_i, so a multi-turn problem is trained with single-turn GRPO updates
(the Flow-GRPO objective).

Equation map (paper → function):
    Eq. 2       the system: planner, executor and verifier turn by turn on (q, K, M), then the
                generator                                                → run_agent, Memory
    Eqs. 4, 7   A_i = (R_i − mean_G R) / std_G R, shared by every turn of τ_i
                                                                         → broadcast_advantages
    Eqs. 5–6    token-level clipped ratio in each planner output, − β·KL → flow_grpo_loss
    Thm. B.1    the broadcast objective = single-turn REINFORCE on each turn (the notebook checks
                its gradient numerically)
    tools       a model-written Python tool, isolated by the OS            → sandbox.python_tool

Deviations (numbered, on purpose):
    1. The loss is one token-mean over each optimiser step's mini-batch on each rank (the ranks'
       gradients then averaged): every planner token weighs alike, however the token budget packs
       it into micro-batches (`--micro-batch-tokens` bounds memory, not the loss). The paper writes
       (1/G)Σ_i (1/T_i)Σ_t (1/|a|)Σ_j; the original's verl 0.5.0 takes a token-mean per 4-row
       micro-batch (`ppo_micro_batch_size_per_gpu`, `train/config.yaml`), divides it by the
       accumulation count, 2 for the 8 rows a GPU's mini-batch holds (`dp_actor.py`), and averages
       over the GPUs: for a full mini-batch a mean of micro-batch means, in which a short turn's
       tokens weigh more when its micro-batch holds short turns (tests/test_agentflow.py computes
       both on uneven turns). The divisor stays 2 on a partial last mini-batch (deviation 7), so
       one of 4 rows or fewer on a GPU gets half its token-mean.
    2. The toy's modules are deterministic rules (`build_toy`); at full scale the query analyser,
       executor, verifier and generator are the base model with the LoRA adapter off (the paper's
       frozen modules, §4.1), which also writes the query analysis the planner reads. The
       original's released config runs its fixed planner, verifier and executor on gpt-4o-mini
       (`MODEL_ENGINE`, `train/config.yaml`).
    3. Toy answers are judged by exact match; the paper uses a GPT-4o judge. Full scale: a number
       must equal the answer's last number, a text answer must appear in it as whole words.
    4. Full-scale prompts are short paraphrases of the original ones (the planner sees the question,
       the query analysis, the tools, the memory and "step k of at most N", and writes `Sub-Goal:`
       and `Tool:`; the executor sees the question, the sub-goal and the memory; the verifier the
       question and the memory, as the paper's Eq. 2 writes V(v | q, e, M), where the original also
       passes it the query analysis); the tools are a sandboxed Python runner, TF-IDF retrieval
       over a local corpus and the base model, instead of web search, Wikipedia and a hosted coder.
    5. The full preset (table in docs/agentflow.md) trains a LoRA adapter (`--lora-rank` 64, so one
       GPU holds planner and frozen modules) at `--lr` 1e-5, 10× the rate at which the original
       trains every weight (1e-6, App. C.1; the LoRA/full ratio of "LoRA Without Regret",
       Schulman et al. 2025), and normalises over the G trajectories (`--group-norm trajectory`,
       the paper's) where the original code normalises over all turn rows.
    6. The planner starts from a supervised warm start on demonstrations of the plan's format
       (`warm_start`; the toy's tiny LM and the SmolLM2 preset; the full preset has none): the
       paper trains an instruction model that already writes it.
    7. Every turn row is trained. The original (`agentflow/verl/trainer.py`) drops the rows whose
       prompt exceeds 18 432 tokens (`data.max_prompt_length`), then floors the row count to a
       multiple of 8 (`ppo_mini_batch_size`) and of the GPU count, dropping the rest; each GPU then
       cuts its share into 8-row mini-batches, so its last one is partial unless the kept rows are
       a multiple of 64. Here the prompts stay bounded instead (each frozen module's output capped,
       memory fields cut at 500 characters), and ranks agree on a number of mini-batches (a rank
       short of rows takes empty ones), so no row has to go; a last mini-batch may be partial here
       too.
    8. Each rank shuffles its own turn rows (seeded by seed, step and rank) and cuts them into
       `--minibatch-rows`/N-row mini-batches. The original shuffles the whole batch once before
       it splits it over the GPUs (and verl's `balance_batch` then reorders it so each GPU gets
       about the same number of tokens). Kept so a rank trains the rows it rolled out: no
       variable-length rows move between processes.
    9. A non-finite gradient norm stops the run with one line (`common.check_finite`), where verl
       skips that optimiser step and goes on (`dp_actor.py`): in this code such a norm has meant a
       bug or a diverged run, which a skipped step would hide in the log.
    10. Each rollout batch draws its queries uniformly with replacement, for `--steps` 100 rollout
       batches (the full preset), evaluated every 25 (`--eval-every`) and after the last. The
       original (`train/config.yaml`) runs `total_epochs` 5 over a shuffled loader (verl's
       `RandomSampler`; ⌊rows/32⌋ batches a pass, a last partial one dropped) of its training
       file, NQ and DeepMath-103K together (about 180 k rows by `data/get_train_data.py`: some
       28 000 rollout batches), validating before the first batch and every 2nd (`test_freq` 2)
       on AIME24's 30 problems. Its length is weeks of one GPU at this preset's size; 100 batches
       are 3 200 queries, and 4 evaluations of a held-out file stand in for its ~14 000.
    11. Small ones: ε 1e-4 in the advantage's denominator, where verl's GRPO estimator adds 1e-6
       (`core_algos.py`); and no clamp of the policy's log-ratio before exp, where verl clamps it
       to ±20 (`core_algos.py`): a ratio that overflows gives a non-finite loss, which stops the
       run (deviation 9 and `common.check_finite`).

Toy (CPU, under a minute for both credit arms; docs/agentflow.md):
    python agentflow.py               # both credit arms on seed 0 (make demo's row)
    python agentflow.py --seeds 0-4   # five seeds, one table: held-out accuracy 0.600 → 0.884
                                      # (broadcast), 0.336 (final-turn), means (docs/agentflow.md)
Laptop (SmolLM2-135M-Instruct, bundled; the whole system, 27 min a seed on 2 cores):
    python agentflow.py --preset smollm2-lookup --seed S --no-ablation  # held-out 0.000 → 0.417
                                            # on seeds 0, 1, 3, 4 and 0.375 on seed 2; final-turn
                                            # credit as good (within one question on the
                                            # four runs measured; docs)
Full scale (one GPU):
    python agentflow.py --preset full --data train.jsonl --eval-data test.jsonl --corpus docs.jsonl
N GPUs (data-parallel, docs/full_scale.md):
    accelerate launch --num_processes N agentflow.py --preset full ...
Sample from the trained planner (full preset; a LoRA adapter on --model):
    python -m utils.sample runs/agentflow/planner "Question: ... Plan the next step."
"""

import copy
import dataclasses
import functools
import json
import random
from pathlib import Path

import torch

import common
from envs import agent_tools, agent_toy
from utils import cli, distributed, sweep, tracking

DATA = Path(__file__).parent / "envs" / "data"


# -------------------------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    preset: str = cli.arg("toy", "the preset these values start from (`--preset NAME` on the CLI)")
    model: str = cli.arg("", "planner: HF model id or path ('' = tiny toy LM)")
    data: str = cli.arg("", "JSONL of {question, answer} ('' = toy task)")
    eval_data: str = cli.arg("", "held-out JSONL of {question, answer}")
    corpus: str = cli.arg("", "JSONL of {text} for the retrieval tool (full)")
    steps: int = cli.arg(60, "rollout batches")
    queries_per_step: int = cli.arg(8, "B queries per batch (paper: 32)")
    group_size: int = cli.arg(8, "G rollouts per query (paper: 8)")
    inner_steps: int = cli.arg(2, "epochs over each batch (one optimiser step per mini-batch)")
    minibatch_rows: int = cli.arg(
        0,
        "turn rows per optimiser step over all ranks, shuffled (π_old fixed; 0 = the whole "
        "batch; original: 64)",
    )
    max_turns: int = cli.arg(3, "planner turns per rollout in training (paper: 3)")
    eval_max_turns: int = cli.arg(10, "planner turns at evaluation (paper: 10)")
    max_new_tokens: int = cli.arg(4, "planner output cap per turn")
    temperature: float = cli.arg(
        1.0, "rollout temperature (original code: 0.7; the paper's text: 0.5); eval is greedy"
    )
    clip_eps: float = cli.arg(0.2, "ε_low of the ratio clip (original code: 0.2)")
    clip_eps_high: float = cli.arg(0.3, "ε_high (original code: 0.3)")
    dual_clip: float = cli.arg(0.0, "cap the loss at c·|A| where A < 0 (0 = off; original: 3)")
    beta: float = cli.arg(0.001, "β of the k3 KL to the reference (paper: 0.001)")
    lr: float = cli.arg(1e-3, "planner learning rate (paper: 1e-6)")
    weight_decay: float = cli.arg(0.0, "AdamW weight decay (original code: 0.01)")
    credit: str = cli.arg(
        "broadcast",
        "broadcast: every turn carries A_i (Flow-GRPO); final-turn: only the last turn is trained",
        ["broadcast", "final-turn"],
    )
    group_norm: str = cli.arg(
        "trajectory",
        "trajectory: normalise over the G rewards (paper); "
        "turn-rows: over all turn rows (official code)",
        ["trajectory", "turn-rows"],
    )
    ablation: bool = cli.arg(True, "also train --credit final-turn from the same start")
    warm_start_demos: int = cli.arg(200, "training queries demonstrated in the warm start")
    warm_start_steps: int = cli.arg(
        400, "supervised steps of the planner's warm start (0 = none; the full preset: none)"
    )
    warm_start_lr: float = cli.arg(3e-3, "learning rate of the warm start")
    careless: float = cli.arg(
        0.7,
        "share of careless demonstrations in the warm start (toy: the second lookup repeats "
        "the first attribute; full scale: `generate` among each query's replies, the other "
        "tools once each)",
    )
    lora_rank: int = cli.arg(0, "LoRA rank (full scale: needed, frozen modules = adapter off)")
    micro_batch_tokens: int = cli.arg(
        4096,
        "tokens per forward pass (a prefix tree: each shared prefix once); gradients accumulate "
        "over micro-batches (bounds memory)",
    )
    gen_batch: int = cli.arg(256, "planner prompts per `generate` call")
    gen_tokens: int = cli.arg(
        0, "padded tokens per `generate` call: rows × (longest prompt + new tokens) (0: rows only)"
    )
    gradient_checkpointing: bool = cli.arg(
        False, "recompute activations in the backward pass (full preset: on)"
    )
    mixed_precision: str = cli.arg(
        "auto",
        "forward passes: bf16 autocast (bf16: on any device, a CPU too), auto: bf16 where "
        "the device multiplies it natively (a GPU, a CPU with AVX512-BF16 or AMX), fp32: none; "
        "weights stay fp32; the run's config states which ran",
        ["auto", "bf16", "fp32"],
    )
    timeout: int = cli.arg(1800, "seconds a collective waits for the other ranks")
    tool_timeout: float = cli.arg(10.0, "Python tool timeout in seconds")
    unsafe_python_tool: bool = cli.arg(
        False,
        "run the Python tool WITHOUT OS isolation where bubblewrap cannot isolate it "
        "(otherwise the tool is disabled there): model-written code then runs as you",
    )
    eval_every: int = cli.arg(20, "steps between held-out evaluations")
    seed: int = cli.arg(0, "random seed")
    seeds: str = cli.arg("", "seed sweep, e.g. 0-4: both credit arms per seed, one table")
    out_dir: str = cli.arg("runs/agentflow", "output folder")
    device: str = cli.arg(
        "auto",
        "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"],
    )
    quiet: bool = cli.arg(False, "no per-step lines or progress bar")
    report_to: str = cli.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = cli.arg(20, "steps between checkpoints (0 = never)")
    resume: bool = cli.arg(False, "continue each arm from its checkpoint.safetensors")
    overwrite: bool = cli.arg(
        False,
        "replace the run already in --out-dir (without it, or --resume, a folder holding a "
        "run is refused)",
    )


# The original recipe, each value beside the original one in docs/agentflow.md (DEVIATIONS 5, 10).
PRESETS = {
    "full": dict(
        model="Qwen/Qwen2.5-7B-Instruct",
        steps=100,
        queries_per_step=32,
        group_size=8,
        inner_steps=1,
        minibatch_rows=64,
        max_new_tokens=2048,
        temperature=0.7,
        lr=1e-5,
        weight_decay=0.01,
        dual_clip=3.0,
        lora_rank=64,
        ablation=False,
        eval_every=25,
        micro_batch_tokens=16384,
        gen_batch=64,
        gen_tokens=262144,
        gradient_checkpointing=True,
        warm_start_steps=0,
    ),
    # A real model on a laptop CPU (SmolLM2-135M-Instruct, bundled): who lives where and works as
    # what, for fictional people whose one-line records only the retrieval tool can find. The whole
    # system runs (frozen modules, sandboxed Python, TF-IDF); the planner first learns the format
    # from demonstrations (DEVIATION 6), every query shown with the same mix of replies (half
    # careless ones that ask `generate`) and all 32 in every step. β 0: the reference (adapter
    # off) never writes the plan's format, so a KL to it pulls out of it. G 8 (the paper's): with
    # G 4 every group of the first step was flat on 2 of 5 seeds (docs/agentflow.md).
    "smollm2-lookup": dict(
        model="smollm2",
        data=str(DATA / "people_train.jsonl"),
        eval_data=str(DATA / "people_test.jsonl"),
        corpus=str(DATA / "people_corpus.jsonl"),
        steps=8,
        queries_per_step=3,
        group_size=8,
        inner_steps=1,
        max_turns=2,
        eval_max_turns=2,
        max_new_tokens=24,
        temperature=0.7,
        lr=2e-4,
        beta=0.0,
        lora_rank=16,
        eval_every=1000,
        careless=0.5,
        warm_start_demos=8,
        warm_start_steps=30,
        warm_start_lr=1e-3,
        micro_batch_tokens=1024,
    ),
}


# ----------------------------------------- the math: Flow-GRPO's broadcast advantage and objective


def broadcast_advantages(rewards, turns, group_size, mode="trajectory", eps=1e-4):
    """Every turn of τ_i gets A_i; A_i = (R_i − mean_G R)/(std_G R + ε) over the query's G rollouts
    (Eqs. 4 and 7).

    rewards: (B·G,) trajectory rewards, a query's G rollouts contiguous; turns: planner turns per
    rollout. mode="turn-rows" is the official code's variant: mean and std over all turn rows of the
    group, so a trajectory with 3 turns counts 3 times. Returns the advantage of every turn row,
    flattened (Σ T_i,).
    """
    if mode == "trajectory":
        per_trajectory = common.group_advantages(rewards, group_size, eps=eps)  # Eq. 7
        # reward broadcast: A_i on every turn (Eq. 4)
        return per_trajectory.repeat_interleave(torch.as_tensor(turns))
    rows = []
    for g in range(0, len(rewards), group_size):
        reps = torch.as_tensor(turns[g : g + group_size])
        group_rows = rewards[g : g + group_size].float().repeat_interleave(reps)
        std = group_rows.std() if len(group_rows) > 1 else torch.tensor(0.0)
        flat = bool((group_rows == group_rows[0]).all())
        rows.append(
            torch.zeros_like(group_rows) if flat else (group_rows - group_rows.mean()) / (std + eps)
        )
    return torch.cat(rows)


@dataclasses.dataclass(frozen=True)
class Clip:
    """The surrogate's clips: ρ_t to [1 − low, 1 + high] (ε_low, ε_high), and the dual clip c
    (0 = off)."""

    low: float
    high: float
    dual: float = 0.0


def flow_grpo_loss(logp, old_logp, ref_logp, advantages, mask, token_count, *, clip, beta):
    """The paper's Flow-GRPO objective (Eqs. 5–6) as a loss, per planner token t of every
    turn-sample:
    L = Σ_t [−min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i) + β·KL_t] / N_tokens,  ρ_t = π_θ/π_old.

    A_i is the broadcast advantage of the turn's trajectory; KL_t is k3 to π_ref as verl's
    `low_var_kl` (log-ratio clamped to ±20, k3 to ±10; 0 when β = 0 skips π_ref); N_tokens counts
    the mini-batch's planner tokens (DEVIATION 1: token-mean), so micro-batches add up to the
    one-shot loss; `clip.dual` c > 0 caps the loss at c·|A| where A < 0 (verl's dual clip)."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    # the pessimistic branch of the clipped surrogate, capped by the dual clip
    pg_loss = common.dual_clip(torch.maximum(pg_loss1, pg_loss2), advantages[:, None], clip.dual)
    kl = torch.zeros_like(logp)  # β = 0: π_ref is not scored
    if ref_logp is not None:
        kl = common.kl_penalty(logp, ref_logp, "k3", limit=10.0, log_ratio_limit=20.0)  # verl's
    loss = ((pg_loss + beta * kl) * mask).sum() / token_count  # Eqs. 5-6
    stats = {
        "clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask).item(),
        "kl": common.masked_mean(kl, mask).item(),
        "ratio_dev": ((ratio.detach() - 1) * mask).abs().max().item(),
    }
    return loss, stats


def turn_minibatches(num_rows, step, args, accelerator):
    """This rank's turn rows in a random order (from (--seed, step, rank)), cut into mini-batches of
    --minibatch-rows / N rows (0: one mini-batch) as the original code cuts its shuffled batch, so a
    step takes about Σ T_i / 64 optimiser steps. Every rank takes the same number (one all-reduce of
    the max): a rank that runs out takes empty mini-batches, which add zero gradient to the ranks'
    mean."""
    rows_per_rank = max(1, args.minibatch_rows // accelerator.num_processes or num_rows)
    my_count = -(-num_rows // rows_per_rank)  # ⌈rows / rows per mini-batch⌉
    count = distributed.max_over_ranks(my_count, accelerator)
    order_seed = distributed.sampling_seed(args.seed, step, accelerator.process_index)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(order_seed)).tolist()
    return [order[m * rows_per_rank : (m + 1) * rows_per_rank] for m in range(count)]


# ------------------------------------------------------- the agentic system: memory M and the loop


@dataclasses.dataclass
class Memory:
    """M: the ordered record of (step, tool, sub-goal, command, result) the modules read each
    turn."""

    entries: list = dataclasses.field(default_factory=list)

    def add(self, tool, subgoal, command, result, ok):
        self.entries.append(
            {
                "step": len(self.entries) + 1,
                "tool": tool,
                "subgoal": subgoal,
                "command": command,
                "result": result,
                "ok": ok,
            }
        )


def run_agent(queries, system, max_turns):
    """One rollout per query: analyse the query, then plan → execute → verify until STOP or
    `max_turns`, then generate (AgentFlow's system).

    `system` holds the modules (ToySystem or ToolSystem), each at the system's temperatures. All
    rollouts advance together (one batched planner call per turn, `system.plan`); each trajectory
    keeps its planner turns, with the sampler's log-probs, for training.
    """
    memories = [Memory() for _ in queries]
    trajectories = [{"query": q, "turns": [], "verdicts": []} for q in queries]
    active, analyses = list(range(len(queries))), system.analyse(queries)
    for turn in range(max_turns):
        if not active:
            break
        prompts = [
            system.planner_prompt(queries[i], memories[i], analyses[i], turn + 1, max_turns)
            for i in active
        ]
        outputs = system.plan(prompts)
        calls = []
        for i, prompt, (text, ids, logp) in zip(active, prompts, outputs):
            trajectories[i]["turns"].append(
                {"prompt": prompt, "ids": ids, "sampler_logp": logp, "text": text}
            )
            try:
                tool, subgoal = system.parse_plan(text)
                calls.append((i, tool, subgoal))
            except ValueError as err:  # a malformed plan is an observation, never a crash
                memories[i].add("none", text.strip(), "", f"error: {err}", ok=False)
        asked = [(queries[i], tool, subgoal, memories[i]) for i, tool, subgoal in calls]
        executed = system.execute(asked) if asked else []
        for (i, tool, subgoal), (command, result, ok) in zip(calls, executed):
            memories[i].add(tool, subgoal, command, result, ok)
        stops = system.verify([(queries[i], memories[i]) for i in active])
        for i, stop in zip(active, stops):
            trajectories[i]["verdicts"].append("STOP" if stop else "CONTINUE")
        active = [i for i, stop in zip(active, stops) if not stop]
    answers = system.generate([(q, m) for q, m in zip(queries, memories)])
    for trajectory, memory, answer in zip(trajectories, memories, answers):
        trajectory |= {
            "memory": memory,
            "answer": answer,
            "reward": float(system.judge(trajectory["query"], answer)),
        }
    return trajectories


# ---------------------------------------------------------------------------------------- rollouts


WARM_START_BATCH = 32  # (prompt, completion) pairs per warm-start step


def warm_start(system, demos, args):
    """Supervised warm start on demonstrations (DEVIATION 6): the planner learns the plan's format,
    and the careless demonstrator's habit (`system.demonstrations`), so RL has something to fix."""
    tokenizer, planner = system.tokenizer, system.planner
    pairs = system.demonstrations(
        demos, random.Random(args.seed), args.careless, Memory, args.max_turns
    )
    gen = torch.Generator().manual_seed(args.seed)
    packing = common.Scoring(tokenizer, args.micro_batch_tokens, planner.device)  # not scored
    optimizer = torch.optim.AdamW(
        [p for p in planner.parameters() if p.requires_grad], lr=args.warm_start_lr
    )
    planner.train()
    for _ in range(args.warm_start_steps):
        # every pair where they fit one batch (the start then depends on no draw), else a draw
        rows = range(len(pairs))
        if len(pairs) > WARM_START_BATCH:
            rows = torch.randint(len(pairs), (WARM_START_BATCH,), generator=gen).tolist()
        batch = [pairs[k] for k in rows]
        prompts = [p for p, _ in batch]
        completions = [tokenizer(c, add_special_tokens=False)["input_ids"] for _, c in batch]
        token_count = sum(map(len, completions))
        optimizer.zero_grad()
        # the batch's token-mean NLL, accumulated over --micro-batch-tokens micro-batches
        for mb in common.scored_micro_batches(
            prompts, completions, sampler_logps=None, scoring=packing
        ):
            logp = common.micro_batch_logprobs(planner, mb)
            (-(logp * mb.mask).sum() / token_count).backward()
        optimizer.step()


def evaluate(system, queries, args, accelerator=None):
    """Greedy rollouts with the evaluation turn cap → ({accuracy, mean turns, tool error rate},
    this rank's rollouts). Sharded over the accelerator's ranks (none: one process): each rolls out
    every N-th query and the numbers are gathered, so none waits in a collective meanwhile."""
    from accelerate.utils import gather_object

    world, rank = (accelerator.num_processes, accelerator.process_index) if accelerator else (1, 0)
    mine = queries[rank::world]  # empty on a rank past the last query
    trajectories = []
    if mine:
        # every module greedy at evaluation (the original's)
        trajectories = run_agent(mine, system.sampling(0.0), args.eval_max_turns)
    my_numbers = [
        (t["reward"], len(t["turns"]), [e["ok"] for e in t["memory"].entries]) for t in trajectories
    ]
    numbers = gather_object(my_numbers) if world > 1 else my_numbers
    oks = [ok for _, _, entry_oks in numbers for ok in entry_oks]
    return {
        "accuracy": sum(r for r, _, _ in numbers) / len(numbers),
        "mean_turns": sum(turns for _, turns, _ in numbers) / len(numbers),
        "tool_error_rate": oks.count(False) / max(1, len(oks)),
    }, trajectories


# ---------------------------------------------------------------------------------------- training


def validate(args):
    """One line per bad flag (cli.check_args: every number's range, then these), before any model
    is built."""
    cli.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (args.max_turns >= 1, f"--max-turns must be ≥ 1 (got {args.max_turns})"),
            (
                args.temperature > 0,
                "--temperature must be > 0 for training rollouts (evaluation is greedy)",
            ),
            (
                bool(args.model) == bool(args.data),
                "--preset full (or --model) needs --data FILE.jsonl; with neither it is the toy",
            ),
            (
                not args.model or args.lora_rank > 0,
                "--model needs --lora-rank > 0: the frozen modules are the adapter-off model",
            ),
        ],
        args,
    )


def train_arm(args, system, out_dir, accelerator, keep=None):
    """Flow-GRPO on the planner (the Flow-GRPO objective): G rollouts per query → broadcast A_i →
    every planner turn a single-turn sample → token-level clipped loss + β·KL. With N processes each
    rank rolls out its block of queries with its own noise and the gradients are averaged once per
    optimiser step. `args.credit` says which turns are trained; `keep` (JSON-able) is saved with
    every checkpoint. Returns the Run, whose records end with the held-out evaluation of the
    trained planner (eval_*, on the last step), and this rank's rollouts of the last evaluation it
    ran (none in a run resumed after its last step)."""
    tokenizer, planner = system.tokenizer, system.planner
    device = planner.device
    reference = None if args.lora_rank else copy.deepcopy(planner).eval().requires_grad_(False)
    params = [p for p in planner.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    autocast = common.training_autocast(device, args.mixed_precision)
    gen = torch.Generator().manual_seed(args.seed)
    mine = distributed.local_groups(args.queries_per_step, accelerator)
    # a training rollout (Eq. 2): the planner samples at T, and the frozen modules as it does
    rollout = functools.partial(
        run_agent, system=system.sampling(args.temperature), max_turns=args.max_turns
    )
    # π_old (where samples are reused) and π_ref scored once per rollout batch
    scoring = common.Scoring(
        tokenizer,
        args.micro_batch_tokens,
        device,
        model=planner,
        reference=reference,
        temperature=args.temperature,
        precision=args.mixed_precision,
        with_reference=bool(args.beta),  # π_ref only where the loss reads it
    )
    clip = Clip(low=args.clip_eps, high=args.clip_eps_high, dual=args.dual_clip)
    surrogate = functools.partial(flow_grpo_loss, clip=clip, beta=args.beta)  # Eqs. 5-6
    # TRY NOT TO MODIFY: the logger, and checkpoints of weights, optimiser, RNGs, metrics so far
    run = tracking.Run(
        out_dir,
        args,
        desc=f"agentflow ({args.credit})",
        total_steps=args.steps,
        modules={"planner": planner},
        optimizers={"optimizer": optimizer},
        generators={"rollouts": gen},
        main_process=accelerator.is_main_process,
    )
    start, extra = run.resume()
    num_queries = len(system.train)
    phases = tracking.Phases()  # each phase's seconds, logged (the benchmarks read them)
    evaluated = []
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. G rollouts of the whole system per query (this rank's queries), of different lengths:
        #    the planner, executor, verifier and generator in turn (Eq. 2)
        drawn = torch.randint(num_queries, (args.queries_per_step,), generator=gen)
        picked = drawn[mine.start : mine.stop].tolist()  # this rank's queries
        queries = [system.train[i] for i in picked for _ in range(args.group_size)]
        distributed.seed_rank_noise(args.seed, step, accelerator)
        with phases.time("rollout"):
            trajectories = rollout(queries)

        # 2. one outcome reward R(τ_i) per rollout, broadcast as A_i to every planner turn of τ_i
        #    (Eqs. 4 and 7)
        rewards = torch.tensor([t["reward"] for t in trajectories])
        turns = [len(t["turns"]) for t in trajectories]
        turn_advantages = broadcast_advantages(
            rewards, turns, args.group_size, mode=args.group_norm
        )  # (Σ T_i,)
        planner_turns = [turn for t in trajectories for turn in t["turns"]]
        every_turn = list(zip(planner_turns, turn_advantages.tolist()))  # (turn, A_i) pairs
        trained_turns = every_turn
        if args.credit == "final-turn":  # the ablation: only each trajectory's last planner turn
            last_turns = torch.tensor(turns).cumsum(0) - 1
            trained_turns = [every_turn[k] for k in last_turns.tolist()]

        # 3. the turn rows shuffled and cut into mini-batches of --minibatch-rows, each in
        #    token-bounded micro-batches; π_old = the trainer's own no-grad forward before any
        #    update, π_ref once
        prompts = [turn["prompt"] for turn, _ in trained_turns]
        completions = [turn["ids"] for turn, _ in trained_turns]
        sampler_logps = [turn["sampler_logp"] for turn, _ in trained_turns]
        advantages = torch.tensor([a for _, a in trained_turns], device=device)  # (turn-samples,)
        planner.train()
        minibatch_indices = turn_minibatches(len(trained_turns), step, args, accelerator)
        reused = args.inner_steps > 1 or len(minibatch_indices) > 1
        with phases.time("prepare"):
            minibatches = [
                common.scored_micro_batches(
                    prompts,
                    completions,
                    sampler_logps=sampler_logps,
                    scoring=scoring,
                    rows=rows,
                    with_old=reused,
                )
                for rows in minibatch_indices
            ]

        # 4. inner_steps epochs of one optimiser step per mini-batch (the same count on every rank),
        #    gradients accumulated over its micro-batches: the Flow-GRPO objective (Eqs. 5-6)
        schedule = [minibatch for _ in range(args.inner_steps) for minibatch in minibatches]
        metrics = tracking.StepMetrics(num_updates=len(schedule))  # every update, micro-batch
        with phases.time("update"):
            for update, minibatch in enumerate(schedule):
                optimizer.zero_grad()
                token_count = max(1, sum(int(mb.mask.sum()) for mb in minibatch))
                for mb in minibatch:
                    with autocast:
                        logp = common.micro_batch_logprobs(planner, mb, args.temperature)  # (B, W)
                    old_logp = common.old_logprobs(mb, logp)  # π_θ before the first update
                    loss, stats = surrogate(
                        logp, old_logp, mb.ref_logp, advantages[mb.rows], mb.mask, token_count
                    )
                    common.check_finite(loss, step)
                    loss.backward()
                    gap = common.sampler_gap(mb, old_logp)
                    metrics.add(len(mb.rows), loss.item(), update=update, sampler_gap=gap, **stats)
                distributed.average_gradients(params, accelerator)  # the update's one collective
                grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                common.check_finite(grad_norm, step, "gradient norm")
                optimizer.step()

        # TRY NOT TO MODIFY: log (rewards: the whole step's, the rest rank 0's), evaluate, save
        all_rewards = accelerator.gather(rewards.float().to(device)).cpu()  # every rank's
        record = metrics.record(all_rewards, args.group_size, grad_norm, phases)
        record |= {"turn_samples": len(trained_turns), "mean_turns": sum(turns) / len(turns)}
        if system.test and (step % args.eval_every == 0 or step == args.steps):
            evaluation, evaluated = evaluate(system, system.test, args, accelerator)
            record |= {f"eval_{k}": v for k, v in evaluation.items()}
        run.log(step, record, keep)
    return run, evaluated


def train(args):
    """Warm start (toy) → evaluate → Flow-GRPO → evaluate; on the toy, the final-turn-credit
    ablation too."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = distributed.setup_accelerator(args.device, args.timeout)
    tracking.check_out_dir(args.out_dir, args, accelerator)
    if args.model:  # the base model's modules on --data, the planner with a LoRA adapter
        system = agent_tools.build_full(args, device)
    else:  # the toy's rule-based modules and a tiny planner
        system = agent_toy.build_toy(args, device)
    if args.warm_start_steps:  # DEVIATION 6: the planner first learns the plan's format
        warm_start(system, system.train[: args.warm_start_demos], args)
    out_dir = Path(args.out_dir)
    initial_state = copy.deepcopy(system.planner.state_dict()) if args.ablation else None
    test = system.test  # every rank evaluates its share; rank 0 writes
    checkpoint = out_dir / "checkpoint.safetensors"
    resumed = args.resume and checkpoint.exists()
    saved = tracking.checkpoint_state(checkpoint)["extra"] if resumed else {}
    if "before" in saved:  # a resumed run: its start was evaluated before its checkpoint
        before, before_text = saved["before"], saved["before_text"]
    else:
        before, before_rollouts = evaluate(system, test, args, accelerator) if test else ({}, [])
        before_text = agent_tools.format_rollout(before_rollouts[0]) if before_rollouts else ""
    run, evaluated = train_arm(
        args, system, out_dir, accelerator, keep={"before": before, "before_text": before_text}
    )
    after = tracking.latest(run.records, "eval_")  # the last step evaluated the trained planner
    summary = (
        {f"{k}_before": v for k, v in before.items()}
        | {f"{k}_after": v for k, v in after.items()}
        | {
            "accuracy_before": before.get("accuracy"),
            "accuracy_after": after.get("accuracy"),
            "mean_turns": after.get("mean_turns"),
            "tool_error_rate": after.get("tool_error_rate"),
            "credit": args.credit,
            "sampler_logprob_max_dev": tracking.largest(run.records, "sampler_gap"),
            # the start: the warm-started planner's sampled success in step 1, and its share of
            # flat groups (1.0: nothing to learn from)
            "start_reward": run.records[0]["reward"] if run.records else None,
            "start_zero_var_frac": run.records[0]["zero_var_frac"] if run.records else None,
        }
    )
    if test:  # the row of `make demo`'s table, and one rollout before and after
        summary["claim"] = {
            "text": "AgentFlow planner: held-out accuracy goes up",
            "before": before["accuracy"],
            "after": after["accuracy"],
        }
        if accelerator.is_main_process:  # the first query's greedy rollout (rank 0 evaluates it)
            after_rollout = (evaluated or evaluate(system, test[:1], args)[1])[0]
            shown = "\n".join(
                [
                    "before training:",
                    before_text,
                    "after training:",
                    agent_tools.format_rollout(after_rollout),
                ]
            )
            (out_dir / "rollouts.txt").write_text(shown + "\n")
            if not args.quiet:
                print(shown)
    if args.model and accelerator.is_main_process:
        system.planner.save_pretrained(out_dir / "planner")  # the LoRA adapter
        system.tokenizer.save_pretrained(out_dir / "planner")
    if args.ablation and system.test:
        other = "final-turn" if args.credit == "broadcast" else "broadcast"
        system.planner.load_state_dict(initial_state)
        common.seed_everything(args.seed)
        ablation_args = dataclasses.replace(args, credit=other, quiet=True)
        ablation, _ = train_arm(ablation_args, system, out_dir / other, accelerator)
        ablated = tracking.latest(ablation.records, "eval_")
        ablation.finish({f"{k}_after": v for k, v in ablated.items()})
        summary[f"accuracy_{other.replace('-', '_')}_credit"] = ablated["accuracy"]
        if accelerator.is_main_process:
            agent_toy.plot_accuracy_comparison(
                before["accuracy"],
                run.records,
                ablation.records,
                name=args.credit,
                other=other,
                path=out_dir / "credit.png",
            )
    return run.finish(
        summary,
        [
            ("accuracy.png", ["eval_accuracy", "reward"], "agentflow: accuracy"),
            (
                "turns.png",
                ["mean_turns", "eval_mean_turns"],
                "agentflow: planner turns per rollout",
            ),
        ],
    )


if __name__ == "__main__":
    args = cli.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(
            train, args, [("", {})], agent_toy.sweep_row, agent_toy.claim_holds, sweep_dir
        )
    else:
        summary = train(args)
        if distributed.is_rank_zero():  # one final JSON, not one per rank
            print(json.dumps(summary, indent=2))
    distributed.leave_process_group()
