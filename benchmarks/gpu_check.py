"""One rollout + update step of each full-size preset on random weights: throughput, memory, MFU.

    python benchmarks/gpu_check.py         # on a GPU: Qwen2.5-1.5B full fine-tune, Qwen2.5-7B +
                                           # LoRA, SD3.5-Medium transformer + LoRA (no downloads)
    python benchmarks/gpu_check.py --tiny  # the same code on CPU, tiny configs (a smoke test)

Models are built on the device from their published configs with random weights, so nothing is
fetched. Each job runs one small warm-up iteration untimed (CUDA initialisation, kernel selection),
then its step: the sampler with per-row seeds and log-probs, the π_ref forward the presets run, the
loss, backward and AdamW. The update's MFU counts 6·N FLOPs per trained token for a full fine-tune
and 4·N under LoRA (a frozen base computes no weight gradients), over peak bf16 FLOP/s; attention
FLOPs are left out. Decoding is reported as achieved memory bandwidth (the weights read once per new
token), the figure that bounds it.
"""

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import flow_grpo  # noqa: E402
import flowrl  # noqa: E402
import rc_grpo  # noqa: E402
from envs import sd3  # noqa: E402
from utils import distributed, models  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
QWEN = {  # published configs (hidden, layers, heads, kv heads, intermediate, vocab)
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
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


def planned_peak_gib(config, lora_rank, rows, prompt_len, new_tokens, token_budget, checkpointing):
    """The preset's planned peak memory, by parts (GiB): weights (fp32 master weights for a full
    fine-tune, a bf16 base under LoRA), gradients and AdamW moments of the trained weights, the
    frozen reference (a full fine-tune's copy; under LoRA the adapter is switched off), the KV
    cache of `generate`, and one micro-batch of `token_budget` tokens: its saved activations
    (per layer only its input under checkpointing) and its completion logits (bf16, their fp32
    copy for logsumexp, and that copy's gradient: 18 bytes per element, as measured)."""
    h, layers, inter, vocab = (config[k] for k in (
        "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    head_dim, kv_heads = h // config["num_attention_heads"], config["num_key_value_heads"]
    per_layer = 4 * h * h + 2 * h * kv_heads * head_dim + 3 * h * inter
    params = layers * per_layer + vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    # LoRA on every linear layer: r·(in + out) each, q/o h→h, k/v h→kv·d, gate/up h→I, down I→h
    trained = lora_rank * layers * (9 * h + 2 * kv_heads * head_dim + 3 * inter) if lora_rank \
        else params
    seq = prompt_len + new_tokens
    micro_rows = max(1, token_budget // seq)
    layer_act = (12 * h + 4 * inter) * 2  # bytes per token of one layer's saved activations (bf16)
    activations = micro_rows * seq * (layers * h * 2 + layer_act if checkpointing
                                      else layers * layer_act)
    gib = {"weights": params * (2 if lora_rank else 4), "grads_and_adam": trained * 12,
           "reference": 0 if lora_rank else params * 4,  # the preset's frozen fp32 copy
           "kv_cache": rows * seq * layers * 2 * kv_heads * head_dim * 2,
           "activations": activations, "logits": micro_rows * (new_tokens + 1) * vocab * 18}
    gib = {k: round(v / 2**30, 2) for k, v in gib.items()}
    return gib | {"total": round(sum(gib.values()), 2)}


def llm_step(name, config, lora_rank, prompts, group_size, prompt_len, new_tokens, token_budget,
             checkpointing, device):
    """GRPO step as the scripts run it: fp32 master weights (LoRA: bf16 base, fp32 adapter) under
    bf16 autocast, generate G completions per prompt, then micro-batches of at most `token_budget`
    tokens (the preset's), activation checkpointing as the preset sets it, the clipped loss on the
    completion only, one AdamW step. Prints the planned peak first."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList, Qwen2Config

    n = prompts * group_size
    plan = planned_peak_gib(config, lora_rank, n, prompt_len, new_tokens, token_budget,
                            checkpointing)
    print(json.dumps({"preset": name, "planned_peak_gib": plan}), flush=True)
    base_dtype = torch.bfloat16 if lora_rank and device.type == "cuda" else torch.float32
    with device:  # random init on the device, not on the CPU
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=base_dtype)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    # π_ref as the presets hold it: a frozen copy for a full fine-tune, the adapter off under LoRA
    reference = None if lora_rank else copy.deepcopy(model).eval().requires_grad_(False)
    if lora_rank:
        model = models.add_lora(model, lora_rank)
    models.check_master_weights(model)
    autocast = common.training_autocast(device)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    config_kwargs = dict(do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)

    def step(ids, new):
        """The preset's step on prompts `ids`: sample `new` tokens per row (per-row seeds, the
        sampler's log-probs), then π_ref and the loss per micro-batch, backward, one AdamW step.
        Returns (generation seconds, update seconds, completed sequences)."""
        rows = len(ids)
        sampler = common.SampledLogprobs(1.0, row_seeds=list(range(rows)))
        sync(device)
        start = time.time()
        with torch.no_grad(), autocast:
            seq = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, logits_processor=LogitsProcessorList([sampler]),
                **config_kwargs)
        sync(device)
        gen_s = time.time() - start
        advantages = common.group_advantages(torch.rand(rows), 2).to(device)
        rows_per_mb = max(1, token_budget // seq.shape[1])
        model.train()
        start = time.time()
        for lo in range(0, rows, rows_per_mb):
            chunk = seq[lo : lo + rows_per_mb]
            attn = torch.ones_like(chunk)
            mask = torch.ones(len(chunk), new, device=device)
            with torch.no_grad(), autocast:
                common.reference_logprobs(model, reference, chunk, attn, new)
            with autocast:
                logp = common.completion_logprobs(model, chunk, attn, new)
            loss, _ = flowrl.grpo_loss(
                logp, logp.detach(), advantages[lo : lo + rows_per_mb], mask, 0.2, rows * new)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync(device)
        return gen_s, time.time() - start, seq

    step(torch.randint(config["vocab_size"], (2, 8), device=device), 2)  # the warm-up, untimed
    ids = torch.randint(config["vocab_size"], (n, prompt_len), device=device)
    gen_s, train_s, seq = step(ids, new_tokens)
    gen_tokens, train_tokens = n * new_tokens, n * seq.shape[1]
    flops, per_token = peak_flops(device), 4 if lora_rank else 6
    return {
        "preset": name, "params": params, "samples": n, "plan_total_gib": plan["total"],
        "rollout_s": round(gen_s, 2), "update_s": round(train_s, 2),
        "rollout_tokens_per_s": round(gen_tokens / gen_s, 1),
        "update_tokens_per_s": round(train_tokens / train_s, 1),
        "decode_gb_per_s": round(new_tokens * weight_bytes / gen_s / 1e9, 1),
        "update_mfu": round(per_token * params * train_tokens / train_s / flops, 4) if flops
        else None}


def sd3_step(config, lora_rank, images, steps, resolution, device):
    """Flow-GRPO step in the sd3 preset's precision (bf16 weights and autocast on a GPU that has it,
    fp32 LoRA), with its gradient checkpointing and β = 0.01 (the reference: the adapter off): SDE
    rollout with CFG, then step_loss over the trained steps; one small warm-up first, untimed."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    dtype = sd3.weight_dtype("auto", device)
    with device:  # random init on the device
        transformer = SD3Transformer2DModel(**config).to(dtype).requires_grad_(False)
    transformer.enable_gradient_checkpointing()  # as the sd3 preset
    transformer.add_adapter(
        LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, init_lora_weights="gaussian",
            target_modules=sd3.SD3_LORA_TARGETS)
    )
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    params = sum(p.numel() for p in transformer.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=3e-4)
    side = resolution // 8 if config["in_channels"] == 16 else resolution
    # 77 CLIP + 128 T5 text tokens, as the sd3 preset encodes them
    embeds = torch.randn(images, 205, config["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(images, config["pooled_projection_dim"], device=device, dtype=dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def velocity(x, sigma, cond):
        with autocast:
            return transformer(
                hidden_states=x.to(dtype), timestep=(1000 * sigma).float().expand(len(x)),
                encoder_hidden_states=cond[0], pooled_projections=cond[1], return_dict=False
            )[0].float()

    def reference(x, sigma, cond):  # the adapter off, as the sd3 preset's reference
        transformer.disable_adapters()
        try:
            return velocity(x, sigma, cond)
        finally:
            transformer.enable_adapters()

    sigmas = flow_grpo.schedule(steps, 3.0, device)
    loss_args = SimpleNamespace(noise_level=0.7, clip_range=1e-4, beta=0.01)

    def step(rows, trained_steps):
        """Roll out `rows` images, then the loss over `trained_steps` steps → (seconds, seconds)."""
        noise = torch.randn(rows, config["in_channels"], side, side, device=device)
        cond, empty = (embeds[:rows], pooled[:rows]), (embeds[:rows] * 0, pooled[:rows] * 0)
        sync(device)
        start = time.time()
        latents, old_logp = flow_grpo.rollout(velocity, noise, sigmas, cond, empty, 4.5, 0.7)
        sync(device)
        rollout_s = time.time() - start
        advantages = torch.randn(rows, device=device)
        start = time.time()
        for j in range(trained_steps):
            x, x_next = latents[j], latents[j + 1]
            v = flow_grpo.guided_velocity(velocity, x, sigmas[j], cond, empty, 4.5)
            with torch.no_grad():
                v_ref = flow_grpo.guided_velocity(reference, x, sigmas[j], cond, empty, 4.5)
            loss, _, _ = flow_grpo.step_loss(
                v, v_ref, x, x_next, sigma=sigmas[j], sigma_next=sigmas[j + 1],
                old_logp=old_logp[j], advantages=advantages, args=loss_args)
            (loss / trained_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
        sync(device)
        return rollout_s, time.time() - start

    step(1, 1)  # the warm-up, untimed
    rollout_s, update_s = step(images, steps - 1)
    return {
        "preset": "sd3.5-medium+lora", "params": params, "images": images, "resolution": resolution,
        "precision": str(dtype), "rollout_s": round(rollout_s, 2), "update_s": round(update_s, 2),
        "rollout_images_per_s": round(images / rollout_s, 3),
        "update_images_per_s": round(images / update_s, 3)}



def real_llm_jobs():
    """(name, config, LoRA rank, prompts, G, prompt tokens, new tokens, micro-batch token budget,
    checkpointing) of the two LLM jobs, budget and checkpointing from the presets themselves."""
    full, bfcl = flowrl.PRESETS["full"], rc_grpo.PRESETS["bfcl"]
    return [("qwen2.5-1.5b full", QWEN["qwen2.5-1.5b"], 0, 8, 8, 256, 512,
             full["micro_batch_tokens"], full["gradient_checkpointing"]),
            ("qwen2.5-7b lora", QWEN["qwen2.5-7b"], 64, 8, 8, 256, 512,
             bfcl["micro_batch_tokens"], bfcl["gradient_checkpointing"])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny configs on CPU: checks the code, not the hardware"
    )
    parser.add_argument("--plan", action="store_true", help="print the real jobs' planned peaks")
    args = parser.parse_args()
    _, device = distributed.setup_accelerator("auto")
    if args.tiny:
        small = dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512)
        jobs = [
            lambda: llm_step("tiny-full", small, 0, 2, 4, 16, 8, 60, True, device),
            lambda: llm_step("tiny-lora", small, 8, 2, 4, 16, 8, 60, False, device),
            lambda: sd3_step(
                dict(
                    sample_size=16, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                    num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                    pooled_projection_dim=64, out_channels=4),
                4,
                2,
                3,
                16,
                device,
            ),
        ]
    else:
        jobs = [lambda: llm_step(*real, device) for real in real_llm_jobs()]
        jobs.append(lambda: sd3_step(SD35_MEDIUM, 32, 8, 10, 512, device))
    if args.plan:
        for real in real_llm_jobs():
            print(json.dumps({"preset": real[0], "planned_peak_gib": planned_peak_gib(
                *real[1:3], real[3] * real[4], *real[5:])}))
        return
    for job in jobs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = job()
        result["peak_gpu_gib"] = (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None
        )
        print(json.dumps(result), flush=True)
        del result
        gc.collect()  # the job's model is in reference cycles: free it before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
