"""`python benchmarks/readability.py`: how densely each algorithm file reads, overall and inside its
training loop (the `for step`/`for epoch` loop), against the rules docs/testing.md states.

Per part: lines, characters per non-blank line (indentation included), the share of lines of 95 or
more columns, and calls per simple statement (ast.Call nodes inside statements that hold no block);
for the loop also the share of its lines in calls written one argument per line (every argument
starts on its own line below the opening: what ruff makes of a call too long for one).
Then each notebook: its cells, its prose in words (a markdown line is no unit: a paragraph may sit
on one line or on ten) and its code lines.
"""

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ["flowrl.py", "flow_grpo.py", "rc_grpo.py", "agentflow.py"]
LOOP_VARIABLES = ("step", "epoch")
COMPOUND = (
    ast.If,
    ast.For,
    ast.While,
    ast.With,
    ast.Try,
    ast.FunctionDef,
    ast.ClassDef,
    ast.AsyncFor,
    ast.AsyncWith,
    ast.AsyncFunctionDef,
    ast.Match,
)


def training_loop(tree):
    """The outermost `for step …`/`for epoch …` loop of the file."""
    loops = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and node.target.id in LOOP_VARIABLES
    ]
    return max(loops, key=lambda node: node.end_lineno - node.lineno)


def calls_per_statement(node):
    simple = [n for n in ast.walk(node) if isinstance(n, ast.stmt) and not isinstance(n, COMPOUND)]
    calls = sum(isinstance(c, ast.Call) for s in simple for c in ast.walk(s))
    return calls / max(1, len(simple))


def one_argument_per_line(node):
    """The line numbers of every call under `node` written one argument per line (nested calls
    counted once)."""
    lines = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and (call.args or call.keywords):
            starts = [argument.lineno for argument in [*call.args, *call.keywords]]
            if min(starts) > call.lineno and len(set(starts)) == len(starts):
                lines |= set(range(call.lineno, call.end_lineno + 1))
    return lines


def measure(lines, node):
    text = [line.rstrip() for line in lines if line.strip()]
    return {
        "lines": len(lines),
        "chars_per_line": sum(map(len, text)) / max(1, len(text)),
        "share_ge_95": sum(len(line) >= 95 for line in text) / max(1, len(text)),
        "calls_per_statement": calls_per_statement(node),
    }


def report(name):
    source = (ROOT / name).read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    loop = training_loop(tree)
    loop_lines = lines[loop.lineno - 1 : loop.end_lineno]
    exploded = len(one_argument_per_line(loop)) / len(loop_lines)
    return {
        "file": measure(lines, tree),
        "loop": measure(loop_lines, loop) | {"one_argument_per_line": exploded},
    }


def main():
    print(
        "| file | lines | chars/line | ≥ 95 cols | calls/stmt | loop lines | loop chars/line "
        "| loop ≥ 95 cols | loop calls/stmt | loop one-arg-per-line |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ALGORITHMS:
        f, loop = report(name).values()
        print(
            f"| `{name}` | {f['lines']} | {f['chars_per_line']:.1f} | {f['share_ge_95']:.0%} | "
            f"{f['calls_per_statement']:.2f} | {loop['lines']} | {loop['chars_per_line']:.1f} | "
            f"{loop['share_ge_95']:.0%} | {loop['calls_per_statement']:.2f} | "
            f"{loop['one_argument_per_line']:.0%} |"
        )
    print("\n| notebook | cells (markdown / code) | prose words | code lines |\n|---|---|---|---|")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        prose = [c for c in cells if c["cell_type"] == "markdown"]
        code = [c for c in cells if c["cell_type"] == "code"]
        words = sum(len("".join(c["source"]).split()) for c in prose)
        code_lines = sum(len("".join(c["source"]).splitlines()) for c in code)
        print(
            f"| `{path.name}` | {len(cells)} ({len(prose)} / {len(code)}) | {words} "
            f"| {code_lines} |"
        )


if __name__ == "__main__":
    sys.exit(main())
