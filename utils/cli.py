"""Flags from a dataclass: one `--flag` per field with its help text, presets that swap in their
defaults (`--preset NAME`), and one clear line per bad value instead of a traceback."""

import argparse
import dataclasses
import sys


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
        description=(sys.modules[args_cls.__module__].__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--preset", default="toy", choices=["toy", *presets],
        help="toy: tiny offline CPU run (default); " + ", ".join(presets) + ": paper-scale")
    names = {f.name for f in dataclasses.fields(args_cls)}
    for f in dataclasses.fields(args_cls):
        if f.name == "preset":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=defaults[f.name],
                help=help_text)
        else:
            kind = (
                {"int": int, "float": float, "str": str}.get(f.type, f.type)
                if isinstance(f.type, str)
                else f.type
            )
            parser.add_argument(
                flag, type=kind, default=defaults[f.name], choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {defaults[f.name]})")
    ns = vars(parser.parse_args(argv))
    if "preset" in names:  # a field of its own: `train(Args(...))` works without the CLI
        return args_cls(**ns)
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
