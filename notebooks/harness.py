"""What the notebooks need that is not their lecture: `import harness` puts the scripts (one folder
up) on the import path and quietens progress bars; `sizes(notebook)` gives the notebook's runs as a
reader runs them or, where the test suite sets NOTEBOOK_QUICK=1, tiny enough to run every cell in a
few minutes; RUN_FULL=1 on a GPU machine lets the full-scale cell train."""

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # no widgets needed

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
hf_logging.disable_progress_bar()  # no "Loading weights" bars in the outputs

QUICK = os.environ.get("NOTEBOOK_QUICK") == "1"
RUN_FULL = os.environ.get("RUN_FULL") == "1" and torch.cuda.is_available()
# flow_grpo's pretrained toy base model, shared with `python flow_grpo.py` (the tests share theirs)
FLOW_GRPO_CACHE = os.environ.get("FLOW_GRPO_CACHE", str(ROOT / "runs" / "flow_grpo_cache"))

# (TOY, REAL): what extends a toy run's Args and a real-model preset
READER = {
    "flowrl": ({}, dict(steps=8)),
    "flow_grpo": (dict(cache_dir=FLOW_GRPO_CACHE), {}),
    "agentflow": ({}, dict(ablation=False)),
    "rc_grpo": ({}, dict(steps=2)),
}
# the tests' sizes (tests/test_notebooks.py checks the agentflow and rc_grpo REAL runs at these)
TINY = {
    "flowrl": (
        dict(steps=4, eval_every=2),
        dict(steps=1, group_size=2, prompts_per_step=1, max_new_tokens=4),
    ),
    "flow_grpo": (dict(cache_dir=FLOW_GRPO_CACHE, epochs=3, eval_per_prompt=8, eval_every=2), {}),
    "agentflow": (
        dict(steps=3, eval_every=3, warm_start_steps=50),
        dict(
            eval_data="../tests/data/people_tiny.jsonl",
            steps=1,
            queries_per_step=1,
            group_size=2,
            warm_start_demos=2,
            warm_start_steps=1,
            ablation=False,
            max_turns=1,
            eval_max_turns=1,
            max_new_tokens=10,
        ),
    ),
    "rc_grpo": (
        dict(toy_tasks=20, toy_test_tasks=10, steps=2, tasks_per_step=2, failure_rollouts=1),
        dict(
            tasks="multi_turn_base_1,multi_turn_base_9",
            arms="rctp+rc-grpo",
            lora_rank=8,
            steps=1,
            tasks_per_step=1,
            group_size=2,
            max_steps=1,
            max_new_tokens=12,
            rctp_epochs=1,
        ),
    ),
}


def sizes(notebook):
    """(TOY, REAL) for `notebook`: the reader's sizes, or the tests' tiny ones."""
    return (TINY if QUICK else READER)[notebook]
