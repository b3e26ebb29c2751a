"""FlowRL: matching the reward distribution with trajectory balance and a learned log Z(x).

Paper: "FlowRL: Matching Reward Distributions for LLM Reasoning", Zhu et al. 2025, arXiv 2509.15207.
"The original code" below is the authors' release (a verl fork).

Reward maximisers (PPO, GRPO) pile their mass onto the single best mode. FlowRL instead fits the
target p*(y|x) ∝ π_ref(y|x)·exp(β·r(x,y)) by minimising KL(π_θ‖p*); in expected gradient that KL
equals the GFlowNet trajectory-balance (TB) loss, whose unknown normaliser Z(x) is a small learned
head (Proposition 1 of the paper).

Equation map (paper → function):
    Prop. 1  KL(π_θ‖p*) and the TB loss (log Z(x) + logπ_θ(y|x) − β·r − logπ_ref(y|x))² have
             the same expected gradient: the TB residual        → trajectory_balance_loss
    TB loss  w·(log Z(x) + logπ_θ(y|x)/|y| − β·r̂ − logπ_ref(y|x)/|y|)², the practical loss
             (length-normalised: DEVIATION 3)                   → trajectory_balance_loss
    w        clip(π_θ/π_old, 1−ε, 1+ε), detached                → importance_weight
    log Z    3-layer MLP on the mean-pooled prompt hidden state  → LogZHead
    p*       π_ref·exp(β·r), exact on the toy by enumeration     → flowrl_tasks.exact_metrics
    GRPO     −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A), the baseline (`--algo grpo`)
                                                                → grpo_loss
    control  GRPO on r − log(π/π_ref)/(β·|y|), whose optimum is also p* (`--algo grpo-kl`)
                                                                → kl_regularised_reward

Deviations (numbered, on purpose):
    1. The toy uses the raw reward (`--reward-norm none`) so p* is exactly defined; the paper's r̂
       is the group-normalised reward (`--reward-norm group`, the full preset's default).
    2. w clips the sequence ratio to [1−ε, 1+ε] as the paper writes; the original code used it
       unclipped (its clipped copy was computed but unused). Clipping bounds the weight of stale
       samples.
    3. With length-normalised log-probs the TB fixed point is π ∝ π_ref·exp(β·|y|·r); the toy's
       responses all have |y| = 3, so its exact target uses β·|y| (the family of Proposition 1 with
       a rescaled β).
    4. log Z has its own learning rate (`--logz-lr`), as GFlowNet practice gives it (FlowRL's log Z
       head).
    5. The toy samples G = 64 per prompt (paper: 8) and takes 8 optimiser steps on each batch for
       300 batches. At π = π_ref the KL part of TB's expected gradient, −β∇E[r] + ∇KL(π‖π_ref)/|y|,
       is zero, so the first updates are REINFORCE on β·r with log Z as the baseline; at β = 1 with
       ~9% of samples rewarded one step per batch barely moves π (measured: near π_ref for 100–175
       batches at 2 steps per batch; a 3× or 10× learning rate did not help, 8 steps per batch
       did). Every arm gets the same rollouts and the same number of optimiser steps.
    6. `--algo grpo-kl`, a control the paper does not run: GRPO on the sequence-level regularised
       reward r − log(π_old(y|x)/π_ref(y|x))/(β·|y|). Its optimum is the same p* (maximising E[r] −
       KL(π‖π_ref)/(β·|y|) gives π ∝ π_ref·exp(β·|y|·r)), so it separates "match a target" from
       "match it with trajectory balance".
    7. The full preset (table in docs/flowrl.md) keeps the original schedule, 16 optimiser steps
       on disjoint mini-batches of each rollout batch (`--minibatches`; w acts from the second),
       at a size one GPU generates: `--prompts-per-step` 32 (original 512, mini-batches of 32
       prompts), `--max-new-tokens` 1024 (original 8k), `--model` Qwen2.5-1.5B-Instruct (original:
       the base Qwen2.5-7B; 32B in the paper too). Its 200 rollout batches (`--steps`; original:
       one pass, `--total-epochs` 1) draw 6 400 prompts without replacement, about a third of a
       pass over DAPO-Math-17k's ~17 k unique prompts. It evaluates Avg@16 at T 0.6 (`--eval-k`,
       `--eval-temperature`: the original's separate test after training, `flowrl_math_test.sh`)
       every 50 rollout batches (`--eval-every`), where the original's validation during training
       is one greedy answer per prompt every 5 (verl's `val_kwargs`, `ppo_trainer.yaml`): 16
       sampled answers per held-out prompt per 50 batches where the original generates 10 greedy
       ones. `--preset full-7b` keeps the original's model, batch, 8k lengths, length (one pass
       over --data, ⌊rows/512⌋ rollout batches) and evaluation (one greedy answer per prompt of
       --eval-data every 5), sharded over the GPUs (`--fsdp`); its Avg@16 is the separate command
       below (`--eval-only`). Prompts are not capped (the original truncates them on the left at
       2048 tokens).
    8. Avg@k samples without top_p 0.95 (the original evaluation's): the one sampler has no
       truncation, so what it draws is what the trainer scores.
    9. log Z pools the whole prompt's hidden states (the original drops the prompt's last token),
       and the math answer is read from `\boxed{}` (DAPO's data asks for an "Answer:" line).
    10. `--algo grpo` has no KL term; the original training script sets a 0.001 `low_var_kl` loss,
       which its FlowRL objective ignores (the paper's baseline configurations are not released).
    11. A non-finite gradient norm stops the run with one line (`common.check_finite`), where the
       original's verl skips that optimiser step and goes on (`dp_actor.py`): in this code such a
       norm has meant a bug or a diverged run, which a skipped step would hide in the log.
    12. TB's loss is the mean over each mini-batch's rows, however `--micro-batch-tokens` packs
       them. The original (`dp_actor.py`, with `use_dynamic_bsz` as `flowrl_7B_math.sh` sets it)
       scales each token-balanced micro-batch's row-mean by len(data)/32, where `data` at that
       line is the 9-entry metrics dict its TB objective returns, not the micro-batch: a
       mini-batch's loss is 9/32 × the sum of its micro-batch means. Its scale grows with the
       number of micro-batches the token budget makes (one row each: 9× the row-mean), and a row
       weighs more in a micro-batch of fewer rows. Not copied: a reused name, not a recipe choice.

Toy (CPU, about a minute per arm; docs/flowrl.md):
    python flowrl.py                   # seed 0, one thread: exact KL(π‖p*) 0.480 → 0.005, 24 of 24
                                       # modes kept
    python flowrl.py --algo grpo       # the reward maximiser: KL 0.480 → 3.694, 2 of 24 kept
    python flowrl.py --algo grpo-kl    # the control with FlowRL's target: 0.480 → 0.182, 20 kept
    python flowrl.py --valleys 1,0.6,0.3   # a target of your own: each prompt's rewards
    python flowrl.py --seeds 0-4       # all three arms on five seeds, one table (means: FlowRL
                                       # 0.007, GRPO 3.301, GRPO-KL 0.094; docs/flowrl.md)
A real model on a laptop (the bundled SmolLM2-135M-Instruct, CPU; `make demo-real`):
    python flowrl.py --preset smollm2-addition --algo grpo   # greedy 0.125 → 0.86, ~5 min
    python flowrl.py --preset smollm2-numbers --seeds 0-2    # FlowRL vs GRPO spread: held 1/3 seeds
Full scale (one GPU, math recipe):
    python flowrl.py --preset full --data train.jsonl --eval-data test.jsonl
N GPUs (data-parallel, docs/full_scale.md):
    accelerate launch --num_processes N flowrl.py --preset full ...
The original's 7B full fine-tune, sharded over 8 GPUs (FSDP; per-GPU plan in docs/full_scale.md),
validated on --eval-data (the original's validation file), then the original's Avg@16 test of the
saved policy, a separate command (`...`: --model runs/flowrl/policy --eval-data test.jsonl):
    accelerate launch --num_processes 8 flowrl.py --preset full-7b --data train.jsonl ...
    python flowrl.py --preset full-7b --eval-only --eval-k 16 --eval-temperature 0.6 ...
Sample from the trained policy (full preset; a plain causal LM folder, no log Z head):
    python -m utils.sample runs/flowrl/policy "What is 7 + 5?"
"""

import copy
import dataclasses
import functools
import json
from pathlib import Path

import torch
import torch.nn as nn

import common
from envs import flowrl_tasks
from utils import cli, distributed, sweep, tracking

# -------------------------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    preset: str = cli.arg("toy", "the preset these values start from (`--preset NAME` on the CLI)")
    algo: str = cli.arg(
        "flowrl",
        "flowrl: trajectory balance; grpo: the reward-maximising baseline; grpo-kl: GRPO on "
        "r − log(π/π_ref)/(β·|y|), the KL-regularised control with FlowRL's target",
        ["flowrl", "grpo", "grpo-kl"],
    )
    task: str = cli.arg(
        "valleys",
        "valleys: the exact toy; math: --data JSONL (full preset); addition, numbers: tasks a "
        "real chat model already sometimes solves (the smollm2 presets)",
        ["valleys", "math", "addition", "numbers"],
    )
    model: str = cli.arg("", "HF model id, a path, or smollm2 (bundled); '' = the toy's tiny LM")
    data: str = cli.arg("", "JSONL of {prompt|problem, answer} for --task math")
    eval_data: str = cli.arg("", "JSONL for Avg@k evaluation (full preset)")
    steps: int = cli.arg(300, "rollout batches")
    sampling: str = cli.arg(
        "replacement",
        "replacement: each rollout batch draws B prompts uniformly (the toys); shuffle: passes "
        "over the prompts in a fresh random order, each prompt once per pass, a last partial batch "
        "dropped (the original's loader)",
        ["replacement", "shuffle"],
    )
    total_epochs: int = cli.arg(
        0,
        "passes over the prompts (--sampling shuffle), ⌊prompts/B⌋ rollout batches each, in "
        "place of --steps (0 = --steps counts; original: 1)",
    )
    prompts_per_step: int = cli.arg(4, "B, prompts per rollout batch")
    group_size: int = cli.arg(64, "G, samples per prompt (original: 8)")
    inner_steps: int = cli.arg(8, "epochs over each rollout batch (--minibatches steps each)")
    minibatches: int = cli.arg(
        1, "disjoint mini-batches per rollout batch, one optimiser step each (π_old fixed)"
    )
    valleys: str = cli.arg(
        "1,1,0.8,0.8,0.5,0.5",
        "the toy's target: each prompt's rewarded answers by their reward in (0, 1] (one random "
        "3-symbol answer each; the others score 0), e.g. 1,0.6,0.3 for three modes",
    )
    max_new_tokens: int = cli.arg(3, "|y| cap")
    beta: float = cli.arg(1.0, "β, reward scale in p* ∝ π_ref·exp(β·r) (original: 15)")
    reward_norm: str = cli.arg(
        "none", "r̂: 'group' = group-normalised (paper), 'none' = raw reward", ["group", "none"]
    )
    clip_eps: float = cli.arg(0.2, "ε for w (FlowRL) and the GRPO clip")
    dual_clip: float = cli.arg(0.0, "GRPO arms: cap the loss at c·|A| where A < 0 (0 = off)")
    lr: float = cli.arg(1e-3, "policy learning rate (original: 1e-6)")
    weight_decay: float = cli.arg(0.0, "AdamW weight decay (original code: 0.1)")
    warmup_steps: int = cli.arg(
        0, "rollout batches of linear learning-rate warm-up, the first at lr 0 (original: 10)"
    )
    logz_lr: float = cli.arg(1e-2, "log Z head learning rate")
    detach_logz: bool = cli.arg(False, "stop log Z's gradient into the backbone")
    temperature: float = cli.arg(1.0, "rollout temperature (original: 1.0)")
    eval_temperature: float = cli.arg(
        0.6, "Avg@k temperature (original: 0, greedy, in training; 0.6 in its test after)"
    )
    eval_k: int = cli.arg(4, "k of Avg@k (original: 1 in training; 16 in its test after)")
    eval_every: int = cli.arg(25, "steps between evaluations")
    eval_only: bool = cli.arg(
        False,
        "evaluate --model on --eval-data (Avg@k) and stop, no training: the original's separate "
        "test after training (Avg@16 at T 0.6)",
    )
    spread_samples: int = cli.arg(
        64, "numbers task: samples per question for the answer spread at the start and the end"
    )
    lora_rank: int = cli.arg(0, "LoRA rank via peft (0 = full fine-tune)")
    micro_batch_tokens: int = cli.arg(
        4096,
        "tokens per forward pass (a prefix tree: each shared prefix once); gradients accumulate "
        "over micro-batches (bounds memory)",
    )
    gen_batch: int = cli.arg(64, "prompts per `generate` call")
    gradient_checkpointing: bool = cli.arg(
        False, "recompute activations in the backward pass (full preset: on)"
    )
    fsdp: bool = cli.arg(
        False,
        "shard the weights, gradients, AdamW moments and π_ref over the N processes "
        "(FSDP2; full fine-tunes past one GPU's memory, the full-7b preset)",
    )
    mixed_precision: str = cli.arg(
        "auto",
        "forward passes: bf16 autocast (bf16: on any device, a CPU too), auto: bf16 where "
        "the device multiplies it natively (a GPU, a CPU with AVX512-BF16 or AMX), fp32: none; "
        "weights stay fp32; the run's config states which ran",
        ["auto", "bf16", "fp32"],
    )
    timeout: int = cli.arg(1800, "seconds a collective waits for the other ranks")
    seed: int = cli.arg(0, "random seed")
    seeds: str = cli.arg("", "seed sweep, e.g. 0-4: all three --algo arms per seed, one table")
    out_dir: str = cli.arg("", "output folder (default runs/flowrl[-grpo|-grpo-kl])")
    device: str = cli.arg(
        "auto",
        "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"],
    )
    quiet: bool = cli.arg(False, "no per-step lines or progress bar")
    report_to: str = cli.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = cli.arg(50, "steps between checkpoints (0 = never)")
    resume: bool = cli.arg(False, "continue from out_dir/checkpoint.safetensors")
    overwrite: bool = cli.arg(
        False,
        "replace the run already in --out-dir (without it, or --resume, a folder holding a "
        "run is refused)",
    )


# The original recipe (each value beside the original one: docs/flowrl.md): G = 8, β = 15, lr 1e-6
# for the policy and log Z, weight decay 0.1, 10 warm-up rollout batches, group-normalised r̂,
# temperature 1 for rollouts and 0.6 for Avg@16 (its test after training), 16 mini-batch steps per
# rollout batch (DEVIATION 7).
PRESETS = {
    "full": dict(
        task="math",
        model="Qwen/Qwen2.5-1.5B-Instruct",
        steps=200,
        prompts_per_step=32,
        group_size=8,
        inner_steps=1,
        minibatches=16,
        max_new_tokens=1024,
        beta=15.0,
        reward_norm="group",
        lr=1e-6,
        logz_lr=1e-6,
        weight_decay=0.1,
        warmup_steps=10,
        eval_k=16,
        dual_clip=3.0,
        eval_every=50,
        micro_batch_tokens=8192,
        gen_batch=64,
        gradient_checkpointing=True,
        sampling="shuffle",
    ),
    # A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct (bundled by a registry package,
    # no download), full fine-tuning in fp32. Greedy accuracy on the 64 held-out sums is Avg@1 at
    # T = 0. The numbers preset: β = 1 on the group-normalised r̂ (β = 15 would dwarf the log-ratio
    # term that keeps π near π_ref) and a slow log Z (at 1e-3 it jumped by ±2 per step).
    "smollm2-addition": dict(
        task="addition",
        model="smollm2",
        steps=40,
        prompts_per_step=4,
        group_size=8,
        inner_steps=1,
        max_new_tokens=12,
        lr=3e-6,
        eval_k=1,
        eval_temperature=0.0,
        eval_every=5,
    ),
    "smollm2-numbers": dict(
        task="numbers",
        model="smollm2",
        steps=12,
        prompts_per_step=2,
        group_size=8,
        inner_steps=1,
        max_new_tokens=10,
        beta=1.0,
        reward_norm="group",
        lr=6e-6,
        logz_lr=1e-4,
        gen_batch=256,
        eval_every=1000,
    ),
}
# The original's model, shapes (512 prompts × G 8, 8k new tokens), length and evaluation: one
# shuffled pass over --data (⌊rows/512⌋ rollout batches), one greedy answer per prompt of
# --eval-data before the first and every 5th (verl's val_kwargs), sharded over the GPUs (--fsdp;
# the per-GPU plan for 8 in docs/full_scale.md); the rest as in `full`. Its Avg@16 is a separate
# command after training (--eval-only), as the original's.
PRESETS["full-7b"] = PRESETS["full"] | dict(
    model="Qwen/Qwen2.5-7B",
    prompts_per_step=512,
    max_new_tokens=8192,
    micro_batch_tokens=16384,
    fsdp=True,
    total_epochs=1,
    eval_every=5,
    eval_k=1,
    eval_temperature=0.0,
)


# ------------------------ the math: trajectory balance with a learned log Z, and the GRPO baseline


def trajectory_balance_loss(
    log_z, logp, ref_logp, reward, beta, *, log_ratio, clip_eps, num_rows=None
):
    """L = (1/N)·Σ_i w_i·(log Z(x_i) + logπ_θ(y_i|x_i)/|y_i| − β·r̂_i − logπ_ref(y_i|x_i)/|y_i|)²

    logp, ref_logp: length-normalised sequence log-probs (B,); reward: r̂ (B,); log_ratio:
    log π_θ(y|x)/π_old(y|x) over the whole completion (B,), whose clipped exponential is w
    (`importance_weight`). N = num_rows (the mini-batch's rows, so micro-batches add up to its
    mean; default B). Returns (loss, stats): per row log Z, w and |residual|, and ratio_dev, the
    largest |π_θ/π_old − 1|. At the optimum every residual is 0: π ∝ π_ref·exp(β·r) with Z its
    normaliser.
    """
    weight = importance_weight(log_ratio, clip_eps)
    residual = log_z + logp - beta * reward - ref_logp  # Prop. 1: the TB residual
    stats = {
        "log_z": log_z.detach(),
        "w_mean": weight,
        "residual_abs": residual.detach().abs(),
        "ratio_dev": (torch.exp(log_ratio.detach()) - 1).abs().max().item(),
    }
    return (weight * residual**2).sum() / (num_rows or len(residual)), stats


def sequence_logprob(token_logp, mask, length_normalize=False):
    """log π(y|x) = Σ_t log π(y_t|x, y_<t) over the completion's tokens, and ÷|y| when
    length_normalize: FlowRL's length-normalised log-prob, which TB compares with β·r̂."""
    total = (token_logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_normalize else total


def importance_weight(log_ratio, clip_eps):
    """w = clip(π_θ(y|x)/π_old(y|x), 1−ε, 1+ε), detached, from log_ratio = log π_θ(y|x)/π_old(y|x)
    (FlowRL's practical loss; DEVIATION 2)."""
    return torch.exp(log_ratio).clamp(1 - clip_eps, 1 + clip_eps).detach()


class LogZHead(nn.Module):
    """log Z_φ(x): Linear–GELU–LayerNorm–Dropout(0.1) twice, then Linear → 1 (FlowRL's log Z head).

    Input: the policy's last hidden state mean-pooled over the prompt tokens, so Z(x) is conditioned
    on the prompt and (unless detached) its gradient shapes the shared backbone.
    """

    def __init__(self, hidden_size):
        super().__init__()
        block = lambda: [
            nn.Linear(hidden_size, hidden_size),
            nn.GELU(),
            nn.LayerNorm(hidden_size),
            nn.Dropout(0.1),
        ]
        self.net = nn.Sequential(*block(), *block(), nn.Linear(hidden_size, 1))

    def forward(self, hidden, prompt_mask, detach=False):
        """hidden (B, P, H), prompt_mask (B, P) → log Z (B,); detach: no gradient into the LM."""
        hidden = hidden.detach() if detach else hidden
        pooled = (hidden * prompt_mask[..., None]).sum(1) / prompt_mask.sum(1, keepdim=True).clamp(
            min=1
        )
        # NOTE: the head runs in fp32, outside autocast and outside FSDP's units (replicated); the
        # original's sits inside its bf16 FSDP module. A few MLP layers: the difference is rounding.
        return self.net(pooled.float()).squeeze(-1)


def kl_regularised_reward(rewards, logp_sum, ref_logp_sum, lengths, beta):
    """r' = r − (log π_old(y|x) − log π_ref(y|x)) / (β·|y|): the GRPO-KL control's reward. GRPO on
    r' maximises E[r] − KL(π‖π_ref)/(β·|y|), whose optimum is TB's p* (DEVIATION 6)."""
    return rewards - (logp_sum - ref_logp_sum) / (beta * lengths)


def grpo_loss(logp, old_logp, advantages, mask, clip_eps, token_count, dual_clip=0.0):
    """The baseline's clipped surrogate (GRPO): L = −Σ_t min(ρ_t·A, clip(ρ_t, 1−ε, 1+ε)·A) /
    N_tokens, with the dual clip at c·|A| for A < 0 when c > 0 (verl's).

    ρ_t = exp(logp − old_logp) per token; N_tokens counts the mini-batch's completion tokens
    (token-mean), so micro-batches add up to the one-shot loss. Returns (loss, stats): the clip
    fraction (a 0-d tensor) and ratio_dev, the largest |ρ_t − 1|."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg_loss = common.dual_clip(torch.maximum(pg_loss1, pg_loss2), advantages[:, None], dual_clip)
    stats = {
        "clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask),
        "ratio_dev": ((ratio.detach() - 1) * mask).abs().max().item(),
    }
    return (pg_loss * mask).sum() / token_count, stats


def row_targets(rewards, micro_batches, completions, args):
    """Each row's target, which its arm's loss reads: TB's r̂, the group-normalised reward
    (`--reward-norm group`, the paper) or r itself (DEVIATION 1); GRPO's A from r; GRPO-KL's A
    from r − log(π_old/π_ref)/(β·|y|), the sequence-level KL-regularised reward whose optimum is
    TB's target p* (DEVIATION 6)."""
    if args.algo == "flowrl":
        normalised = args.reward_norm == "group"
        return common.group_advantages(rewards, args.group_size) if normalised else rewards
    if args.algo == "grpo":
        return common.group_advantages(rewards, args.group_size)
    old_sums = torch.cat([sequence_logprob(mb.old_logp, mb.mask) for mb in micro_batches])
    ref_sums = torch.cat([sequence_logprob(mb.ref_logp, mb.mask) for mb in micro_batches])
    lengths = torch.tensor([len(c) for c in completions]).clamp(min=1)  # |y|
    shaped = kl_regularised_reward(rewards, old_sums.cpu(), ref_sums.cpu(), lengths, args.beta)
    return common.group_advantages(shaped, args.group_size)


def tb_loss(mb, logp, old_logp, prompt_states, targets, minibatch, *, head, args):
    """FlowRL's loss on one micro-batch (Prop. 1, the practical loss): log Z_φ(x) from the prompt's
    last hidden states (B, P, H), w from π_θ/π_old over the whole completion, the TB residual on
    length-normalised log-probs (DEVIATION 3) against its rows' r̂ (`targets`: the step's, by row),
    a mean over the mini-batch's rows."""
    log_z = head(prompt_states, mb.prompt_mask.float(), args.detach_logz)
    log_ratio = sequence_logprob(logp, mb.mask).detach() - sequence_logprob(old_logp, mb.mask)
    logp_norm = sequence_logprob(logp, mb.mask, length_normalize=True)
    ref_norm = sequence_logprob(mb.ref_logp, mb.mask, length_normalize=True)
    num_rows = sum(len(m.rows) for m in minibatch)
    return trajectory_balance_loss(
        log_z,
        logp_norm,
        ref_norm,
        targets[mb.rows],
        args.beta,
        log_ratio=log_ratio,
        clip_eps=args.clip_eps,
        num_rows=num_rows,
    )


def surrogate_loss(mb, logp, old_logp, prompt_states, targets, minibatch, *, args):
    """The GRPO arms' loss on one micro-batch: the clipped surrogate on its rows' A (`targets`: the
    step's, by row; `grpo_loss`), a token-mean over the mini-batch's completion tokens.
    `prompt_states` is log Z's input, which GRPO has no use for: the arms share one forward."""
    token_count = max(1, sum(int(m.mask.sum()) for m in minibatch))
    advantages = targets[mb.rows]
    return grpo_loss(
        logp, old_logp, advantages, mb.mask, args.clip_eps, token_count, dual_clip=args.dual_clip
    )


# ----------------------------------------------------------- rollouts, and an evaluation's numbers


@dataclasses.dataclass(frozen=True)
class Samples:
    """A rollout batch, one row per completion, a group's G contiguous: each row's prompt index
    and prompt, the completion's text and ids, and the sampler's log-probs of those ids."""

    prompt_ids: list
    prompts: list
    texts: list
    completions: list
    sampler_logps: list


@torch.no_grad()
def sample_groups(model, tokenizer, task, picked, seeds, generation):
    """G completions of each picked prompt (`seeds`: one per group) → Samples, in one `generate`
    call per --gen-batch rows.

    Each row draws from its own generator, seeded from its group's seed: a group's samples are the
    same whichever rank draws them and whatever shares the call, so N processes sample exactly what
    one process would."""
    prompt_ids = [i for i in picked for _ in range(generation.group_size)]
    prompts = [task.prompts[i] for i in prompt_ids]
    drawn = common.sample_completions(
        model,
        tokenizer,
        prompts,
        generation.max_new_tokens,
        temperature=generation.temperature,
        stop_at_eos=task.kind != "valleys",
        batch_rows=generation.gen_batch,
        precision=generation.mixed_precision,
        row_seeds=distributed.row_seeds(seeds, generation.group_size),
    )
    texts = [text for text, _, _ in drawn]
    completions = [ids for _, ids, _ in drawn]
    sampler_logps = [logp for _, _, logp in drawn]
    return Samples(prompt_ids, prompts, texts, completions, sampler_logps)


def scalars(metrics, all_keys=False):
    """The numbers among an evaluation's results (what metrics.jsonl logs per step); all_keys:
    everything but the toy's full distributions (what summary.json keeps)."""
    if all_keys:
        return {k: v for k, v in metrics.items() if k != "dists"}
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


# ---------------------------------------------------------------------------------------- training


def make_optimizer(model, head, args):
    """AdamW over the policy (lr) and, under TB only, the log Z head (logz_lr) → (optimizer, the
    trained parameters, which the gradient clip covers together as the original code does)."""
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.lr}]
    if args.algo == "flowrl":
        groups.append({"params": list(head.parameters()), "lr": args.logz_lr})
    for group in groups:
        group["base_lr"] = group["lr"]
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    return optimizer, [p for group in groups for p in group["params"]]


def warm_up(optimizer, step, warmup_steps):
    """Linear warm-up counted in rollout batches, as the original's scheduler (stepped once per
    rollout batch): lr = base_lr·min(1, (s − 1)/K) for rollout batch s = 1, 2, …, with
    K = --warmup-steps, so every optimiser step of the first batch runs at lr 0 (computed from s
    alone, so a resumed run continues it)."""
    factor = 1.0
    if warmup_steps > 0:
        factor = min(1.0, (step - 1) / warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor


def rollout_batches(args, num_prompts):
    """--steps, or with --total-epochs E: E·⌊prompts/B⌋, the original's length (its loader drops a
    last partial batch; verl's total_training_steps = len(train_dataloader)·total_epochs)."""
    per_epoch = num_prompts // args.prompts_per_step
    cli.check_args(
        [
            (
                args.sampling == "replacement" or per_epoch >= 1,
                f"--sampling shuffle: --prompts-per-step {args.prompts_per_step} is more "
                f"than the {num_prompts} prompts of one pass",
            )
        ]
    )
    return args.total_epochs * per_epoch if args.total_epochs else args.steps


def draw_prompts(step, num_prompts, args, gen):
    """The --prompts-per-step prompt indices of rollout batch `step` (1, 2, …): uniform draws with
    replacement from `gen` (--sampling replacement), or the step's slice of its pass's random
    order, each prompt once per pass (shuffle, as the original's shuffled loader). A pass's order
    is recomputed from (--seed, pass), so a resumed run continues it."""
    per_step = args.prompts_per_step
    if args.sampling == "replacement":
        return torch.randint(num_prompts, (per_step,), generator=gen)
    epoch, batch = divmod(step - 1, num_prompts // per_step)
    order_seed = (args.seed * 1_000_003 + epoch) % 2**63
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(order_seed))
    return order[batch * per_step : (batch + 1) * per_step]


def validate(args):
    """One line per bad flag (cli.check_args: every number's range, then these), before any model
    is built."""
    cli.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (args.temperature == 1.0, "--temperature must be 1.0: log-probs are scored at T = 1"),
            (
                (args.task == "math") == bool(args.data),
                "--task math (--preset full) needs --data FILE.jsonl; the other tasks take none",
            ),
            (
                not args.total_epochs or args.sampling == "shuffle",
                "--total-epochs counts passes without replacement: it needs --sampling shuffle",
            ),
            (
                args.task == "valleys" or args.valleys == Args.valleys,
                f"--valleys sets the toy's target; --task {args.task} has its own rewards",
            ),
            (
                flowrl_tasks.parse_valleys(args.valleys) is not None,
                "--valleys must list 1-64 rewards in (0, 1], e.g. 1,0.6,0.3 "
                f"(got {args.valleys!r})",
            ),
            (
                not (args.fsdp and args.lora_rank),
                "--fsdp shards a full fine-tune; a LoRA run keeps its base whole (drop one)",
            ),
            (
                (args.task == "valleys") != bool(args.model),
                f"--task {args.task} needs --model (or a preset: full, smollm2-addition, "
                "smollm2-numbers); the valleys toy builds its own model",
            ),
        ],
        args,
    )


def train(args):
    """Roll out G answers per prompt, score them, then TB (FlowRL) or clipped-surrogate (GRPO)
    updates. Returns the final metrics with the first evaluation under "before"."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = distributed.setup_accelerator(args.device, args.timeout)
    name = "flowrl" + ("" if args.task in ("valleys", "math") else f"-{args.task}")
    out_dir = Path(args.out_dir or f"runs/{name}{'' if args.algo == 'flowrl' else '-' + args.algo}")
    tracking.check_out_dir(out_dir, args, accelerator)
    tokenizer, model, task = flowrl_tasks.build(args, device)
    args = dataclasses.replace(args, steps=rollout_batches(args, len(task.prompts)))
    # π_ref: the same network with LoRA disabled, or a frozen copy of the starting weights
    ref_model = None if args.lora_rank else copy.deepcopy(model).eval().requires_grad_(False)
    autocast = common.training_autocast(device, args.mixed_precision)
    equal_count = None  # --fsdp: each rank holds 1/N of the policy's state and of π_ref
    if args.fsdp:
        bf16 = isinstance(autocast, torch.autocast)  # bf16 compute, fp32 master shards
        distributed.shard(model, bf16)
        distributed.shard(ref_model, bf16)
        equal_count = distributed.equal_count(accelerator)
    # π_old (where samples are reused) and π_ref (not for GRPO) scored once per rollout batch
    scoring = common.Scoring(
        tokenizer,
        args.micro_batch_tokens,
        device,
        model=model,
        reference=ref_model,
        precision=args.mixed_precision,
        with_reference=args.algo != "grpo",
        equal_count=equal_count,
    )
    generation = flowrl_tasks.Generation.from_args(args)
    head = LogZHead(model.config.hidden_size).to(device)  # log Z_φ(x)
    optimizer, trained = make_optimizer(model, head, args)
    gen = torch.Generator().manual_seed(args.seed)
    # the arm's loss on a micro-batch: TB (FlowRL), or the clipped surrogate (GRPO, GRPO-KL)
    if args.algo == "flowrl":
        arm_loss = functools.partial(tb_loss, head=head, args=args)
    else:
        arm_loss = functools.partial(surrogate_loss, args=args)
    evaluate = functools.partial(
        flowrl_tasks.evaluate,
        model,
        ref_model,
        tokenizer,
        task,
        beta=args.beta,
        generation=generation,
        accelerator=accelerator,
    )
    # TRY NOT TO MODIFY: with N processes (`accelerate launch`) each rank rolls out its block of
    # groups and the gradients are averaged once per optimiser step (distributed.average_gradients).
    mine = distributed.local_groups(args.prompts_per_step, accelerator)
    if accelerator.num_processes > 1:  # log Z's dropout: each rank draws its own masks
        torch.manual_seed(distributed.sampling_seed(args.seed, 0, accelerator.process_index))
    run = tracking.Run(
        out_dir,
        args,
        desc=args.algo,
        total_steps=args.steps,
        modules={"model": model, "head": head},
        optimizers={"optimizer": optimizer},
        generators={"rollouts": gen},
        main_process=accelerator.is_main_process,
    )
    main = accelerator.is_main_process  # every rank evaluates (sharded), rank 0 logs and writes
    start, extra = run.resume()
    first = extra["first"] if "first" in extra else evaluate()  # resumed: evaluated before
    # π_old = the trainer's no-grad forward before any update where samples are reused (else the
    # update's own log-probs, detached)
    reused = args.inner_steps * args.minibatches > 1 or args.algo == "grpo-kl"
    phases = tracking.Phases()  # each phase's seconds, logged (the benchmarks read them)
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. sample G completions per prompt (this rank's groups), keeping the sampler's log-probs
        with phases.time("rollout"):
            drawn = draw_prompts(step, len(task.prompts), args, gen)
            picked = drawn[mine.start : mine.stop].tolist()  # this rank's groups
            seeds = [distributed.sampling_seed(args.seed, step, group) for group in mine]
            with distributed.unsharded(model):  # --fsdp: gathered once, not per token
                samples = sample_groups(model, tokenizer, task, picked, seeds, generation)

        # 2. rewards r
        rewards = torch.tensor(list(map(task.reward, samples.prompt_ids, samples.texts)))

        # 3. --minibatches disjoint mini-batches, each in micro-batches of --micro-batch-tokens;
        #    π_old where samples are reused, π_ref once (not for GRPO)
        model.train()
        with phases.time("prepare"):
            minibatches = [
                common.scored_micro_batches(
                    samples.prompts,
                    samples.completions,
                    sampler_logps=samples.sampler_logps,
                    scoring=scoring,
                    rows=rows,
                    with_old=reused,
                )
                for rows in common.split_minibatches(len(samples.texts), args.minibatches)
            ]
        every_micro_batch = [mb for minibatch in minibatches for mb in minibatch if mb.rows]

        # 4. each row's target: TB's r̂ (FlowRL), or GRPO's A (GRPO, GRPO-KL)
        targets = row_targets(rewards, every_micro_batch, samples.completions, args).to(device)

        # 5. inner_steps epochs of one optimiser step per mini-batch, gradients accumulated over its
        #    micro-batches; the loss is normalised over the mini-batch's rows (TB) or tokens (GRPO)
        schedule = [minibatch for _ in range(args.inner_steps) for minibatch in minibatches]
        metrics = tracking.StepMetrics(num_updates=len(schedule))  # every update, micro-batch
        warm_up(optimizer, step, warmup_steps=args.warmup_steps)
        with phases.time("update"):
            for update, minibatch in enumerate(schedule):
                optimizer.zero_grad()
                # --fsdp: one gradient reduction, the empty micro-batches' passes (the iterator's)
                for mb in distributed.micro_batches(model, minibatch, autocast):
                    with autocast:  # log π_θ (B, W) and the prompt states log Z reads (B, P, H)
                        logp, prompt_states = common.micro_batch_forward(
                            model, mb, prompt_states=True
                        )
                    old_logp = common.old_logprobs(mb, logp)  # π_θ before the first update
                    loss, stats = arm_loss(mb, logp, old_logp, prompt_states, targets, minibatch)
                    common.check_finite(loss, step)
                    loss.backward()
                    gap = common.sampler_gap(mb, old_logp)
                    metrics.add(len(mb.rows), loss.item(), update=update, sampler_gap=gap, **stats)
                distributed.average_gradients(trained, accelerator)  # the update's one collective
                grad_norm = distributed.clip_grad_norm(trained, 1.0)  # log Z head included
                common.check_finite(grad_norm, step, "gradient norm")
                optimizer.step()

        # TRY NOT TO MODIFY: log the step's rewards (loss stats: rank 0's), evaluate, checkpoint
        all_rewards = accelerator.gather(rewards.to(device)).cpu()  # every rank's
        record = metrics.record(all_rewards, args.group_size, grad_norm, phases)
        record |= tracking.token_counts(samples.completions, every_micro_batch, args.inner_steps)
        record["lr"] = optimizer.param_groups[0]["lr"]
        if step % args.eval_every == 0 or step == args.steps:
            evaluation = evaluate()
            record |= scalars(evaluation)
        run.log(step, record, {"first": scalars(first, all_keys=True)})

    final = evaluation if start <= args.steps else evaluate()  # resumed after the last step: anew
    summary = flowrl_tasks.summary_of(
        scalars(first, all_keys=True), scalars(final, all_keys=True), args, task
    ) | {"sampler_logprob_max_dev": tracking.largest(run.records, "sampler_gap")}
    plots = flowrl_tasks.run_plots(first, final, args, task, out_dir) if main else []
    if task.kind != "valleys":  # the log Z head stays out of the exported model
        weights = distributed.full_weights(model)  # --fsdp: gathered to rank 0; else None
        if main:
            model.save_pretrained(out_dir / "policy", state_dict=weights)
            tokenizer.save_pretrained(out_dir / "policy")
    return run.finish(summary, plots)


def evaluate_only(args):
    """--eval-only: Avg@k of --model on --eval-data, nothing trained, as the original's test script
    after training (`flowrl_math_test.sh`: 16 answers per problem at T 0.6). Every rank samples its
    share of the rows with the whole model, as a training run's evaluation does."""
    needs = "--eval-only evaluates the math task (--preset full or full-7b) on --eval-data FILE"
    cli.check_args([(args.task == "math" and args.eval_data, needs)])
    accelerator, device = distributed.setup_accelerator(args.device, args.timeout)
    tokenizer, model, task = flowrl_tasks.build(args, device)
    generation = flowrl_tasks.Generation.from_args(args)
    return flowrl_tasks.avg_at_k(model, tokenizer, task, generation, accelerator)


if __name__ == "__main__":
    args = cli.parse_args(Args, PRESETS)
    tasks = flowrl_tasks
    if args.seeds and args.task == "numbers":  # FlowRL vs GRPO on SmolLM2: the answers' spread
        sweep_dir = args.out_dir or "runs/flowrl-numbers-sweep"
        sweep.seed_sweep(
            train, args, tasks.SPREAD_ARMS, tasks.spread_row, tasks.spread_claim, sweep_dir
        )
        tasks.plot_spread_comparison(sweep_dir)
    elif args.seeds:  # the toy: FlowRL, GRPO and GRPO-KL per seed
        sweep_dir = args.out_dir or "runs/flowrl-sweep"
        sweep.seed_sweep(
            train, args, tasks.SWEEP_ARMS, tasks.sweep_row, tasks.claim_holds, sweep_dir
        )
    else:
        summary = evaluate_only(args) if args.eval_only else train(args)
        if distributed.is_rank_zero():  # one final JSON, not one per rank
            print(json.dumps(summary, indent=2))
    distributed.leave_process_group()
