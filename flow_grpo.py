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
    ratio      log N(x_next; mean, s²I), averaged over dims         → common.gaussian_logprob
    KL         ‖mean_θ − mean_ref‖² / (2σ_t²), averaged over dims (official)
                                                                    → gaussian_mean_kl
    CFG        v = v_∅ + w·(v_c − v_∅)                               → guided_velocity
    objective  per step: −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·KL       → step_loss
    GRPO       A = clip((r − mean_prompt)/(std + 1e-4), ±5)          → common.group_advantages
    rollouts   train_steps with the SDE, evaluation at eval_steps with the ODE
                                                                    → rollout

Deviations and choices (numbered; "official" = the authors' released code):
    1. Log-probs are averaged over latent dims (official), not summed as the density would be: the
       ratio is then a per-dimension geometric mean, and the clip range is correspondingly tiny
       (1e-4 for SD3).
    2. The KL on the means divides by σ_t² as the official code does (its sd3 train script), not by
       the paper's s² = σ_t²·|dt|: with 10 steps |dt| is 0.04–0.14 at shift 3, so the paper's form
       weighs each step's KL 7–25× more and β = 0.01/0.04 would mean something else.
    3. "Per-prompt stat tracking" = one group per prompt: every batch draws distinct prompts, so
       each group is one prompt's G samples. `--adv-std global` (official SD3 configs) divides by
       the std of the whole gathered batch; `group` by each group's own.
    4. The toy trains the whole (tiny) velocity MLP with a frozen copy as reference; SD3 trains LoRA
       and its reference is the same transformer with the adapter disabled, as official.
    5. CFG: both halves go through the trained transformer with gradient (the official SD3 script
       does the same; one forward on the doubled batch).
    6. Rollouts run in the training micro-batch shape (`--micro-batch` rows), so rollout and
       training pick the same kernels and the on-policy ratio stays 1 (logged:
       sampler_logprob_max_dev).
    Official defaults exposed as flags (sd3 preset): --adv-std global, --ema 0.9 (evaluation and
    saved weights), --drop-zero-advantage, T5 length 128, VAE and timestep in fp32, PickScore
    through CLIP's image processor on uint8 images.

Precision (NOTE): bf16 autocast on GPUs that support it (`--mixed-precision auto`); fp16 only with a
GradScaler, since the per-step gradients are ~1e-9 at high noise and underflow in fp16 (measured in
tests/test_flow_grpo.py). LoRA weights and optimiser state stay fp32; the SDE arithmetic is fp32.

Toy (CPU, under a minute after a one-time ~24 s pretraining; docs/flow_grpo.md):
    python flow_grpo.py               # ODE accuracy ~0.5 → ~0.99, ~76% of the diversity kept
    python flow_grpo.py --seeds 0-4   # the same on five seeds, one table
Full scale (one GPU, SD3.5-Medium, PickScore):
    python flow_grpo.py --preset sd3 --prompts train.txt --eval-prompts test.txt
N GPUs (DDP, docs/full_scale.md):
    accelerate launch --num_processes N flow_grpo.py --preset sd3 ...
Sample from the trained LoRA (sd3 preset), in Python (the tests reload it the same way):
    pipe = StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    pipe.to("cuda").load_lora_weights("runs/flow_grpo/lora")
    pipe("a red bicycle", num_inference_steps=40, guidance_scale=4.5).images[0].save("out.png")
"""

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import itertools
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import gather_object

import common
from utils import sweep, tracking

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = common.arg("", "diffusers SD3 id or path ('' = toy digits MLP)")
    prompts: str = common.arg("", "training prompts: text file or JSONL {prompt}")
    eval_prompts: str = common.arg(
        "", "evaluation prompts (a separate file; 'train' evaluates on the training prompts)")
    eval_max_prompts: int = common.arg(0, "cap on evaluation prompts (0 = all)")
    eval_batch: int = common.arg(64, "images sampled and scored per chunk")
    reward: str = common.arg(
        "digits",
        "digits (toy classifier), clip, pickscore, or module:function taking (images, prompts)")
    reward_model: str = common.arg("", "override the clip/pickscore model path")
    epochs: int = common.arg(150, "rollout batches")
    prompts_per_epoch: int = common.arg(5, "B distinct prompts per batch")
    group_size: int = common.arg(16, "G images per prompt (paper: 24)")
    train_steps: int = common.arg(10, "T denoising steps of training rollouts")
    eval_steps: int = common.arg(40, "ODE steps for evaluation")
    timestep_fraction: float = common.arg(0.99, "share of the T steps trained")
    noise_level: float = common.arg(0.7, "a in σ_t = a·√(t/(1−t))")
    guidance: float = common.arg(1.0, "CFG scale w (1 = no CFG, one pass)")
    shift: float = common.arg(1.0, "scheduler shift (SD3: 3.0)")
    clip_range: float = common.arg(1e-3, "ε of the per-step ratio clip (SD3: 1e-4)")
    adv_clip: float = common.arg(5.0, "advantages clipped to ±adv_clip")
    adv_std: str = common.arg(
        "group",
        "divide advantages by each group's std or the whole batch's (official SD3: global)",
        ["group", "global"])
    drop_zero_advantage: bool = common.arg(
        False, "leave samples with A = 0 out of the update (official)")
    beta: float = common.arg(0.05, "β of the KL to the reference")
    lr: float = common.arg(1e-3, "AdamW learning rate")
    ema: float = common.arg(
        0.0,
        "EMA decay of the trained weights used for evaluation and saving (0 = off; official 0.9)")
    minibatches: int = common.arg(2, "optimiser steps per rollout batch")
    micro_batch: int = common.arg(
        0, "rows per forward in rollouts and training (gradient accumulated; 0 = whole minibatch)")
    gradient_checkpointing: bool = common.arg(
        False, "recompute the transformer's activations in the backward pass (SD3)")
    lora_rank: int = common.arg(0, "LoRA rank on the attention projections (SD3)")
    resolution: int = common.arg(512, "image size in pixels (SD3)")
    mixed_precision: str = common.arg(
        "fp32",
        "auto: bf16 on GPUs that have it, else fp32; fp16 uses a GradScaler. The SDE math is fp32",
        ["auto", "fp32", "fp16", "bf16"])
    label_noise: float = common.arg(
        0.4,
        "toy: share of pretraining labels replaced at random (how badly the base follows prompts)")
    cache_dir: str = common.arg(
        "runs/flow_grpo_cache", "toy: where the base model and reward classifier are cached")
    eval_per_prompt: int = common.arg(40, "evaluation samples per prompt")
    eval_every: int = common.arg(10, "epochs between evaluations")
    seed: int = common.arg(0, "random seed")
    seeds: str = common.arg("", "seed sweep, e.g. 0-4: one run per seed, one table")
    out_dir: str = common.arg("runs/flow_grpo", "output folder")
    device: str = common.arg(
        "auto", "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"])
    quiet: bool = common.arg(False, "no per-step lines or progress bar")
    report_to: str = common.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = common.arg(50, "epochs between checkpoints (0 = never)")
    resume: bool = common.arg(False, "continue from out_dir/checkpoint.safetensors")


# Official SD3.5-Medium recipe, one-GPU preset: 512 px, 10/40 steps, a = 0.7, CFG 4.5, shift 3, G 8
# × 8 prompts, clip 1e-4, adv clip 5, lr 3e-4, LoRA r 32 / α 64, β 0.01 for PickScore, global std,
# EMA 0.9, zero-A dropped.
PRESETS = {
    "sd3": dict(
        model="stabilityai/stable-diffusion-3.5-medium", reward="pickscore", epochs=300,
        prompts_per_epoch=8, group_size=8, guidance=4.5, shift=3.0, clip_range=1e-4, beta=0.01,
        lr=3e-4, minibatches=2, micro_batch=8, lora_rank=32, mixed_precision="auto",
        adv_std="global", ema=0.9, drop_zero_advantage=True, gradient_checkpointing=True,
        eval_per_prompt=1, eval_every=50, eval_max_prompts=2048, eval_batch=16)
}

# ----------------------------------------------------------------------------- the math


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
    log_prob = common.gaussian_logprob(prev_sample.detach(), mean, std)
    return prev_sample.detach(), log_prob, mean, std


def gaussian_mean_kl(mean, ref_mean, std):
    """KL(N(mean, std²I) ‖ N(ref_mean, std²I)) = ‖mean − ref_mean‖² / (2·std²), averaged over dims →
    (N,)."""
    return ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(1) / (2 * std**2)


def guided_velocity(velocity_fn, x, sigma, cond, empty, guidance):
    """v = v(x, ∅) + w·(v(x, c) − v(x, ∅)), classifier-free guidance; w = 1 is one plain pass.
    Both halves go through one forward on the doubled batch (DDP allows one forward per
    backward)."""
    if guidance == 1.0:
        return velocity_fn(x, sigma, cond)
    both = tuple(torch.cat(pair) for pair in zip(cond, empty))
    v_cond, v_empty = velocity_fn(torch.cat([x, x]), sigma, both).chunk(2)
    return v_empty + guidance * (v_cond - v_empty)


def step_loss(v, v_ref, x, x_next, sigma, sigma_next, old_logp, advantages, args):
    """The per-step objective at one trained denoising step j of a trajectory:
        ρ = exp(log π_θ(x_{j+1}|x_j) − log π_old(x_{j+1}|x_j))   (Eqs. 7–9 give the density)
        L = mean_i [ −min(ρ_i·A_i, clip(ρ_i, 1−ε, 1+ε)·A_i) + β·KL_i ],  KL = ‖μ_θ − μ_ref‖²/(2σ_t²)
    v_ref None means β = 0. Returns (loss, logp, stats)."""
    _, logp, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, args.noise_level, prev_sample=x_next)
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_range, 1 + args.clip_range)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch of the clipped surrogate
    kl = torch.zeros_like(pg_loss)
    if v_ref is not None:
        _, _, ref_mean, _ = sde_step_with_logprob(
            v_ref, x, sigma, sigma_next, args.noise_level, prev_sample=x_next)
        # DEVIATION 2: official σ_t², not s²
        sigma_t = std / math.sqrt(float(sigma) - float(sigma_next))
        kl = gaussian_mean_kl(mean, ref_mean, sigma_t)
    loss = (pg_loss + args.beta * kl).mean()
    stats = {
        "clipfrac": (pg_loss2 > pg_loss1).float().mean().item(), "kl": kl.mean().item(),
        "ratio_max": ratio.max().item()}
    return loss, logp, stats


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
                v, latents[-1], sigmas[j], sigmas[j + 1], noise_level,
                noise=None if step_noise is None else step_noise[j])
            log_probs.append(log_prob)
        else:
            x_next = latents[-1] + (sigmas[j + 1] - sigmas[j]) * v
        latents.append(x_next)
    return torch.stack(latents), (torch.stack(log_probs) if log_probs else None)


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


def mean_pairwise_distance(images, prompt_ids):
    """Diversity: mean L2 distance between two samples of the same prompt, averaged over prompts."""
    flat, labels, out = images.flatten(1).float(), torch.tensor(prompt_ids), []
    for p in labels.unique():
        group = flat[(labels == p).to(flat.device)]
        if len(group) > 1:
            d = torch.cdist(group, group)
            out.append(d.sum().item() / (len(group) * (len(group) - 1)))
    return float(np.mean(out))


# ------------------------------------------------------------------------- the toy task: 8×8 digits


class DigitVelocity(nn.Module):
    """v_θ(x, t, c) for flattened 8×8 digits: an MLP on [x, Fourier features of t, class embedding].

    Class 10 is the empty prompt (trained by label dropout) so classifier-free guidance works.
    """

    def __init__(self, dim=64, hidden=256, classes=10):
        super().__init__()
        self.embed = nn.Embedding(classes + 1, 32)
        self.net = nn.Sequential(
            nn.Linear(dim + 32 + 16, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t, labels):
        freqs = t[:, None] * torch.pi * 2.0 ** torch.arange(8, device=x.device)  # (N, 8)
        return self.net(torch.cat([x, freqs.sin(), freqs.cos(), self.embed(labels)], 1))


def digits_split(seed):
    """scikit-learn's bundled 8×8 digits scaled to [−1, 1]: (train_x, train_y, test_x, test_y),
    80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 8.0 - 1.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def pretrain_velocity(x, y, label_noise, seed, steps=3000):
    """Conditional rectified flow: min ‖v_θ(x_t, t, c) − (x1 − x0)‖², x_t = (1−t)·x0 + t·x1.

    `label_noise` of the labels are replaced by random digits, so the base model follows its prompt
    only part of the time (the toy's analogue of SD3.5-M's 63% on GenEval); 10% go to the empty
    prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    model = DigitVelocity()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    noisy = torch.where(
        torch.rand(len(y), generator=gen) < label_noise, torch.randint(10, y.shape, generator=gen),
        y)
    for _ in range(steps):
        idx = torch.randint(len(x), (256,), generator=gen)
        x0, c = x[idx], noisy[idx]
        c = torch.where(torch.rand(len(c), generator=gen) < 0.1, torch.full_like(c, 10), c)
        x1 = torch.randn(x0.shape, generator=gen)
        t = torch.rand(len(x0), generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        loss = F.mse_loss(model(xt, t, c), x1 - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sched.step()
    return model


def train_classifier(x, y, seed, steps=600):
    """The reward model: a small MLP classifier of digits (cross-entropy, light input noise)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-3)
    for _ in range(steps):
        idx = torch.randint(len(x), (128,), generator=gen)
        loss = F.cross_entropy(
            model(x[idx] + 0.1 * torch.randn(x[idx].shape, generator=gen)), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False)


class DigitsTask:
    """The toy: prompts are the digits 0–9 (10 = empty), images flattened 8×8 in [−1, 1], the reward
    P(prompted digit) under a classifier, and an independent logistic-regression judge (never a
    reward)."""

    def __init__(self, args, device):
        from sklearn.linear_model import LogisticRegression

        train_x, train_y, test_x, test_y = digits_split(args.seed)
        key = hashlib.sha1(json.dumps([args.seed, args.label_noise]).encode()).hexdigest()[:10]
        cache = Path(args.cache_dir) / f"digits-{key}.safetensors"
        base, classifier = (
            DigitVelocity(), nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10)))
        # TRY NOT TO MODIFY: the base model and reward are trained once and cached
        if cache.exists():
            tensors, _ = tracking.load_checkpoint(cache)
            base.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("base.")})
            classifier.load_state_dict(
                {k[4:]: v for k, v in tensors.items() if k.startswith("clf.")})
        else:
            base = pretrain_velocity(train_x, train_y, args.label_noise, args.seed)
            classifier = train_classifier(train_x, train_y, args.seed)
            tracking.save_checkpoint(
                cache,
                {
                    **{f"base.{k}": v for k, v in base.state_dict().items()},
                    **{f"clf.{k}": v for k, v in classifier.state_dict().items()}},
                {},
            )
        self.device = device
        self.classifier = classifier.eval().requires_grad_(False).to(device)
        self.judge = LogisticRegression(max_iter=2000).fit(train_x.numpy(), train_y.numpy())
        self.prompts = self.eval_prompts = list(range(10))
        self.latent_shape = (64,)
        self.policy = base.to(device)
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)  # DEVIATION 4
        self.info = {
            "reward_model_test_accuracy": (
                self.classifier(test_x.to(device)).argmax(1).cpu() == test_y
            )
            .float()
            .mean()
            .item(),
            "judge_test_accuracy": self.judge.score(test_x.numpy(), test_y.numpy()),
            "diversity_test_data": mean_pairwise_distance(test_x, test_y.tolist()),
        }

    def velocity(self, net, x, sigma, cond):
        return net(x, sigma.expand(len(x)), cond[0])

    def ref_velocity(self, x, sigma, cond):
        return self.reference(x, sigma.expand(len(x)), cond[0])

    def encode(self, prompts):
        return (torch.tensor(prompts, device=self.device),)

    def empty(self, n):
        return (torch.full((n,), 10, device=self.device),)

    def decode(self, latents):
        return latents.clamp(-1, 1)

    def reward(self, images, prompts):
        probs = self.classifier(images.to(self.device)).softmax(-1)
        return probs.gather(1, torch.tensor(prompts, device=self.device)[:, None])[:, 0]

    def accuracy(self, images, prompts):
        """Accuracy under the reward classifier, and under the independent judge (catches reward
        hacking)."""
        wanted = torch.tensor(prompts)
        return {
            "accuracy": (self.classifier(images.to(self.device)).argmax(1).cpu() == wanted)
            .float()
            .mean()
            .item(),
            "accuracy_judge": float(
                np.mean(self.judge.predict(images.cpu().numpy()) == wanted.numpy())),
        }

    def save(self, out):
        torch.save(self.policy.state_dict(), out / "policy.pt")


# ------------------------------------------------------------------------ full scale: SD3 + rewards

SD3_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]  # the official LoRA targets
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# name → (model id, processor/tokenizer id, divisor). PickScore's /26 is the official scaling.
CLIP_REWARDS = {
    "clip": ("openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14", 100.0),
    "pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", 26.0)}


def clip_reward(name, override, device):
    """r(image, prompt) = exp(logit_scale)·cos(f_img, f_txt) / divisor with a transformers
    CLIPModel; images go through CLIP's own image processor as uint8 (resize with antialias, centre
    crop), as official."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil as CLIPImageProcessor,
        CLIPModel,
    )  # PIL: no torchvision

    model_id, processor_id, divisor = CLIP_REWARDS[name]
    model_id, processor_id = (override, override) if override else (model_id, processor_id)
    try:
        model = CLIPModel.from_pretrained(model_id).eval().requires_grad_(False).to(device)
        tokenizer = AutoTokenizer.from_pretrained(processor_id)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"error: could not load reward model {model_id!r} ({type(err).__name__}); "
            "check the id or HF cache, or pass --reward-model PATH"
        ) from None
    size = model.config.vision_config.image_size
    try:
        processor = CLIPImageProcessor.from_pretrained(processor_id)
    except OSError:  # no preprocessor_config.json: CLIP's standard processing at the model's size
        processor = CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size},
            image_mean=CLIP_MEAN, image_std=CLIP_STD)

    def reward(images, prompts):
        uint8 = (
            (images.float().clamp(0, 1) * 255)
            .round()
            .to(torch.uint8)
            .permute(0, 2, 3, 1)
            .cpu()
            .numpy()
        )
        pixels = processor(images=list(uint8), return_tensors="pt")["pixel_values"].to(device)
        text = tokenizer(
            prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
        out = model(
            input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
        cos = F.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
        return model.logit_scale.exp() * cos / divisor

    return reward


def load_reward(args, device):
    """`--reward`: clip, pickscore, or module:function, a callable (images in [0, 1], prompts) →
    (N,) scores."""
    if args.reward in CLIP_REWARDS:
        return clip_reward(args.reward, args.reward_model, device)
    module_name, _, fn_name = args.reward.partition(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise SystemExit(
            f"error: --reward {args.reward!r}: {err}; use clip, pickscore or module:function"
        ) from None


def load_prompts(path, flag="--prompts"):
    """Prompts from a text file (one per line) or a JSONL of {"prompt": ...}; clear errors
    otherwise."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: {flag} {str(path)!r} is not a file")
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            lines = [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise SystemExit(
                f"error: {path}: every line must be JSON with a 'prompt' key ({err})") from None
    if not lines:
        raise SystemExit(f"error: {path} holds no prompts")
    return lines


def weight_dtype(mixed_precision, device):
    """The frozen weights' dtype and the autocast dtype: auto = bf16 on a GPU that has it, else
    fp32."""
    if mixed_precision == "auto":
        mixed_precision = (
            "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
        )
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


class SD3Task:
    """StableDiffusion3Pipeline + peft LoRA on the attention projections; π_ref = the adapter
    disabled. Text embeddings are computed once per batch (T5 length 128, official); the VAE decodes
    in fp32."""

    def __init__(self, args, device):
        from diffusers import StableDiffusion3Pipeline
        from peft import LoraConfig

        self.dtype = weight_dtype(args.mixed_precision, device)
        try:
            pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype=self.dtype)
        except (OSError, ValueError) as err:
            raise SystemExit(
                f"error: could not load {args.model!r} "
                f"({type(err).__name__}: {str(err).splitlines()[0]})."
                " Check the id, accept its licence on the hub, or run the toy: --preset toy"
            ) from None
        pipe.to(device)
        # official: decode in fp32 (the VAE has no modules to keep apart)
        pipe.vae.to(torch.float32)
        pipe.set_progress_bar_config(disable=True)
        self.pipe, self.device = pipe, device
        self.policy = pipe.transformer.requires_grad_(False)
        self.policy.add_adapter(
            LoraConfig(
                r=args.lora_rank, lora_alpha=2 * args.lora_rank, init_lora_weights="gaussian",
                target_modules=SD3_LORA_TARGETS)
        )
        for p in self.policy.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # NOTE: trainable LoRA weights (and AdamW state) in fp32
        if args.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.autocast = torch.autocast(
            device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        self.reward = load_reward(args, device)
        self.prompts = load_prompts(args.prompts)
        self.eval_prompts = (
            self.prompts
            if args.eval_prompts == "train"
            else load_prompts(args.eval_prompts, "--eval-prompts")
        )
        side = args.resolution // pipe.vae_scale_factor
        self.latent_shape = (self.policy.config.in_channels, side, side)
        self.empty_embeds = self.encode([""])
        self.info = {}

    def velocity(self, net, x, sigma, cond):
        """v_θ(x, t, c); net is the transformer or its DDP wrapper. The timestep stays fp32
        (official)."""
        with self.autocast:
            v = net(
                hidden_states=x.to(self.dtype), timestep=(1000 * sigma).float().expand(len(x)),
                encoder_hidden_states=cond[0], pooled_projections=cond[1], return_dict=False)[0]
        return v.float()  # NOTE: the SDE step runs in fp32

    def ref_velocity(self, x, sigma, cond):
        self.policy.disable_adapters()
        try:
            return self.velocity(self.policy, x, sigma, cond)
        finally:
            self.policy.enable_adapters()

    @torch.no_grad()
    def encode(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=128)
        return embeds.to(self.dtype), pooled.to(self.dtype)

    def empty(self, n):
        return tuple(e.expand(n, *e.shape[1:]) for e in self.empty_embeds)

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        latents = latents.float() / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(latents, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)

    def accuracy(self, images, prompts):
        return {}

    def save(self, out):
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        StableDiffusion3Pipeline.save_lora_weights(
            out / "lora", transformer_lora_layers=get_peft_model_state_dict(self.policy))


# ----------------------------------------------------------------------------- training


def validate(args):
    common.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (
                args.noise_level > 0,
                "--noise-level must be > 0: the ODE (a = 0) has no log-prob to train on"),
            (
                args.train_steps >= 2 and args.eval_steps >= 1,
                "--train-steps must be ≥ 2 and --eval-steps ≥ 1"),
            (0 < args.timestep_fraction <= 1, "--timestep-fraction must be in (0, 1]"),
            (
                args.clip_range > 0 and args.lr > 0 and args.beta >= 0,
                "--clip-range and --lr must be > 0, --beta ≥ 0"),
            (args.epochs >= 1 and args.minibatches >= 1, "--epochs and --minibatches must be ≥ 1"),
            (
                0 <= args.ema < 1 and args.eval_batch >= 1,
                "--ema must be in [0, 1) and --eval-batch ≥ 1"),
            (not args.model or args.prompts, "--preset sd3 (or --model) needs --prompts FILE"),
            (
                not args.model or args.eval_prompts,
                "--preset sd3 needs --eval-prompts FILE (a held-out set; "
                "'--eval-prompts train' evaluates on the training prompts)",
            ),
            (
                args.model or args.reward == "digits",
                "the toy (no --model) only has the digits reward"),
            (
                not args.model or args.lora_rank > 0,
                "--model needs --lora-rank > 0 (the reference is the disabled adapter)"),
        ]
    )


@torch.no_grad()
def evaluate(task, args, velocity, sigmas, accelerator, keep_images=False):
    """ODE sampling at eval_steps from fixed noise, in chunks of --eval-batch; images go to the CPU
    as they are scored. Reward, and on the toy accuracy and diversity."""
    prompts = task.eval_prompts[: args.eval_max_prompts or None]
    prompts = [p for p in prompts for _ in range(args.eval_per_prompt)]
    noise = torch.randn(
        (len(prompts), *task.latent_shape), generator=torch.Generator().manual_seed(args.seed + 1))
    # each rank a share of the chunks; the toy (which keeps every image for its metrics) runs whole
    # on each
    rank, world = (0, 1) if keep_images else (accelerator.process_index, accelerator.num_processes)
    scores, images = [torch.zeros(0)], []
    for lo in range(rank * args.eval_batch, len(prompts), world * args.eval_batch):
        batch = prompts[lo : lo + args.eval_batch]
        latents, _ = rollout(
            velocity, noise[lo : lo + len(batch)].to(accelerator.device), sigmas,
            task.encode(batch), task.empty(len(batch)), args.guidance, 0.0)
        chunk = task.decode(latents[-1])
        scores.append(score(task.reward, chunk, batch, args.reward))
        if keep_images:
            images.append(chunk.cpu())
    scores = torch.cat(gather_object([torch.cat(scores)]) if world > 1 else scores)
    metrics = {"reward": scores.mean().item()}
    if keep_images:  # the toy: one process, all images
        images = torch.cat(images)
        metrics |= task.accuracy(images, prompts)
        if args.eval_per_prompt > 1:
            metrics["diversity"] = mean_pairwise_distance(
                images, [i // args.eval_per_prompt for i in range(len(prompts))])
    return metrics, images


def train(args):
    """Rollouts with the SDE → rewards → group advantages → per-step clipped ratio + β·KL,
    repeated."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    task = SD3Task(args, device) if args.model else DigitsTask(args, device)
    common.check_args(
        [
            (
                args.prompts_per_epoch <= len(task.prompts),
                f"--prompts-per-epoch {args.prompts_per_epoch} > "
                f"{len(task.prompts)} prompts available",
            )
        ]
    )
    params = [p for p in task.policy.parameters() if p.requires_grad]
    # official: wd 1e-4, grad-norm 1.0
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    fp16 = args.model and task.dtype == torch.float16
    # fp16 only with loss scaling (NOTE)
    scaler = torch.amp.GradScaler(device.type, enabled=bool(fp16))
    ema = [p.detach().clone() for p in params] if args.ema else None
    # TRY NOT TO MODIFY: with N processes the training forward goes through the DDP wrapper (it
    # averages gradients); rollouts and evaluation use the plain network. Each rank keeps its block
    # of groups.
    train_net = accelerator.prepare(task.policy)
    mine = common.local_groups(args.prompts_per_epoch, accelerator)
    rows = slice(mine.start * args.group_size, mine.stop * args.group_size)
    train_sigmas = schedule(args.train_steps, args.shift, device)
    eval_sigmas = schedule(args.eval_steps, args.shift, device)
    trained_steps = max(1, int(args.train_steps * args.timestep_fraction))  # the first 9 of 10
    out_dir = Path(args.out_dir)
    logger = tracking.RunLogger(
        out_dir, dataclasses.asdict(args) | {"preset": args.preset}, args.epochs, "flow_grpo",
        quiet=args.quiet, main_process=accelerator.is_main_process)
    gen = torch.Generator().manual_seed(args.seed)
    velocity = lambda x, sigma, cond: task.velocity(task.policy, x, sigma, cond)  # noqa: E731
    train_velocity = lambda x, sigma, cond: task.velocity(train_net, x, sigma, cond)  # noqa: E731

    def evaluate_now(keep_images=False):
        with swapped(params, ema):  # the EMA weights, when kept, are what is evaluated (official)
            return evaluate(task, args, velocity, eval_sigmas, accelerator, keep_images)

    toy = not args.model
    before, images_before = evaluate_now(keep_images=toy)
    sampler_dev, start = 0.0, 1
    checkpoint = out_dir / "checkpoint.safetensors"
    state_objects = ({"policy": task.policy}, {"optimizer": optimizer}, {"rollouts": gen})
    # TRY NOT TO MODIFY: weights, optimiser, RNGs, metrics so far
    if args.resume and checkpoint.exists():
        done, extra = tracking.load_training_state(checkpoint, *state_objects)
        before, sampler_dev, start = extra["before"], extra["sampler_dev"], done + 1
        logger.restore(extra["records"])
        ema = [p.detach().clone() for p in params] if args.ema else None
    for epoch in range(start, args.epochs + 1):
        # ALGO LOGIC
        # 1. B distinct prompts × G samples (one group per prompt, DEVIATION 3). Every rank draws
        #    the whole batch's prompts and noise from one generator and keeps its rows: N processes
        #    sample what one does.
        pick = torch.randperm(len(task.prompts), generator=gen)[: args.prompts_per_epoch].tolist()
        prompts = [task.prompts[i] for i in pick for _ in range(args.group_size)]
        # x_1, then steps
        noise = torch.randn((len(train_sigmas), len(prompts), *task.latent_shape), generator=gen)
        prompts, noise = prompts[rows], noise[:, rows].to(device)
        cond, empty = task.encode(prompts), task.empty(len(prompts))
        micro = args.micro_batch or len(prompts)
        # 2. SDE rollouts in the training micro-batch shape (DEVIATION 6), keeping latents and
        #    log-probs
        parts = [
            rollout(
                velocity, noise[0, k : k + micro], train_sigmas,
                tuple(c[k : k + micro] for c in cond), tuple(e[k : k + micro] for e in empty),
                args.guidance, args.noise_level, step_noise=noise[1:, k : k + micro])
            for k in range(0, len(prompts), micro)
        ]
        latents, old_logp = (
            torch.cat([p[0] for p in parts], 1),
            torch.cat([p[1] for p in parts], 1),
        )  # (T+1, n, ...)
        # 3. rewards → group advantages, shared by every step of a trajectory
        rewards = score(task.reward, task.decode(latents[-1]), prompts, args.reward)
        # the whole batch: global std, logging
        all_rewards = accelerator.gather(rewards.to(device)).cpu()
        advantages = common.group_advantages(all_rewards, args.group_size, scale=args.adv_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)[rows].to(device)
        # 4. `minibatches` optimiser steps, each over all trained steps of its samples
        order = torch.randperm(args.prompts_per_epoch * args.group_size, generator=gen)
        # this rank's rows
        order = order[(order >= rows.start) & (order < rows.stop)].to(device) - rows.start
        if args.drop_zero_advantage:
            order = order[advantages[order] != 0]
        stats_sum, n_terms = {}, 0
        for m, batch in enumerate(order.chunk(args.minibatches) if len(order) else []):
            optimizer.zero_grad()
            for chunk, j in itertools.product(batch.split(micro), range(trained_steps)):
                sub_cond, sub_empty = tuple(c[chunk] for c in cond), tuple(e[chunk] for e in empty)
                x, x_next = latents[j][chunk], latents[j + 1][chunk]
                v = guided_velocity(
                    train_velocity, x, train_sigmas[j], sub_cond, sub_empty, args.guidance)
                with torch.no_grad():
                    v_ref = (
                        guided_velocity(
                            task.ref_velocity, x, train_sigmas[j], sub_cond, sub_empty,
                            args.guidance)
                        if args.beta > 0
                        else None
                    )
                loss, logp, stats = step_loss(
                    v, v_ref, x, x_next, train_sigmas[j], train_sigmas[j + 1], old_logp[j][chunk],
                    advantages[chunk], args)
                # nothing has been updated yet: training must score what the rollout drew
                if m == 0:
                    sampler_dev = max(
                        sampler_dev, (logp.detach() - old_logp[j][chunk]).abs().max().item())
                if not torch.isfinite(loss):
                    raise SystemExit(
                        f"error: non-finite loss at epoch {epoch}; lower --lr or check the reward")
                accelerator.backward(scaler.scale(loss * len(chunk) / len(batch) / trained_steps))
                n_terms += 1
                stats_sum = {k: stats_sum.get(k, 0.0) + v for k, v in stats.items()}
            # clip the true gradient; a step with inf/NaN gradients is skipped
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()
            for average, p in zip(ema or [], params):  # official: an EMA of the LoRA weights
                average.lerp_(p.detach(), 1 - args.ema)

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        record = {
            "reward": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
            "zero_var_frac": common.zero_variance_fraction(all_rewards, args.group_size),
            "sampler_logprob_max_dev": sampler_dev, "trained_samples": len(order),
            **{k: v / max(1, n_terms) for k, v in stats_sum.items()}}
        if epoch % args.eval_every == 0 and epoch < args.epochs:
            record |= {f"eval_{k}": v for k, v in evaluate_now()[0].items()}
        logger.log(epoch, **record)
        if args.save_every and epoch % args.save_every == 0 and accelerator.is_main_process:
            tracking.save_training_state(
                checkpoint, epoch, *state_objects,
                extra={"before": before, "sampler_dev": sampler_dev, "records": logger.records})

    if sampler_dev > 1e-5:
        print(f"WARNING: training log-probs differ from the rollout's by up to {sampler_dev:.2e}")
    after, images_after = evaluate_now(keep_images=toy)
    logger.records[-1] |= {f"eval_{k}": v for k, v in after.items()}
    if accelerator.is_main_process:
        with swapped(params, ema):
            task.save(out_dir)
    summary = {
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()}, "sampler_logprob_max_dev": sampler_dev,
        **task.info}
    if "accuracy" in before:  # the row of `make demo`'s table
        summary["claim"] = {"text": "Flow-GRPO (images): ODE eval accuracy goes up",
                            "before": before["accuracy"], "after": after["accuracy"]}
    if toy and accelerator.is_main_process:
        plot_digit_grid(images_before, images_after, args.eval_per_prompt, out_dir / "samples.png")
    return logger.finish(
        summary,
        [
            ("reward.png", ["reward", "zero_var_frac"], "flow_grpo: training reward"),
            ("eval.png", ["eval_accuracy", "eval_reward"], "flow_grpo: ODE evaluation"),
            ("kl.png", ["kl"], "flow_grpo: KL to the reference")],
    )


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


def plot_digit_grid(before, after, per_prompt, path, columns=8):
    """Before/after ODE samples, one row per prompted digit (the same noise in both panels)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=100)
    axes = fig.subplots(1, 2)
    for ax, images, title in [(axes[0], before, "base model"), (axes[1], after, "after Flow-GRPO")]:
        grid = images.view(10, per_prompt, 8, 8)[:, :columns].cpu()  # (digit, sample, row, col)
        grid = F.pad(grid, (1, 1, 1, 1), value=-1.0)  # a white frame around each sample
        ax.imshow(
            grid.permute(0, 2, 1, 3).reshape(100, 10 * grid.shape[1]).numpy(), cmap="gray_r",
            vmin=-1, vmax=1)
        ax.set(title=title, xticks=[], yticks=[5 + 10 * i for i in range(10)])
        ax.set_yticklabels([f"'{d}'" for d in range(10)])
    fig.tight_layout()
    fig.savefig(path)


def sweep_row(summaries):
    """One seed of the sweep: ODE accuracy before and after, and diversity kept (after / before)."""
    s = summaries[""]
    return {
        "accuracy_before": s["accuracy_before"], "accuracy_after": s["accuracy_after"],
        "judge_after": s["accuracy_judge_after"],
        "diversity_kept": s["diversity_after"] / s["diversity_before"]}


def claim_holds(row):
    """The toy's claim on one seed: accuracy ≥ 0.95 with ≥ 70% of the base model's diversity."""
    return row["accuracy_after"] >= 0.95 and row["diversity_kept"] >= 0.7


if __name__ == "__main__":
    args = common.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(train, args, [("", {})], sweep_row, claim_holds, sweep_dir)
    else:
        print(json.dumps(train(args), indent=2))
