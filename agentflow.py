"""AgentFlow's Flow-GRPO: train the planner inside a planner/executor/verifier/generator loop.

Paper: "AgentFlow: In-the-Flow Agentic System Optimization for Effective Planning and Tool Use",
Li et al. 2025, arXiv 2510.05592 ("official" below = the authors' released code).
NOT the image "Flow-GRPO" (Liu et al. 2025, arXiv 2505.05470), which turns a flow-matching ODE into
an SDE: that algorithm is flow_grpo.py. Same name, unrelated method.

An agentic system answers a query q with a toolset K and an evolving memory M. Each turn the planner
π_θ (the only trained module) reads (q, K, M^t) and emits a sub-goal and a tool; a frozen executor
turns them into a tool call and runs it; a frozen verifier says STOP or CONTINUE; a frozen generator
writes the final answer from M. One outcome reward R(τ) judges that answer. Flow-GRPO broadcasts it:
every planner turn of τ_i becomes an independent single-turn sample carrying the same
group-normalised advantage A_i, so a multi-turn problem is trained with single-turn GRPO updates
(the Flow-GRPO objective).

Equation map (paper → function):
    the system  q, K, M → planner → executor → verifier → … → generator  → run_agent, Memory
    Flow-GRPO   A_i = (R_i − mean_G R) / std_G R, shared by every turn of τ_i
                                                                         → broadcast_advantages
    Flow-GRPO   token-level clipped ratio in each planner output, − β·KL   → flow_grpo_loss
    tools       a model-written Python tool, isolated by the OS            → python_tool

Deviations (numbered, on purpose):
    1. Turn-samples are averaged token-wise over the whole batch (common `token-mean`, as the
       official verl code), not (1/G)Σ_i (1/T_i)Σ_t (1/|a|)Σ_j as the paper's objective writes.
    2. The toy's executor, verifier and generator are deterministic rules (documented at
       `build_toy`); at full scale they are the base model with the LoRA adapter disabled, as the
       paper's frozen modules.
    3. Toy answers are judged by exact match; the paper uses a GPT-4o judge. Full scale:
       exact/numeric match.
    4. Full-scale loop against the official system: the planner, executor, verifier and generator
       prompts are short paraphrases of the official ones with the same fields (the planner writes
       `Sub-Goal:` and `Tool:`, read in any case; the executor gets the question, the sub-goal and
       the memory so far as its context); tools are a sandboxed Python runner, TF-IDF retrieval over
       a local corpus and the base model, instead of web search, Wikipedia and a hosted coder; the
       verifier sees the whole memory.

Toy (CPU, about 2 minutes for both credit arms; docs/agentflow.md):
    python agentflow.py               # held-out accuracy ~0.57 → ~0.97; final-turn credit ~0.35
    python agentflow.py --seeds 0-4   # the same on five seeds, one table
Full scale (one GPU):
    python agentflow.py --preset full --data train.jsonl --eval-data test.jsonl --corpus docs.jsonl
N GPUs (DDP, docs/full_scale.md):
    accelerate launch --num_processes N agentflow.py --preset full ...
Sample from the trained planner (full preset; a LoRA adapter on --model):
    python -m utils.sample runs/agentflow/planner "Question: ... Plan the next step."
"""

import copy
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import common
from utils import models, sweep, tracking

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = common.arg("", "planner: HF model id or path ('' = tiny toy LM)")
    data: str = common.arg("", "JSONL of {question, answer} ('' = toy task)")
    eval_data: str = common.arg("", "held-out JSONL of {question, answer}")
    corpus: str = common.arg("", "JSONL of {text} for the retrieval tool (full)")
    steps: int = common.arg(60, "rollout batches")
    queries_per_step: int = common.arg(8, "B queries per batch (paper: 32)")
    group_size: int = common.arg(8, "G rollouts per query (paper: 8)")
    inner_steps: int = common.arg(2, "optimiser steps per batch")
    max_turns: int = common.arg(3, "planner turns per rollout in training (paper: 3)")
    eval_max_turns: int = common.arg(10, "planner turns at evaluation (paper: 10)")
    max_new_tokens: int = common.arg(4, "planner output cap per turn")
    temperature: float = common.arg(1.0, "rollout temperature (paper: 0.7); eval is greedy")
    clip_eps: float = common.arg(0.2, "ε_low of the ratio clip (paper: 0.2)")
    clip_eps_high: float = common.arg(0.3, "ε_high (paper: 0.3)")
    beta: float = common.arg(0.001, "β of the k3 KL to the reference (paper: 0.001)")
    lr: float = common.arg(1e-3, "planner learning rate (paper: 1e-6)")
    credit: str = common.arg(
        "broadcast",
        "broadcast: every turn carries A_i (Flow-GRPO); final-turn: only the last turn is trained",
        ["broadcast", "final-turn"])
    group_norm: str = common.arg(
        "trajectory",
        "trajectory: normalise over the G rewards (paper); "
        "turn-rows: over all turn rows (official code)",
        ["trajectory", "turn-rows"],
    )
    ablation: bool = common.arg(True, "also train --credit final-turn from the same start")
    warm_start_demos: int = common.arg(200, "toy: demonstrations in the planner's warm start")
    warm_start_steps: int = common.arg(400, "toy: supervised steps of the warm start")
    careless: float = common.arg(
        0.7, "toy: share of demonstrations whose second lookup repeats the first attribute")
    lora_rank: int = common.arg(0, "LoRA rank (full scale: needed, frozen modules = adapter off)")
    micro_batch_tokens: int = common.arg(
        4096,
        "padded tokens per forward pass; gradients accumulate over micro-batches (bounds memory)")
    gen_batch: int = common.arg(256, "planner prompts per `generate` call")
    gradient_checkpointing: bool = common.arg(
        False, "recompute activations in the backward pass (full preset: on)")
    tool_timeout: float = common.arg(10.0, "Python tool timeout in seconds")
    eval_every: int = common.arg(20, "steps between held-out evaluations")
    seed: int = common.arg(0, "random seed")
    seeds: str = common.arg("", "seed sweep, e.g. 0-4: both credit arms per seed, one table")
    out_dir: str = common.arg("runs/agentflow", "output folder")
    device: str = common.arg(
        "auto", "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"])
    quiet: bool = common.arg(False, "no per-step lines or progress bar")
    report_to: str = common.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = common.arg(20, "steps between checkpoints (0 = never)")
    resume: bool = common.arg(False, "continue each arm from its checkpoint.safetensors")


# Paper setup: G = 8, batch 32 queries, lr 1e-6, KL 0.001 (k3), clip 0.2/0.3,
# temperature 0.7 in training and greedy at evaluation, 3 training turns. Qwen2.5-7B-Instruct with
# LoRA. The paper's lr 1e-6 is for full fine-tuning; with LoRA it is ×10, the LoRA/full-FT
# learning-rate ratio measured in "LoRA Without Regret" (Schulman et al., Thinking Machines 2025).
PRESETS = {
    "full": dict(
        model="Qwen/Qwen2.5-7B-Instruct", steps=100, queries_per_step=32, group_size=8,
        inner_steps=1, max_new_tokens=256, temperature=0.7, lr=1e-5, lora_rank=64, ablation=False,
        eval_every=25, micro_batch_tokens=16384, gen_batch=64, gradient_checkpointing=True)
}

# ----------------------------------------------------------------------------- memory and the loop


@dataclasses.dataclass
class Memory:
    """M: the ordered record of (step, tool, sub-goal, command, result) the modules read each
    turn."""

    entries: list = dataclasses.field(default_factory=list)

    def add(self, tool, subgoal, command, result, ok):
        self.entries.append(
            {
                "step": len(self.entries) + 1,
                "tool": tool,
                "subgoal": subgoal,
                "command": command,
                "result": result,
                "ok": ok,
            }
        )


def run_agent(queries, system, plan, max_turns):
    """One rollout per query: plan → execute → verify, until STOP or `max_turns`, then generate
    (AgentFlow's system).

    `system` holds the modules (ToySystem or ToolSystem). All rollouts advance together (one batched
    planner call per turn). `plan(prompts)` returns, per prompt, (text, completion ids, sampler
    log-probs); each trajectory keeps its planner turns for training.
    """
    memories = [Memory() for _ in queries]
    trajectories = [{"query": q, "turns": [], "verdicts": []} for q in queries]
    active = list(range(len(queries)))
    for _ in range(max_turns):
        if not active:
            break
        prompts = [system.planner_prompt(queries[i], memories[i]) for i in active]
        outputs = plan(prompts)
        calls = []
        for i, prompt, (text, ids, logp) in zip(active, prompts, outputs):
            trajectories[i]["turns"].append(
                {"prompt": prompt, "ids": ids, "old_logp": logp, "text": text})
            try:
                tool, subgoal = system.parse_plan(text)
                calls.append((i, tool, subgoal))
            except ValueError as err:  # a malformed plan is an observation, never a crash
                memories[i].add("none", text.strip(), "", f"error: {err}", ok=False)
        executed = (
            system.execute([(queries[i], tool, subgoal, memories[i]) for i, tool, subgoal in calls])
            if calls
            else []
        )
        for (i, tool, subgoal), (command, result, ok) in zip(calls, executed):
            memories[i].add(tool, subgoal, command, result, ok)
        stops = system.verify([(queries[i], memories[i]) for i in active])
        for i, stop in zip(active, stops):
            trajectories[i]["verdicts"].append("STOP" if stop else "CONTINUE")
        active = [i for i, stop in zip(active, stops) if not stop]
    answers = system.generate([(q, m) for q, m in zip(queries, memories)])
    for trajectory, memory, answer in zip(trajectories, memories, answers):
        trajectory |= {
            "memory": memory,
            "answer": answer,
            "reward": float(system.judge(trajectory["query"], answer)),
        }
    return trajectories


# ----------------------------------------------------------------------------- the toy task


ATTRIBUTES = ["population", "area", "height", "age"]
OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
TOY_TOOLS = {
    "lookup": "lookup <A|B> <attribute>: the attribute of the question's first (A) or second (B) "
    "entity",
    "calc": "calc <plus|minus|times>: combine the last two looked-up values",
}


def toy_queries(seed):
    """Questions over a made-up knowledge base: "population of c03 plus area of c17" (two lookups
    and a calculation) and, one in four, "area of c05" (one lookup). Returns (train, test, kb).

    Test questions use 10 held-out entities and 8 held-out (attribute, operation, attribute) shapes.
    """
    rng = random.Random(seed)
    entities = [f"c{k:02d}" for k in range(40)]
    kb = {e: {a: rng.randint(2, 60) for a in ATTRIBUTES} for e in entities}
    shapes = [(a, op, b) for a in ATTRIBUTES for op in OPERATIONS for b in ATTRIBUTES]
    rng.shuffle(shapes)
    test_shapes, train_shapes = shapes[:8], shapes[8:]

    def make(ents, shape_pool, n):
        out = []
        for _ in range(n):
            e1, e2 = rng.sample(ents, 2)
            if rng.random() < 0.25:
                a = rng.choice(ATTRIBUTES)
                out.append(
                    {
                        "question": f"{a} of {e1}",
                        "entities": (e1,),
                        "shape": (a,),
                        "answer": kb[e1][a],
                    }
                )
                continue
            a, op, b = rng.choice(shape_pool)
            out.append(
                {
                    "question": f"{a} of {e1} {op} {b} of {e2}",
                    "entities": (e1, e2),
                    "shape": (a, op, b),
                    "answer": OPERATIONS[op](kb[e1][a], kb[e2][b]),
                }
            )
        return out

    return (
        make(entities[:30], train_shapes, 400),
        make(entities[30:], test_shapes + train_shapes, 200), kb)


def toy_demonstration(query, careless=False):
    """The golden plan: lookup A attr1, lookup B attr2, calc op (or a single lookup). A careless
    demonstrator repeats attr1 in the second lookup: the mistake sits in a middle turn, and only
    the final answer shows it."""
    if len(query["shape"]) == 1:
        return [f"lookup A {query['shape'][0]}"]
    a, op, b = query["shape"]
    return [f"lookup A {a}", f"lookup B {a if careless else b}", f"calc {op}"]


@dataclasses.dataclass
class ToySystem:
    """The toy's agentic system: a tiny Qwen2 planner; executor, verifier and generator are rules.

    Rules (DEVIATION 2): the executor maps "lookup A population" to lookup(first entity, population)
    and "calc plus" to the last two looked-up values; the verifier says STOP after a successful
    calc; the generator answers the last calc result, else the last looked-up value. A one-lookup
    question stops after its lookup, so rollouts have different lengths (1 to max_turns planner
    turns).
    """

    train: list
    test: list
    kb: dict
    tokenizer: object
    planner: object

    def planner_prompt(self, query, memory):
        """(q, K, M^t) as tokens in fixed slots: `q <attr> <op> <attr> k <tools> t<turn>`, then the
        memory (results summarised as ok/error). Entities stay with the executor, so every word
        the planner must copy sits at the same position on every question."""
        steps = " ".join(
            f"m {e['tool']} {e['subgoal']} {'ok' if e['ok'] else 'error'}" for e in memory.entries
        )
        turn = f"t{len(memory.entries) + 1}"
        slots = " ".join(query["shape"])
        return f"q {slots} k {' '.join(TOY_TOOLS)} {turn} {steps} p".replace("  ", " ")

    def parse_plan(self, text):
        words = text.split()
        if not words or words[0] not in TOY_TOOLS:
            raise ValueError(f"no known tool in {text!r}")
        return words[0], " ".join(words[1:])

    def execute(self, calls):
        results = []
        for query, tool, subgoal, memory in calls:
            words = subgoal.split()
            if (
                tool == "lookup"
                and len(words) == 2
                and words[0] in "AB"[: len(query["entities"])]
                and words[1] in ATTRIBUTES
            ):
                entity = query["entities"]["AB".index(words[0])]
                results.append((f"lookup({entity}, {words[1]})", self.kb[entity][words[1]], True))
            elif tool == "calc" and len(words) == 1 and words[0] in OPERATIONS:
                values = [e["result"] for e in memory.entries if e["tool"] == "lookup" and e["ok"]][
                    -2:
                ]
                if len(values) < 2:
                    results.append(
                        (f"calc({words[0]})", "error: calc needs two looked-up values", False))
                else:
                    results.append(
                        (f"{values[0]} {words[0]} {values[1]}", OPERATIONS[words[0]](*values), True)
                    )
            else:
                results.append(
                    (f"{tool}({subgoal})", f"error: bad arguments {subgoal!r} for {tool}", False))
        return results

    def verify(self, items):
        """STOP once the step the question needs last (calc, or its one lookup) succeeded."""
        return [
            bool(m.entries)
            and m.entries[-1]["ok"]
            and m.entries[-1]["tool"] == ("lookup" if len(q["shape"]) == 1 else "calc")
            for q, m in items
        ]

    def generate(self, items):
        answers = []
        for _, memory in items:
            done = [e["result"] for e in memory.entries if e["ok"]]
            answers.append(done[-1] if done else None)
        return answers

    def judge(self, query, answer):
        return answer == query["answer"]


def build_toy(args, device):
    """Tiny Qwen2 planner warm-started on demonstrations, a share of them careless."""
    train, test, kb = toy_queries(args.seed)
    turns = [f"t{k}" for k in range(1, args.eval_max_turns + 2)]
    words = ["q", "k", "m", "p", "ok", "error", "A", "B", *ATTRIBUTES, *OPERATIONS, *TOY_TOOLS]
    tokenizer = models.make_tokenizer(words + turns)
    planner = models.tiny_causal_lm(len(tokenizer), seed=args.seed).to(device)
    system = ToySystem(train, test, kb, tokenizer, planner)
    warm_start(system, train[: args.warm_start_demos], args)
    return system


def warm_start(system, demos, args):
    """Supervised warm start: the planner learns the plan's format and to copy the question's
    slots, and from the careless demonstrations a habit of repeating attr1 in its second lookup,
    so it starts right on some questions and wrong in a middle turn on the others."""
    tokenizer, planner = system.tokenizer, system.planner
    rng = random.Random(args.seed)
    pairs = []
    for query in demos:
        memory = Memory()
        for text in toy_demonstration(query, careless=rng.random() < args.careless):
            pairs.append((system.planner_prompt(query, memory), text + " <eos>"))
            tool, subgoal = system.parse_plan(text)
            command, result, ok = system.execute([(query, tool, subgoal, memory)])[0]
            memory.add(tool, subgoal, command, result, ok)
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(planner.parameters(), lr=3e-3)
    for _ in range(args.warm_start_steps):
        batch = [pairs[k] for k in torch.randint(len(pairs), (32,), generator=gen).tolist()]
        completions = [tokenizer(c, add_special_tokens=False)["input_ids"] for _, c in batch]
        ids, attn, mask = common.pack_completions(
            tokenizer, [p for p, _ in batch], completions, planner.device)
        logp = common.completion_logprobs(planner, ids, attn, mask.shape[1])
        loss = -common.masked_mean(logp, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# ---------------------------------------------------------------- full scale: tools and LLM modules

# The Python tool runs model-written code. Where the machine allows it (root and util-linux
# `unshare`), each call gets new mount, network and PID namespaces: only a down loopback (no
# network), a /proc that shows only itself, fresh tmpfs over /tmp, /var/tmp, /dev/shm, /root and
# /home (nothing written there survives, nothing secret there is readable), the run's data files
# replaced by /dev/null, and its own empty working directory. It then drops to the unprivileged uid
# SANDBOX_UID, whose process limit of 1 forbids children, with CPU, memory, file-size and open-file
# caps, an empty environment, and output into files the trainer reads at most `max_output`
# characters of. No guard state lives in the model's process.
SANDBOX_UID = 65534  # "nobody"
SANDBOX_BOOT = r"""
import os, resource, subprocess, sys
work, code_path, python, uid, memory_mb, cpu_s, file_mb, *hidden = sys.argv[1:]
uid, mb = int(uid), 1 << 20
def mount(*args):
    subprocess.run(["mount", *args], check=True)
mount("-t", "tmpfs", "-o", "mode=755,size=1m", "tmpfs", "/mnt")
os.mkdir("/mnt/work"); os.mkdir("/mnt/py")
mount("--bind", work, "/mnt/work")
prefixes = sorted({sys.base_prefix, sys.prefix})  # the interpreter and its venv, read-only
keep = [(p, f"/mnt/py/{n}") for n, p in enumerate(prefixes)]
for source, target in keep:
    os.mkdir(target); mount("--bind", source, target); mount("-o", "remount,bind,ro", target)
for folder in ["/tmp", "/var/tmp", "/dev/shm", "/root", "/home"]:
    if os.path.isdir(folder):
        mount("-t", "tmpfs", "-o", "mode=755,size=16m", "tmpfs", folder)
for source, target in keep:
    if not os.path.isdir(source):
        os.makedirs(source); mount("--bind", target, source)
for path in hidden:
    if os.path.isfile(path):
        mount("--bind", "/dev/null", path)
os.chdir("/mnt/work")
for limit, value in [(resource.RLIMIT_AS, int(memory_mb) * mb), (resource.RLIMIT_CPU, int(cpu_s)),
                     (resource.RLIMIT_FSIZE, int(file_mb) * mb), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 1)]:
    resource.setrlimit(limit, (value, value))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
# no helper threads
threads = {k: "1" for k in ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]}
os.execve(python, [python, "-I", "-B", code_path], threads)
"""


def sandbox_isolates():
    """True when each Python tool call can get its own namespaces (root + `unshare`); checked
    once."""
    if not hasattr(sandbox_isolates, "ok"):
        trial = ["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc", "true"]
        sandbox_isolates.ok = (
            os.geteuid() == 0
            and shutil.which("unshare") is not None
            and subprocess.run(trial, capture_output=True).returncode == 0
        )
        if not sandbox_isolates.ok:
            print(
                "WARNING: the Python tool runs WITHOUT OS-level isolation (needs root and "
                "util-linux `unshare`): only resource limits, an empty environment and a temp "
                "folder apply; network, "
                "file reads, writes the user may make, and child processes are NOT blocked.",
                file=sys.stderr,
            )
    return sandbox_isolates.ok


def python_tool(code, timeout=10.0, memory_mb=1024, max_output=2000, hidden_files=()):
    """Run model-written code in an isolated process (see SANDBOX_BOOT) and return (output, ok).

    Output is stdout plus the last stderr line on failure, cut at `max_output` characters; a run
    past `timeout` seconds is killed with everything it started. `hidden_files` (the run's data)
    read as empty.
    """
    import resource

    with (
        tempfile.TemporaryDirectory(prefix="agentflow_py_") as workdir,
        tempfile.TemporaryDirectory(prefix="agentflow_out_") as outdir,
    ):
        work, out = Path(workdir) / "work", Path(outdir)
        work.mkdir()
        (work / "main.py").write_text(code)
        with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
            if sandbox_isolates():
                os.chown(work, SANDBOX_UID, SANDBOX_UID)
                os.chmod(workdir, 0o755)
                command = [
                    "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child",
                    "--mount-proc", "--", sys.executable, "-I", "-c", SANDBOX_BOOT, str(work),
                    "main.py", sys.executable, str(SANDBOX_UID), str(memory_mb),
                    str(int(timeout) + 1), "1", *[str(Path(f).resolve()) for f in hidden_files]]
                limits = None
            else:
                command = [sys.executable, "-I", "-B", "main.py"]

                def limits():
                    for limit, value in [
                        (resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, 1 << 20),
                        (resource.RLIMIT_CPU, int(timeout) + 1)]:
                        resource.setrlimit(limit, (value, value))

            process = subprocess.Popen(
                command, cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                preexec_fn=limits, start_new_session=True)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # with --kill-child, its namespace goes too
                process.wait()
                for _ in range(200):  # until the killed group has exited (at most 2 s more)
                    try:
                        os.killpg(process.pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.01)
                return f"error: timed out after {timeout:g} s", False
        text = (out / "stdout").read_bytes()[: max_output + 1].decode("utf-8", "replace")
        errors = (
            (out / "stderr").read_bytes()[-2000:].decode("utf-8", "replace").strip().splitlines()
        )
    if process.returncode and errors:
        text += "\n" + errors[-1]
    text = text.strip() or (
        "(no output; print the result)"
        if process.returncode == 0
        else f"error: exit status {process.returncode}"
    )
    return text[:max_output] + (
        " …[truncated]" if len(text) > max_output else ""
    ), process.returncode == 0


def make_retriever(corpus_path, top_k=3, max_chars=600):
    """TF-IDF search over a local JSONL corpus of {"text"} (scikit-learn); no web access."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    path = Path(corpus_path)
    if not path.is_file():
        raise SystemExit(f"error: --corpus {str(path)!r} is not a file")
    try:
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise SystemExit(
            f"error: {path}: every line must be JSON with a 'text' key ({err})") from None
    vectorizer = TfidfVectorizer().fit(docs)
    matrix = vectorizer.transform(docs)

    def search(query):
        scores = (matrix @ vectorizer.transform([query]).T).toarray()[:, 0]
        best = scores.argsort()[::-1][:top_k]
        return (
            "\n".join(
                f"[{k + 1}] {docs[j][:max_chars]}" for k, j in enumerate(best) if scores[j] > 0
            )
            or "no match"
        )

    return search


FULL_TOOLS = {
    "python": (
        "Runs Python code and returns what it prints.",
        "a complete Python program that prints the result"),
    "retrieve": ("Searches a local document collection.", "a short keyword search query"),
    "generate": ("Asks a general language model.", "a self-contained question or instruction"),
}


def load_qa_jsonl(path):
    """[{question, answer}] from a JSONL file, with one-line errors for a missing or malformed
    file."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: data file {str(path)!r} is not a file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows.append({"question": str(row["question"]), "answer": str(row["answer"])})
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SystemExit(
                    f"error: {path}:{n}: expected JSON with 'question' and 'answer' ({err})"
                ) from None
    if not rows:
        raise SystemExit(f"error: {path} holds no rows")
    return rows


def answers_match(prediction, answer):
    """Exact match after normalising case, spaces and a trailing period; numbers compared as
    numbers."""
    if prediction is None:
        return False
    pred, gold = str(prediction).strip().strip(".").lower(), str(answer).strip().strip(".").lower()
    try:
        return abs(float(pred.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return " ".join(pred.split()) == " ".join(gold.split())


@dataclasses.dataclass
class ToolSystem:
    """Full scale: the planner is an HF model with LoRA; executor, verifier and generator are the
    same model with the adapter off, greedy (the paper's frozen modules, DEVIATION 2). Tools: Python
    (sandboxed), retrieval over a local corpus, and the base generator."""

    train: list
    test: list
    tokenizer: object
    planner: object
    retrieve: object
    tool_timeout: float
    max_new_tokens: int
    gen_batch: int
    hidden_files: tuple

    def chat(self, text):
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    def frozen(self, prompts, max_new_tokens=None):
        """The frozen modules: base weights (adapter off), greedy."""
        with self.planner.disable_adapter():
            out = common.sample_completions(
                self.planner, self.tokenizer, [self.chat(p) for p in prompts],
                max_new_tokens or self.max_new_tokens, 0.0, batch_rows=self.gen_batch)
        return [text for text, _, _ in out]

    def planner_prompt(self, query, memory):
        tools = "\n".join(
            f"- {name}: {desc} Input: {fmt}." for name, (desc, fmt) in FULL_TOOLS.items()
        )
        return self.chat(
            f"Question: {query['question']}\nTools:\n{tools}\nMemory:\n{render_memory(memory)}\n"
            "Plan the next step. Reply exactly:\n"
            "Sub-Goal: <what to find out next>\nTool: <tool name>"
        )

    def parse_plan(self, text):
        """The official planner's `Sub-Goal:` / `Tool:` fields, any case, markdown bold allowed; the
        sub-goal may span lines."""
        text = text.replace("*", "")
        tool = re.search(r"^\W*tool\W*:\s*([\w-]+)", text, re.I | re.M)
        goal = re.search(r"^\W*sub-?goal\W*:\s*(.+?)(?=^\W*tool\W*:|\Z)", text, re.I | re.M | re.S)
        if not tool or not goal or tool.group(1).lower() not in FULL_TOOLS:
            raise ValueError("expected 'Sub-Goal: …' and 'Tool: <" + "|".join(FULL_TOOLS) + ">'")
        return tool.group(1).lower(), " ".join(goal.group(1).split())

    def execute(self, calls):
        """The executor writes each tool's input from the question, the sub-goal and the memory so
        far (the official executor's context), then the tool runs."""
        commands = self.frozen(
            [
                f"Question: {q['question']}\nContext (earlier steps):\n{render_memory(m)}\n"
                f"Sub-Goal: {goal}\nWrite the input for the tool '{tool}': {FULL_TOOLS[tool][1]}. "
                "Reply with the input only."
                for q, tool, goal, m in calls
            ]
        )
        results = []
        for (query, tool, goal, _), command in zip(calls, commands):
            if tool == "python":
                block = re.search(r"```(?:python)?\n(.*?)```", command, re.S)
                results.append(
                    (
                        command,
                        *python_tool(
                            block.group(1) if block else command, self.tool_timeout,
                            hidden_files=self.hidden_files),
                    )
                )
            elif tool == "retrieve":
                results.append((command, self.retrieve(command), True))
            else:
                results.append((command, self.frozen([command])[0], True))
        return results

    def verify(self, items):
        verdicts = self.frozen(
            [
                f"Question: {q['question']}\nMemory:\n{render_memory(m)}\nIs the memory enough to "
                "answer? Reply STOP or CONTINUE."
                for q, m in items
            ],
            max_new_tokens=8,
        )
        return ["STOP" in v.upper() for v in verdicts]

    def generate(self, items):
        texts = self.frozen(
            [
                f"Question: {q['question']}\nMemory:\n{render_memory(m)}\nGive the final answer on "
                "the last line as 'Answer: <answer>'."
                for q, m in items
            ]
        )
        return [
            (
                re.findall(r"Answer:\s*(.+)", t)
                or [t.strip().splitlines()[-1] if t.strip() else None]
            )[-1]
            for t in texts
        ]

    def judge(self, query, answer):
        return answers_match(answer, query["answer"])


def render_memory(memory):
    """M as text for the LLM modules, one line per step."""
    return (
        "\n".join(
            f"Step {e['step']}: tool={e['tool']} sub-goal={e['subgoal']!r} "
            f"command={e['command']!r} "
            f"result={str(e['result'])[:500]!r}"
            for e in memory.entries
        )
        or "(empty)"
    )


def build_full(args, device):
    """HF planner with LoRA; the frozen modules are the same model with the adapter off."""
    tokenizer, planner = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing)
    retrieve = (
        make_retriever(args.corpus) if args.corpus else (lambda query: "error: no --corpus given")
    )
    # the tool cannot read them
    hidden = tuple(f for f in (args.data, args.eval_data, args.corpus) if f)
    return ToolSystem(
        load_qa_jsonl(args.data), load_qa_jsonl(args.eval_data) if args.eval_data else [],
        tokenizer, planner.to(device), retrieve, args.tool_timeout, args.max_new_tokens,
        args.gen_batch, hidden)


# -------------------------------------------------------------------- the algorithm core: Flow-GRPO


def broadcast_advantages(rewards, turns, group_size, mode="trajectory", eps=1e-4):
    """Every turn of τ_i gets A_i; A_i = (R_i − mean_G R)/(std_G R + ε) over the query's G rollouts
    (the Flow-GRPO objective).

    rewards: (B·G,) trajectory rewards, a query's G rollouts contiguous; turns: planner turns per
    rollout. mode="turn-rows" is the official code's variant: mean and std over all turn rows of the
    group, so a trajectory with 3 turns counts 3 times. Returns the advantage of every turn row,
    flattened (Σ T_i,).
    """
    if mode == "trajectory":
        per_trajectory = common.group_advantages(rewards, group_size, eps=eps)
        # reward broadcast: A_i on every turn
        return per_trajectory.repeat_interleave(torch.as_tensor(turns))
    rows = []
    for g in range(0, len(rewards), group_size):
        reps = torch.as_tensor(turns[g : g + group_size])
        group_rows = rewards[g : g + group_size].float().repeat_interleave(reps)
        std = group_rows.std() if len(group_rows) > 1 else torch.tensor(0.0)
        flat = bool((group_rows == group_rows[0]).all())
        rows.append(
            torch.zeros_like(group_rows) if flat else (group_rows - group_rows.mean()) / (std + eps)
        )
    return torch.cat(rows)


def flow_grpo_loss(
    logp, old_logp, ref_logp, advantages, mask, clip_low, clip_high, beta, token_count
):
    """The paper's Flow-GRPO objective as a loss, per planner token t of every turn-sample:
    L = Σ_t [−min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i) + β·KL_t] / N_tokens,  ρ_t = π_θ/π_old.

    A_i is the broadcast advantage of the turn's trajectory; KL_t is k3 to π_ref; N_tokens counts
    the step's planner tokens (DEVIATION 1: token-mean), so micro-batches add up to the one-shot
    loss."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch of the clipped surrogate
    kl = common.kl_penalty(logp, ref_logp, "k3")
    loss = ((pg_loss + beta * kl) * mask).sum() / token_count
    stats = {
        "clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask).item(),
        "kl": common.masked_mean(kl, mask).item(),
    }
    return loss, stats


def planner_sampler(system, temperature, args):
    """plan(prompts) → [(text, completion ids, sampler log-probs)], batched `generate`."""
    return lambda prompts: common.sample_completions(
        system.planner, system.tokenizer, prompts, args.max_new_tokens, temperature,
        batch_rows=args.gen_batch)


# ----------------------------------------------------------------------------- training


def evaluate(system, queries, args):
    """Greedy rollouts with the evaluation turn cap: accuracy, mean turns, tool error rate."""
    trajectories = run_agent(
        queries, system, planner_sampler(system, 0.0, args), args.eval_max_turns)
    return rollout_stats(trajectories), trajectories


def rollout_stats(trajectories):
    entries = [e for t in trajectories for e in t["memory"].entries]
    return {
        "accuracy": sum(t["reward"] for t in trajectories) / len(trajectories),
        "mean_turns": sum(len(t["turns"]) for t in trajectories) / len(trajectories),
        "tool_error_rate": sum(not e["ok"] for e in entries) / max(1, len(entries)),
    }


def format_rollout(trajectory):
    """One rollout turn by turn: the question, each plan, tool call, result and verdict, then the
    answer."""
    lines = [f"q: {trajectory['query']['question']}   (gold: {trajectory['query']['answer']})"]
    for turn, entry, verdict in zip(
        trajectory["turns"], trajectory["memory"].entries, trajectory["verdicts"]):
        lines.append(
            f"  turn {entry['step']}: planner {turn['text']!r} → tool {entry['tool']}, sub-goal "
            f"{entry['subgoal']!r}, command {entry['command']!r} → "
            f"{str(entry['result'])[:80]!r}; verifier {verdict}"
        )
    lines.append(f"  answer: {trajectory['answer']!r}  reward {trajectory['reward']:.0f}")
    return "\n".join(lines)


def validate(args):
    common.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (
                args.lr > 0 and args.clip_eps > 0 and args.beta >= 0,
                "--lr and --clip-eps must be > 0, --beta ≥ 0"),
            (args.steps >= 1 and args.inner_steps >= 1, "--steps and --inner-steps must be ≥ 1"),
            (
                args.max_turns >= 1 and args.eval_max_turns >= 1,
                "--max-turns and --eval-max-turns must be ≥ 1"),
            (
                args.temperature > 0,
                "--temperature must be > 0 for training rollouts (evaluation is greedy)"),
            (
                args.micro_batch_tokens >= 1 and args.gen_batch >= 1,
                "--micro-batch-tokens and --gen-batch must be ≥ 1"),
            (
                bool(args.model) == bool(args.data),
                "--preset full (or --model) needs --data FILE.jsonl; with neither it is the toy"),
            (
                not args.model or args.lora_rank > 0,
                "--model needs --lora-rank > 0: the frozen modules are the adapter-off model"),
        ]
    )


def train_arm(args, system, train_planner, credit, logger, checkpoint, accelerator):
    """Flow-GRPO on the planner (the Flow-GRPO objective): G rollouts per query → broadcast A_i →
    every planner turn a single-turn sample → token-level clipped loss + β·KL. With N processes each
    rank rolls out its block of queries with its own noise; the planner's DDP wrapper averages the
    gradients."""
    tokenizer, planner = system.tokenizer, system.planner
    device = planner.device
    reference = None if args.lora_rank else copy.deepcopy(planner).eval().requires_grad_(False)
    params = [p for p in planner.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    autocast = common.training_autocast(device)
    gen = torch.Generator().manual_seed(args.seed)
    mine = common.local_groups(args.queries_per_step, accelerator)
    plan = planner_sampler(system, args.temperature, args)
    sampler_dev, start = 0.0, 1
    state_objects = ({"planner": planner}, {"optimizer": optimizer}, {"rollouts": gen})
    # TRY NOT TO MODIFY: weights, optimiser, RNGs, metrics so far
    if args.resume and checkpoint.exists():
        done, extra = tracking.load_training_state(checkpoint, *state_objects)
        sampler_dev, start = extra["sampler_dev"], done + 1
        logger.restore(extra["records"])
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. G rollouts of the whole system per query (this rank's queries), of different lengths
        pick = torch.randint(len(system.train), (args.queries_per_step,), generator=gen)[
            mine.start : mine.stop
        ]
        queries = [system.train[i] for i in pick.tolist() for _ in range(args.group_size)]
        # generate's noise: each rank its own (one process keeps its stream)
        if accelerator.num_processes > 1:
            torch.manual_seed(common.sampling_seed(args.seed, step, accelerator.process_index))
        trajectories = run_agent(queries, system, plan, args.max_turns)
        # 2. one outcome reward R(τ_i) per rollout, broadcast as A_i to every planner turn of τ_i
        #    (the Flow-GRPO objective)
        rewards = torch.tensor([t["reward"] for t in trajectories])
        turns = [len(t["turns"]) for t in trajectories]
        row_adv = broadcast_advantages(rewards, turns, args.group_size, args.group_norm)  # (Σ T_i,)
        rows = list(zip((turn for t in trajectories for turn in t["turns"]), row_adv.tolist()))
        # the ablation: only each trajectory's last planner turn is trained
        if credit == "final-turn":
            rows = [rows[k] for k in (torch.tensor(turns).cumsum(0) - 1).tolist()]
        prompts, completions = [t["prompt"] for t, _ in rows], [t["ids"] for t, _ in rows]
        token_count = max(1, sum(len(c) for c in completions))
        batches = common.micro_batches(tokenizer, prompts, completions, args.micro_batch_tokens)
        packed = [
            common.pack_completions(
                tokenizer, [prompts[k] for k in b], [completions[k] for k in b], device)
            for b in batches
        ]
        with autocast:
            ref_logps = [
                common.reference_logprobs(
                    planner, reference, ids, attn, mask.shape[1], args.temperature)
                for ids, attn, mask in packed
            ]
        # 3. inner_steps optimiser steps, gradients accumulated over token-bounded micro-batches
        planner.train()
        for inner in range(args.inner_steps):
            optimizer.zero_grad()
            for batch, (ids, attn, mask), ref_logp in zip(batches, packed, ref_logps):
                old_logp = common.place_logprobs(mask, [rows[k][0]["old_logp"] for k in batch])
                advantages = torch.tensor([rows[k][1] for k in batch], device=device)
                with autocast:
                    logp = common.completion_logprobs(
                        train_planner, ids, attn, mask.shape[1], args.temperature)
                # not yet updated: training must score what the sampler drew
                if inner == 0 and step == 1:
                    sampler_dev = max(
                        sampler_dev, ((logp.detach() - old_logp) * mask).abs().max().item())
                loss, stats = flow_grpo_loss(
                    logp, old_logp, ref_logp, advantages, mask, args.clip_eps, args.clip_eps_high,
                    args.beta, token_count)
                if not torch.isfinite(loss):
                    raise SystemExit(f"error: non-finite loss at step {step}; lower --lr")
                accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        # the whole step's; the rest is rank 0's
        rewards = accelerator.gather(rewards.float().to(device)).cpu()
        record = {
            "reward": rewards.mean().item(),
            "zero_var_frac": common.zero_variance_fraction(rewards, args.group_size),
            "mean_turns": sum(turns) / len(turns),
            "turn_samples": len(rows),
            "loss": loss.item(),
            "sampler_logprob_max_dev": sampler_dev,
            **stats,
        }
        if (
            system.test
            and (step % args.eval_every == 0 or step == args.steps)
            and accelerator.is_main_process
        ):
            record |= {f"eval_{k}": v for k, v in evaluate(system, system.test, args)[0].items()}
        logger.log(step, **record)
        if (
            args.save_every
            and (step % args.save_every == 0 or step == args.steps)
            and accelerator.is_main_process
        ):
            tracking.save_training_state(
                checkpoint, step, *state_objects,
                extra={"sampler_dev": sampler_dev, "records": logger.records})
    return sampler_dev


def train(args):
    """Warm start (toy) → evaluate → Flow-GRPO → evaluate; on the toy, the final-turn-credit
    ablation too."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    system = build_full(args, device) if args.model else build_toy(args, device)
    train_planner = accelerator.prepare(system.planner)  # DDP wrapper (N processes) for the loss
    out_dir = Path(args.out_dir)
    config = dataclasses.asdict(args) | {"preset": args.preset}
    initial_state = copy.deepcopy(system.planner.state_dict()) if args.ablation else None
    test = system.test if accelerator.is_main_process else []  # only rank 0 evaluates and writes
    before, before_rollouts = evaluate(system, test, args) if test else ({}, [])

    logger = tracking.RunLogger(
        out_dir, config, args.steps, f"agentflow ({args.credit})", quiet=args.quiet,
        main_process=accelerator.is_main_process)
    sampler_dev = train_arm(
        args, system, train_planner, args.credit, logger, out_dir / "checkpoint.safetensors",
        accelerator)
    after, after_rollouts = evaluate(system, test, args) if test else ({}, [])
    summary = (
        {f"{k}_before": v for k, v in before.items()}
        | {f"{k}_after": v for k, v in after.items()}
        | {
            "accuracy_before": before.get("accuracy"),
            "accuracy_after": after.get("accuracy"),
            "mean_turns": after.get("mean_turns"),
            "tool_error_rate": after.get("tool_error_rate"),
            "credit": args.credit,
            "sampler_logprob_max_dev": sampler_dev,
            # the gate on the start: the warm-started planner's sampled success in step 1
            "start_reward": logger.records[0]["reward"] if logger.records else None,
        }
    )
    if test:  # the row of `make demo`'s table
        summary["claim"] = {"text": "AgentFlow planner: held-out accuracy goes up",
                            "before": before["accuracy"], "after": after["accuracy"]}
        shown = "\n".join(
            [
                "before training:", format_rollout(before_rollouts[0]), "after training:",
                format_rollout(after_rollouts[0])]
        )
        (out_dir / "rollouts.txt").write_text(shown + "\n")
        if not args.quiet:
            print(shown)
    if args.model and accelerator.is_main_process:
        system.planner.save_pretrained(out_dir / "planner")  # the LoRA adapter
        system.tokenizer.save_pretrained(out_dir / "planner")
    if args.ablation and system.test:
        other = "final-turn" if args.credit == "broadcast" else "broadcast"
        system.planner.load_state_dict(initial_state)
        common.seed_everything(args.seed)
        ablation_logger = tracking.RunLogger(
            out_dir / other, config | {"credit": other}, args.steps, f"agentflow ({other})",
            quiet=True, main_process=accelerator.is_main_process)
        train_arm(
            dataclasses.replace(args, credit=other), system, train_planner, other, ablation_logger,
            out_dir / other / "checkpoint.safetensors", accelerator)
        if accelerator.is_main_process:
            ablated = evaluate(system, test, args)[0]
            ablation_logger.finish({f"{k}_after": v for k, v in ablated.items()})
            summary[f"accuracy_{other.replace('-', '_')}_credit"] = ablated["accuracy"]
            plot_accuracy_comparison(
                before["accuracy"], logger.records, ablation_logger.records, args.credit, other,
                out_dir / "credit.png")
    return logger.finish(
        summary,
        [
            ("accuracy.png", ["eval_accuracy", "reward"], "agentflow: accuracy"),
            (
                "turns.png", ["mean_turns", "eval_mean_turns"],
                "agentflow: planner turns per rollout"),
        ],
    )


def plot_accuracy_comparison(start, records, other_records, name, other, path):
    """Held-out accuracy over training from the same start, reward broadcast vs final-turn
    credit."""
    tracking.plot_curves(
        {
            name: [(0, start)]
            + [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r],
            other: [(0, start)]
            + [(r["step"], r["eval_accuracy"]) for r in other_records if "eval_accuracy" in r],
        },
        path,
        "held-out accuracy by credit assignment",
        "accuracy",
    )


def sweep_row(summaries):
    """One seed of the sweep: held-out accuracy before, after broadcast and after final-turn
    credit, and the start's sampled success."""
    s = summaries[""]
    return {
        "start_reward": s["start_reward"],
        "accuracy_before": s["accuracy_before"],
        "broadcast": s["accuracy_after"],
        "final_turn": s["accuracy_final_turn_credit"],
    }


def claim_holds(row):
    """The paper's claim on one seed: broadcast credit gains ≥ 0.25 and beats final-turn credit."""
    return (
        row["broadcast"] - row["accuracy_before"] >= 0.25 and row["broadcast"] > row["final_turn"]
    )


if __name__ == "__main__":
    args = common.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(train, args, [("", {})], sweep_row, claim_holds, sweep_dir)
    else:
        print(json.dumps(train(args), indent=2))
