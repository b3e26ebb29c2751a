"""Faults a first GPU run would hit, each fixed and held here: every seed the flag accepts runs,
every rank restores its own CUDA generator, the other ranks' wait for stage 1's file is bounded (and
a folder the ranks do not share fails in seconds), and a multi-process run prints one final JSON."""

import ast
import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import agentflow
import common
import flow_grpo
import flowrl
import rc_grpo
from utils import cli, distributed, sweep, tracking

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"flowrl": flowrl, "flow_grpo": flow_grpo, "agentflow": agentflow, "rc_grpo": rc_grpo}


def drawn_seeds(count=40):
    """The range's ends, the seeds where flowrl's row seeds used to pass 2⁶⁴ and the toys' seeds,
    then `count` seeds spread log-uniformly over 0 … 2³² − 1."""
    rng = random.Random(0)
    spread = [int(2 ** rng.uniform(0, 32)) - 1 for _ in range(count)]
    return [0, 1, 4, 184_461, 184_462, 2**31, cli.SEED_MAX - 1, cli.SEED_MAX, *spread]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_seed_range_is_stated_and_checked_before_anything_runs(name):
    """0 … 2³² − 1 passes every script's number rules; 2³² stops `train` with one line, before a
    model is built; a --seeds sweep past the range is one line too."""
    module = SCRIPTS[name]
    for seed in (0, cli.SEED_MAX):
        args = cli.parse_args(module.Args, module.PRESETS, ["--seed", str(seed)])
        assert not [e for e in cli.number_errors(args) if "--seed" in e]
    args = cli.parse_args(module.Args, module.PRESETS, ["--seed", str(cli.SEED_MAX + 1)])
    with pytest.raises(SystemExit) as stop:
        module.train(args)
    message = str(stop.value)
    assert "\n" not in message and f"--seed must be in 0 … 2^32 − 1 = {cli.SEED_MAX}" in message
    with pytest.raises(SystemExit, match="--seeds must lie in 0 … 2\\^32 − 1"):
        sweep.parse_seeds(f"{cli.SEED_MAX - 1}-{cli.SEED_MAX + 1}")


def test_every_accepted_seed_gives_rollout_seeds_a_generator_takes():
    """Property over seeds drawn across 0 … 2³² − 1: the global seeding takes the seed; flowrl's
    per-row generators (from its group seeds at a first, a late and a far step) take every row seed,
    which are distinct and below 2⁶³; and below 2⁶³ ÷ 1 000 they are the group seed × 1 000 + row,
    the values the toys' summaries were made with."""
    group_size = 16
    for seed in drawn_seeds():
        common.seed_everything(seed)
        torch.Generator().manual_seed(seed + 1)  # flow_grpo's and bfcl_toy's second stream
        groups = [
            distributed.sampling_seed(seed, step, g) for step in (1, 400, 10**6) for g in (0, 1, 63)
        ]
        row_seeds = distributed.row_seeds(groups, group_size)
        assert len(set(row_seeds)) == len(row_seeds) == len(groups) * group_size
        for k, row_seed in enumerate(row_seeds):
            assert 0 <= row_seed < 2**63
            torch.Generator().manual_seed(row_seed)
            group_seed = groups[k // group_size]
            if group_seed < 2**63 // 1_000:
                assert row_seed == group_seed * 1_000 + k % group_size
    assert "distributed.row_seeds(" in (ROOT / "flowrl.py").read_text()  # what flowrl samples with


@pytest.mark.long
def test_flowrl_trains_at_the_largest_seed(tmp_path):
    """The run that used to die at its first rollout (seed ≥ 184 462) trains at 2³² − 1."""
    args = cli.parse_args(
        flowrl.Args,
        flowrl.PRESETS,
        [
            "--seed",
            str(cli.SEED_MAX),
            "--steps",
            "2",
            "--quiet",
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path / "run"),
        ],
    )
    summary = flowrl.train(args)
    assert summary["wall_seconds"] > 0


# ------------------------------------------------------------------ per-rank generators (gloo)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_cuda_state(rank, step):
    return torch.full((16,), 10 * rank + step, dtype=torch.uint8)


def _save_and_resume_on_rank(rank, port, folder):
    """A fake GPU per rank: `get_rng_state` reads this rank's generator, `set_rng_state` records
    what a resume puts back."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    current = {"state": fake_cuda_state(rank, 1)}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.get_rng_state = lambda device="cuda": current["state"].clone()
    torch.cuda.set_rng_state = lambda state, device="cuda": current.update(state=state.clone())
    # every device seen from this process (what a save from rank 0 alone read): cuda:<rank> is ours
    torch.cuda.get_rng_state_all = lambda: [current["state"].clone() for _ in range(2)]
    torch.cuda.set_rng_state_all = lambda states: current.update(state=states[rank].clone())
    torch.manual_seed(100 + rank)
    model = torch.nn.Linear(2, 2)
    cpu_state = torch.get_rng_state()
    path = Path(folder) / "checkpoint.safetensors"
    tracking.save_training_state(path, 3, {"model": model}, {}, {}, {}, write=rank == 0)
    dist.barrier()
    current["state"] = fake_cuda_state(rank, 2)  # the generators move on, then the run resumes
    torch.manual_seed(999)
    tracking.load_training_state(path, {"model": model}, {}, {})
    torch.save(
        {"cuda": current["state"], "cpu": torch.get_rng_state(), "saved_cpu": cpu_state},
        Path(folder) / f"restored.{rank}.pt",
    )
    distributed.leave_process_group()


@pytest.mark.long
def test_every_rank_saves_and_restores_its_own_cuda_generator(tmp_path):
    """Two gloo ranks, each with its own (fake) GPU generator state: after save → draws → resume,
    rank k holds rank k's saved GPU state and its own CPU state, not rank 0's."""
    import torch.multiprocessing as mp

    mp.spawn(_save_and_resume_on_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        restored = torch.load(tmp_path / f"restored.{rank}.pt")
        assert torch.equal(restored["cuda"], fake_cuda_state(rank, 1))
        assert torch.equal(restored["cpu"], restored["saved_cpu"])


# ------------------------------------------------------------------- rc_grpo's stage-1 wait


def _check_folder_on_rank(rank, port, folders, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        distributed.check_shared_folder(folders[rank])
        result = "ok"
    except SystemExit as stop:
        result = str(stop)
    Path(f"{out}.{rank}").write_text(result)
    distributed.leave_process_group()


@pytest.mark.long
@pytest.mark.parametrize("shared", [True, False])
def test_ranks_that_do_not_share_the_out_dir_stop_in_seconds(tmp_path, shared):
    """Two gloo ranks given one folder pass (and the marker is gone); given two folders (two
    machines without a shared file system) both stop with one line naming the fix."""
    import torch.multiprocessing as mp

    folders = [tmp_path / "a", tmp_path / ("a" if shared else "b")]
    for folder in folders:
        folder.mkdir(exist_ok=True)
    out = str(tmp_path / "result")
    mp.spawn(_check_folder_on_rank, args=(free_port(), [str(f) for f in folders], out), nprocs=2)
    results = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    if shared:
        assert results == ["ok", "ok"] and not list(folders[0].glob(".shared*"))
    else:
        for result in results:  # each rank names the marker's path as it sees it
            assert "\n" not in result and "rank(s) [1] cannot see" in result
            assert "same --out-dir" in result


def test_the_wait_for_stage_1_ends_with_one_line_or_when_the_file_appears(tmp_path):
    """A file that never comes: one line naming it and the fix after the timeout. A file written
    meanwhile: the wait returns."""
    missing = tmp_path / "stage1.safetensors"
    with pytest.raises(SystemExit) as stop:
        distributed.wait_for_file(missing, 0.3, "--stage1-timeout")
    message = str(stop.value)
    assert "\n" not in message and str(missing) in message
    assert "--out-dir" in message and "--stage1-timeout" in message
    later = threading.Timer(0.3, missing.write_text, args=("x",))
    later.start()
    distributed.wait_for_file(missing, 30, "--stage1-timeout")
    later.join()
    assert rc_grpo.Args().stage1_timeout >= 24 * 3600  # stage 1 of the bfcl preset: ≈ 1 day


# ---------------------------------------------------------------------------- one final JSON


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_final_json_is_printed_under_rank_zero_only(name):
    """In each script's `__main__` block, every print of a JSON dump sits under
    `distributed.is_rank_zero()`."""
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    main = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
    )
    guarded, prints = set(), []
    for node in ast.walk(main):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "distributed.is_rank_zero()":
            guarded |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Call) and ast.unparse(node).startswith("print(json.dumps("):
            prints.append(node)
    assert prints and all(id(p) in guarded for p in prints)


def test_is_rank_zero_reads_the_launchers_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert distributed.is_rank_zero()
    monkeypatch.setenv("RANK", "0")
    assert distributed.is_rank_zero()
    monkeypatch.setenv("RANK", "1")
    assert not distributed.is_rank_zero()


@pytest.mark.long
def test_two_processes_print_one_final_json(tmp_path):
    """flowrl's toy on two CPU processes (torchrun, gloo): one summary on stdout, not two."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "flowrl.py",
        "--algo",
        "grpo",
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--quiet",
        "--device",
        "cpu",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count('"wall_seconds"') == 1
    start = done.stdout.index("{")
    assert json.loads(done.stdout[start:])["wall_seconds"] > 0


# ------------------------------------------------------------- the GPU check on a CPU torch


@pytest.mark.long
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA torch runs the full-size jobs")
@pytest.mark.parametrize(
    "command", [[sys.executable, "benchmarks/gpu_check.py"], ["bash", "benchmarks/gpu_check.sh"]]
)
def test_the_gpu_check_on_a_cpu_torch_stops_with_one_line(command):
    """Without --tiny, a torch that sees no GPU gets one line and a non-zero exit, before any job
    (the full-size jobs would otherwise start on the CPU and print nothing before the timeout)."""
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHON": sys.executable},
    )
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0] and "--tiny" in lines[0]


def test_checkpointing_is_enabled_under_either_transformers_name():
    """transformers 5.23 names it `activation_checkpointing_enable`, 5.17 (the GPU machine's)
    `gradient_checkpointing_enable`: either is called, non-reentrant."""
    from utils import models

    calls = []

    class Old:
        def gradient_checkpointing_enable(self, kwargs=None):
            calls.append(("gradient", kwargs))

    class New(Old):
        def activation_checkpointing_enable(self, kwargs=None):
            calls.append(("activation", kwargs))

    models.checkpoint_activations(Old())
    models.checkpoint_activations(New())
    non_reentrant = {"use_reentrant": False}
    assert calls == [("gradient", non_reentrant), ("activation", non_reentrant)]


# ------------------------------------------------------------------------- FSDP's root unit


def _forward_after_a_rollout(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from utils import models

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = distributed.shard(models.tiny_causal_lm(64, seed=0), bf16=False)
    ids = torch.randint(64, (2, 6), generator=torch.Generator().manual_seed(0))
    with distributed.unsharded(model):  # the rollout
        model(input_ids=ids)
    model(input_ids=ids)  # the update's forward
    if rank == 0:
        root, layer = model.model.embed_tokens.weight, model.model.layers[0].mlp.up_proj.weight
        sharded = {"root": isinstance(root, DTensor), "layer": isinstance(layer, DTensor)}
        Path(out).write_text(json.dumps(sharded))
    distributed.leave_process_group()


@pytest.mark.long
def test_after_a_rollout_the_root_unit_stays_gathered_for_the_backward(tmp_path):
    """Two gloo ranks, FSDP2: after `unsharded` (the rollout), a forward leaves the decoder layers
    resharded (sharded parameters) and the root unit (embeddings, LM head) gathered for the
    backward that follows, as fully_shard sets the root; resharded, it is gathered again there."""
    import torch.multiprocessing as mp

    out = tmp_path / "kinds.json"
    mp.spawn(_forward_after_a_rollout, args=(free_port(), str(out)), nprocs=2)
    assert json.loads(out.read_text()) == {"root": False, "layer": True}


def test_the_update_flops_count_matmul_weights_and_the_lm_head_on_completions_only():
    """Qwen2.5-7B (h 3 584, 28 layers, 4 KV heads of 128, I 18 944, V 152 064): per layer q and o
    h², k and v h·512, the MLP 3·h·I, by hand; the LM head only for the 100 completion tokens, the
    embedding never; ×6 for a full fine-tune, ×4 under LoRA."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    config = gpu_check.QWEN["qwen2.5-7b"]
    h, inter, vocab = 3584, 18944, 152064
    per_layer = 2 * h * h + 2 * h * 512 + 3 * h * inter
    record = {"tokens_update": 1_000, "tokens_rollout": 100}
    expected = 28 * per_layer * 1_000 + vocab * h * 100
    assert gpu_check.update_flops(config, record, 1, lora=False) == 6 * expected
    assert gpu_check.update_flops(config, record, 1, lora=True) == 4 * expected
    assert gpu_check.update_flops(config, record, 2, lora=True) == 4 * (expected + vocab * h * 100)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", None),
    ],
)
def test_the_mfu_divides_by_the_peak_of_the_exact_gpu_model(monkeypatch, name, peak):
    """The PCIe and NVL cards get their own (lower) dense bf16 peak, not the SXM card's."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert gpu_check.peak_flops(SimpleNamespace(type="cuda")) == peak


def test_the_gpu_check_neither_merges_nor_writes_the_policy(tmp_path):
    """Inside the check's jobs a policy's `save_pretrained` writes nothing and `merged_fp32` makes
    no fp32 copy (rc_grpo's would be a 30.5 GB write and the job's peak); outside, both work."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    from utils import models

    model = models.tiny_causal_lm(32)
    with gpu_check.no_policy_written():
        assert models.merged_fp32(model) is model
        model.save_pretrained(tmp_path / "inside")
    assert not (tmp_path / "inside").exists()
    model.save_pretrained(tmp_path / "outside")
    assert (tmp_path / "outside" / "config.json").exists()


def test_the_decode_bandwidth_counts_the_kv_cache_it_reads():
    """Qwen2.5-1.5B (28 layers, K and V 256 wide, bf16: 28 672 bytes a token), 64 rows of 266
    prompt tokens, 3 decode steps: the weights 3 times, and 64 × (266 + 267 + 268) cached tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    config, params = gpu_check.QWEN["qwen2.5-1.5b"], 1_000
    expected = 2 * params * 3 + 28 * 2 * 256 * 2 * 64 * (266 + 267 + 268)
    assert gpu_check.decode_bytes(config, params, 64, 266, 3) == expected
