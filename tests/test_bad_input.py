"""The bad-input matrix over the four scripts: every case gets one clear message and a non-zero
exit, before any model is built (model ids and data files are covered in each script's own
tests)."""

import importlib

import pytest

import agentflow
import common
import flow_grpo
import flowrl
import rc_grpo
from utils import cli

SCRIPTS = {"flowrl": flowrl, "flow_grpo": flow_grpo, "agentflow": agentflow, "rc_grpo": rc_grpo}
CLIP_FLAG = {
    "flowrl": "--clip-eps", "flow_grpo": "--clip-range", "agentflow": "--clip-eps",
    "rc_grpo": "--clip-eps"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_lists_every_flag(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all("--" + f.replace("_", "-") in out for f in SCRIPTS[name].Args.__dataclass_fields__)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(
    "argv", [["--no-such-flag"], ["--group-size", "abc"], ["--preset", "nonsense"]])
def test_unknown_flags_and_bad_types_exit_with_argparse_usage(name, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(SCRIPTS[name].Args, SCRIPTS[name].PRESETS, argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("case", ["group", "lr", "clip"])
def test_out_of_range_values_get_one_clear_message(name, case, tmp_path):
    argv = {"group": ["--group-size", "1"], "lr": ["--lr", "-1"], "clip": [CLIP_FLAG[name], "0"]}[
        case
    ]
    args = cli.parse_args(
        SCRIPTS[name].Args, SCRIPTS[name].PRESETS, ["--quiet", "--out-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[name].train(args)
    message = str(exit_info.value)
    assert message.startswith("error:") and argv[0] in message and "\n" not in message


def test_flow_grpo_refuses_to_train_on_the_ode(tmp_path):
    args = cli.parse_args(
        flow_grpo.Args, flow_grpo.PRESETS,
        ["--quiet", "--noise-level", "0", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="ODE"):
        flow_grpo.train(args)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_function_in_the_equation_map_exists_and_has_a_docstring(name):
    import re

    module = SCRIPTS[name]
    doc = module.__doc__
    assert "arXiv" in doc and "REFERENCES" not in doc and "Deviations" in doc
    equation_map = doc[doc.index("Equation map") : doc.index("Deviations")]
    names = [
        n.strip()
        for line in equation_map.splitlines()[1:]
        if "→" in line
        for n in line.split("→")[-1].split(",")
        if re.fullmatch(r"\s*(\w+\.)?\w+\s*", n)
    ]
    assert len(names) >= 4
    for entry in names:  # a name of the script, of common, or of a module in envs/
        owner, _, attr = entry.rpartition(".")
        home = {"": module, "common": common}.get(owner) or importlib.import_module(f"envs.{owner}")
        assert (getattr(home, attr).__doc__ or "").strip(), entry
