"""Flow-GRPO at full scale: Stable Diffusion 3.5 (diffusers) with LoRA on its attention projections,
the rewards (PickScore, CLIP score or any `module:function`), prompt files and the dtype plan.
"""

import importlib
from pathlib import Path

import torch
import torch.nn.functional as F

import common
from utils import cli

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
    "pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", 26.0),
}


def clip_reward(name, override, device):
    """r(image, prompt) = exp(logit_scale)·cos(f_img, f_txt) / divisor with a transformers
    CLIPModel; images go through CLIP's own image processor as uint8 (resize with antialias, centre
    crop), as official."""
    from transformers import AutoTokenizer, CLIPModel
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor  # PIL: no torchvision

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
            size={"shortest_edge": size},
            crop_size={"height": size, "width": size},
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
        )

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
            prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"
        ).to(device)
        out = model(
            input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels
        )
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
    if Path(path).suffix == ".jsonl":
        return [row["prompt"] for row in cli.read_jsonl(path, flag, ["prompt"])]
    return [line.strip() for _, line in cli.read_lines(path, flag)]


def weight_dtype(mixed_precision, device):
    """The frozen weights' dtype and the autocast dtype: auto = bf16 where the device multiplies it
    natively (`common.resolved_precision`), else fp32."""
    if mixed_precision == "auto":
        mixed_precision = common.resolved_precision(device)
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


DECODE_CHUNK = 8  # images the VAE decodes at once


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
                r=args.lora_rank,
                lora_alpha=2 * args.lora_rank,
                init_lora_weights="gaussian",
                target_modules=SD3_LORA_TARGETS,
            )
        )
        for p in self.policy.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # NOTE: trainable LoRA weights (and AdamW state) in fp32
        if args.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.autocast = torch.autocast(
            device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )
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
        """v_θ(x, t, c) of `net` (the transformer). The timestep stays fp32 (official)."""
        with self.autocast:
            v = net(
                hidden_states=x.to(self.dtype),
                timestep=(1000 * sigma).float().expand(len(x)),
                encoder_hidden_states=cond[0],
                pooled_projections=cond[1],
                return_dict=False,
            )[0]
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
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=128,
        )
        return embeds.to(self.dtype), pooled.to(self.dtype)

    def empty(self, n):
        return tuple(e.expand(n, *e.shape[1:]) for e in self.empty_embeds)

    @torch.no_grad()
    def decode(self, latents, chunk=DECODE_CHUNK):
        """Latents -> images in [0, 1], `chunk` at a time (fp32 activations at 512 px are 0.75 GiB
        per image: benchmarks/memory_plan.py; the original code decodes 8 at a time too)."""
        vae = self.pipe.vae
        latents = latents.float() / vae.config.scaling_factor + vae.config.shift_factor
        images = [vae.decode(part, return_dict=False)[0].float() for part in latents.split(chunk)]
        return (torch.cat(images) / 2 + 0.5).clamp(0, 1)

    def accuracy(self, images, prompts):
        return {}

    def save(self, out):
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        StableDiffusion3Pipeline.save_lora_weights(
            out / "lora", transformer_lora_layers=get_peft_model_state_dict(self.policy)
        )
