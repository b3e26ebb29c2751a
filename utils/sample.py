"""`python -m utils.sample FOLDER PROMPT`: print what a saved full-scale model writes."""

import argparse
import sys
from pathlib import Path

import common


def sample_trained(argv):
    """`python -m utils.sample FOLDER PROMPT`: load what a full-scale LLM run saved (a causal LM
    folder such as runs/flowrl/policy, or a LoRA adapter folder such as runs/agentflow/planner,
    whose base model must be reachable) and print completions of PROMPT, chat-formatted when the
    tokenizer has a template. Greedy unless --temperature > 0."""
    parser = argparse.ArgumentParser(
        prog="python -m utils.sample", description=sample_trained.__doc__
    )
    parser.add_argument("folder", help="a saved policy, planner or adapter folder")
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--n", type=int, default=1, help="completions to print")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.n < 1:
        raise SystemExit("error: --max-new-tokens and --n must be ≥ 1")
    if not 0 <= args.temperature < float("inf"):  # NaN fails this too
        raise SystemExit(
            f"error: --temperature must be a finite number ≥ 0 (got {args.temperature})"
        )
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
    outputs = common.sample_completions(
        model, tokenizer, [prompt] * args.n, args.max_new_tokens, temperature=args.temperature
    )
    for text, _, _ in outputs:
        print(text)


if __name__ == "__main__":
    sample_trained(sys.argv[1:])
