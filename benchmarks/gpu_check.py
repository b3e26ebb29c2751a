"""One rollout + update step of each full-size preset on random-init models: throughput, peak memory, MFU.

    python benchmarks/gpu_check.py            # on a GPU: Qwen2.5-1.5B full fine-tune, Qwen2.5-7B + LoRA,
                                              # the SD3.5-Medium transformer + LoRA (no downloads)
    python benchmarks/gpu_check.py --tiny     # the same code on CPU with tiny configs (a smoke test)

Models are built from their published configs with random weights, so nothing is fetched. MFU is
6·params·trained-tokens / time / peak bf16 FLOP/s for the update (2·params·tokens for generation), a
rough figure: attention FLOPs are left out.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import flow_grpo  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
QWEN = {  # published configs (hidden, layers, heads, kv heads, intermediate, vocab)
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llm_step(name, config, lora_rank, prompts, group_size, prompt_len, new_tokens, device, dtype):
    """GRPO step: generate G completions per prompt, score them, clipped loss, backward, AdamW step."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=dtype).to(device)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    n = prompts * group_size
    ids = torch.randint(config["vocab_size"], (n, prompt_len), device=device)
    sync(device)
    start = time.time()
    with torch.no_grad():
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    sync(device)
    gen_s = time.time() - start
    attn = torch.ones_like(seq)
    start = time.time()
    logp = common.completion_logprobs(model, seq, attn)[:, prompt_len - 1:]
    rewards = torch.rand(n, device=device)
    loss, _ = common.clipped_policy_loss(logp, logp.detach(), common.group_advantages(rewards.cpu(), group_size).to(device),
                                         torch.ones_like(logp))
    loss.backward()
    optimizer.step()
    sync(device)
    train_s = time.time() - start
    gen_tokens, train_tokens = n * new_tokens, n * seq.shape[1]
    flops = peak_flops(device)
    return {"preset": name, "params": params, "samples": n, "gen_tokens_per_s": round(gen_tokens / gen_s, 1),
            "train_tokens_per_s": round(train_tokens / train_s, 1),
            "gen_mfu": round(2 * params * gen_tokens / gen_s / flops, 4) if flops else None,
            "train_mfu": round(6 * params * train_tokens / train_s / flops, 4) if flops else None}


def sd3_step(config, lora_rank, images, steps, resolution, device, dtype):
    """Flow-GRPO step: SDE rollout with CFG, then the per-step clipped loss over the trained steps."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    transformer = SD3Transformer2DModel(**config).to(device, dtype).requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, init_lora_weights="gaussian",
                                       target_modules=flow_grpo.SD3_LORA_TARGETS))
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    params = sum(p.numel() for p in transformer.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=3e-4)
    side = resolution // 8 if config["in_channels"] == 16 else resolution
    embeds = torch.randn(images, 333, config["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(images, config["pooled_projection_dim"], device=device, dtype=dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def velocity(x, sigma, cond):
        with autocast:
            return transformer(hidden_states=x.to(dtype), timestep=(1000 * sigma).expand(len(x)).to(dtype),
                               encoder_hidden_states=cond[0], pooled_projections=cond[1], return_dict=False)[0].float()

    sigmas = flow_grpo.schedule(steps, 3.0, device)
    noise = torch.randn(images, config["in_channels"], side, side, device=device)
    sync(device)
    start = time.time()
    latents, old_logp = flow_grpo.rollout(velocity, noise, sigmas, (embeds, pooled), (embeds * 0, pooled * 0), 4.5, 0.7)
    sync(device)
    rollout_s = time.time() - start
    advantages = torch.randn(images, device=device)
    start = time.time()
    for j in range(steps - 1):
        v = flow_grpo.guided_velocity(velocity, latents[j], sigmas[j], (embeds, pooled), (embeds * 0, pooled * 0), 4.5)
        _, logp, _, _ = flow_grpo.sde_step_with_logprob(v, latents[j], sigmas[j], sigmas[j + 1], 0.7, prev_sample=latents[j + 1])
        loss, _ = common.clipped_policy_loss(logp[:, None], old_logp[j][:, None], advantages, torch.ones(images, 1, device=device), 1e-4)
        (loss / (steps - 1)).backward()
    optimizer.step()
    sync(device)
    return {"preset": "sd3.5-medium+lora", "params": params, "images": images, "resolution": resolution,
            "rollout_images_per_s": round(images / rollout_s, 3), "update_images_per_s": round(images / (time.time() - start), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU: checks the code, not the hardware")
    args = parser.parse_args()
    _, device = common.setup_accelerator("auto")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=512)
        jobs = [lambda: llm_step("tiny-full", small, 0, 2, 4, 16, 8, device, dtype),
                lambda: llm_step("tiny-lora", small, 8, 2, 4, 16, 8, device, dtype),
                lambda: sd3_step(dict(sample_size=16, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                                      num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                      pooled_projection_dim=64, out_channels=4), 4, 2, 3, 16, device, dtype)]
    else:
        jobs = [lambda: llm_step("qwen2.5-1.5b full", QWEN["qwen2.5-1.5b"], 0, 8, 8, 256, 512, device, dtype),
                lambda: llm_step("qwen2.5-7b lora", QWEN["qwen2.5-7b"], 64, 8, 8, 256, 512, device, dtype),
                lambda: sd3_step(SD35_MEDIUM, 32, 8, 10, 512, device, dtype)]
    for job in jobs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = job()
        result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
