"""RC-GRPO: reward-conditioned fine-tuning, then GRPO with sampled reward tokens (tool calling).

Paper: "RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool
Calling Agents", Zhong et al. 2026, arXiv 2602.03025 (no official code). Environment: the real
BFCL v4 multi-turn data and backends from the `bfcl-eval` package, executed without eval/exec.

After SFT on expert demonstrations a policy is peaked: a task's G rollouts all succeed or all fail,
the group's reward std is 0, A = 0, and GRPO stops learning ("paradox of perfection", RC-GRPO, Prop.
4.2). RC-GRPO first fine-tunes on expert *and* failed trajectories, each tagged in the first user
message with `[Reward Goal: <|high_reward|>]` or `<|low_reward|>` (RCTP-FT). Then each GRPO rollout
draws its own token (P(high) = p): the low-token rollouts behave differently, so groups keep their
variance (RC-GRPO stage 2, Prop. 4.3: E[σ_g²] ≥ ((G−1)/G)·p(1−p)·ε²). Inference uses the high token.

Equation map (paper → function):
    stage 1  RCTP data: expert (high) + failures (low), 1:1, the token at the end of the first
             user message                                               → build_rctp_data,
                                                                          reward_goal
    stage 1  max-likelihood of the assistant tokens only                → supervised_finetune
    stage 2  r_j ~ Bernoulli(p) i.i.d. per rollout (Eq. 3)             → sample_reward_tokens
    stage 2  a_t ~ π_θ(·|h_t, r_j): r_j's goal text in the rollout's prompt → reward_goal, grpo_arm
    stage 2  one group per task across tokens                           → common.group_advantages
    stage 2  −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·KL (k3), per token       → rc_grpo_loss
    reward   R = R_state · R_action (Sec. 3.3)                          → bfcl.trajectory_reward
    Prop 4.2 the paradox of perfection: a peaked policy's groups are flat
                                                                → common.zero_variance_fraction
    Prop 4.3 E[σ_g²] ≥ ((G−1)/G)·p(1−p)·ε², the variance the tokens keep (checked in
             the notebook and in tests/test_rc_grpo.py by simulation)
    BFCL     the official checker's semantics (per-turn state + results) → bfcl.bfcl_check
    BFCL     calls parsed with ast, literal arguments only        → bfcl.parse_calls, bfcl.BFCLEnv

Deviations (numbered, on purpose):
    1. Model output is never eval'd (the official harness does): `parse_calls` accepts only
       `[f(literal, k=literal), ...]` and `BFCLEnv` dispatches to public methods of fresh instances.
    2. Train/test split by id (`id % 10 == 9` → test, 20 per category = 80); the paper's
       per-category counts (18/23/17/22) come from a split it does not publish.
    3. Each assistant step is trained as its own (history → step) sample (the same tokens a
       whole-dialogue pass with an assistant mask would score), so rollouts and training batches
       share one padding path. Failures for RCTP-FT are replayed from their parsed calls
       (unparseable steps are dropped).
    4. π_ref is the stage-1 model, as the paper: a frozen copy on the toy; with LoRA the stage-1
       adapter stays, frozen, and stage 2 trains a second adapter on top, so the stage-1 adapter
       alone is π_ref (one arm per LoRA run). Nothing is merged into a bf16 base in training; the
       saved policy merges both adapters into fp32 weights.
    5. BFCL's harness semantics: an output that decodes to no call (`[]`, plain text, a failed
       parse) ends the user turn; more than `--max-steps` steps in one turn abandons the entry
       (BFCL: 20). Backend calls get a time limit (`BFCLEnv.execute`), and what the model reads
       of their results a length cap (deviation 9).
    6. Laptop knobs, off by default: `--docs needed` shows only the functions the ground truth calls
       and `--max-turns N` keeps the first N turns (BFCL's prompts are ~3k–7.5k tokens with all
       docs); the laptop preset writes a shorter paraphrase of bfcl-eval's system prompt
       (`--system-prompt short`; the bfcl preset sends bfcl-eval's system prompt).
    7. Rollouts follow BFCL's own turn-by-turn protocol (a user turn ends when the model makes no
       call), not the paper's merged prompt with a `done()` tool, so the scores are BFCL's. Accuracy
       is taken as the mean of R, an assumption (the paper's text does not define it); the
       official checker's is reported beside it.
    8. The bfcl preset (table in docs/rc_grpo.md) trains LoRA adapters (`--lora-rank` 64, one GPU
       holds policy and reference; the paper does not say whether it used LoRA) at 10× the paper's
       learning rates (`--lr` 1e-5, `--sft-lr` 1e-4; the LoRA/full ratio of "LoRA Without Regret",
       Schulman et al. 2025), on `--tasks-per-step` 16 tasks for `--steps` 100 (paper: batch 256,
       400 epochs), a size one GPU rolls out in hours. All arms share one batch, where the paper's
       GRPO baseline used 64. `--max-prompt-tokens` (a project limit, not BFCL's) abandons a
       dialogue whose prompt outgrows it and scores it as it stands.
    9. A step's tool results reach the model as one `tool` message, the results joined by
       newlines, each cut at 4 000 characters and the whole at 2 000 at full scale
       (`bfcl.observation`, `ChatFormat.observation`); the checker compares them whole. bfcl-eval's
       harness sends one `tool` message per call, each whole (`base_oss_handler.py`). This weighs
       most on long_context, a quarter of the test split, whose results run long: the model reads
       their first 2 000 characters where the harness shows all of them.

Toy (CPU, about 2–4 minutes for the four arms; docs/rc_grpo.md):
    python rc_grpo.py     # zero-variance fraction 0.881 (SFT+GRPO) vs 0.433 (RCTP+RC-GRPO),
                          # held-out accuracy 0.894 vs 0.862 (means over seeds 0-4, one thread)
    python rc_grpo.py --seeds 0-4                  # Table 1's four arms on five seeds, one table
    python rc_grpo.py --seeds 0-4 --sft-epochs 5   # the equal-epochs control
Laptop (SmolLM2-135M-Instruct, bundled; 19 BFCL entries, both arms; 6-9 min a seed on 2 cores):
    python rc_grpo.py --preset smollm2-bfcl --seeds 0-1   # fewer flat groups, accuracy tied
Full scale (one GPU, BFCL v4):   python rc_grpo.py --preset bfcl
N GPUs (data-parallel, docs/full_scale.md):
    accelerate launch --num_processes N rc_grpo.py --preset bfcl
Sample from a trained arm (bfcl preset; a LoRA adapter on --model):
    python -m utils.sample runs/rc_grpo/rctp+rc-grpo/policy "List the files here."
"""

import collections
import copy
import dataclasses
import functools
import json
import random
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

import common
from envs import bfcl, bfcl_toy
from utils import cli, distributed, models, sweep, tracking

# -------------------------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    preset: str = cli.arg("toy", "the preset these values start from (`--preset NAME` on the CLI)")
    model: str = cli.arg("", "HF model id or path ('' = tiny toy LM)")
    arms: str = cli.arg(
        "sft+grpo,sft+rc-grpo,rctp+grpo,rctp+rc-grpo",
        "comma-separated arms: {sft|rctp}+{grpo|rc-grpo} (Table 1)",
    )
    steps: int = cli.arg(40, "GRPO steps per arm")
    tasks_per_step: int = cli.arg(8, "tasks per GRPO batch")
    group_size: int = cli.arg(5, "G rollouts per task (paper: 5)")
    p_high: float = cli.arg(
        0.5, "p = P(<|high_reward|>) per rollout (paper: 0.5; 1: GRPO under the high token)"
    )
    lr: float = cli.arg(1e-3, "GRPO learning rate (paper: 1e-6)")
    beta: float = cli.arg(0.1, "β of the k3 KL to the reference (paper: 0.1)")
    clip_eps: float = cli.arg(0.2, "ratio clip ε (paper: 0.2)")
    sft_lr: float = cli.arg(3e-3, "stage-1 learning rate (paper: 1e-5)")
    sft_epochs: int = cli.arg(2, "SFT baseline epochs (paper: 2)")
    rctp_epochs: int = cli.arg(5, "RCTP-FT epochs (paper: 5)")
    sft_batch: int = cli.arg(
        16, "stage-1 batch: trajectories at full scale (paper: 16), single steps on the toy"
    )
    failure_rollouts: int = cli.arg(4, "base-model rollouts per train task to find failures")
    max_steps: int = cli.arg(6, "model steps per user turn (BFCL: 20)")
    max_prompt_tokens: int = cli.arg(
        18000, "a dialogue whose prompt grows past this is abandoned and scored as it stands"
    )
    max_new_tokens: int = cli.arg(10, "tokens per model step")
    temperature: float = cli.arg(1.0, "rollout temperature; evaluation is greedy")
    max_tasks: int = cli.arg(
        0, "use N train and N test tasks, taken round-robin over the categories (0 = all)"
    )
    tasks: str = cli.arg("", "comma-separated entry ids to use (train and test)")
    max_turns: int = cli.arg(
        0, "keep only the first N user turns of each entry (0 = all; a laptop knob)"
    )
    docs: str = cli.arg(
        "all",
        "all: every function of the involved classes (BFCL); needed: only those the ground "
        "truth calls (shorter prompts, a laptop knob)",
        ["all", "needed"],
    )
    toy_tasks: int = cli.arg(240, "toy: training tasks")
    toy_test_tasks: int = cli.arg(200, "toy: held-out tasks")
    rare_share: float = cli.arg(0.15, "toy: share of tasks whose file is not in `docs`")
    lora_rank: int = cli.arg(0, "LoRA rank via peft (0 = full fine-tune)")
    micro_batch_tokens: int = cli.arg(
        4096,
        "tokens per forward pass (a prefix tree: each shared prefix once); gradients accumulate "
        "over micro-batches",
    )
    gen_batch: int = cli.arg(64, "rollouts per `generate` call")
    gen_tokens: int = cli.arg(
        0, "padded tokens per `generate` call: rows × (longest prompt + new tokens) (0: rows only)"
    )
    gradient_checkpointing: bool = cli.arg(
        False, "recompute activations in the backward pass (bfcl preset: on)"
    )
    mixed_precision: str = cli.arg(
        "auto",
        "forward passes: bf16 autocast (bf16: on any device, a CPU too), auto: bf16 where "
        "the device multiplies it natively (a GPU, a CPU with AVX512-BF16 or AMX), fp32: none; "
        "weights stay fp32; the run's config states which ran",
        ["auto", "bf16", "fp32"],
    )
    seed: int = cli.arg(0, "random seed")
    seeds: str = cli.arg("", "seed sweep, e.g. 0-4: all arms per seed, one table")
    out_dir: str = cli.arg("runs/rc_grpo", "output folder")
    device: str = cli.arg(
        "auto",
        "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"],
    )
    quiet: bool = cli.arg(False, "no per-step lines or progress bar")
    report_to: str = cli.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = cli.arg(10, "GRPO steps between checkpoints (0 = never)")
    timeout: int = cli.arg(1800, "seconds a collective waits for the other ranks")
    stage1_timeout: int = cli.arg(
        172_800, "seconds the other ranks wait for rank 0's stage 1 (bfcl preset: ≈ 1 day)"
    )
    system_prompt: str = cli.arg(
        "bfcl",
        "BFCL's system prompt: bfcl = what bfcl-eval's harness sends; short = a paraphrase "
        "that fits a laptop model's context",
        ["bfcl", "short"],
    )
    resume: bool = cli.arg(
        False, "continue each GRPO arm from its checkpoint, after stage 1 from its saved file"
    )
    overwrite: bool = cli.arg(
        False,
        "replace the run already in --out-dir (without it, or --resume, a folder holding a "
        "run is refused)",
    )


PRESETS = {  # the paper's recipe, each value beside the paper's in docs/rc_grpo.md (DEVIATION 8)
    "bfcl": dict(
        model="Qwen/Qwen2.5-7B-Instruct",
        arms="rctp+rc-grpo",
        steps=100,
        tasks_per_step=16,
        lr=1e-5,
        sft_lr=1e-4,
        sft_batch=16,
        failure_rollouts=2,
        max_steps=20,
        max_new_tokens=256,
        lora_rank=64,
        micro_batch_tokens=16384,
        gen_batch=32,
        gen_tokens=262144,
        gradient_checkpointing=True,
    ),
    # A real model on a laptop CPU (SmolLM2-135M-Instruct, bundled, fully fine-tuned so one run
    # trains both arms): 19 short BFCL entries, first turn, needed docs; β 0: flat groups unscored
    "smollm2-bfcl": dict(
        model="smollm2",
        arms="sft+grpo,rctp+rc-grpo",
        tasks=bfcl.LAPTOP_TASKS,
        max_turns=1,
        docs="needed",
        steps=4,
        tasks_per_step=2,
        group_size=4,
        lr=3e-5,
        beta=0.0,
        sft_lr=1e-4,
        sft_epochs=2,
        rctp_epochs=2,
        sft_batch=4,
        failure_rollouts=1,
        max_steps=2,
        max_new_tokens=32,
        temperature=0.7,
        micro_batch_tokens=1024,
        system_prompt="short",
    ),
}


# ------------------------------- the math: reward tokens, the RC-GRPO objective, stage 1 (RCTP-FT)


HIGH, LOW = "<|high_reward|>", "<|low_reward|>"
REWARD_TOKENS = (HIGH, LOW)


def reward_goal(token):
    """`[Reward Goal: <|…|>]`, the text that ends the first user message of a reward-conditioned
    trajectory (RCTP-FT); token None = no conditioning."""
    return None if token is None else f"[Reward Goal: {token}]"


def sample_reward_tokens(n, p, generator):
    """r_j ~ Bernoulli(p) i.i.d. per rollout: <|high_reward|> with probability p, else
    <|low_reward|> (RC-GRPO stage 2)."""
    draws = torch.rand(n, generator=generator) < p
    return [HIGH if d else LOW for d in draws.tolist()]  # Eq. 3: r_j ~ Bernoulli(p), i.i.d.


def rc_grpo_loss(logp, old_logp, ref_logp, advantages, mask, token_count, *, clip_eps, beta):
    """L = Σ_t [−min(ρ_t·A, clip(ρ_t, 1−ε, 1+ε)·A) + β·KL_t] / N_tokens, ρ_t = π_θ/π_old per token
    (RC-GRPO stage 2).

    Every term is conditioned on the rollout's own reward token (it sits in the prompt, never
    scored). KL_t is k3 to π_ref, the stage-1 model (0 when β = 0 skips π_ref). N_tokens counts
    the step's completion tokens, so micro-batches add up to the one-shot loss. Returns (loss,
    stats)."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch of the clipped surrogate
    kl = torch.zeros_like(logp) if ref_logp is None else common.kl_penalty(logp, ref_logp, "k3")
    loss = ((pg_loss + beta * kl) * mask).sum() / token_count  # stage 2's objective, under r_j
    stats = {
        "clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask).item(),
        "kl": common.masked_mean(kl, mask).item(),
        "ratio_dev": ((ratio.detach() - 1) * mask).abs().max().item(),
    }
    return loss, stats


def paper_statistics(outcomes, sampler_logps, token_count):
    """{success_high, success_low: the success rate under each reward token (Prop. 4.3's ε
    compares them), entropy: −mean log π of the sampled tokens (Table 4's)}."""
    high = [o["reward"] for o in outcomes if o["token"] == HIGH]
    low = [o["reward"] for o in outcomes if o["token"] == LOW]
    return {
        "success_high": sum(high) / max(1, len(high)),
        "success_low": sum(low) / max(1, len(low)),
        "entropy": -sum(logp.sum().item() for logp in sampler_logps) / token_count,
    }


def build_rctp_data(world, entries, args):
    """Expert trajectories (ground truth, <|high_reward|>) and the base model's failures (R = 0,
    <|low_reward|>), 1:1 (RCTP-FT). Failures are collected `args.gen_batch` rollouts at a time.
    Returns (trajectories, each a list of step samples; number of failures found)."""
    repeated = [e for e in entries for _ in range(args.failure_rollouts)]
    rollouts = []
    for lo in range(0, len(repeated), args.gen_batch):
        batch_entries = repeated[lo : lo + args.gen_batch]
        rollouts += [
            {"entry": r["entry"], "calls_per_turn": r["calls_per_turn"], "reward": r["reward"]}
            for r in bfcl.run_rollouts(
                world, batch_entries, [None] * len(batch_entries), temperature=1.0
            )
        ]
    every_failure = [r for r in rollouts if r["reward"] == 0]
    random.Random(args.seed).shuffle(every_failure)
    failures = every_failure[: len(entries)]
    demonstrated = [e for e in entries if e.get("demonstrated", True)]
    experts = bfcl.stratified(demonstrated, len(failures)) if failures else demonstrated
    high, low = reward_goal(HIGH), reward_goal(LOW)
    trajectories = [bfcl.trajectory_samples(world, e, high, e["ground_truth"]) for e in experts]
    for failure in failures:
        trajectories += [
            bfcl.trajectory_samples(world, failure["entry"], low, failure["calls_per_turn"])
        ]
    return trajectories, len(failures)


def stage1_units(trajectories, args):
    """What one stage-1 batch counts (RC-GRPO stage 1): trajectories at full scale, as the paper;
    single assistant steps on the toy (`--model ''`), whose stage 1 was tuned and measured that
    way."""
    return trajectories if args.model else [[s] for t in trajectories for s in t]


def supervised_finetune(
    world, trajectories, *, epochs, lr, batch, seed, token_budget, precision="auto"
):
    """Maximum likelihood of the assistant tokens given the history (and reward token): stage 1
    (RCTP-FT). `trajectories`: lists of step samples; each batch of `batch` trajectories (the
    paper's unit) is one optimiser step over all their steps, accumulated over token-bounded
    micro-batches."""
    model, tokenizer = world.model, world.tokenizer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = common.training_autocast(model.device, precision)
    packing = common.Scoring(tokenizer, token_budget, model.device)  # packed, not scored
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(trajectories), generator=gen).tolist()
        for start in range(0, len(order), batch):
            batch_steps = [s for i in order[start : start + batch] for s in trajectories[i]]
            prompts = [s["prompt"] for s in batch_steps]
            completions = [s["ids"] for s in batch_steps]
            token_count = sum(len(c) for c in completions)
            optimizer.zero_grad()
            for mb in common.scored_micro_batches(
                prompts, completions, sampler_logps=None, scoring=packing
            ):
                with autocast:
                    logp = common.micro_batch_logprobs(model, mb)
                (-(logp * mb.mask).sum() / token_count).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()


# ---------------------------------------------------------------------------------------- rollouts


def evaluate(world, entries, token, args, temperature=0.0, accelerator=None):
    """Rollouts under `token` (greedy by default) → (accuracy taken as the mean of R =
    R_state·R_action; accuracy by the official checker's semantics, bfcl_check; this rank's
    rollouts). With an `accelerator`, sharded: each rank rolls out every N-th entry (rank 0 the
    first) and the scores are gathered; sampled (temperature > 0), each entry draws from its own
    seed."""
    if not entries:
        return float("nan"), float("nan"), []
    rank, ranks = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = entries[rank::ranks]  # empty on a rank past the last entry
    seeds = None
    if temperature > 0:  # one seed per entry: the same samples on any number of ranks
        every_seed = [distributed.sampling_seed(args.seed, 0, k) for k in range(len(entries))]
        seeds = every_seed[rank::ranks]
    goals = [reward_goal(token)] * len(mine)
    rollouts = bfcl.run_rollouts(world, mine, goals, temperature, seeds=seeds)
    my_scores = [(r["reward"], bfcl.bfcl_check(r["entry"], r["calls_per_turn"])) for r in rollouts]
    scores = gather_object(my_scores) if ranks > 1 else my_scores
    rewards, checked = zip(*scores)
    return sum(rewards) / len(scores), sum(checked) / len(scores), rollouts


# ---------------------------------------------------------------------------------------- training


def validate(args):
    """The arms to train, or one line per bad flag (cli.check_args: every number's range, then
    these)."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    cli.check_args(
        [
            (
                arms and all(a in bfcl_toy.TABLE_1 for a in arms),
                "--arms must list sft+grpo, sft+rc-grpo, rctp+grpo or rctp+rc-grpo "
                f"(got {args.arms!r})",
            ),
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (
                args.temperature > 0,
                "--temperature must be > 0 for training rollouts (eval is greedy)",
            ),
            (
                not args.lora_rank or len(arms) == 1,
                "--lora-rank trains one arm per run (stage 2's adapter stacks on stage 1's)",
            ),
        ],
        args,
    )
    return arms


def grpo_arm(args, world, name, *, use_tokens, reward_conditioned, out_dir, accelerator):
    """Stage 2 from the current weights: G rollouts per task, tokens i.i.d. (RC-GRPO) or fixed
    (GRPO), one group per task across tokens, clipped ratio + β·k3 KL under the rollout's own token
    (RC-GRPO stage 2). π_ref is the stage-1 model: a frozen copy, or (LoRA) the frozen stage-1
    adapter alone, the stage-2 one off. With N processes each rank rolls out its block of tasks with
    its own noise; the gradients are averaged once per optimiser step."""
    model, tokenizer = world.model, world.tokenizer
    if args.lora_rank:  # π_ref: the stage-1 adapter alone (the stage-2 one off)
        reference = models.AdapterSubset(model, ["default"])
    else:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    autocast = common.training_autocast(model.device, args.mixed_precision)
    gen = torch.Generator().manual_seed(args.seed)
    mine = distributed.local_groups(args.tasks_per_step, accelerator)
    surrogate = functools.partial(rc_grpo_loss, clip_eps=args.clip_eps, beta=args.beta)
    # π_ref scored once per step (none when β = 0)
    scoring = common.Scoring(
        tokenizer,
        args.micro_batch_tokens,
        model.device,
        model=model,
        reference=reference,
        temperature=args.temperature,
        precision=args.mixed_precision,
        with_reference=bool(args.beta),
    )
    # TRY NOT TO MODIFY: the logger, and checkpoints of weights, optimiser, RNGs, metrics so far
    run = tracking.Run(
        out_dir / name,
        args,
        desc=name,
        total_steps=args.steps,
        modules={"policy": model},
        optimizers={"optimizer": optimizer},
        generators={"rollouts": gen},
        main_process=accelerator.is_main_process,
        config=dataclasses.asdict(args) | {"arm": name},
    )
    start, extra = run.resume()
    phases = tracking.Phases()  # each phase's seconds, logged (the benchmarks read them)
    num_tasks = len(world.train)
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. draw tasks and, per rollout, a token r_j ~ Bernoulli(p) (RC-GRPO, Eq. 3) or a fixed
        #    one (GRPO)
        picked = torch.randint(num_tasks, (args.tasks_per_step,), generator=gen)
        num_rollouts = len(picked) * args.group_size
        if reward_conditioned:
            every_token = sample_reward_tokens(num_rollouts, args.p_high, gen)
        else:
            every_token = [HIGH if use_tokens else None] * num_rollouts
        # this rank's groups
        my_rollouts = slice(mine.start * args.group_size, mine.stop * args.group_size)
        task_ids = picked.repeat_interleave(args.group_size).tolist()
        entries = [world.train[i] for i in task_ids][my_rollouts]
        tokens = every_token[my_rollouts]
        distributed.seed_rank_noise(args.seed, step, accelerator)

        # 2. G multi-turn rollouts per task, each under its own token; R = R_state·R_action
        #    (Sec. 3.3)
        goals = [reward_goal(t) for t in tokens]
        with phases.time("rollout"):
            rollouts = bfcl.run_rollouts(world, entries, goals, args.temperature)
        rewards = torch.tensor([r["reward"] for r in rollouts])

        # 3. one group per task across tokens: A_j = (R_j − mean_g R)/(σ_g + ε), σ_g the
        #    population std (App. A.2)
        advantages = common.group_advantages(rewards, args.group_size, unbiased=False)
        # every model step of a rollout is a row that carries its rollout's A: (step, A) pairs
        model_steps = [(s, a) for r, a in zip(rollouts, advantages.tolist()) for s in r["steps"]]
        prompts = [s["prompt"] for s, _ in model_steps]
        completions = [s["ids"] for s, _ in model_steps]
        sampler_logps = [s["sampler_logp"] for s, _ in model_steps]
        token_count = max(1, sum(len(c) for c in completions))

        # 4. one optimiser step, gradients accumulated over token-bounded micro-batches; on-policy,
        #    so π_old = the update's own log-probs, detached; π_ref once. A sample with A = 0 has
        #    no gradient when β = 0: it is not scored, and π_ref is not needed
        model.train()
        scored = [k for k, (_, a) in enumerate(model_steps) if a or args.beta]
        step_advantages = torch.tensor([a for _, a in model_steps], device=model.device)
        with phases.time("prepare"):
            micro_batches = common.scored_micro_batches(
                prompts,
                completions,
                sampler_logps=sampler_logps,
                scoring=scoring,
                rows=scored,
                with_old=False,
            )
        metrics = tracking.StepMetrics()  # every micro-batch
        with phases.time("update"):
            optimizer.zero_grad()
            for mb in micro_batches:
                with autocast:
                    logp = common.micro_batch_logprobs(model, mb, args.temperature)  # (B, W)
                old_logp = common.old_logprobs(mb, logp)  # on-policy: this forward, detached
                loss, stats = surrogate(
                    logp, old_logp, mb.ref_logp, step_advantages[mb.rows], mb.mask, token_count
                )
                common.check_finite(loss, f"{step} of {name}")
                loss.backward()
                gap = common.sampler_gap(mb, old_logp)
                metrics.add(len(mb.rows), loss.item(), sampler_gap=gap, **stats)  # ratio_dev, …
            distributed.average_gradients(params, accelerator)  # the one collective of the step
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            common.check_finite(grad_norm, f"{step} of {name}", "gradient norm")
            optimizer.step()

        # TRY NOT TO MODIFY: the whole step's tokens and rewards for the log (loss stats: rank 0's)
        my_outcomes = [
            {"token": t, "reward": r["reward"], "rare": r["entry"].get("rare")}
            for r, t in zip(rollouts, tokens)
        ]
        outcomes = gather_object(my_outcomes)
        all_rewards = torch.tensor([o["reward"] for o in outcomes])
        record = metrics.record(all_rewards, args.group_size, grad_norm, phases)
        record |= paper_statistics(outcomes, sampler_logps, token_count)  # ε, the entropy
        record |= tracking.token_counts(completions, micro_batches)
        record |= bfcl_toy.folder_success(outcomes, high=HIGH, low=LOW)  # the toy's; {} otherwise
        run.log(step, record)
    last = run.records[-10:]  # the sampled tokens' entropy over the last ten steps (Table 4's)
    result = {
        "zero_variance_fraction": sum(r["zero_var_frac"] for r in run.records) / len(run.records),
        "entropy": sum(r["entropy"] for r in last) / len(last),
        "sampler_logprob_max_dev": tracking.largest(run.records, "sampler_gap"),
    }
    return result, run


def stage_one(world, base_data, arms, args, path):
    """Stage 1 (rank 0): the toy's base model first, then SFT and/or RCTP-FT as the arms need, each
    evaluated; saved atomically to `path`: each trained model's weights (with LoRA: its adapter),
    the accuracies and the rollouts shown, in one file every rank loads."""
    if base_data is not None:  # the toy's base: a careless agent's trajectories on generic tasks
        supervised_finetune(
            world,
            [[s] for s in base_data],
            epochs=8,
            lr=3e-3,
            batch=32,
            seed=args.seed,
            token_budget=args.micro_batch_tokens,
            precision=args.mixed_precision,
        )

    def trained_weights():  # a copy of the trained weights as they are now
        return {k: v.detach().clone() for k, v in world.model.named_parameters() if v.requires_grad}

    base = trained_weights()
    accuracy, _, rollouts = evaluate(world, world.test, None, args)
    summary = {"base_accuracy": accuracy}
    shown = ["base model:\n" + bfcl.format_rollout(rollouts[0])]  # the first test entry's
    tensors, needed = {}, {a.split("+")[0] for a in arms}
    if "sft" in needed:  # the baseline: expert trajectories only, no token
        expert = stage1_units(
            [
                bfcl.trajectory_samples(world, e, None, e["ground_truth"])
                for e in world.train
                if e.get("demonstrated", True)
            ],
            args,
        )
        supervised_finetune(
            world,
            expert,
            epochs=args.sft_epochs,
            lr=args.sft_lr,
            batch=args.sft_batch,
            seed=args.seed,
            token_budget=args.micro_batch_tokens,
            precision=args.mixed_precision,
        )
        tensors |= {f"sft/{k}": v for k, v in trained_weights().items()}
        summary["sft_accuracy"] = evaluate(world, world.test, None, args)[0]
    if "rctp" in needed:
        world.model.load_state_dict(base, strict=False)
        rctp_trajectories, n_failures = build_rctp_data(world, world.train, args)
        supervised_finetune(
            world,
            stage1_units(rctp_trajectories, args),
            epochs=args.rctp_epochs,
            lr=args.sft_lr,
            batch=args.sft_batch,
            seed=args.seed,
            token_budget=args.micro_batch_tokens,
            precision=args.mixed_precision,
        )
        tensors |= {f"rctp/{k}": v for k, v in trained_weights().items()}
        high, low = (evaluate(world, world.test, t, args)[0] for t in (HIGH, LOW))
        summary |= {"rctp_accuracy": high, "token_gap": high - low, "rctp_failures": n_failures}
    tracking.save_checkpoint(path, tensors, {"summary": summary, "shown": shown})


def load_stage_one(world, path):
    """({init: its trained weights}, the stage-1 summary, the rollouts shown) from `path`; the
    model holds the last stage-1 model's weights (with LoRA, one arm: the one it trains)."""
    flat, state = tracking.load_checkpoint(path)
    states = collections.defaultdict(dict)
    for key, value in flat.items():
        init, name = key.split("/", 1)
        states[init][name] = value.to(world.model.device)
    for weights in states.values():
        world.model.load_state_dict(weights, strict=False)
    return dict(states), state["summary"], state["shown"]


def train(args):
    """Base → {SFT, RCTP-FT} (stage 1) → {GRPO, RC-GRPO} (stage 2) for each arm of Table 1; held-out
    accuracy."""
    arms = validate(args)
    start = time.time()
    common.seed_everything(args.seed)
    accelerator, device = distributed.setup_accelerator(args.device, args.timeout)
    tracking.check_out_dir(args.out_dir, args, accelerator)
    if args.model:
        world, base_data = bfcl.build_bfcl(args, device), None
    else:  # the toy's base model: trained in stage_one on a careless agent's trajectories
        world, base_data = bfcl_toy.build_toy(args, device, REWARD_TOKENS)
    world.train, world.test = (bfcl.select_entries(e, args) for e in (world.train, world.test))
    cli.check_args(
        [(world.train and world.test, "no train or no test task left after --tasks/--max-tasks")]
    )
    out_dir = Path(args.out_dir)
    rare_test = [e for e in world.test if e.get("rare")]
    # Stage 1 runs once, on rank 0, into out_dir/stage1.safetensors (atomic); every rank loads that
    # file, so all start stage 2 from the same weights, and --resume skips stage 1. The other ranks
    # wait for the file, not in a collective (stage 1 at full scale outlasts its timeout).
    stage1_file = out_dir / "stage1.safetensors"
    distributed.check_shared_folder(out_dir)  # else a rank would wait for a file it cannot see
    if not (args.resume and stage1_file.exists()):
        if accelerator.is_main_process:
            stage_one(world, base_data, arms, args, stage1_file)
        distributed.wait_for_file(stage1_file, args.stage1_timeout, "--stage1-timeout")
    states, summary, shown = load_stage_one(world, stage1_file)
    # stage 1's adapter stays, frozen; stage 2 trains a second one on top, π_ref = stage 1's alone
    if args.lora_rank:
        models.stack_adapter(world.model, "stage2")
        models.check_master_weights(world.model)
    curves = {}
    for arm in arms:
        init, algo = arm.split("+")
        world.model.load_state_dict(states[init], strict=False)
        use_tokens = init == "rctp" or algo == "rc-grpo"
        common.seed_everything(args.seed)
        result, run = grpo_arm(
            args,
            world,
            arm,
            use_tokens=use_tokens,
            reward_conditioned=algo == "rc-grpo",
            out_dir=out_dir,
            accelerator=accelerator,
        )
        token = HIGH if use_tokens else None
        # every rank evaluates its share
        result["accuracy"], result["bfcl_accuracy"], rollouts = evaluate(
            world, world.test, token, args, accelerator=accelerator
        )
        if rare_test:  # the toy: the folders imitation learns poorly, and sampled accuracy
            rare = evaluate(world, rare_test, token, args, accelerator=accelerator)
            result["rare_accuracy"] = rare[0]
            sampled = evaluate(
                world, world.test, token, args, temperature=1.0, accelerator=accelerator
            )
            result["sampled_accuracy"] = sampled[0]
        # what the same weights do when asked for a low reward (not used for the result)
        if use_tokens:
            low = evaluate(world, world.test, LOW, args, accelerator=accelerator)
            result["accuracy_under_low_token"] = low[0]
        if accelerator.is_main_process:  # rank 0 rolled out the first test entry
            shown.append(f"after {arm}:\n" + bfcl.format_rollout(rollouts[0]))
        summary[arm] = run.finish(
            result,
            [
                ("zero_var.png", ["zero_var_frac"], f"{arm}: zero-variance fraction"),
                ("reward.png", ["reward", "success_high", "success_low"], f"{arm}: reward"),
            ],
        )
        curves[arm] = [(r["step"], r["zero_var_frac"]) for r in run.records]
        if (args.model or args.lora_rank) and accelerator.is_main_process:
            # both stages' adapters merged in fp32: the policy that was trained, a plain causal
            # LM (LoRA runs train one arm, so it is the last)
            policy = models.merged_fp32(world.model) if args.lora_rank else world.model
            policy.save_pretrained(out_dir / arm / "policy")
            world.tokenizer.save_pretrained(out_dir / arm / "policy")
    summary |= {
        "test_tasks": len(world.test),
        "wall_seconds": round(time.time() - start, 2),
        "sampler_logprob_max_dev": max(summary[a]["sampler_logprob_max_dev"] for a in arms),
        "peak_rss_mb": max(summary[a]["peak_rss_mb"] for a in arms),
    }
    if {"sft+grpo", "rctp+rc-grpo"} <= set(arms):  # the row of `make demo`'s table
        summary["claim"] = {
            "text": "RC-GRPO: zero-var. fraction, SFT+GRPO → RCTP+RC",
            "before": summary["sft+grpo"]["zero_variance_fraction"],
            "after": summary["rctp+rc-grpo"]["zero_variance_fraction"],
        }
    if accelerator.is_main_process:
        tracking.plot_curves(
            curves,
            out_dir / "zero_variance.png",
            title="zero-variance fraction per GRPO step",
            ylabel="fraction",
        )
        tracking.write_atomically(out_dir / "summary.json", json.dumps(summary, indent=2))
        (out_dir / "rollouts.txt").write_text("\n\n".join(shown) + "\n")
    if not args.quiet:
        print(bfcl_toy.results_table(summary, arms))
    return summary


if __name__ == "__main__":
    args = cli.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(
            train, args, [("", {})], bfcl_toy.sweep_row, bfcl_toy.claim_holds, sweep_dir
        )
    else:
        summary = train(args)
        if distributed.is_rank_zero():  # one final JSON, not one per rank
            print(json.dumps(summary, indent=2))
    distributed.leave_process_group()
