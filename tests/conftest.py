"""Tests never touch the hub: offline mode is set before transformers/diffusers are imported."""

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs 2 workers: one thread each
    os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def flow_grpo_cache(tmp_path_factory):
    """One cache of flow_grpo's toy base model and reward classifier for the whole session (~20 s to
    train)."""
    return tmp_path_factory.mktemp("flow_grpo_cache")


def pytest_terminal_summary(terminalreporter):
    """Where the Python tool cannot be isolated its isolation tests do not run: say so loudly, not
    as one skip among many."""
    from envs import sandbox

    problem = sandbox.isolation_problem()
    if problem:
        terminalreporter.write_line(
            f"NOT ISOLATED HERE: {problem}. The Python tool is disabled on this machine and its "
            "isolation tests did not run (tests/test_python_tool.py).", red=True, bold=True)
