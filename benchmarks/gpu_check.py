"""The scripts' own training steps at full size on random weights: throughput, memory, MFU.

    python benchmarks/gpu_check.py         # on a GPU: flowrl.py --preset full (Qwen2.5-1.5B, full
                                           # fine-tune), flow_grpo.py --preset sd3 (SD3.5-Medium +
                                           # LoRA), flowrl.py --preset full-7b's --fsdp path on one
                                           # rank (Qwen2.5-1.5B), rc_grpo.py --preset bfcl
                                           # (Qwen2.5-7B + LoRA)
    python benchmarks/gpu_check.py --tiny  # the same calls on CPU, tiny configs (a smoke test)
    python benchmarks/gpu_check.py --plan  # the LLM presets' planned peak memory, by parts

Each job calls a script's own `train` with its preset for two steps and reads the second step
from the run's metrics.jsonl: the seconds of each phase (rollout, scoring, update) and the tokens
it generated and trained on. The first step is the warm-up (CUDA initialisation, kernel
selection). Only the weights are not real: `from_pretrained` of transformers and diffusers is
swapped, for the job's length, for a builder of the published configs with random weights on the
device (a word- or letter-level tokenizer, text encoders of one layer), so nothing is fetched.
The LLMs' completions stop at EOS early (`stop_early`) and flowrl's prompts differ in length, so
generation and the micro-batches pad and attention takes a mask, as on real data. Each job names
what it cuts from the preset (fewer prompts per step: the same micro-batch and sequence shapes);
evaluation is skipped or cut to a few prompts. The --fsdp job runs in a process of its own under
torchrun (one rank: FSDP needs a process group).

Figures: rollout and update tokens/s (images/s for SD3), the update's MFU (`update_flops`: the
decoder layers' matmul weights for every token read, the LM head for completion positions only, no
embedding; 6 FLOPs per weight and token for a full fine-tune, 4 under LoRA: a frozen base
computes no weight gradients; attention and recomputation left out; over peak bf16 FLOP/s),
flowrl's decode bandwidth (`decode_bytes`: bf16 weights read once per decode step, and every
row's KV cache so far, padded to the longest prompt: one `generate` call per step at this batch),
peak GPU memory allocated and reserved (the caching allocator's), for the run and per phase
(`phase_peaks`), against the plan.
"""

import argparse
import contextlib
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flow_grpo  # noqa: E402
import flowrl  # noqa: E402
import memory_plan  # noqa: E402
import rc_grpo  # noqa: E402
from envs import bfcl  # noqa: E402
from memory_plan import (  # noqa: E402
    completion_positions,
    fsdp_plan,
    full_plan,
    in_gib,
    kv_bytes_per_token,
    matmul_params,
    param_counts,
    preset_plans,
)
from utils import cli, distributed, models, tracking  # noqa: E402

# Dense bf16 tensor-core peaks (NVIDIA's datasheets halve their sparsity figures), by a part of the
# name torch reports, the more specific first: the PCIe and NVL cards clock lower than the SXM ones.
PEAK_BF16_FLOPS = {
    "H200 NVL": 835e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}
QWEN = {  # the published configs (memory_plan.QWEN), and a tiny one for --tiny
    **memory_plan.QWEN,
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
}
SD3 = {  # SD3.5-Medium's transformer and VAE as published; its text encoders cut to one layer
    "sd3.5-medium": dict(
        transformer=memory_plan.SD3_MEDIUM,
        vae=memory_plan.SD3_VAE,
        clip_widths=(768, 1280),
        t5_width=4096,
    ),
    "tiny": dict(
        transformer=dict(
            sample_size=16,
            patch_size=1,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
        ),
        vae=dict(
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(4,),
            latent_channels=4,
            norm_num_groups=1,
            sample_size=32,
            scaling_factor=1.5035,
            shift_factor=0.0609,
        ),
        clip_widths=(32, 32),
        t5_width=32,
    ),
}
CHAT_TEMPLATE = (  # the word-level tokenizer's: each message as "role: content", then the reply
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
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
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = models.letter_clip_tokenizer(folder)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    clip = lambda width: CLIPTextModelWithProjection(
        CLIPTextConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=1,
            num_attention_heads=width // 64 or 4,
            max_position_embeddings=77,
            projection_dim=width,
            **ids,
        )
    )
    t5_width = parts["t5_width"]
    with device:
        clip_l, clip_g = (clip(width) for width in parts["clip_widths"])
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer),
                d_model=t5_width,
                d_kv=64 if t5_width >= 64 else 8,
                d_ff=t5_width * 5 // 2,
                num_layers=1,
                num_heads=max(4, t5_width // 64),
            )
        )
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**parts["transformer"]),
            vae=AutoencoderKL(in_channels=3, out_channels=3, **parts["vae"]),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            text_encoder=clip_l,
            tokenizer=tokenizer,
            text_encoder_2=clip_g,
            tokenizer_2=tokenizer,
            text_encoder_3=t5,
            tokenizer_3=tokenizer,
        )
    return pipe.to(dtype)


def stop_early(model, eos_id, hazard, counts):
    """A forward hook on `model`'s LM head: +log(hazard·V) on the EOS logit, so that a random
    model's near-uniform next token (logits of std ≈ 0.8 at init) is EOS with probability ≈
    `hazard` at every position, and its completions stop at geometric lengths (a random model
    never stops otherwise: no padding, no mask). It also counts in counts["decode"] the forwards
    of one position per row without gradient: a `generate` call's first (each prompt's last token,
    on its prefilled cache) and each decode step, so one call adds its longest completion's
    length."""
    bias = math.log(hazard * model.config.vocab_size)

    def hook(module, inputs, logits):
        logits[..., eos_id] += bias
        return logits

    def count(module, inputs):
        if inputs[0].shape[1] == 1 and not torch.is_grad_enabled():
            counts["decode"] += 1

    model.get_output_embeddings().register_forward_hook(hook)
    model.get_input_embeddings().register_forward_pre_hook(count)
    return model


@contextlib.contextmanager
def random_weights(device, llm=None, sd3=None, eos_hazard=None):
    """For the `with` block, transformers' `from_pretrained` (AutoTokenizer, AutoModelForCausalLM)
    and diffusers' StableDiffusion3Pipeline.from_pretrained build the config `llm` / the parts
    `sd3` with random weights on `device`, in the dtype the script asks for. With `eos_hazard`,
    the LLM stops early (`stop_early`); yields the count of its decode forwards. diffusers is
    imported for `sd3` only (3 s: the --fsdp job's process needs none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    counts = {"decode": 0}

    def causal_lm(path, dtype=torch.float32, **kwargs):
        with device:
            model = AutoModelForCausalLM.from_config(Qwen2Config(**llm), dtype=dtype)
        if eos_hazard:
            model = stop_early(model, word_tokenizer().eos_token_id, eos_hazard, counts)
        return model

    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        patch = lambda owner, builder: stack.enter_context(
            mock.patch.object(owner, "from_pretrained", builder)
        )
        patch(AutoTokenizer, lambda *args, **kwargs: word_tokenizer())
        patch(AutoModelForCausalLM, causal_lm)
        if sd3:
            from diffusers import StableDiffusion3Pipeline

            patch(
                StableDiffusion3Pipeline,
                lambda path, dtype, **kwargs: sd3_pipeline(sd3, device, dtype, folder),
            )
        yield counts


@contextlib.contextmanager
def calling_model(mean_steps, seed=0):
    """For the `with` block, each output of the random model decodes (`bfcl.decode_calls`) to one
    call with probability 1 − 1/mean_steps, so a user turn takes `mean_steps` model steps on
    average and a later step's prompt holds the earlier steps' exchanges, as the trained model's
    do. The call names no function of the entry's: the backend answers with its one-line error.
    Yields {"steps": model outputs decoded, "turn_ends": those that called nothing}."""
    rng = random.Random(seed)
    counts = {"steps": 0, "turn_ends": 0}

    def decode(text):
        calls = [("gpu_check_step", [], {})] if rng.random() < 1 - 1 / mean_steps else []
        counts["steps"] += 1
        counts["turn_ends"] += not calls
        return calls

    with mock.patch.object(bfcl, "decode_calls", decode):
        yield counts


@contextlib.contextmanager
def no_policy_written():
    """The runs' trained policy is neither merged nor written at their end (rc_grpo: the 7B merged
    into fp32, 30.5 GB; flowrl: 6 GB; --fsdp's gather of the whole model to rank 0's CPU): the
    check measures the steps, and the merge would set the job's peak memory."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    def skip(*args, **kwargs):
        return None

    with (
        mock.patch.object(models, "merged_fp32", lambda model: model),
        mock.patch.object(distributed, "full_weights", lambda model: None),
        mock.patch.object(PreTrainedModel, "save_pretrained", skip),
        mock.patch.object(PeftModel, "save_pretrained", skip),
    ):
        yield


@contextlib.contextmanager
def phase_peaks(device, counts=None):
    """For the `with` block, every phase a script times (tracking.Phases: rollout, prepare,
    update) also reads the GPU's peak memory over it, allocated and reserved in GiB: yields
    {phase: [allocated, reserved]}, the largest over the run's steps, with "run" for the whole run
    (between the phases too: building, evaluation). With `counts` (random_weights'), the
    one-position forwards of the last rollout phase are kept under "decode_steps" (flowrl's one
    `generate` call per step: its longest completion). On a CPU: no peaks."""
    cuda, timed = device.type == "cuda", tracking.Phases.time
    peaks = {"run": [0.0, 0.0]} if cuda else {}

    def fold(name):
        read = [
            torch.cuda.max_memory_allocated(device) / 2**30,
            torch.cuda.max_memory_reserved(device) / 2**30,
        ]
        for key in (name, "run"):
            peaks[key] = [max(a, b) for a, b in zip(peaks.get(key, [0.0, 0.0]), read)]
        torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def time(self, name):
        if cuda:
            fold("run")
        decoded = counts["decode"] if counts else 0
        with timed(self, name):
            yield
        if cuda:
            fold(name)
        if counts and name == "rollout":
            peaks["decode_steps"] = counts["decode"] - decoded

    with mock.patch.object(tracking.Phases, "time", time):
        yield peaks
    if cuda:
        fold("run")


def brightness(images, prompts):
    """The SD3 job's reward (`--reward __main__:brightness`): each image's mean pixel, a stand-in
    for PickScore, whose cost is not the trainer's."""
    return images.float().mean(dim=(1, 2, 3))


def second_step(script, argv, out_dir, device, metrics="metrics.jsonl", counts=None):
    """Run `script.train` on `argv` parsed as the script does (two steps) → (the second step's
    logged metrics, out_dir/`metrics`, and `phase_peaks`' record)."""
    args = cli.parse_args(
        script.Args,
        script.PRESETS,
        [*argv, "--save-every", "0", "--quiet", "--overwrite", "--out-dir", str(out_dir)],
    )
    with phase_peaks(device, counts) as peaks:
        script.train(args)
    lines = (Path(out_dir) / metrics).read_text().splitlines()
    return json.loads(lines[-1]), peaks


def update_flops(config, record, passes, lora):
    """The update's matmul FLOPs: a multiply-add per decoder-layer linear weight (q and o h×h, k
    and v h×kv·d, gate/up/down) for every token its forwards read, and per LM-head weight (V×h) for
    the completion positions only (`passes` over the generated tokens); the embedding is a lookup.
    ×6 for a full fine-tune (forward, input and weight gradients), ×4 under LoRA."""
    head = config["vocab_size"] * config["hidden_size"]
    multiply_adds = (
        matmul_params(config) * record["tokens_update"] + head * record["tokens_rollout"] * passes
    )
    return (4 if lora else 6) * multiply_adds


def decode_bytes(config, params, rows, prompt_tokens, steps):
    """Bytes one `generate` call reads from memory over `steps` decode steps of `rows` rows: the
    bf16 weights once per step, and at step t every row's KV cache of prompt_tokens + t tokens."""
    kv_tokens = rows * (prompt_tokens * steps + steps * (steps - 1) / 2)
    return 2 * params * steps + kv_bytes_per_token(config) * kv_tokens


def figures(record, peaks, flops_done, device):
    """Throughput, MFU (`flops_done`: the update's FLOPs) and peak memory (`phase_peaks`': the
    run's, and [allocated, reserved] per phase) of a logged step (`record`)."""
    flops = peak_flops(device)
    run = peaks.get("run", [None, None])
    result = {
        "rollout_s": round(record["time_rollout"], 2),
        "prepare_s": round(record["time_prepare"], 2),
        "update_s": round(record["time_update"], 2),
        "peak_gpu_gib": round(run[0], 2) if run[0] is not None else None,
        "peak_reserved_gib": round(run[1], 2) if run[1] is not None else None,
        "phase_peak_gib": {
            phase: [round(gib, 2) for gib in peak]
            for phase, peak in peaks.items()
            if phase not in ("run", "decode_steps")
        },
    }
    if "tokens_update" in record:
        result |= {
            "rollout_tokens_per_s": round(record["tokens_rollout"] / record["time_rollout"], 1),
            "update_tokens_per_s": round(record["tokens_update"] / record["time_update"], 1),
            "update_mfu": round(flops_done / record["time_update"] / flops, 4) if flops else None,
        }
    return result


def prompt_file(folder, lengths):
    """A --data file of math-style rows whose prompts are `lengths` words long (WORDS in turn)."""
    data = Path(folder) / "prompts.jsonl"
    words = WORDS * (max(lengths) // len(WORDS) + 1)
    data.write_text(
        "".join(
            json.dumps({"prompt": " ".join(words[i : i + n]), "answer": "1"}) + "\n"
            for i, n in enumerate(lengths)
        )
    )
    return data


def flowrl_run(tiny, device, out_dir, preset, fsdp=False):
    """flowrl.py --preset `preset` on 8 prompts × G 8 in 4 mini-batches (`fsdp`: 6 × G 8 in one,
    so that a mini-batch of ≈ 20k tokens spans several 16 384-token micro-batches) whose lengths
    spread geometrically from 64 to 512 words (math prompts' spread: one `generate` call left-pads
    them and the packed micro-batches pad, so SDPA gets a mask), a random Qwen2.5-1.5B whose
    completions stop at EOS with a hazard of ln 4 / max_new_tokens per token (about a quarter run
    to the limit) → the job's figures."""
    config, new_tokens, rows, minibatches = QWEN["qwen2.5-1.5b"], 1024, 8, 4
    if fsdp:
        new_tokens, rows, minibatches = 256, 6, 1
    lengths = [round(64 * 8 ** (i / (rows - 1))) for i in range(rows)]
    extra = ["--max-new-tokens", str(new_tokens)]
    if tiny:
        config, new_tokens = QWEN["tiny"], 8
        lengths = [n // 16 for n in lengths]
        extra = ["--max-new-tokens", "8", "--micro-batch-tokens", "128", "--device", "cpu"]
    micro_batch_tokens = 128 if tiny else flowrl.PRESETS[preset]["micro_batch_tokens"]
    data = prompt_file(out_dir, lengths)
    argv = [
        "--preset",
        preset,
        "--model",
        "qwen2.5-1.5b",
        "--data",
        str(data),
        "--steps",
        "2",
        "--total-epochs",
        "0",
        "--prompts-per-step",
        str(rows),
        "--minibatches",
        str(minibatches),
        "--eval-every",
        "1000",
        *extra,
    ]
    units, original = [], distributed.shard  # FSDP units per sharded model (the policy, π_ref)

    def shard(model, bf16):
        from torch.distributed.fsdp import FSDPModule

        sharded = original(model, bf16)
        units.append(sum(isinstance(m, FSDPModule) for m in model.modules()))
        return sharded

    with (
        random_weights(device, llm=config, eos_hazard=math.log(4) / new_tokens) as counts,
        no_policy_written(),
        mock.patch.object(flowrl.distributed, "shard", shard),
    ):
        record, peaks = second_step(flowrl, argv, Path(out_dir) / "run", device, counts=counts)
    params, _ = param_counts(config)
    result = {
        "job": f"flowrl --preset {preset}" + (" --fsdp on 1 rank" if fsdp else ""),
        "params": params,
        "prompt_words": [min(lengths), max(lengths)],
        "fsdp_units": units,
        "max_new_tokens": new_tokens,
    }
    # the plan at this job's shapes (a word a token; + the chat template's words); its load phase
    # (--fsdp) falls in the run's peak, which the loops' phases do not split
    shape = dict(
        gen_rows=8 * rows,
        prompt_tokens=max(lengths) + 10,
        new_tokens=new_tokens,
        micro_batch_tokens=micro_batch_tokens,
        completion_positions=completion_positions(
            micro_batch_tokens, min(lengths) + 10, new_tokens
        ),
    )
    plan = fsdp_plan(config, 1, **shape) if fsdp else full_plan(config, **shape)
    result["plan_gib"] = {phase: in_gib(terms)["total"] for phase, terms in plan.items()}
    passes = flowrl.PRESETS[preset].get("inner_steps", flowrl.Args.inner_steps)
    result |= figures(record, peaks, update_flops(config, record, passes, lora=False), device)
    decode_steps = peaks["decode_steps"]
    result["mean_completion_tokens"] = round(record["tokens_rollout"] / (8 * rows), 1)
    result["decode_steps"] = decode_steps  # the longest completion: one generate call
    padded_prompt = max(lengths) + 10  # left-padded to the longest, + the chat template's words
    read = decode_bytes(config, params, 8 * rows, padded_prompt, decode_steps)
    result["decode_gb_per_s"] = round(read / record["time_rollout"] / 1e9, 1)
    return result


def flowrl_job(tiny, device, out_dir):
    """flowrl.py --preset full (Qwen2.5-1.5B, full fine-tune, 1024 new tokens, micro-batches of
    8192 tokens, checkpointing) at 8 prompts × G 8 in 4 mini-batches of 16 rows (the preset: 32
    prompts in 16 of 16): `flowrl_run`."""
    return flowrl_run(tiny, device, out_dir, "full")


def flowrl_fsdp_job(tiny, device, out_dir):
    """flowrl.py --preset full-7b's path (--fsdp: fully_shard per layer and on the root, bf16
    compute over fp32 shards, `unsharded` generation, `distributed.micro_batches` with gradient
    sync on a mini-batch's last micro-batch, micro-batches of 16 384 tokens) on one rank, in a
    process of its own under torchrun: the 7B does not fit one GPU unsharded (its fp32 weights,
    gradients and AdamW alone are 122 GB), so Qwen2.5-1.5B, 6 prompts × G 8 in one mini-batch,
    256 new tokens (the preset: 512 prompts in 16 mini-batches, 8192). One rank's collectives are
    local: this checks FSDP2's code path, streams and memory on a GPU, not the interconnect."""
    if os.environ.get("WORLD_SIZE") != "1":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            __file__,
            "--fsdp-job",
            *(["--tiny"] if tiny else []),
        ]
        try:  # a failure is the job's line, and rc_grpo's job still runs
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"job": "flowrl --preset full-7b --fsdp on 1 rank", "error": "over 300 s"}
        rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not rows:
            return {"job": "flowrl --preset full-7b --fsdp on 1 rank", "error": done.stderr[-2000:]}
        return json.loads(rows[-1])
    return flowrl_run(tiny, device, out_dir, "full-7b", fsdp=True)


def rc_grpo_job(tiny, device, out_dir):
    """rc_grpo.py --preset bfcl (Qwen2.5-7B + LoRA r 64, the real BFCL v4 entries with bfcl-eval's
    system prompt and every function's docs; stage 1, stage 2; the policy not saved) on 2
    train and 2 test tasks, their first user turn, one RCTP-FT epoch, 2 tasks per step (the preset:
    16 and every turn). The random model's outputs decode to a call as often as BFCL's ground truth
    calls in a first turn (`calling_model`: 2.50 model steps on average, up to the preset's 20), so
    a step's prompt holds the turn's steps so far: 24 `generate` calls in the job, as many as two
    turns of one step each would take; its 10 rows of ≈ 3k words per `generate` call stay far
    below the preset's 262 144-token chunks (those are planned: benchmarks/memory_plan.py).
    Completions stop at EOS with a hazard of 8 / max_new_tokens per token (a mean of 32 of the 256:
    a BFCL answer is a call list of tens of tokens; an assumption, not measured on the real model),
    so a `generate` call runs until its longest row stops."""
    config, new_tokens, extra = QWEN["qwen2.5-7b"], rc_grpo.PRESETS["bfcl"]["max_new_tokens"], []
    if tiny:
        config, new_tokens = QWEN["tiny"], 8
        extra = [
            "--max-new-tokens",
            "8",
            "--max-steps",
            "2",
            "--docs",
            "needed",
            "--system-prompt",
            "short",
            "--device",
            "cpu",
        ]
    argv = [
        "--preset",
        "bfcl",
        "--model",
        "qwen2.5-7b",
        "--max-tasks",
        "2",
        "--max-turns",
        "1",
        "--steps",
        "2",
        "--tasks-per-step",
        "2",
        "--rctp-epochs",
        "1",
        *extra,
    ]
    # BFCL's ground truth: 1.50 calls in a first user turn over its 800 entries; taken as one call
    # per model step (an assumption: a step may list several), then the step that ends the turn
    truth = [len(entry["ground_truth"][0]) for entry in bfcl.load_bfcl_entries()]
    with (
        random_weights(device, llm=config, eos_hazard=8 / new_tokens),
        no_policy_written(),
        calling_model(1 + sum(truth) / len(truth)) as steps,
    ):
        record, peaks = second_step(
            rc_grpo, argv, Path(out_dir) / "run", device, metrics="rctp+rc-grpo/metrics.jsonl"
        )
    params, _ = param_counts(config)
    return {
        "job": "rc_grpo --preset bfcl",
        "params": params,
        "model_steps_per_user_turn": round(steps["steps"] / max(1, steps["turn_ends"]), 2),
    } | figures(record, peaks, update_flops(config, record, 1, lora=True), device)


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
    argv = [
        "--preset",
        "sd3",
        "--model",
        "sd3.5-medium",
        "--reward",
        "__main__:brightness",
        "--prompts",
        str(prompts),
        "--eval-prompts",
        str(prompts),
        "--epochs",
        "2",
        "--prompts-per-epoch",
        "2",
        "--eval-every",
        "1000",
        *extra,
    ]
    with random_weights(device, sd3=parts):
        record, peaks = second_step(flow_grpo, argv, Path(out_dir) / "run", device)
    images = 2 * 8
    result = {"job": "flow_grpo --preset sd3", "images": images} | figures(
        record, peaks, None, device
    )
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
            phase: in_gib(terms) for phase, terms in plans["flowrl full-7b"].items()
        },
        "flowrl full (qwen2.5-1.5b)": larger(plans["flowrl full"]),
        "rc_grpo bfcl (qwen2.5-7b + lora)": larger(plans["rc_grpo bfcl"]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny configs on CPU: checks the code, not the hardware"
    )
    parser.add_argument("--plan", action="store_true", help="print the LLM presets' planned peaks")
    parser.add_argument("--fsdp-job", action="store_true", help=argparse.SUPPRESS)  # torchrun's
    args = parser.parse_args()
    if args.plan:
        for preset, plan in real_llm_plans().items():
            print(json.dumps({"preset": preset, "planned_peak_gib": plan}))
        return
    if not args.tiny and not torch.cuda.is_available():  # else the full-size jobs run on the CPU
        raise SystemExit(
            f"error: torch {torch.__version__} sees no CUDA GPU: run this on the GPU machine, or "
            "pass --tiny for the same code at tiny sizes on the CPU"
        )
    device = torch.device("cpu") if args.tiny else distributed.setup_accelerator("auto")[1]
    jobs = (flowrl_job, flow_grpo_job, flowrl_fsdp_job, rc_grpo_job)  # the longest last
    if args.fsdp_job:  # flowrl_fsdp_job's own process, one rank under torchrun
        jobs = (flowrl_fsdp_job,)
    for job in jobs:
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
    distributed.leave_process_group()


if __name__ == "__main__":
    main()
