"""Several processes (`accelerate launch`, `torchrun`): the process group, each rank's share of a
step's groups, seeds per stream of rollout noise, and the one gradient all-reduce per optimiser step
that keeps every rank in step whatever its number of micro-batches."""

import os
import time
from pathlib import Path

import torch

import common


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
            "pass --mixed-precision to the script instead"
        )
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))
    accelerator = Accelerator(
        cpu=device_name == "cpu", mixed_precision="no", kwargs_handlers=[timeout]
    )
    return accelerator, accelerator.device


def leave_process_group():
    """After a run's last collective, on a normal exit: this rank leaves the process group, as
    torch asks. First it sleeps, the GIL released, for 0.2 s: gloo's worker threads drop their last
    collectives' tensors after the main thread has its result, and dropping one takes the GIL. A
    process that starts finalising Python before that aborts (SIGABRT, "terminate called without
    an active exception"), failing a run that finished. Two-rank FSDP runs of a small model that
    ended right after a collective aborted 8 times in 209 without the sleep (destroying the group
    or a barrier alone did not help), 0 times in 80 with it. A no-op in one process."""
    if torch.distributed.is_initialized():
        time.sleep(0.2)
        torch.distributed.destroy_process_group()


def local_groups(num_groups, accelerator):
    """This rank's contiguous block of the step's groups: range(lo, hi). Every member of a group
    lands on the same rank, so its advantage (GRPO) is computed from the whole group there, as in
    one process."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if num_groups % world:
        raise SystemExit(
            f"error: {num_groups} groups per step do not split evenly over {world} processes"
        )
    per_rank = num_groups // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def sampling_seed(seed, step, stream):
    """A seed for one stream of rollout noise at one step (a group, or a rank's share of the step):
    distinct across streams, so no two ranks share noise, and recomputed from (seed, step) after a
    resume. Kept below 2⁶³ (a torch seed is 64-bit), so a seed made from another one still fits."""
    return ((seed * 1_000_003 + step) * 100_003 + stream) % 2**63


def seed_rank_noise(seed, step, accelerator):
    """Each rank its own sampling noise for this step (`generate` draws from torch's global
    generator), from (seed, step, rank); one process keeps its single stream."""
    if accelerator.num_processes > 1:
        torch.manual_seed(sampling_seed(seed, step, accelerator.process_index))


def row_seeds(group_seeds, group_size):
    """A seed per row of each group: group seed × 1 000 + row, kept below 2⁶³ as the group seeds
    are (a torch seed is 64-bit; a group seed from a large --seed would overflow it). Below
    2⁶³ ÷ 1 000 (the toys' seeds) the modulo changes nothing."""
    return [(seed * 1_000 + row) % 2**63 for seed in group_seeds for row in range(group_size)]


def is_rank_zero():
    """Rank 0 of a launched group (torchrun and `accelerate launch` set RANK), or the only process:
    the one that prints the run's final JSON."""
    return int(os.environ.get("RANK", "0")) == 0


def check_shared_folder(folder):
    """Every rank sees a file rank 0 writes in `folder`, or every rank exits with one line: ranks on
    machines without a shared file system fail in seconds, not after stage 1's day-long wait. A
    no-op in one process."""
    if not torch.distributed.is_initialized():
        return
    rank = torch.distributed.get_rank()
    marker = Path(folder) / f".shared-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if rank == 0:
        marker.write_text("written by rank 0; every rank must see it\n")
    torch.distributed.barrier()
    seen = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(seen, marker.exists())
    if rank == 0:
        marker.unlink()
    if not all(seen):
        blind = [r for r, ok in enumerate(seen) if not ok]
        raise SystemExit(
            f"error: rank(s) {blind} cannot see {marker}, which rank 0 wrote: give every rank the "
            "same --out-dir on a file system they share"
        )


def wait_for_file(path, timeout_s, flag):
    """Poll (not in a collective, which would time out) until `path` exists; after `timeout_s`
    seconds, exit with one line naming the file and the fix."""
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(
                f"error: {path} did not appear within {timeout_s} s (rank 0 writes it): give "
                f"every rank the same --out-dir on a shared file system, check rank 0's log, or "
                f"raise {flag}"
            )
        time.sleep(min(2.0, timeout_s / 10))


def average_gradients(params, accelerator):
    """g ← mean over ranks of each rank's accumulated g: what DDP's all-reduce computes, as one
    collective per parameter per optimiser step (a rank without a gradient adds zeros), so ranks
    may run different numbers of micro-batches (their rollouts differ in length) without a hang. A
    no-op in one process; sharded parameters (FSDP) are skipped: their gradients are reduced by
    FSDP in the backward pass."""
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    params = [p for p in params if not is_sharded(p)]  # FSDP reduces its shards' itself
    if not params:
        return
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


def rows_in_order(order, my_rows):
    """The rows of `order` (a permutation every rank shares) that fall in this rank's block
    `my_rows` (a slice), in that order and counted from the block's start."""
    mine = (order >= my_rows.start) & (order < my_rows.stop)
    return order[mine] - my_rows.start


def max_over_ranks(count, accelerator):
    """The largest `count` any rank holds (one all-reduce), so every rank runs the same number of
    a phase's steps. `count` itself in one process."""
    if accelerator.num_processes == 1:
        return count
    import torch.distributed as dist

    value = torch.tensor([count], device=accelerator.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


# ------------------------------------------------ sharding (FSDP2): flowrl.py --fsdp, past one GPU


def is_sharded(tensor):
    """A DTensor: a shard of a parameter (or gradient) that FSDP holds across the ranks."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def shard(model, bf16):
    """FSDP2 (`fully_shard`) on each decoder layer, then on the root (embeddings, final norm, LM
    head): each rank keeps 1/N of every weight, its gradient and its AdamW moments. The shards stay
    fp32 master weights; with `bf16` the forward and backward run on bf16 copies gathered layer by
    layer, and gradients are reduced in fp32 (a MixedPrecisionPolicy). A frozen model (the
    reference) is first cast to bf16 when `bf16`: it is only ever read."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch.distributed.is_initialized():  # one rank under a launcher is allowed (gpu_check)
        raise SystemExit(
            "error: --fsdp shards over several processes: start it with "
            "`accelerate launch --num_processes N` or `torchrun --nproc_per_node N`"
        )
    frozen = not any(p.requires_grad for p in model.parameters())
    policy = MixedPrecisionPolicy()
    if bf16 and frozen:
        model.to(torch.bfloat16)
    elif bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


class unsharded:
    """`with unsharded(model):` every FSDP unit of `model` is gathered once on entering and kept
    gathered through any number of forwards (generate's decode steps then run no collective, so
    ranks may generate different lengths and numbers of batches), and resharded on leaving. A no-op
    for a model that is not sharded."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule

        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.root = model

    def __enter__(self):
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()

    def __exit__(self, *exc):
        for unit in self.units:
            unit.reshard()
            # fully_shard's defaults back: the layers reshard after forward, the root (embeddings,
            # LM head) does not, as the backward needs it at once
            unit.set_reshard_after_forward(unit is not self.root, recurse=False)


def micro_batches(model, minibatch, autocast):
    """`for mb in micro_batches(model, minibatch, autocast):` the mini-batch's micro-batches that
    hold rows, for the loop's forward and backward. For a sharded model (FSDP), whose every forward
    and backward is a collective: gradients are reduce-scattered on the mini-batch's last backward
    only (accumulated unsharded before it), and the empty micro-batches that
    common.scored_micro_batches appended (so every rank runs as many) run their forward and a zero
    backward here."""
    sharded = hasattr(model, "set_requires_gradient_sync")
    for k, mb in enumerate(minibatch):
        if sharded:
            model.set_requires_gradient_sync(k == len(minibatch) - 1)
        if mb.rows:
            yield mb
            continue
        with autocast:
            logp = common.micro_batch_logprobs(model, mb)
        (logp.sum() * 0).backward()


def clip_grad_norm(params, max_norm):
    """torch's clip_grad_norm_ over parameters some of which are sharded (DTensor gradients, their
    norm taken across the ranks) and some replicated: the norm of all gradients together, returned
    as a plain tensor."""
    params = [p for p in params if p.grad is not None]
    parts = [[p for p in params if is_sharded(p)], [p for p in params if not is_sharded(p)]]
    parts = [part for part in parts if part]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in part]) for part in parts]
    norms = [n.full_tensor() if is_sharded(n) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    for part in parts:
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)
    return total


def full_weights(model):
    """The whole state dict of a sharded `model`, gathered to rank 0 on its CPU (every rank must
    call; the others get {}), for `save_pretrained(state_dict=...)`; None for a model that is not
    sharded (save_pretrained then reads the model itself)."""
    if not any(is_sharded(p) for p in model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def equal_count(accelerator):
    """count → the largest count any rank holds (`max_over_ranks`): how many micro-batches each rank
    of a sharded model runs (common.scored_micro_batches pads up to it)."""
    return lambda count: max_over_ranks(count, accelerator)
