"""Several processes (`accelerate launch`, `torchrun`): the process group, each rank's share of a
step's groups, seeds per stream of rollout noise, and the one gradient all-reduce per optimiser step
that keeps every rank in step whatever its number of micro-batches."""

import torch


def setup_accelerator(device_name="auto", timeout_s=1800):
    """Accelerate's process state → (accelerator, device). One process normally; under `accelerate
    launch` or `torchrun`, one process per device in one process group whose collectives give up
    after `timeout_s` (gradients: average_gradients). device_name "cpu" forces the CPU (gloo);
    "auto" takes cuda:<local rank>, mps or cpu. Precision is each script's `--mixed-precision`:
    an accelerate config asking for fp16/bf16 is refused (accelerate would scale losses it never
    unscales)."""
    import datetime
    import os

    from accelerate import Accelerator, InitProcessGroupKwargs

    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if asked != "no":
        raise SystemExit(
            f"error: the accelerate config asks for mixed_precision {asked!r}; set it to 'no' and "
            "pass --mixed-precision to the script instead")
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))
    accelerator = Accelerator(
        cpu=device_name == "cpu", mixed_precision="no", kwargs_handlers=[timeout])
    return accelerator, accelerator.device


def local_groups(num_groups, accelerator):
    """This rank's contiguous block of the step's groups: range(lo, hi). Every member of a group
    lands on the same rank, so its advantage (GRPO) is computed from the whole group there, as in
    one process."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if num_groups % world:
        raise SystemExit(
            f"error: {num_groups} groups per step do not split evenly over {world} processes")
    per_rank = num_groups // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def sampling_seed(seed, step, stream):
    """A seed for one stream of rollout noise at one step (a group, or a rank's share of the step):
    distinct across streams, so no two ranks share noise, and recomputed from (seed, step) after a
    resume."""
    return (seed * 1_000_003 + step) * 100_003 + stream


def average_gradients(params, accelerator):
    """g ← mean over ranks of each rank's accumulated g: what DDP's all-reduce computes, as one
    collective per parameter per optimiser step (a rank without a gradient adds zeros), so ranks
    may run different numbers of micro-batches (their rollouts differ in length) without a hang. A
    no-op in one process."""
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    # which parameters got a gradient on any rank (one small all-reduce): one that got none
    # anywhere stays None, so AdamW skips it as it would in one process
    has_grad = [p.grad is not None for p in params]
    has_grad = torch.tensor(has_grad, dtype=torch.float, device=params[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    for p, anywhere in zip(params, has_grad.tolist()):  # every rank, the same order
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= accelerator.num_processes


def max_over_ranks(count, accelerator):
    """The largest `count` any rank holds (one all-reduce), so every rank runs the same number of
    a phase's steps. `count` itself in one process."""
    if accelerator.num_processes == 1:
        return count
    import torch.distributed as dist

    value = torch.tensor([count], device=accelerator.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
