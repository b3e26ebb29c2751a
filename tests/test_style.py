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
    for path in [
        ROOT / "common.py",
        *ROOT.glob("envs/*.py"),
        *ROOT.glob("utils/*.py"),
        *(ROOT / name for name in ALGORITHMS),
    ]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        imported |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module
        }
        mine = imported & project
        if path.name == "common.py":
            assert not mine, mine
        else:
            assert not mine & {Path(a).stem for a in ALGORITHMS}, (path.name, mine)


RUN_FLAGS = [
    "seed",
    "seeds",
    "out_dir",
    "device",
    "quiet",
    "report_to",
    "save_every",
    "resume",
    "overwrite",
    "timeout",
]


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


def ruff(*command):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check_passes():
    """ruff.toml's rules (pycodestyle, pyflakes, import order, bugbear) over the project's Python
    and its notebooks."""
    result = ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    """The layout is `ruff format`'s (line length 100, magic trailing comma off): a call that fits
    on one line is on one line, and none is tuned by hand."""
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def rebinding_chains(tree):
    """`x = f(...)` then, later in the same block, `x = g(x)`: one name for a list, a tensor and a
    gathered tensor in turn. Returns the line numbers of the second assignments."""
    import ast

    def assigned(node):
        simple = isinstance(node, ast.Assign) and len(node.targets) == 1
        return node.targets[0].id if simple and isinstance(node.targets[0], ast.Name) else None

    def bound(node):  # every name an assignment sets, tuple targets included
        targets = node.targets if isinstance(node, ast.Assign) else []
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}

    found = []
    for block in (
        getattr(n, field, None) for n in ast.walk(tree) for field in ("body", "orelse", "finalbody")
    ):
        if not isinstance(block, list):
            continue
        for k, statement in enumerate(block):
            name = assigned(statement)
            value = ast.walk(statement.value) if name else ()
            reads = {n.id for n in value if isinstance(n, ast.Name)}
            if name in reads and any(name in bound(earlier) for earlier in block[:k]):
                found.append(statement.lineno)
    return found


def crowded_calls_in_loops(tree, limit=8):
    """Calls inside a loop (or a comprehension) that take more than `limit` arguments: what the
    formatter would still stack one per line. Returns their line numbers."""
    import ast

    loops = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    return sorted(
        {
            call.lineno
            for loop in ast.walk(tree)
            if isinstance(loop, loops)
            for call in ast.walk(loop)
            if isinstance(call, ast.Call) and len(call.args) + len(call.keywords) > limit
        }
    )


def test_no_rebinding_chain_and_no_crowded_call_in_a_loop():
    """In the four algorithm files: one name per meaning (no `x = g(x)` after `x = f(...)`), and no
    call in a loop with more than 8 arguments (a group of values that travel together is one
    object)."""
    import ast

    for name in ALGORITHMS:
        tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
        assert not rebinding_chains(tree), (name, "rebinding chains", rebinding_chains(tree))
        crowded = crowded_calls_in_loops(tree)
        assert not crowded, (name, "calls in a loop with more than 8 arguments", crowded)


def test_the_rule_finds_what_it_names():
    import ast

    chain = ast.parse("def f(x):\n    y = g(x)\n    z = 1\n    y = y.cpu()\n")
    unpacked = ast.parse("def f(x):\n    y, n = g(x)\n    n = max(1, n)\n")
    renamed = ast.parse("def f(x):\n    y = g(x)\n    y_cpu = y.cpu()\n")
    crowded = ast.parse("for i in r:\n    h(1, 2, 3, 4, 5, a=6, b=7, c=8, d=9)\n")
    assert rebinding_chains(chain) == [4] and not rebinding_chains(renamed)
    assert rebinding_chains(unpacked) == [3]
    assert crowded_calls_in_loops(crowded) == [2]
    assert not crowded_calls_in_loops(ast.parse("h(1, 2, 3, 4, 5, a=6, b=7, c=8, d=9)\n"))


def test_project_calls_pass_few_positional_arguments():
    """No call in an algorithm file passes a project function more than six positional arguments,
    or a literal or expression (not a name) positionally after its third: those go by keyword."""
    import ast

    project_modules = {
        "common",
        "tracking",
        "distributed",
        "cli",
        "sweep",
        "models",
        "bfcl",
        "bfcl_toy",
        "flowrl_tasks",
        "agent_tools",
        "agent_toy",
        "digits",
        "sd3",
        "sandbox",
    }
    bad = []
    for name in ALGORITHMS:
        tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
        own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            func = call.func
            mine = (isinstance(func, ast.Name) and func.id in own) or (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in project_modules
            )
            named = (ast.Name, ast.Attribute, ast.Subscript)  # a name, or an item of one
            late = [a for a in call.args[3:] if not isinstance(a, named)]
            if mine and (len(call.args) > 6 or late):
                bad.append(f"{name}:{call.lineno}")
    assert not bad, bad


def test_each_loop_reads_as_its_algorithm_box():
    """Every training loop is at most 115 lines, at most 15 % of them in calls written one argument
    per line (a per-run constant is bound once above the loop, not restated each step), and no
    loop computes a ratio or log-ratio itself: each loss returns the statistics it owns. No script
    writes a micro-batch's π_old, π_ref or sampler log-probs (common scores and reads them).
    Every loop times its rollout, preparation and update (one line each, the same names).
    FlowRL's update holds no `args.algo` test (each arm's loss is picked once, above the loop)
    and trajectory_balance_loss returns its statistics. AgentFlow's rollout is one system: its
    planner samples inside it (`system.plan`), with no sampler passed beside it."""
    import ast
    import inspect
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import agentflow
    import flowrl
    import readability

    for name in ALGORITHMS:
        source = (ROOT / name).read_text(encoding="utf-8")
        loop = readability.training_loop(ast.parse(source))
        lines = loop.end_lineno - loop.lineno + 1
        exploded = len(readability.one_argument_per_line(loop))
        assert lines <= 115, (name, "loop lines", lines)
        assert exploded <= 0.15 * lines, (name, "lines in one-argument-per-line calls", exploded)
        ratios = [
            node.lineno
            for node in ast.walk(loop)
            if isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Store)
            and node.id in ("ratio", "log_ratio")
        ]
        assert not ratios, (name, "a ratio computed in the loop", ratios)
        timed = {ast.unparse(n.items[0]) for n in ast.walk(loop) if isinstance(n, ast.With)}
        phases = {f"phases.time('{phase}')" for phase in ("rollout", "prepare", "update")}
        assert phases <= timed, (name, "phases not timed", phases - timed)
        writes = [  # π_old is chosen in one place (common.old_logprobs), never written back
            node.lineno
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and node.attr in ("old_logp", "ref_logp", "sampler_logp")
        ]
        assert not writes, (name, "a micro-batch's log-probs written by the script", writes)
        if name == "flowrl.py":
            timed = [n for n in ast.walk(loop) if isinstance(n, ast.With)]
            (update,) = [n for n in timed if "phases.time('update')" in ast.unparse(n.items[0])]
            algo = [n.lineno for n in ast.walk(update) if ast.unparse(n) == "args.algo"]
            assert not algo, ("an args.algo test in FlowRL's update", algo)
    _, stats = flowrl.trajectory_balance_loss(
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.ones(2),
        1.0,
        log_ratio=torch.zeros(2),
        clip_eps=0.2,
    )
    assert {"ratio_dev", "w_mean", "log_z", "residual_abs"} <= set(stats)
    assert list(inspect.signature(agentflow.run_agent).parameters) == [
        "queries",
        "system",
        "max_turns",
    ]
