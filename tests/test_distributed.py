"""Two CPU processes (torchrun → accelerate → DDP over gloo) train exactly what one process trains.

The two-process run goes through tests/ddp_driver.py, which saves every rank's trainable parameters.
(a) the two ranks end with identical parameters; (b) they match a one-process run with the same
global batch to float rounding, which is far below the size of the update itself. FlowRL's log Z
head has dropout, whose draws depend on the process layout, so the LLM side is checked with `--algo
grpo`.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
import ddp_driver
import flow_grpo
import flowrl
from envs import digits, flowrl_tasks
from utils import cli, distributed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.long


def train_and_load(tmp_path, name, processes, flags, env=None):
    """Each rank's trainable parameters after `flags` ran in `processes` processes (1: in this
    process)."""
    prefix, common_flags = (
        tmp_path / name,
        ["--out-dir", str(tmp_path / f"{name}-run"), "--quiet", "--device", "cpu"],
    )
    if processes == 1:
        module = {"flowrl": flowrl, "flow_grpo": flow_grpo}[flags[0]]
        ddp_driver.optimizers.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.optim, "AdamW", ddp_driver.RecordingAdamW)
            module.train(cli.parse_args(module.Args, module.PRESETS, [*flags[1:], *common_flags]))
        return [
            [
                p.detach().clone()
                for group in ddp_driver.optimizers[-1].param_groups
                for p in group["params"]
            ]
        ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        str(ROOT / "tests" / "ddp_driver.py"),
        flags[0],
        str(prefix),
        *flags[1:],
        *common_flags,
    ]
    # a hang (ranks in different collectives) fails the test instead of stalling the suite
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp_path / f"{name}.rank{rank}.pt") for rank in range(processes)]


def distance(a, b):
    return torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b))).item()


@pytest.mark.parametrize(
    "flags",
    [
        [
            "flowrl",
            "--algo",
            "grpo",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "16",
            "--eval-every",
            "100",
        ],
        [
            "flow_grpo",
            "--epochs",
            "2",
            "--prompts-per-epoch",
            "4",
            "--minibatches",
            "1",
            "--eval-per-prompt",
            "2",
            "--eval-every",
            "100",
        ],
    ],
    ids=["flowrl-grpo", "flow_grpo"],
)
def test_two_processes_train_what_one_process_trains(tmp_path, request, flags):
    if flags[0] == "flow_grpo":  # asked for here only: the flowrl run never waits for its training
        flags = [*flags, "--cache-dir", str(request.getfixturevalue("flow_grpo_cache"))]
    (one,) = train_and_load(tmp_path, "one", 1, flags)
    rank0, rank1 = train_and_load(tmp_path, "two", 2, flags)

    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), (
        "the ranks' parameters drifted apart"
    )
    module = {"flowrl": flowrl, "flow_grpo": flow_grpo}[flags[0]]
    args = cli.parse_args(module.Args, module.PRESETS, flags[1:])
    initial = (
        flowrl_tasks.build_toy(args)[1]
        if module is flowrl
        else digits.DigitsTask(args, torch.device("cpu")).policy
    )
    moved = distance(one, [p.detach() for p in initial.parameters() if p.requires_grad])
    assert moved > 1e-2, "training did not change the parameters; the comparison would be empty"
    assert distance(one, rank0) < 1e-4 * moved


def test_groups_must_split_evenly_over_processes():
    class TwoRanks:
        num_processes, process_index = 2, 1

    assert distributed.local_groups(4, TwoRanks()) == range(2, 4)
    with pytest.raises(SystemExit, match="do not split evenly over 2 processes"):
        distributed.local_groups(5, TwoRanks())


def test_ranks_with_different_numbers_of_micro_batches_finish_and_agree(tmp_path):
    """AgentFlow's rollouts differ in length per rank, so with a small token budget the ranks run
    different numbers of micro-batches (counted: the loss's calls), and with mini-batches of 6 turn
    rows (3 a rank) different numbers of rows per mini-batch: the mini-batch count agreed by one
    all-reduce and one all-reduce per optimiser step keep them in step."""
    flags = [
        "agentflow",
        "--steps",
        "2",
        "--queries-per-step",
        "2",
        "--group-size",
        "4",
        "--micro-batch-tokens",
        "25",
        "--minibatch-rows",
        "6",
        "--warm-start-steps",
        "20",
        "--no-ablation",
        "--eval-every",
        "100",
        "--save-every",
        "0",
    ]
    rank0, rank1 = train_and_load(tmp_path, "uneven", 2, flags, {"COUNT_CALLS": "flow_grpo_loss"})
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), "the ranks drifted apart"
    losses = [int((tmp_path / f"uneven.rank{rank}.calls").read_text()) for rank in range(2)]
    assert losses[0] != losses[1], f"{losses}: pick a budget between the ranks' tree sizes"


def test_an_evaluation_with_fewer_queries_than_ranks_finishes(tmp_path):
    """AgentFlow's full path under two ranks with one held-out query: rank 1's shard is empty; it
    rolls out nothing and the gathered accuracy is rank 0's."""
    from test_agentflow import tiny_planner

    model = tiny_planner(tmp_path)
    first = (tmp_path / "qa.jsonl").read_text().splitlines()[0]
    (tmp_path / "one.jsonl").write_text(first + "\n")
    flags = [
        "agentflow",
        "--preset",
        "full",
        "--model",
        str(model),
        "--data",
        str(tmp_path / "qa.jsonl"),
        "--eval-data",
        str(tmp_path / "one.jsonl"),
        "--corpus",
        str(tmp_path / "corpus.jsonl"),
        "--steps",
        "1",
        "--queries-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--lora-rank",
        "4",
        "--save-every",
        "0",
        "--timeout",
        "60",
    ]
    rank0, rank1 = train_and_load(tmp_path, "one-query", 2, flags)
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))


def test_uneven_rc_grpo_ranks_finish_and_agree_after_one_stage_1(tmp_path):
    """RC-GRPO's dialogues differ in length per rank: with a small token budget the ranks run
    different numbers of micro-batches (8 and 6, then 5 and 7) and still end with the same
    weights. Stage 1 runs once, on rank 0 (rank 1 runs no supervised fine-tuning at all), and both
    ranks load its file."""
    flags = [
        "rc_grpo",
        "--steps",
        "2",
        "--arms",
        "rctp+rc-grpo",
        "--toy-tasks",
        "20",
        "--toy-test-tasks",
        "4",
        "--tasks-per-step",
        "4",
        "--failure-rollouts",
        "1",
        "--micro-batch-tokens",
        "60",
        "--save-every",
        "0",
    ]
    rank0, rank1 = train_and_load(
        tmp_path, "uneven-rc", 2, flags, {"COUNT_CALLS": "supervised_finetune"}
    )
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), "the ranks drifted apart"
    calls = [int((tmp_path / f"uneven-rc.rank{r}.calls").read_text()) for r in range(2)]
    assert calls[0] == 2 and calls[1] == 0  # the toy's base model and RCTP-FT, on rank 0 only


def test_an_evaluation_longer_than_the_collective_timeout_finishes(tmp_path):
    """Every rank evaluates (sharded where it samples), so none waits in a collective while
    another evaluates: each evaluation takes 6 s more, the process group gives up after 4 s."""
    flags = [
        "flowrl",
        "--algo",
        "grpo",
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "8",
        "--eval-every",
        "1",
        "--timeout",
        "4",
    ]
    rank0, rank1 = train_and_load(tmp_path, "slow-eval", 2, flags, {"SLOW_EVAL_SECONDS": "6"})
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))


def _average_on_rank(rank, port, out):
    from types import SimpleNamespace

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    params[0].grad = torch.full((3,), 2.0 * (rank + 1))  # on both ranks
    if rank == 0:
        params[1].grad = torch.full((3,), 4.0)  # on one rank only
    distributed.average_gradients(params, SimpleNamespace(num_processes=2))
    torch.save([None if p.grad is None else p.grad for p in params], f"{out}.{rank}.pt")
    distributed.leave_process_group()


def test_a_gradient_none_on_every_rank_stays_none(tmp_path):
    """Averaging over two gloo ranks: a gradient on both is their mean, one on a single rank is
    halved (the other adds zeros), and one on no rank stays None, so AdamW leaves that parameter
    alone (no weight decay on a zero gradient), as it would in one process."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_average_on_rank, args=(port, str(tmp_path / "grads")), nprocs=2)
    for rank in range(2):
        both, one, none = torch.load(tmp_path / f"grads.{rank}.pt")
        assert torch.equal(both, torch.full((3,), 3.0)) and torch.equal(one, torch.full((3,), 2.0))
        assert none is None


def test_micro_batches_reduce_once_and_run_the_empty_ones_inside(monkeypatch):
    """A sharded model's mini-batch: gradients reduced on its last backward only; the padding
    micro-batches (no rows) run a forward and a zero backward inside the iterator and are not
    yielded."""
    syncs = []
    weight = torch.ones(1, requires_grad=True)

    class Sharded:
        def set_requires_gradient_sync(self, sync):
            syncs.append(sync)

    def forward(model, mb):
        syncs.append("forward")
        return weight * mb.mask

    monkeypatch.setattr(common, "micro_batch_logprobs", forward)
    ids = torch.ones(1, 2)
    minibatch = [common.MicroBatch(rows, *[ids] * 8) for rows in ([0, 1], [2], [], [])]
    autocast = contextlib.nullcontext()
    yielded = [mb.rows for mb in distributed.micro_batches(Sharded(), minibatch, autocast)]
    assert yielded == [[0, 1], [2]]
    assert syncs == [False, False, False, "forward", True, "forward"]
    assert weight.grad is not None and not weight.grad.any()  # zero backward: the collective ran
