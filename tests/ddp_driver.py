"""Run a script's `train` under torchrun (or alone) and save this rank's trainable parameters.

    torchrun --nproc_per_node 2 tests/ddp_driver.py flowrl OUT_FILE_PREFIX --steps 2 ...

Used by tests/test_distributed.py and tests/test_fsdp.py: the optimiser is the one object every
script hands all its trainable tensors to, so a recording AdamW captures them without touching the
scripts.
"""

import importlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import cli, distributed  # noqa: E402

optimizers = []


class RecordingAdamW(torch.optim.AdamW):
    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        optimizers.append(self)


def slow(evaluate, seconds):
    """An evaluation that takes `seconds` longer (SLOW_EVAL_SECONDS): longer than the process
    group's timeout, a rank that waits in a collective meanwhile would fail."""

    def wrapped(*args, **kwargs):
        time.sleep(seconds)
        return evaluate(*args, **kwargs)

    return wrapped


if __name__ == "__main__":
    torch.optim.AdamW = RecordingAdamW
    script, prefix = sys.argv[1], sys.argv[2]
    module = importlib.import_module(script)
    calls = []
    if os.environ.get("COUNT_CALLS"):  # how often this rank runs a function of the script, or
        # of another module ("common.pack_micro_batch")
        owner, _, name = os.environ["COUNT_CALLS"].rpartition(".")
        owner = importlib.import_module(owner) if owner else module
        counted = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: calls.append(1) or counted(*a, **k))
    if os.environ.get("SLOW_EVAL_SECONDS"):
        from envs import flowrl_tasks

        flowrl_tasks.evaluate = slow(flowrl_tasks.evaluate, float(os.environ["SLOW_EVAL_SECONDS"]))
    module.train(cli.parse_args(module.Args, module.PRESETS, sys.argv[3:]))
    params = [  # a sharded parameter (--fsdp) gathered whole: every rank, the same order
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for group in optimizers[-1].param_groups
        for p in group["params"]
    ]
    torch.save(params, f"{prefix}.rank{os.environ.get('RANK', '0')}.pt")
    Path(f"{prefix}.rank{os.environ.get('RANK', '0')}.calls").write_text(str(len(calls)))
    distributed.leave_process_group()
