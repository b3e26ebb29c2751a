"""Flow-GRPO for flow-matching image models: online RL through an SDE that shares the ODE's marginals.

Paper: "Flow-GRPO: Training Flow Matching Models via Online RL", Liu et al. 2025, arXiv 2505.05470.
Official code: yifan123/flow_grpo. Digest: REFERENCES.md §1.
NOT AgentFlow's "Flow-GRPO" (Li et al. 2025, arXiv 2510.05592), which trains an LLM planner inside a
multi-turn agent loop: that algorithm is agentflow.py. Same name, unrelated method.

A flow-matching sampler is a deterministic ODE, so an image has no likelihood and GRPO has no ratio.
Flow-GRPO swaps the ODE for a reverse-time SDE with the same marginal at every noise level (§1.2): each
denoising step becomes a Gaussian policy N(mean_θ, s²I), whose log-prob gives the per-step ratio. The
trajectory's group-relative advantage is applied at every trained step. Training samples use few steps
(10, "denoising reduction"); evaluation uses the full ODE schedule (40).

Equation map (REFERENCES.md section → function):
    §1.2 Eqs. 7–9  mean = x + [v + σ_t²/(2t)·(x + (1−t)·v)]·dt,  s = σ_t·√|dt|,  σ_t = a·√(t/(1−t))
                                                                               → sde_step_with_logprob
    §1.3           log N(x_next; mean, s²I), averaged over dims                → common.gaussian_logprob
    §1.4           KL = ‖mean_θ − mean_ref‖² / (2s²), averaged over dims        → gaussian_mean_kl
    §1.5           CFG v = v_∅ + w·(v_c − v_∅)                                  → guided_velocity
    §1.5           rollouts at train_steps with SDE, eval at eval_steps with ODE → rollout
    §0 / §1.5      A = clip((r − mean_prompt)/(std_prompt + 1e-4), ±5)          → common.group_advantages
    §0             per-step clipped surrogate on ρ = exp(logp − old_logp)       → common.clipped_policy_loss

Deviations (numbered, on purpose):
    1. Log-probs are averaged over latent dims (the official choice, §1.3), not summed as the density
       would be: the ratio is then a per-dimension geometric mean, stable in bf16/fp16, and the clip range
       is correspondingly tiny (1e-4 for SD3). The KL is averaged the same way so β keeps its meaning.
    2. The KL keeps the paper's s² = σ_t²·|dt| (the official code drops |dt|, issues #22/#27/#78).
    3. "Per-prompt stat tracking" = one group per prompt: every batch draws distinct prompts, so each
       group is exactly one prompt's G samples and common.group_advantages is the tracker.
    4. The toy trains the whole (tiny) velocity MLP with a frozen copy as reference; SD3 trains LoRA and
       its reference is the same transformer with the adapter disabled (§1.4), as the official code.

Toy (default, CPU, about a minute):   python flow_grpo.py
Full scale (one GPU, SD3.5-Medium):   python flow_grpo.py --preset sd3 --prompts prompts.txt
N GPUs (DDP, README):                 accelerate launch --num_processes N flow_grpo.py --preset sd3 ...
"""
import copy
import dataclasses
import hashlib
import importlib
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = dataclasses.field(default="", metadata={"help": "diffusers SD3 id or path ('' = toy digits MLP)"})
    prompts: str = dataclasses.field(default="", metadata={"help": "text file (one prompt per line) or JSONL {prompt}"})
    reward: str = dataclasses.field(default="digits", metadata={
        "help": "digits (toy classifier), clip, pickscore, or module:function taking (images, prompts)"})
    reward_model: str = dataclasses.field(default="", metadata={"help": "override the clip/pickscore model path"})
    epochs: int = dataclasses.field(default=150, metadata={"help": "rollout batches"})
    prompts_per_epoch: int = dataclasses.field(default=5, metadata={"help": "B distinct prompts per batch"})
    group_size: int = dataclasses.field(default=16, metadata={"help": "G images per prompt (paper: 24)"})
    train_steps: int = dataclasses.field(default=10, metadata={"help": "T denoising steps of training rollouts"})
    eval_steps: int = dataclasses.field(default=40, metadata={"help": "ODE steps for evaluation"})
    timestep_fraction: float = dataclasses.field(default=0.99, metadata={"help": "share of the T steps trained"})
    noise_level: float = dataclasses.field(default=0.7, metadata={"help": "a in σ_t = a·√(t/(1−t))"})
    guidance: float = dataclasses.field(default=1.0, metadata={"help": "CFG scale w (1 = no CFG, one pass)"})
    shift: float = dataclasses.field(default=1.0, metadata={"help": "scheduler shift (SD3: 3.0)"})
    clip_range: float = dataclasses.field(default=1e-3, metadata={"help": "ε of the per-step ratio clip (SD3: 1e-4)"})
    adv_clip: float = dataclasses.field(default=5.0, metadata={"help": "advantages clipped to ±adv_clip"})
    beta: float = dataclasses.field(default=0.05, metadata={"help": "β of the KL to the reference"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "AdamW learning rate"})
    minibatches: int = dataclasses.field(default=2, metadata={"help": "optimiser steps per rollout batch"})
    micro_batch: int = dataclasses.field(default=0, metadata={"help": "forward chunk (gradient accumulated; 0 = whole minibatch)"})
    lora_rank: int = dataclasses.field(default=0, metadata={"help": "LoRA rank on the attention projections (SD3)"})
    resolution: int = dataclasses.field(default=512, metadata={"help": "image size in pixels (SD3)"})
    mixed_precision: str = dataclasses.field(default="fp32", metadata={
        "help": "weights dtype; the SDE arithmetic is always fp32", "choices": ["fp32", "fp16", "bf16"]})
    label_noise: float = dataclasses.field(default=0.4, metadata={
        "help": "toy: share of pretraining labels replaced at random (how badly the base follows prompts)"})
    cache_dir: str = dataclasses.field(default="runs/flow_grpo_cache", metadata={"help": "toy: where the base model and reward classifier are cached"})
    eval_per_prompt: int = dataclasses.field(default=40, metadata={"help": "evaluation samples per prompt"})
    eval_every: int = dataclasses.field(default=10, metadata={"help": "epochs between evaluations"})
    seed: int = dataclasses.field(default=0, metadata={"help": "random seed"})
    out_dir: str = dataclasses.field(default="runs/flow_grpo", metadata={"help": "output folder"})
    device: str = dataclasses.field(default="auto", metadata={
        "help": "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU", "choices": ["auto", "cpu"]})
    quiet: bool = dataclasses.field(default=False, metadata={"help": "no per-step lines or progress bar"})
    save_every: int = dataclasses.field(default=50, metadata={"help": "epochs between checkpoints (0 = never)"})
    resume: bool = dataclasses.field(default=False, metadata={"help": "continue from out_dir/checkpoint.safetensors"})


# Official SD3.5-Medium recipe, one-GPU preset (REFERENCES.md §1.6): 512 px, 10/40 steps, a = 0.7, CFG 4.5,
# shift 3, G 8 × 8 prompts, clip 1e-4, adv clip 5, lr 3e-4, LoRA r 32 / α 64, fp16, β 0.01 for PickScore.
PRESETS = {"sd3": dict(model="stabilityai/stable-diffusion-3.5-medium", reward="pickscore", epochs=300,
                       prompts_per_epoch=8, group_size=8, guidance=4.5, shift=3.0, clip_range=1e-4, beta=0.01,
                       lr=3e-4, minibatches=2, micro_batch=8, lora_rank=32, mixed_precision="fp16",
                       eval_per_prompt=1, eval_every=50)}

# ----------------------------------------------------------------------------- the toy task: 8×8 digits


class DigitVelocity(nn.Module):
    """v_θ(x, t, c) for flattened 8×8 digits: an MLP on [x, Fourier features of t, class embedding].

    Class 10 is the empty prompt (trained by label dropout) so classifier-free guidance works.
    """

    def __init__(self, dim=64, hidden=256, classes=10):
        super().__init__()
        self.embed = nn.Embedding(classes + 1, 32)
        self.net = nn.Sequential(nn.Linear(dim + 32 + 16, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t, labels):
        freqs = t[:, None] * torch.pi * 2.0 ** torch.arange(8, device=x.device)  # (N, 8)
        return self.net(torch.cat([x, freqs.sin(), freqs.cos(), self.embed(labels)], 1))


def digits_split(seed):
    """scikit-learn's bundled 8×8 digits scaled to [−1, 1]: (train_x, train_y, test_x, test_y), 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 8.0 - 1.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def pretrain_velocity(x, y, label_noise, seed, steps=3000):
    """Conditional rectified flow: min ‖v_θ(x_t, t, c) − (x1 − x0)‖², x_t = (1−t)·x0 + t·x1 (§1.1).

    `label_noise` of the labels are replaced by random digits, so the base model follows its prompt
    only part of the time (the toy's analogue of SD3.5-M's 63% on GenEval); 10% go to the empty prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    model = DigitVelocity()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    noisy = torch.where(torch.rand(len(y), generator=gen) < label_noise, torch.randint(10, y.shape, generator=gen), y)
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
        loss = F.cross_entropy(model(x[idx] + 0.1 * torch.randn(x[idx].shape, generator=gen)), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False)


def build_toy(args, device):
    """Base velocity MLP + reward classifier, trained on first use and cached under runs/flow_grpo_cache."""
    from sklearn.linear_model import LogisticRegression

    train_x, train_y, test_x, test_y = digits_split(args.seed)
    key = hashlib.sha1(json.dumps([args.seed, args.label_noise]).encode()).hexdigest()[:10]
    cache = Path(args.cache_dir) / f"digits-{key}.safetensors"
    base, classifier = DigitVelocity(), nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10))
    if cache.exists():
        tensors, _ = common.load_checkpoint(cache)
        base.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("base.")})
        classifier.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("clf.")})
    else:
        base = pretrain_velocity(train_x, train_y, args.label_noise, args.seed)
        classifier = train_classifier(train_x, train_y, args.seed)
        common.save_checkpoint(cache, {**{f"base.{k}": v for k, v in base.state_dict().items()},
                                       **{f"clf.{k}": v for k, v in classifier.state_dict().items()}}, {})
    classifier = classifier.eval().requires_grad_(False).to(device)
    # An independent judge (logistic regression, never used as reward) to catch reward hacking.
    judge = LogisticRegression(max_iter=2000).fit(train_x.numpy(), train_y.numpy())
    reward_acc = (classifier(test_x.to(device)).argmax(1).cpu() == test_y).float().mean().item()
    policy = base.to(device)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # DEVIATION 4: frozen copy as π_ref

    def velocity_of(net):
        return lambda x, sigma, cond: net(x, sigma.expand(len(x)), cond[0])

    def reward(images, prompts):  # P(prompted digit) under the reward classifier
        return classifier(images).softmax(-1).gather(1, torch.tensor(prompts, device=images.device)[:, None])[:, 0]

    def judge_accuracy(images, prompts):
        return float(np.mean(judge.predict(images.cpu().numpy()) == np.array(prompts)))

    return {"prompts": list(range(10)), "latent_shape": (64,), "policy": policy,
            "velocity_of": velocity_of, "ref_velocity": velocity_of(reference),
            "encode": lambda prompts: (torch.tensor(prompts, device=device),),
            "empty": lambda n: (torch.full((n,), 10, device=device),),
            "decode": lambda latents: latents.clamp(-1, 1), "reward": reward,
            "is_correct": lambda images, prompts: classifier(images).argmax(1).cpu() == torch.tensor(prompts),
            "judge_accuracy": judge_accuracy, "info": {"reward_model_test_accuracy": reward_acc,
                                                       "judge_test_accuracy": judge.score(test_x.numpy(), test_y.numpy()),
                                                       "diversity_test_data": mean_pairwise_distance(test_x, test_y.tolist())},
            "save": lambda out: torch.save(policy.state_dict(), out / "policy.pt")}


# ----------------------------------------------------------------------------- full scale: SD3 + rewards

SD3_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out"]  # REFERENCES.md §1.6
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# name → (model id, tokenizer id, divisor). PickScore's /26 is the official scaling (§1.6).
CLIP_REWARDS = {"clip": ("openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14", 100.0),
                "pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", 26.0)}


def clip_reward(name, override, device):
    """r(image, prompt) = exp(logit_scale)·cos(f_img, f_txt) / divisor with a transformers CLIPModel."""
    from transformers import AutoTokenizer, CLIPModel

    model_id, tokenizer_id, divisor = CLIP_REWARDS[name]
    model_id, tokenizer_id = (override, override) if override else (model_id, tokenizer_id)
    try:
        model = CLIPModel.from_pretrained(model_id).eval().requires_grad_(False).to(device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_id)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: could not load reward model {model_id!r} ({type(err).__name__}); "
                         "check the id or HF cache, or pass --reward-model PATH") from None
    mean = torch.tensor(CLIP_MEAN, device=device)[:, None, None]
    std = torch.tensor(CLIP_STD, device=device)[:, None, None]

    def score(images, prompts):
        size = model.config.vision_config.image_size
        pixels = (F.interpolate(images.float(), size=(size, size), mode="bicubic", align_corners=False) - mean) / std
        text = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
        cos = F.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
        return model.logit_scale.exp() * cos / divisor

    return score


def load_reward(args, device):
    """`--reward`: clip, pickscore, or module:function, a callable (images in [0, 1], prompts) → (N,) scores."""
    if args.reward in CLIP_REWARDS:
        return clip_reward(args.reward, args.reward_model, device)
    module_name, _, fn_name = args.reward.partition(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"error: --reward {args.reward!r}: {err}; use clip, pickscore or module:function") from None


def load_prompts(path):
    """Prompts from a text file (one per line) or a JSONL of {"prompt": ...}; clear errors otherwise."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: --prompts {str(path)!r} is not a file")
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            lines = [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise SystemExit(f"error: {path}: every line must be JSON with a 'prompt' key ({err})") from None
    if not lines:
        raise SystemExit(f"error: {path} holds no prompts")
    return lines


def build_sd3(args, device):
    """StableDiffusion3Pipeline + peft LoRA on the attention projections; π_ref = adapter disabled."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype=dtype)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: could not load {args.model!r} ({type(err).__name__}: {str(err).splitlines()[0]}). "
                         "Check the id, accept its licence on the hub, or run the toy: --preset toy") from None
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, init_lora_weights="gaussian",
                                       target_modules=SD3_LORA_TARGETS))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # NOTE: trainable LoRA weights in fp32, the frozen base in `dtype`
    reward = load_reward(args, device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def velocity_of(net):  # net: the transformer, or its DDP wrapper for the training forward
        def velocity(x, sigma, cond):
            with autocast:
                v = net(hidden_states=x.to(dtype), timestep=(1000 * sigma).expand(len(x)).to(dtype),
                        encoder_hidden_states=cond[0], pooled_projections=cond[1], return_dict=False)[0]
            return v.float()  # NOTE: the SDE step runs in fp32 (§1.2: bf16 overflows there)
        return velocity

    def ref_velocity(x, sigma, cond):
        transformer.disable_adapters()
        try:
            return velocity_of(transformer)(x, sigma, cond)
        finally:
            transformer.enable_adapters()

    @torch.no_grad()
    def encode(prompts):  # text embeddings once per batch, passed as prompt_embeds (§1.6)
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                                  do_classifier_free_guidance=False)
        return embeds.to(dtype), pooled.to(dtype)

    empty_embeds = encode([""])

    @torch.no_grad()
    def decode(latents):
        latents = latents.to(dtype) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        return (pipe.vae.decode(latents, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)

    def save(out):
        StableDiffusion3Pipeline.save_lora_weights(out / "lora", transformer_lora_layers=get_peft_model_state_dict(transformer))

    side = args.resolution // pipe.vae_scale_factor
    return {"prompts": load_prompts(args.prompts), "latent_shape": (transformer.config.in_channels, side, side),
            "policy": transformer, "velocity_of": velocity_of, "ref_velocity": ref_velocity, "encode": encode,
            "empty": lambda n: tuple(e.expand(n, *e.shape[1:]) for e in empty_embeds), "decode": decode,
            "reward": reward, "is_correct": None, "judge_accuracy": None, "info": {}, "save": save}


# ----------------------------------------------------------------------------- the algorithm core


def sde_step_with_logprob(velocity, sample, sigma, sigma_next, noise_level, prev_sample=None, noise=None):
    """x_next ~ N(mean, s²I), mean = x + [v + σ_t²/(2t)·(x + (1−t)·v)]·dt, s = σ_t·√|dt|  (§1.2, Eqs. 7–9).

    Rectified-flow convention: t = sigma, t = 1 is noise, dt = sigma_next − sigma < 0; σ_t = a·√(t/(1−t))
    with a = noise_level, and at t = 1 the next sigma stands in for t in 1 − t (§1.2). Arithmetic in fp32.
    Given `prev_sample` the step only scores it; otherwise it samples with `noise` ~ N(0, I) (drawn here
    if None). Returns (prev_sample, log_prob (N,), mean, std).
    """
    if noise_level <= 0:
        raise ValueError("noise_level = 0 is the deterministic ODE: a transition has no density, so there is no "
                         "log-prob and no ratio (seed 002, question 1); use noise_level > 0 for training rollouts")
    velocity, sample = velocity.float(), sample.float()
    sigma, sigma_next = float(sigma), float(sigma_next)
    dt = sigma_next - sigma
    sigma_t = noise_level * math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma)))  # σ_t = a·√(t/(1−t))
    mean = sample + (velocity + sigma_t**2 / (2 * sigma) * (sample + (1 - sigma) * velocity)) * dt  # Eq. (9)
    std = sigma_t * math.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn_like(mean) if noise is None else noise.float().to(mean.device)
        prev_sample = mean + std * noise
    log_prob = common.gaussian_logprob(prev_sample.detach(), mean, std)  # §1.3, DEVIATION 1: mean over dims
    return prev_sample.detach(), log_prob, mean, std


def gaussian_mean_kl(mean, ref_mean, std):
    """KL(N(mean, s²I) ‖ N(ref_mean, s²I)) = ‖mean − ref_mean‖² / (2s²), averaged over dims → (N,)  (§1.4)."""
    return ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(1) / (2 * std**2)


def guided_velocity(velocity_fn, x, sigma, cond, empty, guidance):
    """v = v(x, ∅) + w·(v(x, c) − v(x, ∅)), classifier-free guidance (§1.5); w = 1 is one plain pass.
    Both halves go through one forward on the doubled batch (DDP allows one forward per backward)."""
    if guidance == 1.0:
        return velocity_fn(x, sigma, cond)
    v_cond, v_empty = velocity_fn(torch.cat([x, x]), sigma, tuple(torch.cat(pair) for pair in zip(cond, empty))).chunk(2)
    return v_empty + guidance * (v_cond - v_empty)


@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, cond, empty, guidance, noise_level, step_noise=None):
    """Our own denoising loop from t = 1 to 0. With noise_level > 0 every step is an SDE step (its noise
    step_noise[j], or drawn) and we keep what training re-scores: latents (T+1, N, ...) and log_probs (T, N).
    noise_level = 0 is the Euler ODE x_next = x + dt·v (evaluation; log_probs None)."""
    latents, log_probs = [noise.float()], []
    for j in range(len(sigmas) - 1):
        v = guided_velocity(velocity_fn, latents[-1], sigmas[j], cond, empty, guidance).float()
        if noise_level > 0:
            x_next, log_prob, _, _ = sde_step_with_logprob(v, latents[-1], sigmas[j], sigmas[j + 1], noise_level,
                                                           noise=None if step_noise is None else step_noise[j])
            log_probs.append(log_prob)
        else:
            x_next = latents[-1] + (sigmas[j + 1] - sigmas[j]) * v
        latents.append(x_next)
    return torch.stack(latents), (torch.stack(log_probs) if log_probs else None)


def score(reward_fn, images, prompts, name):
    """Call the (possibly user-supplied) reward; its failure or a non-finite score is one clear error."""
    try:
        scores = torch.as_tensor(reward_fn(images, prompts)).float().cpu().reshape(-1)
    except Exception as err:
        raise SystemExit(f"error: the reward {name!r} raised {type(err).__name__}: {err}") from None
    if scores.numel() != len(prompts) or not torch.isfinite(scores).all():
        raise SystemExit(f"error: the reward {name!r} must return one finite score per image "
                         f"(got {scores.numel()} scores for {len(prompts)} images, finite: {bool(torch.isfinite(scores).all())})")
    return scores


def schedule(num_steps, shift, device):
    """The N+1 sigmas of diffusers' FlowMatchEulerDiscreteScheduler (1 → 0), as the pipeline uses them (§1.1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float().to(device)


def mean_pairwise_distance(images, prompt_ids):
    """Diversity: mean L2 distance between two samples of the same prompt, averaged over prompts."""
    flat, labels, out = images.flatten(1).float(), torch.tensor(prompt_ids), []
    for p in labels.unique():
        group = flat[(labels == p).to(flat.device)]
        if len(group) > 1:
            d = torch.cdist(group, group)
            out.append(d.sum().item() / (len(group) * (len(group) - 1)))
    return float(np.mean(out))


# ----------------------------------------------------------------------------- training


def validate(args):
    common.check_args([
        (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
        (args.noise_level > 0, "--noise-level must be > 0: the ODE (a = 0) has no log-prob to train on"),
        (args.train_steps >= 2 and args.eval_steps >= 1, "--train-steps must be ≥ 2 and --eval-steps ≥ 1"),
        (0 < args.timestep_fraction <= 1, "--timestep-fraction must be in (0, 1]"),
        (args.clip_range > 0 and args.lr > 0 and args.beta >= 0, "--clip-range and --lr must be > 0, --beta ≥ 0"),
        (args.epochs >= 1 and args.minibatches >= 1, "--epochs and --minibatches must be ≥ 1"),
        (not args.model or args.prompts, "--preset sd3 (or --model) needs --prompts FILE"),
        (args.model or args.reward == "digits", "the toy (no --model) only has the digits reward"),
        (not args.model or args.lora_rank > 0, "--model needs --lora-rank > 0 (the reference is the disabled adapter)"),
    ])


def train(args):
    """Rollouts with the SDE → rewards → group advantages → per-step clipped ratio + β·KL, repeated."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    world = build_sd3(args, device) if args.model else build_toy(args, device)
    prompts_all = world["prompts"]
    common.check_args([(args.prompts_per_epoch <= len(prompts_all),
                        f"--prompts-per-epoch {args.prompts_per_epoch} > {len(prompts_all)} prompts available")])
    params = [p for p in world["policy"].parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)  # §1.6: wd 1e-4, grad-norm 1.0
    # More than one process (`accelerate launch`): the training forward goes through the DDP wrapper, which
    # averages gradients; rollouts and evaluation use the plain network. Each rank keeps its block of groups.
    velocity = world["velocity_of"](world["policy"])
    train_velocity = world["velocity_of"](accelerator.prepare(world["policy"]))
    mine = common.local_groups(args.prompts_per_epoch, accelerator)
    rows = slice(mine.start * args.group_size, mine.stop * args.group_size)
    train_sigmas = schedule(args.train_steps, args.shift, device)
    eval_sigmas = schedule(args.eval_steps, args.shift, device)
    trained_steps = max(1, int(args.train_steps * args.timestep_fraction))  # §1.5: the first 9 of 10
    out_dir = Path(args.out_dir)
    logger = common.RunLogger(out_dir, dataclasses.asdict(args) | {"preset": args.preset}, args.epochs,
                              "flow_grpo", quiet=args.quiet,
                              main_process=accelerator.is_main_process)
    gen = torch.Generator().manual_seed(args.seed)

    def evaluate():
        """ODE sampling at eval_steps from fixed noise: reward, accuracy, diversity (§1.5). Rank 0 only."""
        if not accelerator.is_main_process:
            return {}, None
        eval_gen = torch.Generator().manual_seed(args.seed + 1)
        prompts = [p for p in prompts_all for _ in range(args.eval_per_prompt)]
        images = []
        for chunk in range(0, len(prompts), 64):
            batch = prompts[chunk:chunk + 64]
            noise = torch.randn((len(batch), *world["latent_shape"]), generator=eval_gen).to(device)
            latents, _ = rollout(velocity, noise, eval_sigmas, world["encode"](batch), world["empty"](len(batch)),
                                 args.guidance, 0.0)
            images.append(world["decode"](latents[-1]))
        images = torch.cat(images)
        with torch.no_grad():
            metrics = {"reward": score(world["reward"], images, prompts, args.reward).mean().item()}
        if args.eval_per_prompt > 1:
            metrics["diversity"] = mean_pairwise_distance(images, [i // args.eval_per_prompt for i in range(len(prompts))])
        if world["is_correct"] is not None:
            metrics["accuracy"] = world["is_correct"](images, prompts).float().mean().item()
            metrics["accuracy_judge"] = world["judge_accuracy"](images, prompts)
        return metrics, images

    before, images_before = evaluate()
    first_ratio_dev, start = 0.0, 1
    checkpoint = out_dir / "checkpoint.safetensors"
    state_objects = ({"policy": world["policy"]}, {"optimizer": optimizer}, {"rollouts": gen})
    if args.resume and checkpoint.exists():  # weights (LoRA included), optimiser, RNGs, metrics so far
        done, extra = common.load_training_state(checkpoint, *state_objects)
        before, first_ratio_dev, start = extra["before"], extra["first_ratio_dev"], done + 1
        logger.restore(extra["records"])
    for epoch in range(start, args.epochs + 1):
        # --- rollouts: B distinct prompts × G samples (one group per prompt, DEVIATION 3). Every rank draws the
        # whole batch's prompts and noise from the same generator and keeps its rows: N processes sample
        # exactly what one process would, and no two ranks share noise.
        pick = torch.randperm(len(prompts_all), generator=gen)[:args.prompts_per_epoch].tolist()
        prompts = [prompts_all[i] for i in pick for _ in range(args.group_size)]
        noise = torch.randn((len(train_sigmas), len(prompts), *world["latent_shape"]), generator=gen)  # x_1, then per step
        prompts, noise = prompts[rows], noise[:, rows].to(device)
        cond, empty = world["encode"](prompts), world["empty"](len(prompts))
        latents, old_logp = rollout(velocity, noise[0], train_sigmas, cond, empty, args.guidance,
                                    args.noise_level, step_noise=noise[1:])  # (T+1, n, ...), (T, n)
        with torch.no_grad():
            rewards = score(world["reward"], world["decode"](latents[-1]), prompts, args.reward)
        advantages = common.group_advantages(rewards, args.group_size).clamp(-args.adv_clip, args.adv_clip).to(device)

        # --- updates: `minibatches` optimiser steps, each summing the trained steps of its samples
        perm = torch.randperm(args.prompts_per_epoch * args.group_size, generator=gen)
        perm = perm[(perm >= rows.start) & (perm < rows.stop)].to(device) - rows.start  # this rank's rows, shuffled
        stats_sum, kl_sum, n_terms = {}, 0.0, 0
        for m, batch in enumerate(perm.chunk(args.minibatches)):
            optimizer.zero_grad()
            for chunk in batch.split(args.micro_batch or len(batch)):
                sub_cond, sub_empty = tuple(c[chunk] for c in cond), tuple(e[chunk] for e in empty)
                for j in range(trained_steps):
                    v = guided_velocity(train_velocity, latents[j][chunk], train_sigmas[j], sub_cond, sub_empty,
                                        args.guidance)
                    _, logp, mean, std = sde_step_with_logprob(v, latents[j][chunk], train_sigmas[j], train_sigmas[j + 1],
                                                               args.noise_level, prev_sample=latents[j + 1][chunk])
                    if m == 0:  # nothing has been updated yet: the ratio must be exactly 1 (§1.3)
                        first_ratio_dev = max(first_ratio_dev, (logp.detach() - old_logp[j][chunk]).exp().sub(1).abs().max().item())
                    ones = torch.ones_like(logp)[:, None]
                    loss, stats = common.clipped_policy_loss(logp[:, None], old_logp[j][chunk][:, None],
                                                             advantages[chunk], ones, args.clip_range)
                    if args.beta > 0:
                        with torch.no_grad():
                            v_ref = guided_velocity(world["ref_velocity"], latents[j][chunk], train_sigmas[j], sub_cond,
                                                    sub_empty, args.guidance)
                            _, _, ref_mean, _ = sde_step_with_logprob(v_ref, latents[j][chunk], train_sigmas[j],
                                                                      train_sigmas[j + 1], args.noise_level,
                                                                      prev_sample=latents[j + 1][chunk])
                        kl = gaussian_mean_kl(mean, ref_mean, std).mean()
                        loss = loss + args.beta * kl
                        kl_sum += kl.item()
                    weight = len(chunk) / len(batch) / trained_steps
                    if not torch.isfinite(loss):
                        raise SystemExit(f"error: non-finite loss at epoch {epoch}; lower --lr or check the reward")
                    accelerator.backward(loss * weight)
                    n_terms += 1
                    for k, val in stats.items():
                        stats_sum[k] = stats_sum.get(k, 0.0) + val
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

        rewards = accelerator.gather(rewards.to(device)).cpu()  # the whole batch's rewards; loss stats are rank 0's
        record = {"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
                  "zero_var_frac": common.zero_variance_fraction(rewards, args.group_size), "kl": kl_sum / n_terms,
                  "first_ratio_dev": first_ratio_dev, **{k: v / n_terms for k, v in stats_sum.items()}}
        if epoch % args.eval_every == 0 and epoch < args.epochs:
            record |= {f"eval_{k}": v for k, v in evaluate()[0].items()}
        logger.log(epoch, **record)
        if args.save_every and epoch % args.save_every == 0 and accelerator.is_main_process:
            common.save_training_state(checkpoint, epoch, *state_objects, extra={
                "before": before, "first_ratio_dev": first_ratio_dev, "records": logger.records})

    if first_ratio_dev > 1e-5:
        print(f"WARNING: on-policy ratio deviated from 1 by {first_ratio_dev:.2e}: rollout and training differ")
    after, images_after = evaluate()
    logger.records[-1] |= {f"eval_{k}": v for k, v in after.items()}
    if accelerator.is_main_process:
        world["save"](out_dir)
    summary = {**{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
               "first_step_ratio_max_dev": first_ratio_dev, **world["info"]}
    if world["is_correct"] is not None and accelerator.is_main_process:
        plot_digit_grid(images_before, images_after, args.eval_per_prompt, out_dir / "samples.png")
    return logger.finish(summary, [("reward.png", ["reward", "zero_var_frac"], "flow_grpo: training reward"),
                                   ("eval.png", ["eval_accuracy", "eval_reward"], "flow_grpo: ODE evaluation"),
                                   ("kl.png", ["kl"], "flow_grpo: KL to the reference")])


def plot_digit_grid(before, after, per_prompt, path, columns=8):
    """Before/after ODE samples, one row per prompted digit (the same noise in both panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 5.5), dpi=100)
    for ax, images, title in [(axes[0], before, "base model"), (axes[1], after, "after Flow-GRPO")]:
        grid = images.view(10, per_prompt, 8, 8)[:, :columns].cpu()  # (digit, sample, row, col)
        grid = F.pad(grid, (1, 1, 1, 1), value=-1.0)  # a white frame around each sample
        ax.imshow(grid.permute(0, 2, 1, 3).reshape(100, 10 * grid.shape[1]).numpy(), cmap="gray_r", vmin=-1, vmax=1)
        ax.set(title=title, xticks=[], yticks=[5 + 10 * i for i in range(10)])
        ax.set_yticklabels([f"'{d}'" for d in range(10)])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    result = train(common.parse_args(Args, PRESETS))
    print(json.dumps(result, indent=2))
