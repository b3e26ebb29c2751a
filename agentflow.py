"""AgentFlow's Flow-GRPO: train the planner inside a multi-turn planner/executor/verifier/generator loop.

Paper: "AgentFlow: In-the-Flow Agentic System Optimization for Effective Planning and Tool Use",
Li et al. 2025, arXiv 2510.05592. Official code: lupantech/AgentFlow. Digest: REFERENCES.md §4.
NOT the image "Flow-GRPO" (Liu et al. 2025, arXiv 2505.05470), which turns a flow-matching ODE into an
SDE: that algorithm is flow_grpo.py. Same name, unrelated method.

An agentic system answers a query q with a toolset K and an evolving memory M. Each turn the planner
π_θ (the only trained module) reads (q, K, M^t) and emits a sub-goal and a tool; a frozen executor turns
them into a tool call and runs it; a frozen verifier says STOP or CONTINUE; a frozen generator writes the
final answer from M. One outcome reward R(τ) judges that answer. Flow-GRPO broadcasts it: every planner
turn of τ_i becomes an independent single-turn sample carrying the same group-normalised advantage A_i,
so a multi-turn problem is trained with single-turn GRPO updates (§4.2).

Equation map (REFERENCES.md section → function):
    §4.1  the loop q, K, M → planner → executor → verifier → … → generator       → run_agent, Memory
    §4.2  A_i = (R_i − mean_G R) / std_G R, shared by every turn of τ_i           → broadcast_advantages
    §4.2  token-level clipped ratio inside each planner output, minus β·KL (k3)   → common.clipped_policy_loss,
                                                                                     common.kl_penalty
    §4.3  a model-written Python tool, sandboxed (subprocess, timeout, limits)    → python_tool

Deviations (numbered, on purpose):
    1. Turn-samples are averaged token-wise over the whole batch (common `token-mean`, as the official
       verl code), not (1/G)Σ_i (1/T_i)Σ_t (1/|a|)Σ_j as Eq. in §4.2 writes.
    2. The toy's executor, verifier and generator are deterministic rules (documented at `build_toy`);
       at full scale they are the base model with the LoRA adapter disabled, as the paper's frozen modules.
    3. Toy answers are judged by exact match; the paper uses a GPT-4o judge. Full scale: exact/numeric match.

Toy (default, CPU, a few minutes):   python agentflow.py
Full scale (one GPU):                python agentflow.py --preset full --data train.jsonl --eval-data test.jsonl
N GPUs (DDP, README):               accelerate launch --num_processes N agentflow.py --preset full ...
"""
import copy
import dataclasses
import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import common

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = dataclasses.field(default="", metadata={"help": "planner: HF model id or path ('' = tiny toy LM)"})
    data: str = dataclasses.field(default="", metadata={"help": "JSONL of {question, answer} ('' = toy task)"})
    eval_data: str = dataclasses.field(default="", metadata={"help": "held-out JSONL of {question, answer}"})
    corpus: str = dataclasses.field(default="", metadata={"help": "JSONL of {text} for the retrieval tool (full)"})
    steps: int = dataclasses.field(default=120, metadata={"help": "rollout batches"})
    queries_per_step: int = dataclasses.field(default=8, metadata={"help": "B queries per batch (paper: 32)"})
    group_size: int = dataclasses.field(default=8, metadata={"help": "G rollouts per query (paper: 8)"})
    inner_steps: int = dataclasses.field(default=2, metadata={"help": "optimiser steps per batch"})
    max_turns: int = dataclasses.field(default=3, metadata={"help": "planner turns per rollout in training (paper: 3)"})
    eval_max_turns: int = dataclasses.field(default=10, metadata={"help": "planner turns at evaluation (paper: 10)"})
    max_new_tokens: int = dataclasses.field(default=4, metadata={"help": "planner output cap per turn"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "rollout temperature (paper: 0.7); eval is greedy"})
    clip_eps: float = dataclasses.field(default=0.2, metadata={"help": "ε_low of the ratio clip (paper: 0.2)"})
    clip_eps_high: float = dataclasses.field(default=0.3, metadata={"help": "ε_high (paper: 0.3)"})
    beta: float = dataclasses.field(default=0.001, metadata={"help": "β of the k3 KL to the reference (paper: 0.001)"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "planner learning rate (paper: 1e-6)"})
    credit: str = dataclasses.field(default="broadcast", metadata={
        "help": "broadcast: every turn carries A_i (Flow-GRPO); final-turn: only the last turn is trained",
        "choices": ["broadcast", "final-turn"]})
    group_norm: str = dataclasses.field(default="trajectory", metadata={
        "help": "trajectory: normalise over the G rewards (paper); turn-rows: over all turn rows (official code)",
        "choices": ["trajectory", "turn-rows"]})
    ablation: bool = dataclasses.field(default=True, metadata={"help": "also train --credit final-turn from the same start"})
    warm_start_demos: int = dataclasses.field(default=24, metadata={"help": "toy: demonstrations in the planner's warm start"})
    warm_start_steps: int = dataclasses.field(default=40, metadata={"help": "toy: supervised steps of the warm start"})
    lora_rank: int = dataclasses.field(default=0, metadata={"help": "LoRA rank (full scale: needed, frozen modules = adapter off)"})
    tool_timeout: float = dataclasses.field(default=10.0, metadata={"help": "Python tool timeout in seconds"})
    eval_every: int = dataclasses.field(default=20, metadata={"help": "steps between held-out evaluations"})
    seed: int = dataclasses.field(default=0, metadata={"help": "random seed"})
    out_dir: str = dataclasses.field(default="runs/agentflow", metadata={"help": "output folder"})
    device: str = dataclasses.field(default="auto", metadata={
        "help": "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU", "choices": ["auto", "cpu"]})
    quiet: bool = dataclasses.field(default=False, metadata={"help": "no per-step lines or progress bar"})
    save_every: int = dataclasses.field(default=20, metadata={"help": "steps between checkpoints (0 = never)"})
    resume: bool = dataclasses.field(default=False, metadata={"help": "continue each arm from its checkpoint.safetensors"})


# Paper setup (REFERENCES.md §4.3): G = 8, batch 32 queries, lr 1e-6, KL 0.001 (k3), clip 0.2/0.3,
# temperature 0.7 in training and greedy at evaluation, 3 training turns. Qwen2.5-7B-Instruct with LoRA.
PRESETS = {"full": dict(model="Qwen/Qwen2.5-7B-Instruct", steps=100, queries_per_step=32, group_size=8,
                        inner_steps=1, max_new_tokens=256, temperature=0.7, lr=1e-6, lora_rank=64, ablation=False,
                        eval_every=25)}

# ----------------------------------------------------------------------------- memory and the loop (§4.1)


@dataclasses.dataclass
class Memory:
    """M: the ordered record of (step, tool, sub-goal, command, result) the modules read each turn."""
    entries: list = dataclasses.field(default_factory=list)

    def add(self, tool, subgoal, command, result, ok):
        self.entries.append({"step": len(self.entries) + 1, "tool": tool, "subgoal": subgoal, "command": command,
                             "result": result, "ok": ok})


def run_agent(queries, world, plan, max_turns):
    """One rollout per query: plan → execute → verify, until STOP or `max_turns`, then generate.

    All rollouts advance together (one batched planner call per turn). `plan(prompts)` returns, per prompt,
    (text, completion_ids, old_logp); each trajectory keeps its planner turns for training.
    """
    memories = [Memory() for _ in queries]
    trajectories = [{"query": q, "turns": [], "verdicts": []} for q in queries]
    active = list(range(len(queries)))
    for _ in range(max_turns):
        if not active:
            break
        prompts = [world["planner_prompt"](queries[i], memories[i]) for i in active]
        outputs = plan(prompts)
        calls = []
        for i, prompt, (text, ids, logp) in zip(active, prompts, outputs):
            trajectories[i]["turns"].append({"prompt": prompt, "ids": ids, "old_logp": logp, "text": text})
            try:
                tool, subgoal = world["parse_plan"](text)
                calls.append((i, tool, subgoal))
            except ValueError as err:  # a malformed plan is an observation, never a crash
                memories[i].add("none", text.strip(), "", f"error: {err}", ok=False)
        executed = world["execute"]([(queries[i], tool, subgoal, memories[i]) for i, tool, subgoal in calls]) if calls else []
        for (i, tool, subgoal), (command, result, ok) in zip(calls, executed):
            memories[i].add(tool, subgoal, command, result, ok)
        stops = world["verify"]([(queries[i], memories[i]) for i in active])
        for i, stop in zip(active, stops):
            trajectories[i]["verdicts"].append("STOP" if stop else "CONTINUE")
        active = [i for i, stop in zip(active, stops) if not stop]
    answers = world["generate"]([(q, m) for q, m in zip(queries, memories)])
    for trajectory, memory, answer in zip(trajectories, memories, answers):
        trajectory |= {"memory": memory, "answer": answer, "reward": float(world["judge"](trajectory["query"], answer))}
    return trajectories


# ----------------------------------------------------------------------------- the toy task


ATTRIBUTES = ["population", "area", "height", "age"]
OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
TOY_TOOLS = {"lookup": "lookup <A|B> <attribute>: the attribute of the question's first (A) or second (B) entity",
             "calc": "calc <plus|minus|times>: combine the last two looked-up values"}


def toy_queries(seed):
    """Questions over a made-up knowledge base: "population of c03 plus area of c17" (two lookups and a
    calculation) and, one in four, "area of c05" (one lookup). Returns (train, test, kb).

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
                out.append({"question": f"{a} of {e1}", "entities": (e1,), "shape": (a,), "answer": kb[e1][a]})
                continue
            a, op, b = rng.choice(shape_pool)
            out.append({"question": f"{a} of {e1} {op} {b} of {e2}", "entities": (e1, e2), "shape": (a, op, b),
                        "answer": OPERATIONS[op](kb[e1][a], kb[e2][b])})
        return out

    return make(entities[:30], train_shapes, 400), make(entities[30:], test_shapes + train_shapes, 200), kb


def toy_demonstration(query):
    """The golden plan: lookup A attr1, lookup B attr2, calc op (or a single lookup)."""
    if len(query["shape"]) == 1:
        return [f"lookup A {query['shape'][0]}"]
    a, op, b = query["shape"]
    return [f"lookup A {a}", f"lookup B {b}", f"calc {op}"]


def build_toy(args, device):
    """Tiny Qwen2 planner with a short supervised warm start; executor/verifier/generator are rules.

    Rules (DEVIATION 2): the executor maps "lookup A population" to lookup(first entity, population) and
    "calc plus" to the last two looked-up values; the verifier says STOP after a successful calc; the
    generator answers the last calc result, else the last looked-up value. A one-lookup question stops after
    its lookup, so rollouts have different lengths (1 to max_turns planner turns).
    """
    train, test, kb = toy_queries(args.seed)
    words = ["q", "k", "m", "p", "of", "ok", "error", "A", "B", *ATTRIBUTES, *OPERATIONS, *TOY_TOOLS,
             *[f"c{k:02d}" for k in range(40)]]
    tokenizer = common.make_tokenizer(words)
    planner = common.tiny_causal_lm(len(tokenizer), seed=args.seed)

    def planner_prompt(query, memory):  # (q, K, M^t) as tokens; results are summarised as ok/error
        steps = " ".join(f"m {e['tool']} {e['subgoal']} {'ok' if e['ok'] else 'error'}" for e in memory.entries)
        return f"q {query['question']} k {' '.join(TOY_TOOLS)} {steps} p".replace("  ", " ")

    def parse_plan(text):
        words = text.split()
        if not words or words[0] not in TOY_TOOLS:
            raise ValueError(f"no known tool in {text!r}")
        return words[0], " ".join(words[1:])

    def execute(calls):
        results = []
        for query, tool, subgoal, memory in calls:
            args_ = subgoal.split()
            if tool == "lookup" and len(args_) == 2 and args_[0] in "AB"[:len(query["entities"])] and args_[1] in ATTRIBUTES:
                entity = query["entities"]["AB".index(args_[0])]
                results.append((f"lookup({entity}, {args_[1]})", kb[entity][args_[1]], True))
            elif tool == "calc" and len(args_) == 1 and args_[0] in OPERATIONS:
                values = [e["result"] for e in memory.entries if e["tool"] == "lookup" and e["ok"]][-2:]
                if len(values) < 2:
                    results.append((f"calc({args_[0]})", "error: calc needs two looked-up values", False))
                else:
                    results.append((f"{values[0]} {args_[0]} {values[1]}", OPERATIONS[args_[0]](*values), True))
            else:
                results.append((f"{tool}({subgoal})", f"error: bad arguments {subgoal!r} for {tool}", False))
        return results

    def verify(items):  # STOP once the step the question needs last (calc, or its one lookup) succeeded
        return [bool(m.entries) and m.entries[-1]["ok"] and m.entries[-1]["tool"] == ("lookup" if len(q["shape"]) == 1 else "calc")
                for q, m in items]

    def generate(items):
        answers = []
        for _, m in items:
            done = [e["result"] for e in m.entries if e["ok"]]
            answers.append(done[-1] if done else None)
        return answers

    world = {"train": train, "test": test, "tokenizer": tokenizer, "planner": planner, "planner_prompt": planner_prompt,
             "parse_plan": parse_plan, "execute": execute, "verify": verify, "generate": generate,
             "judge": lambda query, answer: answer == query["answer"]}
    warm_start(world, train[:args.warm_start_demos], args.seed, args.warm_start_steps)
    return world


def warm_start(world, demos, seed, steps):
    """Supervised warm start on golden plans: the planner starts competent but imperfect."""
    tokenizer, planner = world["tokenizer"], world["planner"]
    pairs = []
    for query in demos:
        memory = Memory()
        for text in toy_demonstration(query):
            pairs.append((world["planner_prompt"](query, memory), text + " <eos>"))
            tool, subgoal = world["parse_plan"](text)
            command, result, ok = world["execute"]([(query, tool, subgoal, memory)])[0]
            memory.add(tool, subgoal, command, result, ok)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(planner.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = [pairs[k] for k in torch.randint(len(pairs), (32,), generator=gen).tolist()]
        ids, attn, mask = common.pack_completions(tokenizer, [p for p, _ in batch], [tokenizer(c, add_special_tokens=False)["input_ids"]
                                                                    for _, c in batch], planner.device)
        logp = common.completion_logprobs(planner, ids, attn)
        loss = -common.masked_mean(logp, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# ----------------------------------------------------------------------------- full scale: tools and LLM modules

SANDBOX_GUARD = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED = {"os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen", "socket.connect",
            "socket.bind", "ctypes.dlopen", "os.kill"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.truncate",
                "shutil.rmtree", "os.utime", "os.chown"}
def _inside(path):
    return isinstance(path, int) or os.path.realpath(os.fsdecode(path)).startswith(_ROOT + os.sep)
def _guard(event, args):
    if event in _BLOCKED or (event == "import" and args[0] in ("ctypes", "_ctypes")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory: {path}")
    if event in _PATH_EVENTS and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"sandbox: {event} outside the working directory")
sys.addaudithook(_guard)
del _guard
'''


def python_tool(code, timeout=10.0, memory_mb=1024, max_output=2000):
    """Run model-written code in a separate Python process and return its output as an observation.

    Isolation (best effort, not a security boundary — use a container for hostile models): an empty
    temporary working directory, `python -I` with an empty environment (no inherited secrets), CPU-time
    and address-space limits, a wall-clock timeout, and an audit hook that refuses writes outside the
    working directory, process spawning, sockets and ctypes. Output is truncated to `max_output` chars.
    """
    import resource

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 1, int(timeout) + 1))

    with tempfile.TemporaryDirectory(prefix="agentflow_py_") as workdir:
        script = Path(workdir) / "main.py"
        script.write_text(SANDBOX_GUARD + "\n" + code)
        try:
            done = subprocess.run([sys.executable, "-I", str(script)], cwd=workdir, env={}, capture_output=True,
                                  text=True, timeout=timeout, preexec_fn=limits)
        except subprocess.TimeoutExpired:
            return f"error: timed out after {timeout:g} s", False
    output = (done.stdout + ("\n" + done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr else ""))
    output = output.strip() or "(no output; print the result)"
    return output[:max_output] + (" …[truncated]" if len(output) > max_output else ""), done.returncode == 0


def make_retriever(corpus_path, top_k=3, max_chars=600):
    """TF-IDF search over a local JSONL corpus of {"text"} (scikit-learn); no web access."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    path = Path(corpus_path)
    if not path.is_file():
        raise SystemExit(f"error: --corpus {str(path)!r} is not a file")
    try:
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise SystemExit(f"error: {path}: every line must be JSON with a 'text' key ({err})") from None
    vectorizer = TfidfVectorizer().fit(docs)
    matrix = vectorizer.transform(docs)

    def search(query):
        scores = (matrix @ vectorizer.transform([query]).T).toarray()[:, 0]
        best = scores.argsort()[::-1][:top_k]
        return "\n".join(f"[{k + 1}] {docs[j][:max_chars]}" for k, j in enumerate(best) if scores[j] > 0) or "no match"

    return search


FULL_TOOLS = {
    "python": ("Runs Python code and returns what it prints.", "a complete Python program that prints the result"),
    "retrieve": ("Searches a local document collection.", "a short keyword search query"),
    "generate": ("Asks a general language model.", "a self-contained question or instruction"),
}


def load_qa_jsonl(path):
    """[{question, answer}] from a JSONL file, with one-line errors for a missing or malformed file."""
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
                raise SystemExit(f"error: {path}:{n}: expected JSON with 'question' and 'answer' ({err})") from None
    if not rows:
        raise SystemExit(f"error: {path} holds no rows")
    return rows


def answers_match(prediction, answer):
    """Exact match after normalising case, spaces and a trailing period; numbers compared as numbers."""
    if prediction is None:
        return False
    pred, gold = str(prediction).strip().strip(".").lower(), str(answer).strip().strip(".").lower()
    try:
        return abs(float(pred.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return " ".join(pred.split()) == " ".join(gold.split())


def build_full(args, device):
    """HF planner with LoRA; executor, verifier and generator are the same model with the adapter off."""
    tokenizer, planner = common.load_causal_lm(args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                               lora_rank=args.lora_rank)
    retrieve = make_retriever(args.corpus) if args.corpus else (lambda query: "error: no --corpus given")
    tool_list = "\n".join(f"- {name}: {desc} Input: {fmt}." for name, (desc, fmt) in FULL_TOOLS.items())

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    def render(memory):
        return "\n".join(f"Step {e['step']}: tool={e['tool']} sub-goal={e['subgoal']!r} command={e['command']!r} "
                         f"result={str(e['result'])[:500]!r}" for e in memory.entries) or "(empty)"

    def frozen(prompts, max_new_tokens=256):  # the frozen modules: base weights, greedy (DEVIATION 2)
        with planner.disable_adapter(), torch.no_grad():
            seq, _, mask, plen = common.sample_completions(planner, tokenizer, [chat(p) for p in prompts],
                                                           max_new_tokens, temperature=0.0)
        return tokenizer.batch_decode(seq[:, plen:] * mask, skip_special_tokens=True)

    def planner_prompt(query, memory):
        return chat(f"Question: {query['question']}\nTools:\n{tool_list}\nMemory:\n{render(memory)}\n"
                    "Plan the next step. Reply exactly:\nSub-goal: <what to find out next>\nTool: <tool name>")

    def parse_plan(text):
        tool, goal = re.search(r"Tool:\s*([\w-]+)", text), re.search(r"Sub-goal:\s*(.+)", text)
        if not tool or not goal or tool.group(1) not in FULL_TOOLS:
            raise ValueError("expected 'Sub-goal: …' and 'Tool: <" + "|".join(FULL_TOOLS) + ">'")
        return tool.group(1), goal.group(1).strip()

    def execute(calls):
        commands = frozen([f"Question: {q['question']}\nSub-goal: {goal}\nWrite the input for the tool '{tool}': "
                           f"{FULL_TOOLS[tool][1]}. Reply with the input only." for q, tool, goal, _ in calls])
        results = []
        for (query, tool, goal, _), command in zip(calls, commands):
            if tool == "python":
                block = re.search(r"```(?:python)?\n(.*?)```", command, re.S)
                results.append((command, *python_tool(block.group(1) if block else command, args.tool_timeout)))
            elif tool == "retrieve":
                results.append((command, retrieve(command), True))
            else:
                results.append((command, frozen([command])[0], True))
        return results

    def verify(items):
        verdicts = frozen([f"Question: {q['question']}\nMemory:\n{render(m)}\nIs the memory enough to answer? "
                           "Reply STOP or CONTINUE." for q, m in items], max_new_tokens=8)
        return ["STOP" in v.upper() for v in verdicts]

    def generate(items):
        texts = frozen([f"Question: {q['question']}\nMemory:\n{render(m)}\nGive the final answer on the last line "
                        "as 'Answer: <answer>'." for q, m in items])
        return [(re.findall(r"Answer:\s*(.+)", t) or [t.strip().splitlines()[-1] if t.strip() else None])[-1] for t in texts]

    return {"train": load_qa_jsonl(args.data), "test": load_qa_jsonl(args.eval_data) if args.eval_data else [],
            "tokenizer": tokenizer, "planner": planner, "planner_prompt": planner_prompt, "parse_plan": parse_plan,
            "execute": execute, "verify": verify, "generate": generate,
            "judge": lambda query, answer: answers_match(answer, query["answer"])}


# ----------------------------------------------------------------------------- the algorithm core (§4.2)


def broadcast_advantages(rewards, turns, group_size, mode="trajectory", eps=1e-4):
    """Every turn of τ_i gets A_i; A_i = (R_i − mean_G R)/(std_G R + ε) over the query's G rollouts (§4.2).

    rewards: (B·G,) trajectory rewards, a query's G rollouts contiguous; turns: planner turns per rollout.
    mode="turn-rows" is the official code's variant: mean and std over all turn rows of the group, so a
    trajectory with 3 turns counts 3 times. Returns the advantage of every turn row, flattened (Σ T_i,).
    """
    if mode == "trajectory":
        per_trajectory = common.group_advantages(rewards, group_size, eps=eps)
        return per_trajectory.repeat_interleave(torch.as_tensor(turns))  # §4.2 reward broadcast: A_i on every turn
    rows = []
    for g in range(0, len(rewards), group_size):
        reps = torch.as_tensor(turns[g:g + group_size])
        group_rows = rewards[g:g + group_size].float().repeat_interleave(reps)
        std = group_rows.std() if len(group_rows) > 1 else torch.tensor(0.0)
        flat = bool((group_rows == group_rows[0]).all())
        rows.append(torch.zeros_like(group_rows) if flat else (group_rows - group_rows.mean()) / (std + eps))
    return torch.cat(rows)


def planner_sampler(world, temperature, max_new_tokens):
    """plan(prompts) → [(text, completion ids, log-probs at sampling time)], one batched `generate`."""
    return lambda prompts: common.sample_with_logprobs(world["planner"], world["tokenizer"], prompts, max_new_tokens,
                                                       temperature)


# ----------------------------------------------------------------------------- training


def evaluate(world, queries, args):
    """Greedy rollouts with the evaluation turn cap: accuracy, mean turns, tool error rate."""
    trajectories = run_agent(queries, world, planner_sampler(world, 0.0, args.max_new_tokens), args.eval_max_turns)
    return rollout_stats(trajectories), trajectories


def rollout_stats(trajectories):
    entries = [e for t in trajectories for e in t["memory"].entries]
    return {"accuracy": sum(t["reward"] for t in trajectories) / len(trajectories),
            "mean_turns": sum(len(t["turns"]) for t in trajectories) / len(trajectories),
            "tool_error_rate": sum(not e["ok"] for e in entries) / max(1, len(entries))}


def format_rollout(trajectory):
    """One rollout turn by turn: the question, each plan, tool call, result and verdict, then the answer."""
    lines = [f"q: {trajectory['query']['question']}   (gold: {trajectory['query']['answer']})"]
    for turn, entry, verdict in zip(trajectory["turns"], trajectory["memory"].entries, trajectory["verdicts"]):
        lines.append(f"  turn {entry['step']}: planner {turn['text']!r} → tool {entry['tool']}, sub-goal "
                     f"{entry['subgoal']!r}, command {entry['command']!r} → {str(entry['result'])[:80]!r}; verifier {verdict}")
    lines.append(f"  answer: {trajectory['answer']!r}  reward {trajectory['reward']:.0f}")
    return "\n".join(lines)


def validate(args):
    common.check_args([
        (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
        (args.lr > 0 and args.clip_eps > 0 and args.beta >= 0, "--lr and --clip-eps must be > 0, --beta ≥ 0"),
        (args.steps >= 1 and args.inner_steps >= 1, "--steps and --inner-steps must be ≥ 1"),
        (args.max_turns >= 1 and args.eval_max_turns >= 1, "--max-turns and --eval-max-turns must be ≥ 1"),
        (args.temperature > 0, "--temperature must be > 0 for training rollouts (evaluation is greedy)"),
        (bool(args.model) == bool(args.data), "--preset full (or --model) needs --data FILE.jsonl; with neither it is the toy"),
        (not args.model or args.lora_rank > 0, "--model needs --lora-rank > 0: the frozen modules are the adapter-off model"),
    ])


def train_arm(args, world, credit, logger, checkpoint, accelerator):
    """Flow-GRPO on the planner: G rollouts per query → broadcast A_i → token-level clipped loss + β·KL.
    With N processes each rank rolls out its block of queries with its own noise; the planner's DDP wrapper
    averages the gradients of the ranks' token-mean losses."""
    tokenizer, planner = world["tokenizer"], world["planner"]
    device = planner.device
    reference = None if args.lora_rank else copy.deepcopy(planner).eval().requires_grad_(False)
    params = [p for p in planner.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    mine = common.local_groups(args.queries_per_step, accelerator)
    plan = planner_sampler(world, args.temperature, args.max_new_tokens)
    first_ratio_dev, start = 0.0, 1
    state_objects = ({"planner": planner}, {"optimizer": optimizer}, {"rollouts": gen})
    if args.resume and checkpoint.exists():  # weights, optimiser, RNGs and metrics so far
        done, extra = common.load_training_state(checkpoint, *state_objects)
        first_ratio_dev, start = extra["first_ratio_dev"], done + 1
        logger.restore(extra["records"])
    for step in range(start, args.steps + 1):
        pick = torch.randint(len(world["train"]), (args.queries_per_step,), generator=gen)[mine.start:mine.stop].tolist()
        queries = [world["train"][i] for i in pick for _ in range(args.group_size)]
        if accelerator.num_processes > 1:  # generate's noise: each rank its own (one process keeps its stream)
            torch.manual_seed(common.sampling_seed(args.seed, step, accelerator.process_index))
        trajectories = run_agent(queries, world, plan, args.max_turns)  # G rollouts of different lengths
        rewards = torch.tensor([t["reward"] for t in trajectories])
        turns = [len(t["turns"]) for t in trajectories]
        row_adv = broadcast_advantages(rewards, turns, args.group_size, args.group_norm)  # (Σ T_i,)
        rows = [(turn, a) for turn, a in zip((turn for t in trajectories for turn in t["turns"]), row_adv.tolist())]
        if credit == "final-turn":  # the ablation: only each trajectory's last planner turn is trained
            last = torch.tensor(turns).cumsum(0) - 1
            rows = [rows[k] for k in last.tolist()]
        ids, attn, mask = common.pack_completions(tokenizer, [t["prompt"] for t, _ in rows], [t["ids"] for t, _ in rows], device)
        old_logp = common.place_logprobs(mask, [t["old_logp"] for t, _ in rows])
        advantages = torch.tensor([a for _, a in rows], device=device)
        ref_logp = common.reference_logprobs(planner, reference, ids, attn, args.temperature)

        planner.train()
        for inner in range(args.inner_steps):
            logp = common.completion_logprobs(world["train_planner"], ids, attn, temperature=args.temperature)
            if inner == 0:  # re-batched, re-padded, not yet updated: must equal the sampler's log-probs
                first_ratio_dev = max(first_ratio_dev, ((logp.detach() - old_logp).exp() - 1).mul(mask).abs().max().item())
            # §4.2 J(θ): token-level min(ρ·A_i, clip(ρ, 1−ε, 1+ε_high)·A_i) (DEVIATION 1: token-mean), − β·KL (k3)
            loss, stats = common.clipped_policy_loss(logp, old_logp, advantages, mask, args.clip_eps, args.clip_eps_high)
            kl = common.masked_mean(common.kl_penalty(logp, ref_logp), mask)
            loss = loss + args.beta * kl
            if not torch.isfinite(loss):
                raise SystemExit(f"error: non-finite loss at step {step}; lower --lr")
            optimizer.zero_grad()
            accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

        rewards = accelerator.gather(rewards.float().to(device)).cpu()  # the whole step's; the rest is rank 0's
        record = {"reward": rewards.mean().item(), "zero_var_frac": common.zero_variance_fraction(rewards, args.group_size),
                  "mean_turns": sum(turns) / len(turns), "turn_samples": len(rows), "loss": loss.item(), "kl": kl.item(),
                  "first_ratio_dev": first_ratio_dev, **stats}
        if world["test"] and (step % args.eval_every == 0 or step == args.steps) and accelerator.is_main_process:
            record |= {f"eval_{k}": v for k, v in evaluate(world, world["test"], args)[0].items()}
        logger.log(step, **record)
        if args.save_every and (step % args.save_every == 0 or step == args.steps) and accelerator.is_main_process:
            common.save_training_state(checkpoint, step, *state_objects,
                                       extra={"first_ratio_dev": first_ratio_dev, "records": logger.records})
    return first_ratio_dev


def train(args):
    """Warm start (toy) → evaluate → Flow-GRPO → evaluate; on the toy, the final-turn-credit ablation too."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    world = build_full(args, device) if args.model else build_toy(args, device)
    world["planner"].to(device)
    world["train_planner"] = accelerator.prepare(world["planner"])  # DDP wrapper (N processes) for the loss
    out_dir = Path(args.out_dir)
    config = dataclasses.asdict(args) | {"preset": args.preset}
    initial_state = copy.deepcopy(world["planner"].state_dict()) if args.ablation else None
    test = world["test"] if accelerator.is_main_process else []  # only rank 0 evaluates and writes
    before, before_rollouts = evaluate(world, test, args) if test else ({}, [])

    logger = common.RunLogger(out_dir, config, args.steps, f"agentflow ({args.credit})", quiet=args.quiet,
                              main_process=accelerator.is_main_process)
    first_ratio_dev = train_arm(args, world, args.credit, logger, out_dir / "checkpoint.safetensors", accelerator)
    after, after_rollouts = evaluate(world, test, args) if test else ({}, [])
    summary = {f"{k}_before": v for k, v in before.items()} | {f"{k}_after": v for k, v in after.items()} | {
        "accuracy_before": before.get("accuracy"), "accuracy_after": after.get("accuracy"),
        "mean_turns": after.get("mean_turns"), "tool_error_rate": after.get("tool_error_rate"),
        "credit": args.credit, "first_step_ratio_max_dev": first_ratio_dev}
    if test:
        shown = "\n".join(["before training:", format_rollout(before_rollouts[0]), "after training:",
                           format_rollout(after_rollouts[0])])
        (out_dir / "rollouts.txt").write_text(shown + "\n")
        if not args.quiet:
            print(shown)
    if args.model and accelerator.is_main_process:
        world["planner"].save_pretrained(out_dir / "planner")  # the LoRA adapter
        world["tokenizer"].save_pretrained(out_dir / "planner")
    if args.ablation and world["test"]:
        other = "final-turn" if args.credit == "broadcast" else "broadcast"
        world["planner"].load_state_dict(initial_state)
        common.seed_everything(args.seed)
        ablation_logger = common.RunLogger(out_dir / other, config | {"credit": other}, args.steps, f"agentflow ({other})",
                                           quiet=True, main_process=accelerator.is_main_process)
        train_arm(dataclasses.replace(args, credit=other), world, other, ablation_logger,
                  out_dir / other / "checkpoint.safetensors", accelerator)
        if accelerator.is_main_process:
            ablated = evaluate(world, test, args)[0]
            ablation_logger.finish({f"{k}_after": v for k, v in ablated.items()})
            summary[f"accuracy_{other.replace('-', '_')}_credit"] = ablated["accuracy"]
            plot_accuracy_comparison(before["accuracy"], logger.records, ablation_logger.records, args.credit, other,
                                     out_dir / "credit.png")
    return logger.finish(summary, [("accuracy.png", ["eval_accuracy", "reward"], "agentflow: accuracy"),
                                   ("turns.png", ["mean_turns", "eval_mean_turns"], "agentflow: planner turns per rollout")])


def plot_accuracy_comparison(start, records, other_records, name, other, path):
    """Held-out accuracy over training from the same start, reward broadcast vs final-turn credit."""
    common.plot_curves({name: [(0, start)] + [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r],
                        other: [(0, start)] + [(r["step"], r["eval_accuracy"]) for r in other_records if "eval_accuracy" in r]},
                       path, "held-out accuracy by credit assignment", "accuracy")


if __name__ == "__main__":
    result = train(common.parse_args(Args, PRESETS))
    print(json.dumps(result, indent=2))
