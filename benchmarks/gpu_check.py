"""The scripts' own training steps at full size on random weights: throughput, memory, MFU.

    python benchmarks/gpu_check.py         # on a GPU: flowrl.py --preset full (Qwen2.5-1.5B, full
                                           # fine-tune), rc_grpo.py --preset bfcl (Qwen2.5-7B +
                                           # LoRA), flow_grpo.py --preset sd3 (SD3.5-Medium + LoRA)
    python benchmarks/gpu_check.py --tiny  # the same calls on CPU, tiny configs (a smoke test)
    python benchmarks/gpu_check.py --plan  # the LLM presets' planned peak memory, by parts

Each job calls a script's own `train` with its preset for two steps and reads the second step
from the run's metrics.jsonl: the seconds of each phase (rollout, scoring, update) and the tokens
it generated and trained on. The first step is the warm-up (CUDA initialisation, kernel
selection). Only the weights are not real: `from_pretrained` of transformers and diffusers is
swapped, for the job's length, for a builder of the published configs with random weights on the
device (a word- or letter-level tokenizer, text encoders of one layer), so nothing is fetched.
Each job names what it cuts from the preset (fewer prompts per step: the same micro-batch and
sequence shapes); evaluation is skipped or cut to a few prompts.

Figures: rollout and update tokens/s (images/s for SD3), the update's MFU (`update_flops`: the
decoder layers' matmul weights for every token read, the LM head for completion positions only, no
embedding; 6 FLOPs per weight and token for a full fine-tune, 4 under LoRA: a frozen base
computes no weight gradients; attention and recomputation left out; over peak bf16 FLOP/s),
flowrl's decode bandwidth (`decode_bytes`: bf16 weights read once per decode step, and every
row's KV cache so far: one `generate` call per step at this batch), peak GPU memory allocated
and reserved (the caching allocator's) against the plan.
"""

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flow_grpo  # noqa: E402
import flowrl  # noqa: E402
import rc_grpo  # noqa: E402
from memory_plan import (  # noqa: E402
    full_plan, in_gib, kv_bytes_per_token, matmul_params, param_counts, preset_plans)
from utils import cli, distributed, models  # noqa: E402

# Dense bf16 tensor-core peaks (NVIDIA's datasheets halve their sparsity figures), by a part of the
# name torch reports, the more specific first: the PCIe and NVL cards clock lower than the SXM ones.
PEAK_BF16_FLOPS = {"H200 NVL": 835e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H200": 989e12,
                   "H100": 989e12, "A100": 312e12}
QWEN = {  # published configs (hidden, layers, heads, kv heads, intermediate, vocab)
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=2048, tie_word_embeddings=True),
}
SD3 = {  # SD3.5-Medium's transformer and VAE as published; its text encoders cut to one layer
    "sd3.5-medium": dict(
        transformer=dict(
            sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        vae=dict(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
            norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
            use_quant_conv=False, use_post_quant_conv=False),
        clip_widths=(768, 1280), t5_width=4096),
    "tiny": dict(
        transformer=dict(
            sample_size=16, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
            pooled_projection_dim=64, out_channels=4),
        vae=dict(
            down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(4,), latent_channels=4, norm_num_groups=1, sample_size=32,
            scaling_factor=1.5035, shift_factor=0.0609),
        clip_widths=(32, 32), t5_width=32),
}
CHAT_TEMPLATE = (  # the word-level tokenizer's: each message as "role: content", then the reply
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
WORDS = [f"w{i}" for i in range(1000)]


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def word_tokenizer():
    """A word-level tokenizer over WORDS with a plain chat template (the real ones are not
    fetched): the prompts the checks write are WORDS, one token each."""
    tokenizer = models.make_tokenizer(WORDS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sd3_pipeline(parts, device, dtype, folder):
    """A StableDiffusion3Pipeline of `parts` (SD3), random weights on `device` in `dtype`: two CLIP
    text encoders and a T5 of one layer each, at the widths the transformer reads."""
    from diffusers import (
        AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
        StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = models.letter_clip_tokenizer(folder)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    clip = lambda width: CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=1,
        num_attention_heads=width // 64 or 4, max_position_embeddings=77, projection_dim=width,
        **ids))
    t5_width = parts["t5_width"]
    with device:
        clip_l, clip_g = (clip(width) for width in parts["clip_widths"])
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer), d_model=t5_width, d_kv=64 if t5_width >= 64 else 8,
            d_ff=t5_width * 5 // 2, num_layers=1, num_heads=max(4, t5_width // 64)))
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**parts["transformer"]),
            vae=AutoencoderKL(in_channels=3, out_channels=3, **parts["vae"]),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=clip_l,
            tokenizer=tokenizer, text_encoder_2=clip_g, tokenizer_2=tokenizer, text_encoder_3=t5,
            tokenizer_3=tokenizer)
    return pipe.to(dtype)


@contextlib.contextmanager
def random_weights(device, llm=None, sd3=None):
    """For the `with` block, transformers' `from_pretrained` (AutoTokenizer, AutoModelForCausalLM)
    and diffusers' StableDiffusion3Pipeline.from_pretrained build the config `llm` / the parts
    `sd3` with random weights on `device`, in the dtype the script asks for."""
    from diffusers import StableDiffusion3Pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    def causal_lm(path, dtype=torch.float32, **kwargs):
        with device:
            return AutoModelForCausalLM.from_config(Qwen2Config(**llm), dtype=dtype)

    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        patch = lambda owner, builder: stack.enter_context(
            mock.patch.object(owner, "from_pretrained", builder))
        patch(AutoTokenizer, lambda *args, **kwargs: word_tokenizer())
        patch(AutoModelForCausalLM, causal_lm)
        patch(StableDiffusion3Pipeline,
              lambda path, dtype, **kwargs: sd3_pipeline(sd3, device, dtype, folder))
        yield


@contextlib.contextmanager
def no_policy_written():
    """The runs' trained policy is neither merged nor written at their end (rc_grpo: the 7B merged
    into fp32, 30.5 GB; flowrl: 6 GB): the check measures the steps, and the merge would set the
    job's peak memory."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    def skip(*args, **kwargs):
        return None

    with mock.patch.object(models, "merged_fp32", lambda model: model), \
            mock.patch.object(PreTrainedModel, "save_pretrained", skip), \
            mock.patch.object(PeftModel, "save_pretrained", skip):
        yield


def brightness(images, prompts):
    """The SD3 job's reward (`--reward __main__:brightness`): each image's mean pixel, a stand-in
    for PickScore, whose cost is not the trainer's."""
    return images.float().mean(dim=(1, 2, 3))


def second_step(script, argv, out_dir, metrics="metrics.jsonl"):
    """Run `script.train` on `argv` parsed as the script does (two steps) → (the second step's
    logged metrics, out_dir/`metrics`, and the peak GPU memory in GiB: allocated, reserved)."""
    args = cli.parse_args(script.Args, script.PRESETS, [
        *argv, "--save-every", "0", "--quiet", "--overwrite", "--out-dir", str(out_dir)])
    script.train(args)
    lines = (Path(out_dir) / metrics).read_text().splitlines()
    peak = (None, None)
    if torch.cuda.is_available():
        peak = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
    return json.loads(lines[-1]), peak


def update_flops(config, record, passes, lora):
    """The update's matmul FLOPs: a multiply-add per decoder-layer linear weight (q and o h×h, k
    and v h×kv·d, gate/up/down) for every token its forwards read, and per LM-head weight (V×h) for
    the completion positions only (`passes` over the generated tokens); the embedding is a lookup.
    ×6 for a full fine-tune (forward, input and weight gradients), ×4 under LoRA."""
    head = config["vocab_size"] * config["hidden_size"]
    multiply_adds = (matmul_params(config) * record["tokens_update"]
                     + head * record["tokens_rollout"] * passes)
    return (4 if lora else 6) * multiply_adds


def decode_bytes(config, params, rows, prompt_tokens, steps):
    """Bytes one `generate` call reads from memory over `steps` decode steps of `rows` rows: the
    bf16 weights once per step, and at step t every row's KV cache of prompt_tokens + t tokens."""
    kv_tokens = rows * (prompt_tokens * steps + steps * (steps - 1) / 2)
    return 2 * params * steps + kv_bytes_per_token(config) * kv_tokens


def figures(record, peak_gib, flops_done, device):
    """Throughput, MFU (`flops_done`: the update's FLOPs) and peak memory of a logged step
    (`record`)."""
    flops = peak_flops(device)
    result = {
        "rollout_s": round(record["time_rollout"], 2),
        "prepare_s": round(record["time_prepare"], 2), "update_s": round(record["time_update"], 2),
        "peak_gpu_gib": round(peak_gib[0], 2) if peak_gib[0] is not None else None,
        "peak_reserved_gib": round(peak_gib[1], 2) if peak_gib[1] is not None else None}
    if "tokens_update" in record:
        result |= {
            "rollout_tokens_per_s": round(record["tokens_rollout"] / record["time_rollout"], 1),
            "update_tokens_per_s": round(record["tokens_update"] / record["time_update"], 1),
            "update_mfu": round(flops_done / record["time_update"] / flops, 4) if flops
            else None}
    return result


def flowrl_job(tiny, device, out_dir):
    """flowrl.py --preset full (Qwen2.5-1.5B, full fine-tune, 1024 new tokens, micro-batches of
    8192 tokens, checkpointing) at 8 prompts × G 8 in 4 mini-batches of 16 rows (the preset: 32
    prompts in 16 of 16), prompts of 256 words."""
    config, prompt_words, extra = QWEN["qwen2.5-1.5b"], 256, []
    if tiny:
        config, prompt_words = QWEN["tiny"], 16
        extra = ["--max-new-tokens", "8", "--micro-batch-tokens", "128", "--device", "cpu"]
    data = Path(out_dir) / "prompts.jsonl"
    words = (WORDS * prompt_words)[:prompt_words]
    data.write_text("".join(json.dumps({"prompt": " ".join(words[i:] + words[:i]), "answer": "1"})
                            + "\n" for i in range(8)))
    argv = ["--preset", "full", "--model", "qwen2.5-1.5b", "--data", str(data), "--steps", "2",
            "--prompts-per-step", "8", "--minibatches", "4", "--eval-every", "1000", *extra]
    plan = full_plan(config, gen_rows=64, prompt_tokens=prompt_words + 10, new_tokens=1024,
                     micro_batch_tokens=8192)
    with random_weights(device, llm=config), no_policy_written():
        record, peak = second_step(flowrl, argv, Path(out_dir) / "run")
    params, _ = param_counts(config)
    result = {"job": "flowrl --preset full", "params": params,
              "plan_total_gib": max(in_gib(phase)["total"] for phase in plan.values())}
    passes = flowrl.PRESETS["full"].get("inner_steps", flowrl.Args.inner_steps)
    result |= figures(record, peak, update_flops(config, record, passes, lora=False), device)
    decode_steps = record["tokens_rollout"] / 64  # one generate call: rows share the length
    read = decode_bytes(config, params, 64, prompt_words + 10, decode_steps)
    result["decode_gb_per_s"] = round(read / record["time_rollout"] / 1e9, 1)
    return result


def rc_grpo_job(tiny, device, out_dir):
    """rc_grpo.py --preset bfcl (Qwen2.5-7B + LoRA r 64, the real BFCL v4 entries with bfcl-eval's
    system prompt and every function's docs; stage 1, stage 2; the policy not saved) on 2
    train and 2 test tasks, their first user turn, one RCTP-FT epoch, 2 tasks per step (the
    preset: 16)."""
    config, extra = QWEN["qwen2.5-7b"], []
    if tiny:
        config = QWEN["tiny"]
        extra = ["--max-new-tokens", "8", "--max-steps", "2", "--docs", "needed",
                 "--system-prompt", "short", "--device", "cpu"]
    argv = ["--preset", "bfcl", "--model", "qwen2.5-7b", "--max-tasks", "2", "--max-turns", "1",
            "--steps", "2", "--tasks-per-step", "2", "--rctp-epochs", "1", *extra]
    with random_weights(device, llm=config), no_policy_written():
        record, peak = second_step(
            rc_grpo, argv, Path(out_dir) / "run", metrics="rctp+rc-grpo/metrics.jsonl")
    params, _ = param_counts(config)
    return {"job": "rc_grpo --preset bfcl", "params": params} | figures(
        record, peak, update_flops(config, record, 1, lora=True), device)


def flow_grpo_job(tiny, device, out_dir):
    """flow_grpo.py --preset sd3 (SD3.5-Medium + LoRA r 32, 512 px, 10 SDE steps with CFG, β 0.01,
    checkpointing, micro-batches of 8) at 2 prompts × G 8 (the preset: 8 × 8); evaluation on 4
    prompts."""
    parts, extra = SD3["sd3.5-medium"], []
    if tiny:
        parts = SD3["tiny"]
        extra = ["--resolution", "16", "--eval-steps", "2", "--device", "cpu"]
    prompts = Path(out_dir) / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\na green bird\na cup\n")
    argv = ["--preset", "sd3", "--model", "sd3.5-medium", "--reward", "__main__:brightness",
            "--prompts", str(prompts), "--eval-prompts", str(prompts), "--epochs", "2",
            "--prompts-per-epoch", "2", "--eval-every", "1000", *extra]
    with random_weights(device, sd3=parts):
        record, peak = second_step(flow_grpo, argv, Path(out_dir) / "run")
    images = 2 * 8
    result = {"job": "flow_grpo --preset sd3", "images": images} | figures(
        record, peak, None, device)
    result["rollout_images_per_s"] = round(images / record["time_rollout"], 3)
    result["update_images_per_s"] = round(images / record["time_update"], 3)
    return result


def real_llm_plans():
    """{preset: planned peak} of the LLM presets at their own shapes (benchmarks/memory_plan.py,
    by term, in GiB): flowrl's full and rc_grpo's bfcl on one GPU at their larger phase, flowrl's
    full-7b sharded over 8 by phase."""
    plans = preset_plans()
    larger = lambda phases: max(map(in_gib, phases.values()), key=lambda gib: gib["total"])
    return {
        "flowrl full-7b (qwen2.5-7b, fsdp, per gpu of 8)": {
            phase: in_gib(terms) for phase, terms in plans["flowrl full-7b"].items()},
        "flowrl full (qwen2.5-1.5b)": larger(plans["flowrl full"]),
        "rc_grpo bfcl (qwen2.5-7b + lora)": larger(plans["rc_grpo bfcl"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny configs on CPU: checks the code, not the hardware"
    )
    parser.add_argument("--plan", action="store_true", help="print the LLM presets' planned peaks")
    args = parser.parse_args()
    if args.plan:
        for preset, plan in real_llm_plans().items():
            print(json.dumps({"preset": preset, "planned_peak_gib": plan}))
        return
    if not args.tiny and not torch.cuda.is_available():  # else the full-size jobs run on the CPU
        raise SystemExit(
            f"error: torch {torch.__version__} sees no CUDA GPU: run this on the GPU machine, or "
            "pass --tiny for the same code at tiny sizes on the CPU")
    device = torch.device("cpu") if args.tiny else distributed.setup_accelerator("auto")[1]
    for job in (flowrl_job, flow_grpo_job, rc_grpo_job):  # the longest last, for a timeout to cut
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.time()
        with tempfile.TemporaryDirectory() as out_dir:
            result = job(args.tiny, device, out_dir)
        result["job_s"] = round(time.time() - start, 1)
        print(json.dumps(result), flush=True)
        gc.collect()  # the job's models sit in reference cycles: free them before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
