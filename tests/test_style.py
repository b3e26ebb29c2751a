"""Readability rules the project keeps, checked on every source file."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["", "envs", "utils", "tests", "benchmarks"]
SOURCES = sorted(p for d in FOLDERS for p in (ROOT / d).glob("*.py"))


def test_lines_fit_in_100_columns():
    long_lines = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in SOURCES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > 100
    ]
    assert SOURCES and not long_lines, long_lines
