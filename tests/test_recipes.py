"""Each full preset against the original recipe: the table in docs/<algorithm>.md states every value
beside the original one; the preset column must be what PRESETS holds, every row where the two
differ must be a numbered deviation in the script's docstring (named by its --flag), and every
original value names where it comes from: a file (of the original code or a package) or the
paper's section."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import agentflow
import flow_grpo
import flowrl
import rc_grpo

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## The full preset against the original recipe"
FILE = re.compile(r"`[\w./*-]+\.(py|sh|yaml|json)`")
SECTION = re.compile(r"(§\d|App\. [A-E]|Table \d|Eq\. \d)")


def recipe_rows(page):
    """(flag, preset cell, original cell, source cell) for each row of the page's recipe table."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert HEADING in text, f"docs/{page} has no recipe table"
    rows = []
    for line in text.split(HEADING, 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 4:
            rows.append((cells[0].strip("`"), cells[1], cells[2], cells[3]))
        elif rows and not line.startswith("|"):
            break
    return rows


def literal(cell):
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return cell


@pytest.mark.parametrize(
    "module, preset, page",
    [
        (flowrl, "full", "flowrl.md"),
        (agentflow, "full", "agentflow.md"),
        (rc_grpo, "bfcl", "rc_grpo.md"),
        (flow_grpo, "sd3", "flow_grpo.md"),
    ],
)
def test_recipe_table_matches_the_preset_and_the_deviations(module, preset, page):
    values = dataclasses.asdict(dataclasses.replace(module.Args(), **module.PRESETS[preset]))
    deviations = module.__doc__.split("Deviations", 1)[1]
    rows = recipe_rows(page)
    assert len(rows) >= 8
    for flag, preset_cell, original_cell, source in rows:
        assert FILE.search(source) or SECTION.search(source), f"{page}: {flag} names no source"
        if "paper" in source:
            assert SECTION.search(source), f"{page}: {flag} cites the paper without a section"
        assert flag in values, f"{page}: {flag} is not a flag of {module.__name__}"
        assert literal(preset_cell) == values[flag], (page, flag, preset_cell, values[flag])
        if literal(original_cell) != values[flag]:
            option = "--" + flag.replace("_", "-")
            assert option in deviations, f"{module.__name__}: {option} differs and is no deviation"
