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


ALGORITHMS = ["flowrl.py", "flow_grpo.py", "rc_grpo.py", "agentflow.py"]


def test_each_algorithm_file_shows_its_loss_early():
    """The paper's math comes first: the first loss function sits in the first half of the file.
    No line or function caps: a file reads by its density (docs/testing.md), not its length."""
    import ast

    for name in ALGORITHMS:
        source = (ROOT / name).read_text(encoding="utf-8")
        lines = len(source.splitlines())
        functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
        first_loss = min(n.lineno for n in functions if n.name.endswith("_loss"))
        assert first_loss <= 0.5 * lines, (name, first_loss, lines)


def test_imports_go_one_way():
    """No algorithm file imports another, nothing in envs/ or utils/ imports one, and common.py
    imports no project module."""
    import ast

    project = {p.stem for p in ROOT.glob("*.py")} | {"envs", "utils"}
    for path in [ROOT / "common.py", *ROOT.glob("envs/*.py"), *ROOT.glob("utils/*.py"),
                 *(ROOT / name for name in ALGORITHMS)]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.module}
        mine = imported & project
        if path.name == "common.py":
            assert not mine, mine
        else:
            assert not mine & {Path(a).stem for a in ALGORITHMS}, (path.name, mine)


RUN_FLAGS = ["seed", "seeds", "out_dir", "device", "quiet", "report_to", "save_every", "resume",
             "overwrite", "timeout"]


def test_the_four_scripts_share_the_run_flags():
    """The run flags (not the paper's) exist in every script with one type and one set of choices,
    so a flag learnt on one script works on the others."""
    import dataclasses
    import importlib

    shapes = {}
    for name in ALGORITHMS:
        fields = {f.name: f for f in dataclasses.fields(importlib.import_module(name[:-3]).Args)}
        missing = [flag for flag in RUN_FLAGS if flag not in fields]
        assert not missing, (name, missing)
        for flag in RUN_FLAGS:
            shape = (str(fields[flag].type), fields[flag].metadata.get("choices"))
            assert shapes.setdefault(flag, shape) == shape, (name, flag, shape, shapes[flag])


def test_the_loops_read_at_cleanrl_density():
    """Inside each training loop: at most 56 characters per non-blank line, 10 % of lines of 95
    columns or more, 1.0 calls per simple statement (CleanRL's ppo.py loop: 54.5, 10 %, 0.89)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import readability

    for name in ALGORITHMS:
        loop = readability.report(name)["loop"]
        assert loop["chars_per_line"] <= 56, (name, loop)
        assert loop["share_ge_95"] <= 0.10, (name, loop)
        assert loop["calls_per_statement"] <= 1.0, (name, loop)


def test_project_calls_pass_few_positional_arguments():
    """No call in an algorithm file passes a project function more than six positional arguments,
    or a literal or expression (not a name) positionally after its third: those go by keyword."""
    import ast

    project_modules = {"common", "tracking", "distributed", "cli", "sweep", "models", "bfcl",
                       "bfcl_toy", "flowrl_tasks", "agent_tools", "agent_toy", "digits", "sd3",
                       "sandbox"}
    bad = []
    for name in ALGORITHMS:
        tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
        own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            func = call.func
            mine = (isinstance(func, ast.Name) and func.id in own) or (
                isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in project_modules)
            named = (ast.Name, ast.Attribute, ast.Subscript)  # a name, or an item of one
            late = [a for a in call.args[3:] if not isinstance(a, named)]
            if mine and (len(call.args) > 6 or late):
                bad.append(f"{name}:{call.lineno}")
    assert not bad, bad
