"""Flags from a dataclass: one `--flag` per field with its help text, presets that swap in their
defaults (`--preset NAME`), and one clear line per bad value instead of a traceback."""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path


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
    names = {f.name for f in dataclasses.fields(args_cls)}
    for f in dataclasses.fields(args_cls):
        if f.name == "preset":
            continue
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
    if "preset" in names:  # a field of its own: `train(Args(...))` works without the CLI
        return args_cls(**ns)
    preset = ns.pop("preset")
    args = args_cls(**ns)
    args.preset = preset
    return args


def preset(script, name, **flags):
    """`script`'s Args as `--preset name` and then `flags` build them on the command line, for a
    run called in-process: `cli.preset(flowrl, "full", data="train.jsonl")`."""
    return script.Args(**(script.PRESETS[name] | flags), preset=name)


# Rules that hold for a flag of this name in every script; each script's `validate` adds its own.
COUNTS = (  # at least 1
    "steps",
    "epochs",
    "prompts_per_step",
    "queries_per_step",
    "prompts_per_epoch",
    "tasks_per_step",
    "inner_steps",
    "minibatches",
    "max_new_tokens",
    "eval_every",
    "eval_k",
    "micro_batch_tokens",
    "micro_batch",
    "gen_batch",
    "eval_batch",
    "eval_per_prompt",
    "train_steps",
    "eval_steps",
    "max_turns",
    "eval_max_turns",
    "sft_batch",
    "failure_rollouts",
    "max_steps",
    "max_prompt_tokens",
    "timeout",
    "stage1_timeout",
    "spread_samples",
    "warm_start_demos",
    "toy_tasks",
    "toy_test_tasks",
    "minibatch_rows",
    "gen_tokens",
)
OPTIONAL_COUNTS = (  # where 0 means "all"
    "max_turns",
    "micro_batch",
    "minibatch_rows",
    "gen_tokens",
)
FRACTIONS = ("careless", "rare_share", "p_high", "timestep_fraction", "label_noise")  # in [0, 1]
POSITIVE = (
    "lr",
    "logz_lr",
    "sft_lr",
    "warm_start_lr",
    "clip_eps",
    "clip_eps_high",
    "clip_range",
    "adv_clip",
    "tool_timeout",
)
# --seed and --seeds: 0 … 2³² − 1, the range numpy's global seed takes (torch's takes 64 bits)
SEED_MAX = 2**32 - 1


def number_errors(args):
    """One message per number flag that breaks the rules above; every float must be finite and
    every other number ≥ 0."""
    errors = []
    for field in dataclasses.fields(args):
        value, flag = getattr(args, field.name), "--" + field.name.replace("_", "-")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value != value or value in (float("inf"), float("-inf")):
            errors.append(f"{flag} must be a finite number (got {value})")
        elif field.name in COUNTS and not (value >= 1 or field.name in OPTIONAL_COUNTS):
            errors.append(f"{flag} must be ≥ 1 (got {value})")
        elif field.name in FRACTIONS and not 0 <= value <= 1:
            errors.append(f"{flag} must be in [0, 1] (got {value})")
        elif field.name in POSITIVE and not value > 0:
            errors.append(f"{flag} must be > 0 (got {value})")
        elif value < 0:
            errors.append(f"{flag} must be ≥ 0 (got {value})")
        elif field.name == "seed" and value > SEED_MAX:
            errors.append(f"{flag} must be in 0 … 2^32 − 1 = {SEED_MAX} (got {value})")
    return errors


def check_args(conditions, args=None):
    """Exit with one clear line for the violated `(condition, message)` pairs, and (given `args`)
    the number rules above, instead of a deep traceback."""
    errors = (number_errors(args) if args is not None else []) + [
        msg for ok, msg in conditions if not ok
    ]
    if errors:
        raise SystemExit("error: " + "; ".join(errors))


def read_lines(path, flag):
    """[(line number, line)] of a UTF-8 text file's non-empty lines, or one line saying why not
    (missing, a folder, unreadable, binary, empty)."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: {flag} {str(path)!r} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SystemExit(
            f"error: {flag} {path} is not UTF-8 text (bad byte at offset {err.start})"
        ) from None
    except OSError as err:
        raise SystemExit(f"error: {flag} {path} cannot be read ({err.strerror})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise SystemExit(f"error: {flag} {path} holds no rows")
    return lines


def read_jsonl(path, flag, fields):
    """One dict per JSONL row with `fields` ("prompt|problem": the first of these present), each a
    non-empty string (a number becomes its text); null, NaN, empty and missing fields, or a row
    that is not a JSON object, get one line naming the file and the row."""
    rows = []
    for n, line in read_lines(path, flag):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"error: {path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise SystemExit(f"error: {path}:{n}: expected a JSON object with {fields}")
        kept = {}
        for field in fields:
            names = field.split("|")
            value = next((row[name] for name in names if row.get(name) is not None), None)
            usable = isinstance(value, (str, int, float)) and not isinstance(value, bool)
            if (
                not usable
                or (isinstance(value, float) and not math.isfinite(value))
                or not str(value).strip()
            ):
                raise SystemExit(
                    f"error: {path}:{n}: {field!r} must be a non-empty string or number "
                    f"(got {json.dumps(value)})"
                )
            kept[names[0]] = str(value)
        rows.append(kept)
    return rows
