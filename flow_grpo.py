"""Flow-GRPO for flow-matching image models: online RL through an SDE with the ODE's marginals.

Paper: "Flow-GRPO: Training Flow Matching Models via Online RL", Liu et al. 2025, arXiv 2505.05470.
NOT AgentFlow's "Flow-GRPO" (Li et al. 2025, arXiv 2510.05592), which trains an LLM planner inside a
multi-turn agent loop: that algorithm is agentflow.py. Same name, unrelated method.

A flow-matching sampler is a deterministic ODE, so an image has no likelihood and GRPO has no ratio.
Flow-GRPO swaps the ODE for a reverse-time SDE with the same marginal at every noise level: each
denoising step becomes a Gaussian policy N(mean_θ, s²I), whose log-prob gives the per-step ratio.
The trajectory's group-relative advantage is applied at every trained step. Training samples use few
steps (10, "denoising reduction"); evaluation uses the full ODE schedule (40).

Equation map (paper → function):
    Eqs. 7–9   mean = x + [v + σ_t²/(2t)·(x + (1−t)·v)]·dt,  s = σ_t·√|dt|,  σ_t = a·√(t/(1−t))
                                                                    → sde_step_with_logprob
    ratio      log N(x_next; mean, s²I), averaged over dims         → gaussian_logprob
    KL         ‖mean_θ − mean_ref‖² / (2σ_t²), averaged over dims (official)
                                                                    → gaussian_mean_kl
    CFG        v = v_∅ + w·(v_c − v_∅)                               → guided_velocity
    Eq. 5      per step: −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·KL       → step_loss
    Eq. 4      A = (R − mean_G R)/std_G R; as the official code computes it,
               (r − mean_prompt)/(std + 1e-4), std global or per prompt (Dev. 3)
                                                                    → common.group_advantages
               then clipped to ±5 (--adv-clip)                       → train, step 3
    rollouts   train_steps with the SDE, evaluation at eval_steps with the ODE
                                                                    → rollout

Deviations and choices (numbered; "official" = the authors' released code):
    1. Log-probs are averaged over latent dims (official), not summed as the density would be: the
       ratio is then a per-dimension geometric mean, and the clip range is correspondingly tiny
       (1e-4 for SD3).
    2. The KL on the means divides by σ_t² as the official code does (its sd3 train script), not by
       the paper's s² = σ_t²·|dt|: with 10 steps at shift 3, |dt| over the trained steps is
       0.040–0.269, so the paper's form weighs each step's KL 3.7–25× more.
    3. "Per-prompt stat tracking" = one group per prompt: every batch draws distinct prompts, so
       each group is one prompt's G samples. `--adv-std global` (official SD3 configs) divides by
       the std of the whole gathered batch, `group` by each group's; both the population std
       (÷G), as the original's tracker.
    4. The toy trains the whole (tiny) velocity MLP with a frozen copy as reference; SD3 trains LoRA
       and its reference is the same transformer with the adapter disabled, as official.
    5. (Not a deviation.) CFG: both halves go through the trained transformer with gradient, as
       the original script does (a detach of the unconditional half came and went again).
    6. Rollouts run in the training micro-batch shape (`--micro-batch` rows), so rollout and
       training pick the same kernels and the on-policy ratio stays 1 (sampler_ratio_max_dev).
    7. The sd3 preset (table in docs/flow_grpo.md) runs `--mixed-precision auto` (bf16; the original
       prefers fp16, also offered, with a GradScaler). `--drop-zero-advantage` drops every sample
       with A = 0, and what is left runs in `--micro-batch`-row training batches, so a batch with
       drops has fewer of them and the EMA (one call per training batch) moves fewer times. The
       original (`train_sd3.py`) turns back just enough A = 0 samples to make the count a multiple
       of its 8 training batches, which it always keeps, smaller: 4 EMA calls and 4 accumulated
       batches per optimiser step.
    8. The sd3 preset stops after `--epochs` 300 rollout batches; the original's loop
       (`train_sd3.py`) has no end: it trains until it is stopped.
    9. Under fp32 and bf16 a non-finite gradient norm stops the run with one line
       (`common.check_finite`), as a non-finite loss does. The original (`train_sd3.py`) checks
       neither: under bf16 it steps on it; under fp16, its default, its GradScaler skips that step
       and lowers its scale, as the GradScaler does here.

Precision (NOTE): bf16 autocast where the device multiplies bf16 natively (`--mixed-precision auto`:
a GPU, a CPU with AVX512-BF16 or AMX); fp16 only with a GradScaler, since the per-step gradients
are ~1e-9 at high noise and underflow in fp16 (measured in tests/test_flow_grpo.py). LoRA weights
and optimiser state stay fp32; the SDE arithmetic is fp32.

Toy (CPU, under a minute after a one-time ~24 s pretraining; docs/flow_grpo.md):
    python flow_grpo.py               # seed 0 (make demo's row)
    python flow_grpo.py --seeds 0-4   # five seeds, one table: ODE accuracy 0.507 → 0.996, 0.772
                                      # of the diversity kept, means (docs/flow_grpo.md)
Full scale (one GPU, SD3.5-Medium, PickScore):
    python flow_grpo.py --preset sd3 --prompts train.txt --eval-prompts test.txt
N GPUs (data-parallel, docs/full_scale.md):
    accelerate launch --num_processes N flow_grpo.py --preset sd3 ...
Sample from the trained LoRA (sd3 preset), in Python (the tests reload it the same way):
    pipe = StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    pipe.to("cuda").load_lora_weights("runs/flow_grpo/lora")
    pipe("a red bicycle", num_inference_steps=40, guidance_scale=4.5).images[0].save("out.png")
"""

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object

import common
from envs import digits, sd3
from utils import cli, distributed, sweep, tracking

# -------------------------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    preset: str = cli.arg("toy", "the preset these values start from (`--preset NAME` on the CLI)")
    model: str = cli.arg("", "diffusers SD3 id or path ('' = toy digits MLP)")
    prompts: str = cli.arg("", "training prompts: text file or JSONL {prompt}")
    eval_prompts: str = cli.arg(
        "", "evaluation prompts (a separate file; 'train' evaluates on the training prompts)"
    )
    eval_max_prompts: int = cli.arg(0, "cap on evaluation prompts (0 = all)")
    eval_batch: int = cli.arg(64, "images sampled and scored per chunk")
    reward: str = cli.arg(
        "digits",
        "digits (toy classifier), clip, pickscore, or module:function taking (images, prompts)",
    )
    reward_model: str = cli.arg("", "override the clip/pickscore model path")
    epochs: int = cli.arg(150, "rollout batches")
    prompts_per_epoch: int = cli.arg(5, "B distinct prompts per batch")
    group_size: int = cli.arg(16, "G images per prompt (paper: 24)")
    train_steps: int = cli.arg(10, "T denoising steps of training rollouts")
    eval_steps: int = cli.arg(40, "ODE steps for evaluation")
    timestep_fraction: float = cli.arg(0.99, "share of the T steps trained")
    noise_level: float = cli.arg(0.7, "a in σ_t = a·√(t/(1−t))")
    guidance: float = cli.arg(1.0, "CFG scale w (1 = no CFG, one pass)")
    shift: float = cli.arg(1.0, "scheduler shift (SD3: 3.0)")
    clip_range: float = cli.arg(1e-3, "ε of the per-step ratio clip (SD3: 1e-4)")
    adv_clip: float = cli.arg(5.0, "advantages clipped to ±adv_clip")
    adv_std: str = cli.arg(
        "group",
        "divide advantages by each group's std or the whole batch's (official SD3: global)",
        ["group", "global"],
    )
    drop_zero_advantage: bool = cli.arg(False, "leave samples with A = 0 out of the update")
    beta: float = cli.arg(0.05, "β of the KL to the reference")
    lr: float = cli.arg(1e-3, "AdamW learning rate")
    ema: float = cli.arg(
        0.0,
        "EMA decay of the trained weights used for evaluation and saving (0 = off; official 0.9)",
    )
    minibatches: int = cli.arg(2, "optimiser steps per rollout batch")
    micro_batch: int = cli.arg(
        0, "rows per forward in rollouts and training (gradient accumulated; 0 = whole minibatch)"
    )
    gradient_checkpointing: bool = cli.arg(
        False, "recompute the transformer's activations in the backward pass (SD3)"
    )
    lora_rank: int = cli.arg(0, "LoRA rank on the attention projections (SD3)")
    resolution: int = cli.arg(512, "image size in pixels (SD3)")
    mixed_precision: str = cli.arg(
        "fp32",
        "auto: bf16 on GPUs that have it, else fp32; fp16 uses a GradScaler. The SDE math is fp32",
        ["auto", "fp32", "fp16", "bf16"],
    )
    label_noise: float = cli.arg(
        0.4,
        "toy: share of pretraining labels replaced at random (how badly the base follows prompts)",
    )
    cache_dir: str = cli.arg(
        "runs/flow_grpo_cache", "toy: where the base model and reward classifier are cached"
    )
    eval_per_prompt: int = cli.arg(40, "evaluation samples per prompt")
    eval_every: int = cli.arg(10, "epochs between evaluations")
    seed: int = cli.arg(0, "random seed")
    seeds: str = cli.arg("", "seed sweep, e.g. 0-4: one run per seed, one table")
    out_dir: str = cli.arg("runs/flow_grpo", "output folder")
    device: str = cli.arg(
        "auto",
        "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"],
    )
    quiet: bool = cli.arg(False, "no per-step lines or progress bar")
    report_to: str = cli.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = cli.arg(50, "epochs between checkpoints (0 = never)")
    timeout: int = cli.arg(1800, "seconds a collective waits for the other ranks")
    resume: bool = cli.arg(False, "continue from out_dir/checkpoint.safetensors")
    overwrite: bool = cli.arg(
        False,
        "replace the run already in --out-dir (without it, or --resume, a folder holding a "
        "run is refused)",
    )


# The original SD3.5-Medium recipe at its one-GPU (OCR) configuration's shape with the PickScore
# configuration's β and reward; each value beside the original in docs/flow_grpo.md.
PRESETS = {
    "sd3": dict(
        model="stabilityai/stable-diffusion-3.5-medium",
        reward="pickscore",
        epochs=300,
        prompts_per_epoch=8,
        group_size=8,
        guidance=4.5,
        shift=3.0,
        clip_range=1e-4,
        beta=0.01,
        lr=3e-4,
        minibatches=2,
        micro_batch=8,
        lora_rank=32,
        mixed_precision="auto",
        adv_std="global",
        ema=0.9,
        drop_zero_advantage=True,
        gradient_checkpointing=True,
        eval_per_prompt=1,
        eval_every=60,
        eval_max_prompts=2048,
        eval_batch=16,
    )
}


# -------------------- the math: the SDE step and its log-prob, the per-step objective, its KL, CFG


def gaussian_logprob(x, mean, std):
    """log N(x; mean, std²·I) per element, **averaged** over all non-batch dims → (B,)
    (DEVIATION 1).

    Averaging (the official Flow-GRPO choice, inherited from DDPO; Flow-GRPO's averaged log-prob)
    makes the ratio a per-dimension geometric mean, so a sensible clip range is tiny (1e-4 for SD3,
    not 0.2); summing over 64×64×16 latent dims gives ratios that overflow.
    """
    x, mean = x.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    per_elem = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)
    return per_elem.flatten(1).mean(1)


def sde_step_with_logprob(
    velocity, sample, sigma, sigma_next, noise_level, prev_sample=None, noise=None
):
    """x_next ~ N(mean, s²I), mean = x + [v + σ_t²/(2t)·(x + (1−t)·v)]·dt, s = σ_t·√|dt|
    (Eqs. 7–9).

    Rectified-flow convention: t = sigma, t = 1 is noise, dt = sigma_next − sigma < 0; σ_t =
    a·√(t/(1−t)) with a = noise_level, and at t = 1 the next sigma stands in for t in 1 − t.
    Arithmetic in fp32. Given `prev_sample` the step only scores it; otherwise it samples with
    `noise` ~ N(0, I) (drawn here if None). Returns (prev_sample, log_prob (N,), mean, std).
    """
    if noise_level <= 0:
        raise ValueError(
            "noise_level = 0 is the deterministic ODE: a transition has no density, so there is no "
            "log-prob and no ratio; use noise_level > 0 for training rollouts"
        )
    velocity, sample = velocity.float(), sample.float()
    sigma, sigma_next = float(sigma), float(sigma_next)
    dt = sigma_next - sigma
    # σ_t = a·√(t/(1−t))
    sigma_t = noise_level * math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma)))
    # Eq. 9
    mean = sample + (velocity + sigma_t**2 / (2 * sigma) * (sample + (1 - sigma) * velocity)) * dt
    std = sigma_t * math.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn_like(mean) if noise is None else noise.float().to(mean.device)
        prev_sample = mean + std * noise
    # DEVIATION 1: mean over dims
    log_prob = gaussian_logprob(prev_sample.detach(), mean, std)
    return prev_sample.detach(), log_prob, mean, std


@dataclasses.dataclass(frozen=True)
class Objective:
    """Eq. 5's constants, read off the flags of the same names: the SDE's noise level a (Eq. 9),
    the ratio's clip ε and the KL weight β."""

    noise_level: float
    clip_range: float
    beta: float


def step_loss(v, v_ref, x, x_next, *, sigmas, old_logp, advantages, objective):
    """The per-step objective at one trained denoising step j of a trajectory, sigmas = (σ_j,
    σ_{j+1}):
        ρ = exp(log π_θ(x_{j+1}|x_j) − log π_old(x_{j+1}|x_j))   (Eqs. 7–9 give the density)
        L = mean_i [ −min(ρ_i·A_i, clip(ρ_i, 1−ε, 1+ε)·A_i) + β·KL_i ],  KL = ‖μ_θ − μ_ref‖²/(2σ_t²)
    v_ref None means β = 0. Returns (loss, stats)."""
    sigma, sigma_next = sigmas
    _, logp, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, objective.noise_level, prev_sample=x_next
    )
    ratio = torch.exp(logp - old_logp)  # Eq. 5's ρ
    clip = objective.clip_range
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch of the clipped surrogate
    kl = torch.zeros_like(pg_loss)
    if v_ref is not None:
        _, _, ref_mean, _ = sde_step_with_logprob(
            v_ref, x, sigma, sigma_next, objective.noise_level, prev_sample=x_next
        )
        # DEVIATION 2: official σ_t², not s²
        sigma_t = std / math.sqrt(float(sigma) - float(sigma_next))
        kl = gaussian_mean_kl(mean, ref_mean, sigma_t)
    loss = (pg_loss + objective.beta * kl).mean()  # Eq. 5
    stats = {
        "clipfrac": (pg_loss2 > pg_loss1).float().mean().item(),
        "kl": kl.mean().item(),
        "ratio_dev": (ratio.detach() - 1).abs().max().item(),
    }
    return loss, stats


def gaussian_mean_kl(mean, ref_mean, std):
    """KL(N(mean, std²I) ‖ N(ref_mean, std²I)) = ‖mean − ref_mean‖² / (2·std²), averaged over dims →
    (N,)."""
    return ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(1) / (2 * std**2)


def guided_velocity(velocity_fn, x, sigma, cond, empty, guidance):
    """v = v(x, ∅) + w·(v(x, c) − v(x, ∅)), classifier-free guidance; w = 1 is one plain pass.
    Both halves go through one forward on the doubled batch (the official SD3 script does the
    same)."""
    if guidance == 1.0:
        return velocity_fn(x, sigma, cond)
    both = tuple(torch.cat(pair) for pair in zip(cond, empty))
    v_cond, v_empty = velocity_fn(torch.cat([x, x]), sigma, both).chunk(2)
    return v_empty + guidance * (v_cond - v_empty)


# ---------------------------------------------------------------------------------------- rollouts


@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, cond, empty, guidance, noise_level, step_noise=None):
    """Our own denoising loop from t = 1 to 0. With noise_level > 0 every step is an SDE step (its
    noise step_noise[j], or drawn) and we keep what training re-scores: latents (T+1, N, ...) and
    log_probs (T, N). noise_level = 0 is the Euler ODE x_next = x + dt·v (evaluation; log_probs
    None)."""
    latents, log_probs = [noise.float()], []
    for j in range(len(sigmas) - 1):
        v = guided_velocity(velocity_fn, latents[-1], sigmas[j], cond, empty, guidance).float()
        if noise_level > 0:
            x_next, log_prob, _, _ = sde_step_with_logprob(
                v,
                latents[-1],
                sigmas[j],
                sigmas[j + 1],
                noise_level,
                noise=None if step_noise is None else step_noise[j],
            )
            log_probs.append(log_prob)
        else:
            x_next = latents[-1] + (sigmas[j + 1] - sigmas[j]) * v
        latents.append(x_next)
    return torch.stack(latents), (torch.stack(log_probs) if log_probs else None)


def sde_rollouts(velocity_fn, noise, sigmas, cond, empty, *, micro, guidance, noise_level):
    """`rollout` with the SDE over `micro` rows at a time: noise[0] is x_1 (n, ...), noise[1:] each
    step's noise. Returns latents (T+1, n, ...) and the sampler's log-probs (T, n)."""
    micro_rollouts = []
    for k in range(0, noise.shape[1], micro):
        rows = slice(k, k + micro)
        micro_rollout = rollout(
            velocity_fn,
            noise[0, rows],
            sigmas,
            cond=tuple(c[rows] for c in cond),
            empty=tuple(e[rows] for e in empty),
            guidance=guidance,
            noise_level=noise_level,
            step_noise=noise[1:, rows],
        )
        micro_rollouts.append(micro_rollout)
    latents, log_probs = zip(*micro_rollouts)
    return torch.cat(latents, 1), torch.cat(log_probs, 1)


def schedule(num_steps, shift, device):
    """The N+1 sigmas of diffusers' FlowMatchEulerDiscreteScheduler (1 → 0), as the pipeline uses
    them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float().to(device)


def score(reward_fn, images, prompts, name):
    """Call the (possibly user-supplied) reward; its failure or a non-finite score is one clear
    error."""
    try:
        scores = torch.as_tensor(reward_fn(images, prompts)).float().cpu().reshape(-1)
    except Exception as err:
        raise SystemExit(f"error: the reward {name!r} raised {type(err).__name__}: {err}") from None
    if scores.numel() != len(prompts) or not torch.isfinite(scores).all():
        raise SystemExit(
            f"error: the reward {name!r} must return one finite score per image (got "
            f"{scores.numel()} scores for {len(prompts)} images, "
            f"finite: {bool(torch.isfinite(scores).all())})"
        )
    return scores


@torch.no_grad()
def evaluate(task, args, velocity, sigmas, accelerator, keep_images=False):
    """ODE sampling at eval_steps from fixed noise, in chunks of --eval-batch; images go to the CPU
    as they are scored. Reward, and on the toy accuracy and diversity. Call it inside `swapped`
    so that the EMA weights, when kept, are what is evaluated (official)."""
    chosen = task.eval_prompts[: args.eval_max_prompts or None]
    prompts = [p for p in chosen for _ in range(args.eval_per_prompt)]
    noise = torch.randn(
        (len(prompts), *task.latent_shape), generator=torch.Generator().manual_seed(args.seed + 1)
    )
    # each rank a share of the chunks; the toy (which keeps every image for its metrics) runs whole
    # on each
    rank, world = (0, 1) if keep_images else (accelerator.process_index, accelerator.num_processes)
    score_chunks, image_chunks = [torch.zeros(0)], []
    for lo in range(rank * args.eval_batch, len(prompts), world * args.eval_batch):
        batch = prompts[lo : lo + args.eval_batch]
        latents, _ = rollout(
            velocity,
            noise[lo : lo + len(batch)].to(accelerator.device),
            sigmas,
            cond=task.encode(batch),
            empty=task.empty(len(batch)),
            guidance=args.guidance,
            noise_level=0.0,
        )
        chunk = task.decode(latents[-1])
        score_chunks.append(score(task.reward, chunk, batch, args.reward))
        if keep_images:
            image_chunks.append(chunk.cpu())
    my_scores = torch.cat(score_chunks)
    scores = torch.cat(gather_object([my_scores])) if world > 1 else my_scores
    metrics = {"reward": scores.mean().item()}
    images = torch.cat(image_chunks) if keep_images else None
    if keep_images:  # the toy: one process, all images
        metrics |= task.accuracy(images, prompts)
        if args.eval_per_prompt > 1:
            metrics["diversity"] = digits.mean_pairwise_distance(
                images, [i // args.eval_per_prompt for i in range(len(prompts))]
            )
    return metrics, images


@torch.no_grad()
def ema_update(ema, params, decay, step, every=8):
    """The original code's EMA of the trained weights, called once per training batch with
    s = the optimiser steps taken so far: when s + 1 is a multiple of `every`,
    ema ← d·ema + (1 − d)·θ with the warm-up d = min(decay, (1 + s)/(10 + s))."""
    if ema is not None and (step + 1) % every == 0:
        for average, p in zip(ema, params):
            average.lerp_(p.detach(), 1 - min(decay, (1 + step) / (10 + step)))


@contextlib.contextmanager
def swapped(params, ema):
    """Inside the block the EMA values stand in for `params` (nothing changes when ema is None)."""
    if ema is None:
        yield
        return
    saved = [p.detach().clone() for p in params]
    for p, e in zip(params, ema):
        p.data.copy_(e)
    try:
        yield
    finally:
        for p, s in zip(params, saved):
            p.data.copy_(s)


# ---------------------------------------------------------------------------------------- training


def validate(args):
    """One line per bad flag (cli.check_args: every number's range, then these), before any model
    is built."""
    full = bool(args.model)  # the sd3 preset
    cli.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (args.noise_level > 0, "--noise-level must be > 0: the ODE (a = 0) has no log-prob"),
            (args.train_steps >= 2, "--train-steps must be ≥ 2"),
            (args.timestep_fraction > 0, "--timestep-fraction must be in (0, 1]"),
            (args.ema < 1, "--ema must be in [0, 1)"),
            (
                args.resolution >= 16 and args.resolution % 16 == 0,
                f"--resolution must be a multiple of 16 (got {args.resolution})",
            ),
            (not full or args.prompts, "--preset sd3 (or --model) needs --prompts FILE"),
            (
                not full or args.eval_prompts,
                "--preset sd3 needs --eval-prompts FILE (a held-out set; "
                "'--eval-prompts train' evaluates on the training prompts)",
            ),
            (full or args.reward == "digits", "the toy (no --model) only has the digits reward"),
            (
                not Path(args.cache_dir).exists() or Path(args.cache_dir).is_dir(),
                f"--cache-dir {args.cache_dir!r} is not a folder",
            ),
            (
                not full or args.lora_rank > 0,
                "--model needs --lora-rank > 0 (the reference is the disabled adapter)",
            ),
        ],
        args,
    )


def train(args):
    """SDE rollouts → rewards → group advantages → per-step clipped ratio + β·KL, repeated."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = distributed.setup_accelerator(args.device, args.timeout)
    tracking.check_out_dir(args.out_dir, args, accelerator)
    task = sd3.SD3Task(args, device) if args.model else digits.DigitsTask(args, device)
    cli.check_args(
        [
            (
                args.prompts_per_epoch <= len(task.prompts),
                f"--prompts-per-epoch "
                f"{args.prompts_per_epoch} > {len(task.prompts)} prompts available",
            )
        ]
    )
    params = [p for p in task.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)  # official wd, clip 1.0
    fp16 = bool(args.model) and task.dtype == torch.float16  # fp16 only with loss scaling (NOTE)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    ema = torch.nn.ParameterList([p.detach().clone() for p in params]) if args.ema else None
    # TRY NOT TO MODIFY: with N processes each rank keeps its block of groups (gradients: below)
    mine = distributed.local_groups(args.prompts_per_epoch, accelerator)
    my_rows = slice(mine.start * args.group_size, mine.stop * args.group_size)
    train_sigmas = schedule(args.train_steps, args.shift, device)
    eval_sigmas = schedule(args.eval_steps, args.shift, device)
    trained_steps = max(1, int(args.train_steps * args.timestep_fraction))  # the first 9 of 10
    objective = Objective(noise_level=args.noise_level, clip_range=args.clip_range, beta=args.beta)
    micro_rows = args.micro_batch or len(mine) * args.group_size  # this rank's rows at a time
    sample = functools.partial(
        sde_rollouts, micro=micro_rows, guidance=args.guidance, noise_level=args.noise_level
    )
    out_dir, toy = Path(args.out_dir), not args.model
    gen = torch.Generator().manual_seed(args.seed)
    run = tracking.Run(
        out_dir,
        args,
        desc="flow_grpo",
        total_steps=args.epochs,
        modules={"policy": task.policy} | ({"ema": ema} if ema else {}),
        optimizers={"optimizer": optimizer},
        generators={"rollouts": gen},
        main_process=accelerator.is_main_process,
    )
    velocity = functools.partial(task.velocity, task.policy)  # v_θ(x, σ, cond)
    start, extra = run.resume()
    before, images_before = extra.get("before"), None  # resumed: evaluated before its checkpoint
    if before is None:
        with swapped(params, ema):
            before, images_before = evaluate(task, args, velocity, eval_sigmas, accelerator, toy)
    optimizer_steps = extra.get("updates", 0)  # optimiser steps so far (the EMA's clock)
    num_prompts = len(task.prompts)
    rollouts_per_epoch = args.prompts_per_epoch * args.group_size
    phases = tracking.Phases()  # each phase's seconds, logged (the benchmarks read them)
    for epoch in range(start, args.epochs + 1):
        # ALGO LOGIC
        # 1. B distinct prompts × G samples (one group per prompt, DEVIATION 3). Every rank
        #    draws the whole batch's prompts and noise from one generator and keeps its rows:
        #    N processes sample what one does.
        permutation = torch.randperm(num_prompts, generator=gen)
        picked = permutation[: args.prompts_per_epoch].tolist()
        batch_prompts = [task.prompts[i] for i in picked for _ in range(args.group_size)]
        noise_shape = (len(train_sigmas), len(batch_prompts), *task.latent_shape)
        batch_noise = torch.randn(noise_shape, generator=gen)  # x_1, then each step's noise
        prompts = batch_prompts[my_rows]  # this rank's rows
        noise = batch_noise[:, my_rows].to(device)
        cond = task.encode(prompts)
        empty = task.empty(len(prompts))

        # 2. SDE rollouts (Eq. 9) in the training micro-batch shape (DEVIATION 6):
        #    latents (T+1, n, ...) and the sampler's per-step log-probs (T, n)
        with phases.time("rollout"):
            latents, old_logp = sample(velocity, noise, train_sigmas, cond, empty)

        # 3. rewards → group advantages (Eq. 4), shared by every step of a trajectory
        with phases.time("prepare"):
            images = task.decode(latents[-1])
            rewards = score(task.reward, images, prompts, args.reward)
        all_rewards = accelerator.gather(rewards.to(device)).cpu()  # the whole batch's (global std)
        normalised = common.group_advantages(  # Eq. 4, the population std as the original
            all_rewards, args.group_size, scale=args.adv_std, unbiased=False
        )
        # this rank's rows, clipped at ±--adv-clip (the original's ±5)
        advantages = normalised.clamp(-args.adv_clip, args.adv_clip)[my_rows].to(device)

        # 4. `minibatches` optimiser steps, each over all trained steps of its
        #    samples: the clipped objective (Eq. 5) at every trained step j
        shuffled = torch.randperm(rollouts_per_epoch, generator=gen)
        my_order = distributed.rows_in_order(shuffled, my_rows).to(device)  # this rank's, shuffled
        order = my_order[advantages[my_order] != 0] if args.drop_zero_advantage else my_order
        # every rank takes the same `minibatches` steps, however many of its rows are left; one
        # process skips an empty one (e.g. every A = 0, dropped)
        minibatches = [
            minibatch
            for minibatch in torch.tensor_split(order, args.minibatches)
            if len(minibatch) or accelerator.num_processes > 1
        ]
        metrics = tracking.StepMetrics(num_updates=len(minibatches))  # each micro-batch, step j
        grad_norm = torch.zeros(())  # logged as 0 where no optimiser step runs (every A = 0)
        with phases.time("update"):
            for m, minibatch in enumerate(minibatches):
                optimizer.zero_grad()
                micro_batches = minibatch.split(micro_rows)
                for rows in micro_batches:
                    sub_cond = tuple(c[rows] for c in cond)
                    sub_empty = tuple(e[rows] for e in empty)
                    for j in range(trained_steps):  # every trained denoising step of these samples
                        x, x_next = latents[j][rows], latents[j + 1][rows]
                        sigma = train_sigmas[j]
                        step_old_logp = old_logp[j][rows]
                        v = guided_velocity(velocity, x, sigma, sub_cond, sub_empty, args.guidance)
                        v_ref = None  # β = 0 needs no reference
                        if args.beta:
                            with torch.no_grad():
                                v_ref = guided_velocity(
                                    task.ref_velocity, x, sigma, sub_cond, sub_empty, args.guidance
                                )
                        loss, stats = step_loss(
                            v,
                            v_ref,
                            x,
                            x_next,
                            sigmas=train_sigmas[j : j + 2],
                            old_logp=step_old_logp,
                            advantages=advantages[rows],
                            objective=objective,
                        )
                        common.check_finite(loss, epoch)
                        # its share of the mini-batch's mean over samples and steps
                        scaled = loss * len(rows) / len(minibatch) / trained_steps
                        scaler.scale(scaled).backward()
                        metrics.add(len(rows), scaled.item(), update=m, **stats)  # ratio_dev, …
                # the EMA steps once per micro-batch (the same count on every rank), as the
                # original: those before the optimiser step see the weights before it
                num_micro_batches = distributed.max_over_ranks(len(micro_batches), accelerator)
                for _ in range(num_micro_batches - 1):
                    ema_update(ema, params, args.ema, optimizer_steps)
                # the step's one collective; then clip the true gradient
                distributed.average_gradients(params, accelerator)
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                if not fp16:  # fp16: the GradScaler skips an overflowed step and lowers its scale
                    common.check_finite(grad_norm, epoch, "gradient norm")
                scaler.step(optimizer)
                scaler.update()
                optimizer_steps += 1
                ema_update(ema, params, args.ema, optimizer_steps)

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        record = metrics.record(all_rewards, args.group_size, grad_norm, phases)
        record["trained_samples"] = len(order)
        if epoch % args.eval_every == 0 and epoch < args.epochs:
            with swapped(params, ema):
                evaluation, _ = evaluate(task, args, velocity, eval_sigmas, accelerator)
            record |= {f"eval_{k}": v for k, v in evaluation.items()}
        saved = {"before": before, "updates": optimizer_steps}
        run.log(epoch, record, saved)

    # the first update scores what the rollout drew: on-policy its ρ is exactly 1
    sampler_dev = tracking.largest(run.records, "ratio_dev_first")
    if sampler_dev > 1e-5:
        print(f"WARNING: the first update's ratio ρ differs from 1 by up to {sampler_dev:.2e}")
    with swapped(params, ema):
        after, images_after = evaluate(task, args, velocity, eval_sigmas, accelerator, toy)
        if accelerator.is_main_process:
            task.save(out_dir)
    run.records[-1] |= {f"eval_{k}": v for k, v in after.items()}
    summary = {
        **{f"{k}_before": v for k, v in before.items()},
        **task.info,
        **{f"{k}_after": v for k, v in after.items()},
        "sampler_ratio_max_dev": sampler_dev,
    }
    if "accuracy" in before:  # the row of `make demo`'s table
        summary["claim"] = {
            "text": "Flow-GRPO (images): ODE eval accuracy goes up",
            "before": before["accuracy"],
            "after": after["accuracy"],
        }
    if toy and accelerator.is_main_process and images_before is not None:
        digits.plot_digit_grid(
            images_before, images_after, args.eval_per_prompt, path=out_dir / "samples.png"
        )
    return run.finish(
        summary,
        [
            ("reward.png", ["reward", "zero_var_frac"], "flow_grpo: training reward"),
            ("eval.png", ["eval_accuracy", "eval_reward"], "flow_grpo: ODE evaluation"),
            ("kl.png", ["kl"], "flow_grpo: KL to the reference"),
        ],
    )


if __name__ == "__main__":
    args = cli.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(train, args, [("", {})], digits.sweep_row, digits.claim_holds, sweep_dir)
    else:
        summary = train(args)
        if distributed.is_rank_zero():  # one final JSON, not one per rank
            print(json.dumps(summary, indent=2))
    distributed.leave_process_group()
