"""Each full-scale preset's peak GPU memory, per phase, as a sum of named terms, and each term held
against PyTorch's own tracker (MemTracker) on the scripts' own steps at small shapes.

    python benchmarks/memory_plan.py             # every preset's phases, term by term (GiB)
    python benchmarks/memory_plan.py --fit       # which presets fit an 80 GB and a 141 GB GPU, and
                                                 # with which --gen-tokens / --micro-batch-tokens
    python benchmarks/memory_plan.py --measure   # tracked vs planned at the scaled shapes (CPU)

A plan is a dict {term: bytes}; a phase's peak is the sum of its terms. The terms follow the code:
what each phase holds (weights, the reference, gradients, AdamW moments, FSDP's shards and gathers)
and what one `generate` call or one micro-batch adds. Where a per-token cost is a sum of kernel
temporaries (the MLP in a prefill, one checkpointed layer recomputed in the backward) its
coefficients were read off the tracker at the scaled shapes (`measure`), then held there by
tests/test_memory_plan.py at shapes of other widths, depths, vocabularies and lengths: the plan is
within 15 % of the tracked peak of every phase (the old hand arithmetic had no unsharded FSDP
gradients, q and o at 4h², and one row of logits per micro-batch).

What the tracker does not see, and no plan here holds: the CUDA caching allocator's rounding and
fragmentation (reserved minus allocated), NCCL's buffers, the CUDA context (≈0.5 GiB), and kernels
whose workspace differs between the CPU measured here and a GPU (SDPA's; cuBLAS's).
"""

import argparse
import collections
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
QWEN = {  # published configs (Qwen2Config keyword arguments)
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
# SD3.5-Medium's transformer (diffusers' SD3Transformer2DModel config, as published)
SD3_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
SD3_VAE = dict(  # SD3.5-Medium's VAE (diffusers AutoencoderKL keyword arguments)
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# Parameters: the transformer and its LoRA r 32 on SD3_LORA_TARGETS (envs/sd3.py), counted from
# SD3_MEDIUM built on the meta device with diffusers 0.42; the other parts' published sizes: CLIP-L
# and CLIP-G with projections, T5-XXL's encoder, the 16-channel VAE, PickScore (a CLIP-H/14)
SD3_TRANSFORMER, SD3_LORA_R32 = 2_243_171_520, 18_776_064
SD3_PARTS = {
    "clip_l": 123_650_304,
    "clip_g": 694_659_840,
    "t5_xxl": 4_762_310_656,
    "vae": 83_653_863,
    "pickscore": 986_109_441,
}


# ----------------------------------------------------------------------------- sizes


def shape_of(config):
    """(hidden h, layers, intermediate I, vocabulary V, key/value width kv·d) of a Qwen2 config."""
    h, layers, inter, vocab = (
        config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    )
    kv_width = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return h, layers, inter, vocab, kv_width


def param_counts(config, lora_rank=0, adapters=1):
    """(parameters, trained parameters) of a Qwen2 `config`, exactly as transformers builds it:
    per layer q and o h×h, k and v h×kv·d, biases on q/k/v, gate/up/down h×I, two RMSNorms; the
    embedding and an LM head of V×h (one shared matrix when tied), the final norm. LoRA on every
    linear layer trains r·(in + out) each, per adapter."""
    h, layers, inter, vocab, kv_width = shape_of(config)
    attention = 2 * h * h + 2 * h * kv_width + h + 2 * kv_width
    per_layer = attention + 3 * h * inter + 2 * h
    params = layers * per_layer + h + vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    if not lora_rank:
        return params, params
    return params, adapters * lora_rank * layers * (9 * h + 2 * kv_width + 3 * inter)


def matmul_params(config):
    """The parameters a token's forward multiplies by (2 FLOPs each): the decoder layers' linear
    weights only; the embedding is a lookup, and the LM head (V·h) runs on completion positions
    only, so it is counted per completion token, not here."""
    h, layers, inter, _, kv_width = shape_of(config)
    return layers * (2 * h * h + 2 * h * kv_width + 3 * h * inter)


def kv_bytes_per_token(config, dtype_bytes=2):
    """K and V of every layer for one token: layers × 2 × kv·d × 2 bytes in bf16."""
    h, layers, _, _, kv_width = shape_of(config)
    return layers * 2 * kv_width * dtype_bytes


# ----------------------------------------------------------------------------- per-call terms
# Per-token coefficients (bytes per token per unit of I and of h) of the kernels' temporaries at a
# phase's peak moment, read off MemTracker (`measure`, bf16 autocast) at scaled Qwen2 shapes of
# I/h = 3.5 and 7 and h = 128 and 256 (the presets' I/h: 5.3 and 5.8), and held by the test at
# other shapes. "fp32": fp32 master weights under autocast (the residual stream in fp32); "bf16": a
# bf16 base or FSDP's bf16 gathers; "lora", "lora2": a bf16 base with one LoRA adapter, or two
# stacked (rc_grpo's stage 2), on every linear layer.
PREFILL_MLP = {
    "fp32": (6.0, 24.25),
    "bf16": (6.0, 13.25),
    "lora": (8.0, 13.25),
    "lora2": (8.0, 13.25),
}  # (× I, × h)
LAYER_RECOMPUTE = {
    "fp32": (12.0, 34.0),
    "bf16": (12.0, 34.0),
    "lora": (14.0, 38.0),
    "lora2": (18.0, 30.6),
}
STREAM_BYTES = {"fp32": 4, "bf16": 2, "lora": 2, "lora2": 2}  # the residual stream's element
LOGIT_BYTES = 18  # per completion logit: bf16 logits, their fp32 copy, that copy's gradient


def rollout_terms(config, rows, prompt_tokens, new_tokens, kind, prefill_tokens=None):
    """One `generate` call's peak beside the weights, the larger of two moments: the prefill's
    last layer (the prompts' KV cache, and one MLP's temporaries over the tokens of its largest
    forward, `prefill_tokens`: `common.prompt_cache` runs the prompts of each length together,
    unpadded; default every row at `prompt_tokens`, prompts of one length) or the last decode step
    (the whole KV cache, and the copy DynamicCache's `torch.cat` makes of one layer's K/V as it
    grows)."""
    h, layers, inter, _, _ = shape_of(config)
    per_inter, per_hidden = PREFILL_MLP[kind]
    prompt = rows * prompt_tokens
    prefill = {
        "kv_cache_prompts": prompt * kv_bytes_per_token(config),
        "prefill_mlp": (prefill_tokens or prompt) * (per_inter * inter + per_hidden * h),
    }
    total = rows * (prompt_tokens + new_tokens)
    decode = {
        "kv_cache": total * kv_bytes_per_token(config),
        "cache_growth_copy": total * kv_bytes_per_token(config) // layers,
    }
    return prefill if sum(prefill.values()) > sum(decode.values()) else decode


def micro_batch_terms(config, tokens, completion_positions, kind):
    """One micro-batch of `tokens` tokens (its prefix tree) under checkpointing, at the peak of its
    backward: every layer's input (kept by checkpointing, and once more by output_hidden_states),
    plus the larger of two moments: the completion logits with their fp32 copy and its gradient (the
    backward's start), or one layer's activations and their gradients recomputed."""
    h, layers, inter, vocab, _ = shape_of(config)
    per_inter, per_hidden = LAYER_RECOMPUTE[kind]
    inputs = {"layer_inputs": (layers + 2) * tokens * h * STREAM_BYTES[kind]}
    logits = completion_positions * vocab * LOGIT_BYTES
    recompute = tokens * (per_inter * inter + per_hidden * h)
    return inputs | ({"logits": logits} if logits >= recompute else {"layer_recompute": recompute})


# ----------------------------------------------------------------------------- the plans


def log_z_head_params(config):
    """flowrl.LogZHead: two h×h Linear–LayerNorm blocks and a Linear to 1."""
    h = config["hidden_size"]
    return 2 * (h * h + h) + 2 * 2 * h + h + 1


def full_plan(
    config,
    *,
    gen_rows,
    prompt_tokens,
    new_tokens,
    micro_batch_tokens,
    completion_positions=None,
    prefill_tokens=None,
):
    """A full fine-tune on one GPU (flowrl --preset full), {phase: {term: bytes}}: fp32 master
    weights, an fp32 copy as π_ref (flowrl.py deep-copies the model), fp32 gradients (held from the
    last mini-batch's backward through the next rollout: zero_grad comes at the next update),
    AdamW's two fp32 moments, autocast's bf16 copies of the matmul weights (cached for the forward
    or the whole `generate` call), and log Z's head with its gradients and moments."""
    params, _ = param_counts(config)
    state = {
        "weights": 4 * params,
        "reference": 4 * params,
        "grads": 4 * params,
        "adam": 8 * params,
        "autocast_weights": 2 * matmul_params(config),
        "log_z_head": 16 * log_z_head_params(config),
    }
    positions = completion_positions or micro_batch_tokens
    return {
        "rollout": state
        | rollout_terms(config, gen_rows, prompt_tokens, new_tokens, "fp32", prefill_tokens),
        "update": state | micro_batch_terms(config, micro_batch_tokens, positions, "fp32"),
    }


def fsdp_plan(
    config,
    gpus,
    *,
    gen_rows,
    prompt_tokens,
    new_tokens,
    micro_batch_tokens,
    completion_positions=None,
    prefill_tokens=None,
    accumulate_unsharded=True,
):
    """A full fine-tune sharded over `gpus` (flowrl --fsdp), per GPU: {phase: {term: bytes}}.

    load: every rank builds the whole fp32 model on its device and deep-copies it for π_ref before
    `distributed.shard` splits them (flowrl.py `train`); log Z's head is not sharded. rollout: 1/N
    of the fp32 weights, their gradients, AdamW's moments and the bf16 reference, with the whole
    policy gathered in bf16 (`distributed.unsharded`) and the call's KV cache. update: the shards,
    plus (gradient sync off for all but a mini-batch's last micro-batch:
    `distributed.micro_batches`) every parameter's unsharded gradient, kept in fp32 (FSDP2 upcasts
    it to the reduce dtype) until that last backward; the gathered bf16 weights; one micro-batch in
    bf16."""
    params, _ = param_counts(config)
    h, layers, inter, vocab, kv_width = shape_of(config)
    layer = 2 * h * h + 2 * h * kv_width + 3 * h * inter
    root = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    shards = {
        "weights_shard": 4 * params / gpus,
        "grads_shard": 4 * params / gpus,
        "adam_shard": 8 * params / gpus,
        "reference_shard": 2 * params / gpus,
        "log_z_head": 16 * log_z_head_params(config),
    }
    positions = completion_positions or micro_batch_tokens
    # while sync is off the sharded gradients are None (zero_grad); the last backward turns the
    # unsharded ones into them layer by layer, so the two are not held whole at once
    kept = (
        {"unsharded_fp32_grads": 4 * params}
        if accumulate_unsharded
        else {"grads_shard": 4 * params / gpus}
    )
    micro = micro_batch_terms(config, micro_batch_tokens, positions, "bf16")
    # gathered in bf16: at the logits' moment (the backward's start) the root unit only; at a
    # layer's recompute also that layer and the next (prefetched), and the layer's bf16 gradients
    gathered = (
        {"root_gathered": 2 * root}
        if "logits" in micro
        else {"root_and_two_layers": 2 * (root + 2 * layer), "layer_grads": 2 * layer}
    )
    update = {k: v for k, v in shards.items() if k != "grads_shard"} | kept | gathered | micro
    return {
        "load": {"policy_fp32": 4 * params, "reference_fp32": 4 * params},
        "rollout": shards
        | {"gathered_policy": 2 * params}
        | rollout_terms(config, gen_rows, prompt_tokens, new_tokens, "bf16", prefill_tokens),
        "update": update,
    }


def lora_plan(
    config,
    rank,
    adapters,
    *,
    gen_rows,
    prompt_tokens,
    new_tokens,
    micro_batch_tokens,
    completion_positions=None,
    prefill_tokens=None,
):
    """LoRA on a bf16 base (rc_grpo --preset bfcl: a frozen stage-1 adapter and the trained stage-2
    one; agentflow --preset full: one), {phase: {term: bytes}}: the base, the adapters in fp32, the
    trained adapter's gradients and AdamW moments, autocast's bf16 copy of the trained adapter;
    π_ref is the base with the adapters off (no copy)."""
    params, trained = param_counts(config, rank)
    state = {
        "base_bf16": 2 * params,
        "adapters": 4 * trained * adapters,
        "grads": 4 * trained,
        "adam": 8 * trained,
        "autocast_weights": 2 * trained,
    }
    positions = completion_positions or micro_batch_tokens
    kind = "lora2" if adapters == 2 else "lora"
    return {
        "rollout": state
        | rollout_terms(config, gen_rows, prompt_tokens, new_tokens, kind, prefill_tokens),
        "update": state | micro_batch_terms(config, micro_batch_tokens, positions, kind),
    }


def in_gib(parts):
    gib = {k: round(v / GIB, 2) for k, v in parts.items()}
    return gib | {"total": round(sum(parts.values()) / GIB, 2)}


# ----------------------------------------------------------------------------- the tracker


def _tracker():
    """torch's MemTracker, allowed to see the same model called again at the top level (each of
    `generate`'s decode steps, each micro-batch): it refuses a second root call unless its
    per-module statistics are reset, and only the global peak is read here."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            hooks = install_grad_hooks and all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, hooks)  # frozen: no hook

        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            outer = set(self._mod_tracker.parents) - {name}
            if (
                module in self.memory_tracking
                and not self._mod_tracker.is_bw
                and outer == {"Global"}
            ):
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    return Tracker()


def tracked(step, *external):
    """Run `step()` under MemTracker with `external` (modules, optimizers, tensors made before it)
    registered → (peak bytes, {category: bytes} at the peak). A frozen module (a LoRA base) gets no
    gradient hooks, which MemTracker would otherwise try to put on every parameter."""
    tracker = _tracker()
    tracker.track_external(*external)
    with tracker:
        step()
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    parts = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    return parts.pop("Total"), parts


WORDS = [f"w{i}" for i in range(200)]


def tiny_model(config, dtype=torch.float32, seed=0):
    """A Qwen2 causal LM of `config` with random weights and activation checkpointing, as
    `models.load_causal_lm` sets it up for a preset."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=dtype)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers < 5.23: absent
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    return model


def prompts_of(lengths):
    """Prompts of the given lengths in words (one word-level token each)."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)) for i, n in enumerate(lengths)]


def completions_of(lengths, vocab, seed=0):
    """Completions (token id lists) of the given lengths, random ids past the special tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def adam_state(optimizer, params):
    """AdamW's moments made as after a first step (a step on zero gradients), gradients cleared."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def rollout_step(model, tokenizer, shape):
    """One rollout phase: `common.sample_completions` with the shape's prompts, budget and rows,
    under bf16 autocast, every row run to its last new token."""
    import common

    return lambda: common.sample_completions(
        model,
        tokenizer,
        prompts_of(shape["prompt_lengths"]),
        shape["new_tokens"],
        stop_at_eos=False,
        batch_rows=shape["gen_rows"],
        token_budget=shape.get("gen_tokens", 0),
        precision="bf16",
        row_seeds=list(range(len(shape["prompt_lengths"]))),
    )


def update_batches(tokenizer, shape, vocab):
    """The update's micro-batches (`common.scored_micro_batches`, packed only), with π_ref's
    log-probs stood in by zeros (scored in the prepare phase, not this one)."""
    import common

    prompts = prompts_of(shape["update_prompts"])
    completions = completions_of(shape["update_completions"], vocab)
    scoring = common.Scoring(tokenizer, shape["micro_batch_tokens"], torch.device("cpu"))
    batches = common.scored_micro_batches(
        prompts, completions, sampler_logps=None, scoring=scoring, with_old=False
    )
    for mb in batches:
        mb.ref_logp = torch.zeros(mb.mask.shape)
    return batches


def flowrl_update_step(model, head, batches, micro_batches):
    """flowrl.py's update over one mini-batch (`train`, step 5, TB arm): each micro-batch's
    forward (log-probs and hidden states), log Z, the TB loss and its backward."""
    import common
    import flowrl

    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    num_rows = sum(len(mb.rows) for mb in batches)

    def step():
        for mb in micro_batches(batches):
            with autocast:
                logp, prompt_states = common.micro_batch_forward(model, mb, prompt_states=True)
            log_z = head(prompt_states, mb.prompt_mask.float())
            loss, _ = flowrl.trajectory_balance_loss(
                log_z,
                flowrl.sequence_logprob(logp, mb.mask, length_normalize=True),
                flowrl.sequence_logprob(mb.ref_logp, mb.mask, length_normalize=True),
                torch.zeros(len(mb.rows)),
                beta=15.0,
                log_ratio=torch.zeros(len(mb.rows)),  # on-policy: w = 1
                clip_eps=0.2,
                num_rows=num_rows,
            )
            loss.backward()

    return step


def lora_update_step(model, batches):
    """rc_grpo's / agentflow's update of one mini-batch: each micro-batch's completion log-probs
    under bf16 autocast and the backward of a per-token surrogate."""
    import common

    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def step():
        for mb in batches:
            with autocast:
                logp = common.micro_batch_logprobs(model, mb)
            (-(logp * mb.mask).sum() / mb.mask.sum()).backward()

    return step


def measure_full(config, shape):
    """flowrl --preset full's phases on one process, tracked and set beside `full_plan`
    (`compared`)."""
    import flowrl
    from utils import models

    tokenizer = models.make_tokenizer(WORDS)
    model = tiny_model(config)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    head = flowrl.LogZHead(config["hidden_size"])
    trained = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    adam_state(optimizer, trained)
    for p in trained:  # the last mini-batch's gradients, still held in the next rollout
        p.grad = torch.zeros_like(p)
    rollout = tracked(rollout_step(model, tokenizer, shape), model, reference, head, optimizer)
    optimizer.zero_grad()
    batches = update_batches(tokenizer, shape, config["vocab_size"])
    model.train()
    update = tracked(
        flowrl_update_step(model, head, batches, iter), model, reference, head, optimizer
    )
    plan = full_plan(config, **plan_args(shape, batches))
    return compared(plan, {"rollout": rollout, "update": update})


def measure_lora(config, shape, rank, adapters):
    """rc_grpo --preset bfcl's (two stacked adapters) or agentflow --preset full's (one) phases:
    a bf16 base as `models.load_causal_lm` loads it on a GPU, fp32 adapters; beside `lora_plan`."""
    from utils import models

    tokenizer = models.make_tokenizer(WORDS)
    model = models.add_lora(tiny_model(config, torch.bfloat16), rank)
    if adapters == 2:
        models.stack_adapter(model, "stage2")
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5)
    adam_state(optimizer, trained)
    for p in trained:
        p.grad = torch.zeros_like(p)
    rollout = tracked(rollout_step(model, tokenizer, shape), model, optimizer)
    optimizer.zero_grad()
    model.train()
    batches = update_batches(tokenizer, shape, config["vocab_size"])
    update = tracked(lora_update_step(model, batches), model, optimizer)
    plan = lora_plan(config, rank, adapters, **plan_args(shape, batches))
    return compared(plan, {"rollout": rollout, "update": update})


def packed_shape(batches):
    """(tokens, completion logit positions) of the largest of a step's micro-batches."""
    largest = max(batches, key=lambda mb: mb.tokens)
    return largest.tokens, largest.mask.shape[0] * (largest.mask.shape[1] + 1)


def plan_args(shape, batches):
    """The plan's keyword arguments for a scaled shape and its packed micro-batches (its prompts
    share no prefix: the largest prefill forward is the most tokens of one length in a call)."""
    import common

    tokens, positions = packed_shape(batches)
    lengths = shape["prompt_lengths"]
    chunks = common.generation_chunks(
        lengths, shape["new_tokens"], shape["gen_rows"], shape.get("gen_tokens", 0)
    )
    of_length = [collections.Counter(lengths[i] for i in chunk) for chunk in chunks]
    return dict(
        gen_rows=max(map(len, chunks)),
        prompt_tokens=max(lengths),
        new_tokens=shape["new_tokens"],
        micro_batch_tokens=tokens,
        completion_positions=positions,
        prefill_tokens=max(n * (k - 1) for c in of_length for k, n in c.items()),
    )


def compared(plan, measured):
    """{phase: {"tracked": bytes, "planned": bytes, "ratio": planned / tracked, "terms": plan,
    "categories": the tracker's categories at its peak}}."""
    out = {}
    for phase, (peak, parts) in measured.items():
        planned = sum(plan[phase].values())
        out[phase] = {
            "tracked": peak,
            "planned": planned,
            "ratio": planned / peak,
            "terms": plan[phase],
            "categories": parts,
        }
    return out


def _fsdp_rank(rank, world, store, config, shape, queue):
    """One rank of `measure_fsdp` (a gloo group on the CPU): flowrl --fsdp's load, rollout and
    update, each tracked."""
    import torch.distributed as dist

    import flowrl
    from utils import distributed, models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tokenizer = models.make_tokenizer(WORDS)
    built = {}

    def load():  # flowrl.train: the model built whole, deep-copied for π_ref, then both sharded
        built["model"] = model = tiny_model(config)
        built["reference"] = reference = copy.deepcopy(model).eval().requires_grad_(False)
        distributed.shard(model, True)
        distributed.shard(reference, True)

    measured = {"load": tracked(load)}
    model, reference = built["model"], built["reference"]
    head = flowrl.LogZHead(config["hidden_size"])
    trained = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    adam_state(optimizer, trained)
    for p in trained:  # the last mini-batch's (sharded) gradients, held through the rollout
        p.grad = torch.zeros_like(p)

    def rollout():
        with distributed.unsharded(model):
            rollout_step(model, tokenizer, shape)()

    measured["rollout"] = tracked(rollout, model, reference, head, optimizer)
    optimizer.zero_grad()
    batches = update_batches(tokenizer, shape, config["vocab_size"])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.train()
    measured["update"] = tracked(
        flowrl_update_step(
            model, head, batches, lambda mbs: distributed.micro_batches(model, mbs, autocast)
        ),
        model,
        reference,
        head,
        optimizer,
    )
    if rank == 0:
        queue.put((measured, plan_args(shape, batches)))
    dist.barrier()
    distributed.leave_process_group()


def measure_fsdp(config, shape, world=2):
    """flowrl --fsdp's phases on `world` gloo ranks (spawned processes), rank 0's tracked peaks
    against `fsdp_plan`."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _fsdp_rank,
            args=(world, f"{folder}/store", config, shape, queue),
            nprocs=world,
            start_method="spawn",
        )
        measured, args = queue.get()
    return compared(fsdp_plan(config, world, **args), measured)


def measure_sd3(shape):
    """flow_grpo --preset sd3's trained step on a small SD3 transformer (bf16, LoRA on
    SD3_LORA_TARGETS in fp32, checkpointing), tracked: `SD3Task.velocity` through
    `flow_grpo.guided_velocity` (CFG), the reference with the adapter off, `flow_grpo.step_loss`
    and its backward, twice (the second with the first's gradients held)."""
    import types

    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    import flow_grpo
    from envs.sd3 import SD3_LORA_TARGETS, SD3Task

    torch.manual_seed(0)
    width, side, rows = shape["heads"] * shape["head_dim"], shape["side"], shape["rows"]
    net = SD3Transformer2DModel(
        sample_size=side,
        patch_size=2,
        in_channels=4,
        num_layers=shape["blocks"],
        attention_head_dim=shape["head_dim"],
        num_attention_heads=shape["heads"],
        joint_attention_dim=48,
        caption_projection_dim=width,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=side,
        qk_norm="rms_norm",
        dual_attention_layers=tuple(range(shape["blocks"] // 2)),
    ).to(torch.bfloat16)
    net.requires_grad_(False).add_adapter(
        LoraConfig(
            r=8, lora_alpha=16, init_lora_weights="gaussian", target_modules=SD3_LORA_TARGETS
        )
    )
    trained = [p for p in net.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()  # as SD3Task: trainable LoRA weights in fp32
    net.enable_gradient_checkpointing()
    task = types.SimpleNamespace(
        autocast=torch.autocast("cpu", dtype=torch.bfloat16), dtype=torch.bfloat16, policy=net
    )
    task.velocity = lambda model, x, sigma, cond: SD3Task.velocity(task, model, x, sigma, cond)
    policy = lambda x, sigma, cond: SD3Task.velocity(task, net, x, sigma, cond)
    reference = lambda x, sigma, cond: SD3Task.ref_velocity(task, x, sigma, cond)
    x, x_next = torch.randn(2, rows, 4, side, side)
    text = lambda: (
        torch.randn(rows, shape["text_tokens"], 48, dtype=torch.bfloat16),
        torch.randn(rows, 32, dtype=torch.bfloat16),
    )
    cond, empty = text(), text()
    sigmas = torch.tensor([0.9, 0.8])
    objective = types.SimpleNamespace(noise_level=0.7, clip_range=1e-4, beta=0.01)

    def step():
        for _ in range(2):
            v = flow_grpo.guided_velocity(policy, x, sigmas[0], cond, empty, 4.5)
            with torch.no_grad():
                v_ref = flow_grpo.guided_velocity(reference, x, sigmas[0], cond, empty, 4.5)
            loss, _ = flow_grpo.step_loss(
                v,
                v_ref,
                x,
                x_next,
                sigmas=sigmas,
                old_logp=torch.zeros(rows),
                advantages=torch.ones(rows),
                objective=objective,
            )
            loss.backward()

    net.train()
    measured = tracked(step, net)
    base = sum(p.numel() for p in net.parameters()) - sum(p.numel() for p in trained)
    adapter = sum(p.numel() for p in trained)
    plan = {"transformer_bf16": 2 * base, "lora_and_grads": 8 * adapter} | sd3_update_terms(
        width, shape["blocks"], 2 * rows, (side // 2) ** 2, shape["text_tokens"]
    )
    return compared({"update": plan}, {"update": measured})


def measure_sd3_decode(shape):
    """flow_grpo --preset sd3's prepare phase at its peak: `SD3Task.decode` (fp32, no gradients) of
    `rows` latents, `chunk` at a time, through SD3's VAE with its channels cut to `channels`
    (published: 128), tracked."""
    import types

    from diffusers import AutoencoderKL

    from envs.sd3 import SD3Task

    torch.manual_seed(0)
    width = shape["channels"]
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        **SD3_VAE | dict(block_out_channels=(width, 2 * width, 4 * width, 4 * width)),
    )
    task = types.SimpleNamespace(pipe=types.SimpleNamespace(vae=vae))
    latents = torch.randn(shape["rows"], SD3_VAE["latent_channels"], shape["side"], shape["side"])
    measured = tracked(lambda: SD3Task.decode(task, latents, chunk=shape["chunk"]), vae)
    params = sum(p.numel() for p in vae.parameters())
    decode = sd3_decode_terms(width, shape["chunk"], shape["rows"], 8 * shape["side"])
    return compared({"prepare": {"vae_fp32": 4 * params} | decode}, {"prepare": measured})


# Scaled shapes: Qwen2 configs of other widths, depths, vocabularies and ties than the ones the
# coefficients were read at, prompts of mixed lengths (padding, so the mask), two micro-batches
# per mini-batch (the second runs with the first's gradients held); for FSDP, a step whose weights
# outweigh its tokens, so the gradients' term decides the update's peak.
SCALED = {
    "a": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=640,
        vocab_size=768,
        tie_word_embeddings=True,
    ),
    "b": dict(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=480,
        vocab_size=1536,
        tie_word_embeddings=False,
    ),
}
SHAPES = {
    "short": dict(
        prompt_lengths=[30, 60, 90, 120] * 2,
        new_tokens=4,
        gen_rows=8,
        update_prompts=[20, 30, 25, 35] * 2,
        update_completions=[100, 120, 110, 90] * 2,
        micro_batch_tokens=640,
    ),
    "budget": dict(
        prompt_lengths=[150, 40, 100, 160, 60, 120],
        new_tokens=4,
        gen_rows=6,
        gen_tokens=500,
        update_prompts=[60, 20, 40] * 2,
        update_completions=[40, 150, 70] * 2,
        micro_batch_tokens=700,
    ),
    "weights": dict(
        prompt_lengths=[10, 20, 30, 40],
        new_tokens=4,
        gen_rows=4,
        update_prompts=[8, 12] * 2,
        update_completions=[20, 30] * 2,
        micro_batch_tokens=100,
    ),
}
SD3_SHAPE = dict(heads=3, head_dim=32, blocks=3, side=24, text_tokens=30, rows=3)
SD3_DECODE_SHAPE = dict(channels=64, side=12, rows=3, chunk=2)  # 96 px images


def scaled_checks():
    """Every preset kind's phases, tracked vs planned, at the scaled shapes: {check: result}."""
    return {
        "flowrl full (a, short)": measure_full(SCALED["a"], SHAPES["short"]),
        "flowrl full (b, budget)": measure_full(SCALED["b"], SHAPES["budget"]),
        "rc_grpo bfcl: 2 adapters (a, budget)": measure_lora(SCALED["a"], SHAPES["budget"], 8, 2),
        "agentflow full: 1 adapter (b, short)": measure_lora(SCALED["b"], SHAPES["short"], 8, 1),
        "flowrl full-7b: fsdp, 2 ranks (b, weights)": measure_fsdp(SCALED["b"], SHAPES["weights"]),
        "flow_grpo sd3: width 96, 3 blocks, 144 + 30 tokens": measure_sd3(SD3_SHAPE),
        "flow_grpo sd3: VAE decode, width 64, 96 px": measure_sd3_decode(SD3_DECODE_SHAPE),
    }


# ----------------------------------------------------------------------------- the presets

CARDS_GIB = {"80 GB (H100)": 79.0, "141 GB (H200)": 140.0}  # what torch can allocate on each
HEADROOM = 0.9  # a plan fits under 90 % of it: the allocator's fragmentation, CUDA context, NCCL
FLOWRL_PROMPT = 300  # math prompts with the chat template (DAPO/MATH: ~100–300 tokens)
BFCL_PROMPTS = (3000, 18000)  # BFCL's shortest and longest dialogue prompts (--max-prompt-tokens)
AGENTFLOW_PROMPTS = (512, 2048)  # the planner's shortest and longest prompts


def budgeted_call(gen_tokens, gen_rows, prompt_tokens, new_tokens):
    """(rows, prompt) of the worst `generate` call under a token budget: as many rows of the
    longest prompt as `common.generation_chunks` lets into one call."""
    return min(gen_rows, max(1, gen_tokens // (prompt_tokens + new_tokens))), prompt_tokens


def completion_positions(micro_batch_tokens, shortest_prompt, new_tokens):
    """Completion logit positions of the fullest micro-batch `common.micro_batches` can pack: r
    rows of the shortest prompt whose completions are as long as the budget allows (at most
    `new_tokens`), maximised over r. Completions that stop early fill a micro-batch with more
    rows: about the whole budget is completion positions when prompts are short."""
    rows = range(1, max(1, micro_batch_tokens // (shortest_prompt + 1)) + 1)
    return max(r * (min(new_tokens, micro_batch_tokens // r - shortest_prompt) + 1) for r in rows)


def preset_plans(gen_tokens=None, micro_batch_tokens=None, gpus=8):
    """{preset: {phase: {term: bytes}}} at each preset's own shapes; `gen_tokens` and
    `micro_batch_tokens`, where given, cap the presets' --gen-tokens / --micro-batch-tokens."""
    import agentflow
    import flow_grpo
    import flowrl
    import rc_grpo

    out = {}
    full, big = flowrl.PRESETS["full"], flowrl.PRESETS["full-7b"]
    for name, preset, config in (
        ("flowrl full", full, QWEN["qwen2.5-1.5b"]),
        ("flowrl full-7b", big, QWEN["qwen2.5-7b"]),
    ):
        budget = min(micro_batch_tokens or 2**62, preset["micro_batch_tokens"])
        new = preset["max_new_tokens"]
        shape = dict(
            gen_rows=preset["gen_batch"],
            prompt_tokens=FLOWRL_PROMPT if name.endswith("full") else 2048,
            new_tokens=new,
            micro_batch_tokens=budget,
            completion_positions=completion_positions(budget, FLOWRL_PROMPT, new),
        )
        out[name] = (
            fsdp_plan(config, gpus, **shape) if preset.get("fsdp") else full_plan(config, **shape)
        )
    for name, preset, adapters, prompts in (
        ("rc_grpo bfcl", rc_grpo.PRESETS["bfcl"], 2, BFCL_PROMPTS),
        ("agentflow full", agentflow.PRESETS["full"], 1, AGENTFLOW_PROMPTS),
    ):
        budget = min(micro_batch_tokens or 2**62, preset["micro_batch_tokens"])
        new = preset["max_new_tokens"]
        gen_budget = min(gen_tokens or 2**62, preset["gen_tokens"])
        rows, prompt = budgeted_call(gen_budget, preset["gen_batch"], prompts[1], new)
        out[name] = lora_plan(
            QWEN["qwen2.5-7b"],
            preset["lora_rank"],
            adapters,
            gen_rows=rows,
            prompt_tokens=prompt,
            new_tokens=new,
            micro_batch_tokens=budget,
            completion_positions=completion_positions(budget, prompts[0], new),
        )
    out["flow_grpo sd3"] = sd3_plan(flow_grpo.PRESETS["sd3"])
    return out


# SD3's transformer under checkpointing and bf16 autocast: bytes of the trained step's peak per
# forward row, per unit of the width D, fitted (least squares) to MemTracker's peaks (`measure_sd3`)
# at widths 64 and 128, 2, 4 and 6 blocks (the first half dual-attention, as SD3.5-Medium's 13 of
# 24), 64 and 256 image tokens, 20 and 60 text tokens; at two shapes left out of the fit it is
# within 8 % (the test holds one). From 6 blocks to SD3.5-Medium's 24 is an extrapolation.
SD3_PER_BLOCK = {"image": 3.05, "text": 13.2}  # × tokens × blocks: the blocks' saved inputs
SD3_RECOMPUTE = {"image": 57.4, "text": 24.1}  # × tokens: one block recomputed, its gradients


def sd3_update_terms(width, blocks, forward_rows, image_tokens, text_tokens):
    """One trained denoising step of a micro-batch (CFG: both halves in one forward of
    `forward_rows` = 2 × micro-batch rows), at its backward's peak."""
    saved = blocks * (image_tokens * SD3_PER_BLOCK["image"] + text_tokens * SD3_PER_BLOCK["text"])
    recompute = image_tokens * SD3_RECOMPUTE["image"] + text_tokens * SD3_RECOMPUTE["text"]
    return {
        "block_inputs": forward_rows * width * saved,
        "block_recompute": forward_rows * width * recompute,
    }


# SD3's VAE decoding in fp32 without gradients: bytes per image pixel per unit of the first block's
# width (the published 128), read off MemTracker's peaks (`measure_sd3_decode`): 24.0 at widths 32
# and 64, 64–256 px, 1–4 images (six fp32 tensors of that width at full resolution at once).
VAE_DECODE_BYTES = 24


def sd3_decode_terms(width, chunk, rows, side):
    """`SD3Task.decode` of `rows` images of side × side pixels, `chunk` at a time: one chunk's
    activations, and the decoded fp32 RGB images (held as the chunks come, then concatenated:
    twice)."""
    return {
        "vae_decode": VAE_DECODE_BYTES * min(chunk, rows) * side**2 * width,
        "images_fp32": 2 * 12 * rows * side**2,
    }


def sd3_plan(preset, resolution=512):
    """flow_grpo --preset sd3 (SD3.5-Medium + LoRA, envs/sd3.py): the transformer and text
    encoders in bf16, the VAE in fp32 (it decodes in fp32), PickScore in fp32, the LoRA adapter in
    fp32 with its gradients, AdamW moments and EMA copy. The prepare phase's peak is the VAE
    decoding the step's images DECODE_CHUNK at a time (`SD3Task.decode`); the update's, one trained
    step of a micro-batch (image tokens (resolution / 16)², text tokens 77 CLIP + 128 T5). Not
    planned: the rollout's no-grad transformer forward (one block's activations at a time, below
    the decode), SDPA's workspace on a GPU."""
    adapter = SD3_LORA_R32 * preset["lora_rank"] // 32
    state = {
        "transformer_bf16": 2 * SD3_TRANSFORMER,
        "text_encoders_bf16": 2 * sum(SD3_PARTS[k] for k in ("clip_l", "clip_g", "t5_xxl")),
        "vae_fp32": 4 * SD3_PARTS["vae"],
        "pickscore_fp32": 4 * SD3_PARTS["pickscore"],
        "lora_adam_ema": 20 * adapter,
    }
    width = SD3_MEDIUM["num_attention_heads"] * SD3_MEDIUM["attention_head_dim"]
    step = sd3_update_terms(
        width,
        SD3_MEDIUM["num_layers"],
        2 * preset["micro_batch"],
        (resolution // 16) ** 2,
        77 + 128,
    )
    from envs.sd3 import DECODE_CHUNK

    rows = preset["prompts_per_epoch"] * preset["group_size"]  # the step's, all on one GPU
    decode = sd3_decode_terms(SD3_VAE["block_out_channels"][0], DECODE_CHUNK, rows, resolution)
    return {"prepare": state | decode, "update": state | step}


def fits(plans, card_gib):
    """{preset: True/False}: every phase's plan under HEADROOM × what the card gives torch."""
    return {
        name: all(sum(p.values()) / GIB <= HEADROOM * card_gib for p in phases.values())
        for name, phases in plans.items()
    }


def largest_fitting(card_gib):
    """For each preset that does not fit the card at its own flags, the largest caps on
    --gen-tokens and --micro-batch-tokens (None: the preset's own) with which every phase does."""
    out = {}
    for gen_tokens in (None, 196608, 131072, 65536):
        for micro in (None, 12288, 8192, 4096):
            plans = preset_plans(gen_tokens, micro)
            for name, ok in fits(plans, card_gib).items():
                if ok and name not in out:
                    out[name] = {
                        "gen_tokens": gen_tokens,
                        "micro_batch_tokens": micro,
                        "peak_gib": max(in_gib(p)["total"] for p in plans[name].values()),
                    }
    return {
        name: flags
        for name, flags in out.items()
        if flags["gen_tokens"] or flags["micro_batch_tokens"]
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="which presets fit 80 GB and 141 GB")
    parser.add_argument("--measure", action="store_true", help="tracked vs planned, scaled shapes")
    parser.add_argument("--gen-tokens", type=int, help="cap the presets' --gen-tokens")
    parser.add_argument("--micro-batch-tokens", type=int, help="cap the presets' budgets")
    args = parser.parse_args()
    if args.measure:
        for name, result in scaled_checks().items():
            for phase, row in result.items():
                print(
                    json.dumps(
                        {
                            "check": name,
                            "phase": phase,
                            "tracked_mib": round(row["tracked"] / 2**20, 3),
                            "planned_mib": round(row["planned"] / 2**20, 3),
                            "ratio": round(row["ratio"], 3),
                            "terms_mib": {k: round(v / 2**20, 3) for k, v in row["terms"].items()},
                        }
                    )
                )
        return
    plans = preset_plans(args.gen_tokens, args.micro_batch_tokens)
    if args.fit:
        for card, gib in CARDS_GIB.items():
            print(
                json.dumps(
                    {
                        "card": card,
                        "fits_at_preset_flags": fits(plans, gib),
                        "fits_with": largest_fitting(gib),
                    }
                )
            )
        return
    for name, phases in plans.items():
        for phase, terms in phases.items():
            print(json.dumps({"preset": name, "phase": phase, "planned_gib": in_gib(terms)}))


if __name__ == "__main__":
    main()
