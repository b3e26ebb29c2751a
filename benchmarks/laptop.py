"""`make bench-laptop`: each laptop preset, shortened but shape-true (the preset's rollout batch,
group, tokens and micro-batches; about a quarter of its steps, each phase about its share of the
run), timed as the script runs it, beside this machine's matmul limit measured in the same process
and precision.

Per preset it prints wall and CPU seconds; the tokens the forwards computed (every input
position, padding and repeats included) against the tokens the algorithm needs (per forward call,
the distinct prefixes of its rows' real tokens: a prompt shared by G rows counts once); the
matmul FLOPs done (every `nn.Linear` and attention's two products, forward and backward, counted
from their shapes) per wall second; and `torch.mm`'s rate at SmolLM2-135M's shapes with the
same threads and precision, the faster of a measurement before the run and one after. The claim
is the ratios, not an absolute time.

    make bench-laptop                          # all three presets, about 13 min on 2 cores
    python benchmarks/laptop.py flowrl         # one of them; --json FILE keeps the numbers
"""

import argparse
import collections
import contextlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from utils import cli  # noqa: E402

# (script, preset, the shortening: about a quarter of the preset's training, and of its held-out
# evaluation where that divides, so each phase keeps about its share of the run's time)
RUNS = {
    # 10 of 40 steps, evaluated every 5 as the preset (3 evaluations against its 9)
    "flowrl": ("flowrl", "smollm2-addition", ["--algo", "grpo", "--steps", "10"]),
    # 8 of 30 warm-start steps, 2 of 8 steps, the start and end evaluated on 6 of 24 queries
    "agentflow": (
        "agentflow",
        "smollm2-lookup",
        ["--no-ablation", "--steps", "2", "--warm-start-steps", "8"],
    ),
    # 1 of 4 steps, 1 of 2 epochs per stage-1 fine-tuning; its 7 evaluations whole (a larger share)
    "rc_grpo": (
        "rc_grpo",
        "smollm2-bfcl",
        ["--steps", "1", "--sft-epochs", "1", "--rctp-epochs", "1"],
    ),
}
# SmolLM2-135M's matmuls as x @ Wᵀ: (rows, in, out) of up/gate, down, q/o, at m = 256 rows
SHAPES = [(256, 576, 1536), (256, 1536, 576), (256, 576, 576)]


def prefix_tokens(rows):
    """Distinct prefixes over token sequences (nodes of their prefix tree): the tokens a forward
    needs when every shared prefix is computed once."""
    root, nodes = {}, 0
    for row in rows:
        node = root
        for token in row:
            if token not in node:
                node[token], nodes = {}, nodes + 1
            node = node[token]
    return nodes


class Count:
    """Tokens computed and needed per kind of call (`calls`: name → [computed, needed]; "other":
    forwards outside them, e.g. a toy's own pretraining), and matmul FLOPs (`flops`, attention's
    share of them in `attention_flops`), gathered by hooks."""

    def __init__(self):
        self.calls = collections.defaultdict(lambda: [0, 0])
        self.inside = ["other"]
        self.flops = self.attention_flops = 0.0

    @property
    def computed(self):
        return sum(c for c, _ in self.calls.values())

    @property
    def needed(self):
        return sum(n for _, n in self.calls.values())

    def linear(self, module, inputs, output):
        """2·in·out per row forward; backward: the input's gradient where it needs one, the
        weight's where it is trained (a LoRA base: the input's only)."""
        if not isinstance(module, torch.nn.Linear):
            return
        rows = inputs[0].numel() // module.in_features
        per_pass = 2.0 * module.in_features * module.out_features * rows
        backward = torch.is_grad_enabled() and output.requires_grad
        self.flops += per_pass * (
            1 + backward * (inputs[0].requires_grad + module.weight.requires_grad)
        )

    def attention(self, query, key, is_causal):
        """QKᵀ and the weights times V: 2·2·head_dim FLOPs per (query, key) pair scored, for
        every query head; all Tq·Tk pairs under a mask (its masked pairs too, as a Linear's
        padding rows), the lower triangle when causal. Backward: twice that."""
        q_len, k_len = query.shape[-2], key.shape[-2]
        pairs = q_len * (q_len + 1) // 2 if is_causal else q_len * k_len
        per_pass = 4.0 * query.shape[-1] * pairs * query[..., 0, 0].numel()
        backward = torch.is_grad_enabled() and query.requires_grad
        self.attention_flops += per_pass * (1 + 2 * backward)
        self.flops += per_pass * (1 + 2 * backward)

    def wrap(self, name, function, rows_of):
        """`function` counted as `name`: the tokens its forwards compute, and the distinct
        prefixes of the rows `rows_of(args, kwargs, output)` returns as needed."""

        def counted_call(*args, **kwargs):
            self.inside.append(name)
            try:
                out = function(*args, **kwargs)
            finally:
                self.inside.pop()
            self.calls[name][1] += prefix_tokens(rows_of(args, out))
            return out

        return counted_call


def tree_rows(args, out):
    """A micro-batch's rows as token lists: each row's prompt, then its completion."""
    mb = args[1]
    for nodes, prompt_mask, completion, mask in zip(
        mb.prompt_nodes, mb.prompt_mask, mb.completion_ids, mb.mask
    ):
        yield mb.ids[0, nodes[prompt_mask.bool()]].tolist() + completion[mask.bool()].tolist()


def packed_rows(args, out):
    """A packed batch's rows (ids and attention: args 1 and 2) without their padding."""
    return (ids[m.bool()].tolist() for ids, m in zip(args[1], args[2]))


def sampled_rows(args, out):
    """Each sampled row: its prompt's tokens, then the tokens it kept."""
    tokenizer, prompts = args[1], args[2]
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return (p + ids for p, (_, ids, _) in zip(encoded, out))


WRAPPED = {
    "micro_batch_forward": tree_rows,
    "completion_forward": packed_rows,
    "sample_completions": sampled_rows,
}


@contextlib.contextmanager
def counted(count):
    """`count` hooked onto every nn.Linear, every embedding lookup, every attention
    (`scaled_dot_product_attention`, which transformers' models call) and common's forward and
    sampling calls for the duration."""
    hook = torch.nn.modules.module.register_module_forward_hook(count.linear)
    embedding_forward = torch.nn.Embedding.forward
    sdpa = torch.nn.functional.scaled_dot_product_attention
    originals = {name: getattr(common, name) for name in WRAPPED}

    def embedding(module, input_ids):
        count.calls[count.inside[-1]][0] += input_ids.numel()
        return embedding_forward(module, input_ids)

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        count.attention(query, key, is_causal)
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    torch.nn.Embedding.forward = embedding
    torch.nn.functional.scaled_dot_product_attention = attention
    for name, rows_of in WRAPPED.items():
        setattr(common, name, count.wrap(name, originals[name], rows_of))
    try:
        yield count
    finally:
        torch.nn.Embedding.forward = embedding_forward
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for name, original in originals.items():
            setattr(common, name, original)
        hook.remove()


def matmul_peak(precision, seconds=2.0):
    """torch.mm's GFLOP/s at SmolLM2-135M's shapes, this process's threads, in `precision`."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rates = []
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(SHAPES):
            a @ b
            calls += 1
        rates.append(2 * m * k * n * calls / (time.perf_counter() - start) / 1e9)
    return sum(rates) / len(rates)


def quarter_of(path, folder):
    """A file of the first quarter of the JSONL `path`'s rows, in `folder`."""
    rows = Path(path).read_text().splitlines()
    quarter = Path(folder) / f"quarter_of_{Path(path).name}"
    quarter.write_text("\n".join(rows[: len(rows) // 4]) + "\n")
    return str(quarter)


def bench(name):
    script, preset, flags = RUNS[name]
    module = __import__(script)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "run")
        argv = ["--preset", preset, *flags, "--quiet", "--overwrite", "--out-dir", out]
        args = cli.parse_args(module.Args, module.PRESETS, argv)
        command = " ".join([f"{script}.py", "--preset", preset, *flags])
        if getattr(args, "eval_data", ""):  # a held-out file (agentflow): a quarter of it
            command += f" --eval-data <the first quarter of {Path(args.eval_data).name}>"
            args.eval_data = quarter_of(args.eval_data, folder)
        precision = common.resolved_precision(torch.device("cpu"), args.mixed_precision)
        peak_before = matmul_peak(precision)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        with counted(Count()) as count:
            module.train(args)
        wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    # the machine's limit: the faster of two measurements (one alone moves by 10-20 %)
    peak = max(peak_before, matmul_peak(precision))
    return {
        "preset": f"{script} {preset}",
        "command": command,
        "precision": precision,
        "threads": torch.get_num_threads(),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "tokens_computed": count.computed,
        "tokens_needed": count.needed,
        "computed_per_needed": round(count.computed / max(1, count.needed), 3),
        "gflops_per_s": round(count.flops / wall / 1e9, 1),
        "matmul_peak_gflops_per_s": round(peak, 1),
        "of_peak": round(count.flops / wall / 1e9 / peak, 3),
        "attention_share_of_flops": round(count.attention_flops / max(1.0, count.flops), 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "calls": {name: {"computed": c, "needed": n} for name, (c, n) in count.calls.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", help=f"any of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    cli_args = parser.parse_args()
    unknown = sorted(set(cli_args.runs) - set(RUNS))
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    rows = [bench(name) for name in cli_args.runs or list(RUNS)]
    columns = ["preset", "precision", "threads", "wall_s", "cpu_s", "computed_per_needed"]
    columns += ["gflops_per_s", "matmul_peak_gflops_per_s", "of_peak"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if cli_args.json:
        Path(cli_args.json).write_text(json.dumps(rows, indent=2) + "\n")
