"""RC-GRPO: reward-conditioned fine-tuning, then GRPO with sampled reward tokens (tool calling).

Paper: "Reward-Conditioned Group Relative Policy Optimization for multi-turn tool calling", Zhong et
al. 2026, arXiv 2602.03025 (no official code). Environment: the real BFCL v4 multi-turn data and
backends from the `bfcl-eval` package, executed without eval/exec.

After SFT on expert demonstrations a policy is peaked: a task's G rollouts all succeed or all fail,
the group's reward std is 0, A = 0, and GRPO stops learning ("paradox of perfection", RC-GRPO, Prop.
4.3). RC-GRPO first fine-tunes on expert *and* failed trajectories, each tagged in the first user
message with `[Reward Goal: <|high_reward|>]` or `<|low_reward|>` (RCTP-FT). Then each GRPO rollout
draws its own token (P(high) = p): the low-token rollouts behave differently, so groups keep their
variance (RC-GRPO stage 2, Prop. 4.3: E[σ_g²] ≥ ((G−1)/G)·p(1−p)·ε²). Inference uses the high token.

Equation map (paper → function):
    stage 1  RCTP data: expert (high) + failures (low), 1:1, the token at the end of the first
             user message                                               → build_rctp_data,
                                                                          add_reward_token
    stage 1  max-likelihood of the assistant tokens only                → supervised_finetune
    stage 2  r_j ~ Bernoulli(p) i.i.d. per rollout                      → sample_reward_tokens
    stage 2  one group per task across tokens                           → common.group_advantages
    stage 2  −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·KL (k3), per token       → rc_grpo_loss
    reward   R = R_state · R_action                                     → trajectory_reward
    BFCL     the official checker's semantics (per-turn state + results) → bfcl_check
    BFCL     calls parsed with ast, literal arguments only              → parse_calls, BFCLEnv

Deviations (numbered, on purpose):
    1. Model output is never eval'd (the official harness does): `parse_calls` accepts only
       `[f(literal, k=literal), ...]` and `BFCLEnv` dispatches to public methods of fresh instances.
    2. Train/test split by id (`id % 10 == 9` → test, 20 per category = 80); the paper's
       per-category counts (18/23/17/22) come from a split it does not publish.
    3. Each assistant step is trained as its own (history → step) sample (the same tokens a
       whole-dialogue pass with an assistant mask would score), so rollouts and training batches
       share one padding path. Failures for RCTP-FT are replayed from their parsed calls
       (unparseable steps are dropped).
    4. π_ref is the stage-1 model, as the paper: a frozen copy on the toy; with LoRA the stage-1
       adapter is merged into the weights and stage 2 trains a fresh adapter, so "adapter off" is
       the stage-1 model (one arm per LoRA run).
    5. BFCL's harness semantics: an output that decodes to no call (`[]`, plain text, a failed
       parse) ends the user turn; more than `--max-steps` steps in one turn abandons the entry
       (BFCL: 20). Backend calls get a time limit and their results a length cap
       (`BFCLEnv.execute`).
    6. Laptop knobs, off by default: `--docs needed` shows only the functions the ground truth calls
       and `--max-turns N` keeps the first N turns (BFCL's prompts are ~3k–7.5k tokens with all
       docs).

Toy (CPU, about 2–3 minutes for the four arms; docs/rc_grpo.md):
    python rc_grpo.py     # zero-variance fraction ~0.96 (SFT+GRPO) vs ~0.43 (RCTP+RC-GRPO),
                          # ε > 0.3; held-out accuracy ~0.88 for both arms on most seeds
    python rc_grpo.py --seeds 0-4 --arms sft+grpo,rctp+rc-grpo   # five seeds, one table
Full scale (one GPU, BFCL v4):   python rc_grpo.py --preset bfcl
N GPUs (DDP, docs/full_scale.md):
    accelerate launch --num_processes N rc_grpo.py --preset bfcl
Sample from a trained arm (bfcl preset; a LoRA adapter on --model):
    python -m utils.sample runs/rc_grpo/rctp+rc-grpo/policy "List the files here."
"""

import ast
import copy
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import random
import re
import select
import signal
import threading
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

import common
from utils import models, sweep, tracking

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = common.arg("", "HF model id or path ('' = tiny toy LM)")
    arms: str = common.arg(
        "sft+grpo,sft+rc-grpo,rctp+grpo,rctp+rc-grpo",
        "comma-separated arms: {sft|rctp}+{grpo|rc-grpo} (Table 1)")
    steps: int = common.arg(40, "GRPO steps per arm")
    tasks_per_step: int = common.arg(8, "tasks per GRPO batch")
    group_size: int = common.arg(5, "G rollouts per task (paper: 5)")
    p_high: float = common.arg(0.5, "p = P(<|high_reward|>) per rollout (paper: 0.5)")
    lr: float = common.arg(1e-3, "GRPO learning rate (paper: 1e-6)")
    beta: float = common.arg(0.1, "β of the k3 KL to the reference (paper: 0.1)")
    clip_eps: float = common.arg(0.2, "ratio clip ε (paper: 0.2)")
    sft_lr: float = common.arg(3e-3, "stage-1 learning rate (paper: 1e-5)")
    sft_epochs: int = common.arg(2, "SFT baseline epochs (paper: 2)")
    rctp_epochs: int = common.arg(5, "RCTP-FT epochs (paper: 5)")
    sft_batch: int = common.arg(16, "stage-1 batch (paper: 16)")
    failure_rollouts: int = common.arg(4, "base-model rollouts per train task to find failures")
    max_steps: int = common.arg(6, "model steps per user turn (BFCL: 20)")
    max_new_tokens: int = common.arg(10, "tokens per model step")
    temperature: float = common.arg(1.0, "rollout temperature; evaluation is greedy")
    max_tasks: int = common.arg(
        0, "use N train and N test tasks, taken round-robin over the categories (0 = all)")
    tasks: str = common.arg("", "comma-separated entry ids to use (train and test)")
    max_turns: int = common.arg(
        0, "keep only the first N user turns of each entry (0 = all; a laptop knob)")
    docs: str = common.arg(
        "all",
        "all: every function of the involved classes (BFCL); "
        "needed: only those the ground truth calls "
        "(shorter prompts, a laptop knob)",
        ["all", "needed"],
    )
    toy_tasks: int = common.arg(240, "toy: training tasks")
    toy_test_tasks: int = common.arg(200, "toy: held-out tasks")
    rare_share: float = common.arg(0.15, "toy: share of tasks whose file is not in `docs`")
    lora_rank: int = common.arg(0, "LoRA rank via peft (0 = full fine-tune)")
    micro_batch_tokens: int = common.arg(
        4096,
        "padded tokens per forward pass; gradients accumulate over micro-batches (bounds memory)")
    gen_batch: int = common.arg(64, "rollouts per `generate` call")
    gradient_checkpointing: bool = common.arg(
        False, "recompute activations in the backward pass (bfcl preset: on)")
    seed: int = common.arg(0, "random seed")
    seeds: str = common.arg("", "seed sweep, e.g. 0-4: all arms per seed, one table")
    out_dir: str = common.arg("runs/rc_grpo", "output folder")
    device: str = common.arg(
        "auto", "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"])
    quiet: bool = common.arg(False, "no per-step lines or progress bar")
    report_to: str = common.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = common.arg(10, "GRPO steps between checkpoints (0 = never)")
    resume: bool = common.arg(
        False,
        "continue each GRPO arm from its checkpoint (stage 1 is recomputed: it is deterministic)")


# Paper recipe: G = 5, p = 0.5, β 0.1, clip 0.2; RCTP-FT batch 16, 5 epochs; SFT 2 epochs;
# Qwen2.5-7B-Instruct. The paper's lr (1e-6 RL, 1e-5 stage 1) is for full fine-tuning; with LoRA (so
# that one GPU holds policy and reference) both are ×10, the LoRA/full-FT learning-rate ratio
# measured in "LoRA Without Regret" (Schulman et al., Thinking Machines 2025). BFCL prompts are ~5k
# tokens: three rows per micro-batch.
PRESETS = {
    "bfcl": dict(
        model="Qwen/Qwen2.5-7B-Instruct", arms="rctp+rc-grpo", steps=100, tasks_per_step=16,
        lr=1e-5, sft_lr=1e-4, failure_rollouts=2, max_steps=20, max_new_tokens=256, lora_rank=64,
        micro_batch_tokens=16384, gen_batch=32, gradient_checkpointing=True)
}

HIGH, LOW = "<|high_reward|>", "<|low_reward|>"
REWARD_TOKENS = (HIGH, LOW)

# ---------------------------------------------------------------- BFCL v4: data, parsing, execution

CATEGORIES = ["base", "long_context", "miss_func", "miss_param"]
MAX_CALL_CHARS = (
    16000  # longer model outputs are rejected before parsing (huge literals, bracket bombs)
)


def bfcl_root():
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent


def load_bfcl_entries(categories=CATEGORIES):
    """The BFCL v4 multi-turn entries with `ground_truth` (per-turn lists of call strings) added."""
    entries = []
    for category in categories:
        data = bfcl_root() / "data" / f"BFCL_v4_multi_turn_{category}.json"
        answers = bfcl_root() / "data" / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json"
        truth = {
            row["id"]: row["ground_truth"]
            for row in map(json.loads, answers.read_text().splitlines())
        }
        for line in data.read_text().splitlines():
            entry = json.loads(line)
            entries.append(entry | {"category": category, "ground_truth": truth[entry["id"]]})
    return entries


def split_entries(entries):
    """DEVIATION 2: numeric id % 10 == 9 → test (80 of 800), the rest train (720)."""
    test = [e for e in entries if int(e["id"].rsplit("_", 1)[1]) % 10 == 9]
    return [e for e in entries if e not in test], test


def function_docs(entry):
    """(docs shown from the start, {turn: docs revealed on that turn}) from bfcl_eval's function-doc
    files."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs = []
    for cls in entry["involved_classes"]:
        path = bfcl_root() / "data" / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]
        docs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # --docs needed: only what the ground truth calls (DEVIATION 6)
    if entry.get("docs") == "needed":
        needed = {
            name
            for turn in entry["ground_truth"]
            for call in turn
            for name, _, _ in parse_calls(call)
        }
        docs = [d for d in docs if d["name"] in needed]
    missed = {int(t): names for t, names in entry.get("missed_function", {}).items()}
    hidden = {name for names in missed.values() for name in names}
    # `excluded_function` is ignored, as the official harness
    shown = [d for d in docs if d["name"] not in hidden]
    return shown, {t: [d for d in docs if d["name"] in names] for t, names in missed.items()}


def _literal(node):
    """A literal argument value (str, number, bool, None, and lists/tuples/dicts/sets of those)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"an argument ({type(node).__name__}) is not a literal") from None


def parse_calls(text):
    """`[f(a=1), g('x', b=[2])]` → [(name, args, kwargs), ...], parsed with `ast`, literal arguments
    only.

    A bare single call `f(a=1)` is accepted too. Names must be plain identifiers without a leading
    underscore; attribute access, nested calls, names, comprehensions, lambdas, arithmetic and
    starred arguments are rejected. Any failure, however deep or long the text, is a ValueError (in
    BFCL's protocol a failed decode ends the turn). Nothing is evaluated.
    """
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("python").strip()
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"output longer than {MAX_CALL_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
        calls = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
        return [_parse_call(call) for call in calls]
    except (SyntaxError, MemoryError, RecursionError, TypeError) as err:
        raise ValueError(f"not a Python list of calls ({type(err).__name__})") from None


def _parse_call(call):
    """One `ast.Call` of a plain, public name with literal arguments → (name, args, kwargs)."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"a {type(call).__name__} is not a call of a plain function name")
    name = call.func.id
    if name.startswith("_"):
        raise ValueError(f"private or dunder function {name!r} is not allowed")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        raise ValueError(f"*args/**kwargs in {name}() are not allowed")
    return (
        name, tuple(_literal(a) for a in call.args),
        {k.arg: _literal(k.value) for k in call.keywords})


def format_call(name, args, kwargs):
    """The inverse of parse_calls for one call, in the ground truth's style: f('x', k=1)."""
    return (
        f"{name}({', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()])})"
    )


class BFCLEnv:
    """Fresh backend instances for one entry; calls dispatch only to allow-listed public methods.

    Every instance is built from a deep copy of the entry's `initial_config`, so parallel rollouts
    of one task never share state (the official harness caches instances in module globals).
    """

    def __init__(self, entry):
        from bfcl_eval.constants.executable_backend_config import (
            CLASS_FILE_PATH_MAPPING,
            STATELESS_CLASSES,
        )

        self.instances, self.methods, self.stateless = {}, {}, set()
        hidden = {n for names in entry.get("missed_function", {}).values() for n in names}
        for cls in entry["involved_classes"]:
            instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[cls]), cls)()
            if cls not in STATELESS_CLASSES:
                instance._load_scenario(
                    copy.deepcopy(entry["initial_config"].get(cls, {})),
                    long_context=entry["category"] == "long_context")
            self.instances[cls] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method
                    if cls in STATELESS_CLASSES:
                        self.stateless.add(name)
        self.hidden = {n: self.methods.pop(n) for n in hidden if n in self.methods}

    def reveal(self, names):
        """miss_func: the held-out functions become callable on the turn the data says."""
        for name in names:
            if name in self.hidden:
                self.methods[name] = self.hidden.pop(name)

    def execute(self, calls):
        """Run parsed calls in order; each result (or error) as a string, as BFCL shows it to the
        model.

        A call gets CALL_SECONDS: stateless backends (MathAPI) run in a forked child that is killed
        at the limit (`power(9, 999999999)` is all literals and C-level work no in-process timer can
        stop); stateful ones run here under a SIGALRM timer. Results are cut at MAX_RESULT_CHARS.
        Over a limit → an error observation; the rollout goes on."""
        results = []
        for name, args, kwargs in calls:
            if name not in self.methods:
                results.append(f"Error during execution: function {name!r} is not available")
            elif name in self.stateless:
                results.append(run_forked(self.methods[name], args, kwargs))
            else:
                results.append(run_timed(self.methods[name], args, kwargs))
        return results

    def state(self):
        """Public attributes of every instance: what the official state check compares."""
        return {
            cls: {k: v for k, v in vars(inst).items() if not k.startswith("_")}
            for cls, inst in self.instances.items()
        }

    def bound_arguments(self, name, args, kwargs):
        """{parameter: value} for a call, so positional and keyword spellings compare equal."""
        method = self.methods.get(name) or self.hidden.get(name)
        try:
            return dict(inspect.signature(method).bind(*args, **kwargs).arguments)
        except (TypeError, ValueError, AttributeError):
            return {**{f"#{i}": a for i, a in enumerate(args)}, **kwargs}


CALL_SECONDS = 2.0  # per backend call
MAX_RESULT_CHARS = 4000  # per call result


def format_result(out):
    """A backend's return value as the model sees it (dicts as JSON), cut at MAX_RESULT_CHARS."""
    text = out if isinstance(out, str) else json.dumps(out) if isinstance(out, dict) else str(out)
    return text[:MAX_RESULT_CHARS]


def run_timed(method, args, kwargs):
    """Call a stateful backend method here, interrupted by SIGALRM after CALL_SECONDS (main thread
    only)."""
    timed = threading.current_thread() is threading.main_thread()

    def expire(*_):
        raise TimeoutError(f"call took longer than {CALL_SECONDS:g} s")

    if timed:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
    try:
        return format_result(method(*args, **kwargs))
    except Exception as err:  # a backend error is an observation for the model, never a crash
        return f"Error during execution: {format_result(str(err))}"
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def run_forked(method, args, kwargs):
    """Call a stateless backend method in a forked child, killed after CALL_SECONDS; its text comes
    back through a pipe (at most MAX_RESULT_CHARS)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write, exit without running the parent's cleanup
        os.close(read_end)
        try:
            text = format_result(method(*args, **kwargs))
        except BaseException as err:
            text = f"Error during execution: {format_result(str(err))}"
        os.write(write_end, text.encode("utf-8", "replace")[: 4 * MAX_RESULT_CHARS])
        os._exit(0)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + CALL_SECONDS
    with os.fdopen(read_end, "rb") as pipe:
        while (left := deadline - time.monotonic()) > 0 and select.select([pipe], [], [], left)[0]:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"Error during execution: call took longer than {CALL_SECONDS:g} s"
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace")


def replay(entry, calls_per_turn, on_turn=None):
    """Execute a trajectory's calls turn by turn in a fresh env; `on_turn(turn, env, results)` after
    each."""
    env = BFCLEnv(entry)
    revealed = {int(t): names for t, names in entry.get("missed_function", {}).items()}
    for turn, calls in enumerate(calls_per_turn):
        env.reveal(revealed.get(turn, []))
        results = []
        for call in calls:
            try:
                results += env.execute(parse_calls(call))
            except ValueError as err:
                results.append(f"Error: {err}")
        if on_turn:
            on_turn(turn, env, results)
    return env


def trajectory_reward(entry, calls_per_turn):
    """R = R_state · R_action ∈ {0, 1}  (RC-GRPO's reward).

    R_state: the final state equals the ground truth's final state. R_action: every ground-truth
    call appears among the agent's calls with the same name and the same values for the ground
    truth's arguments (extra arguments allowed, order ignored, each agent call used once).
    """
    env, truth_env = replay(entry, calls_per_turn), replay(entry, entry["ground_truth"])
    if env.state() != truth_env.state():  # RC-GRPO's reward R_state
        return 0.0
    made = []
    for calls in calls_per_turn:
        for call in calls:
            try:
                made += [(n, env.bound_arguments(n, a, k)) for n, a, k in parse_calls(call)]
            except ValueError:
                continue
    # RC-GRPO's reward R_action: every ground-truth call, matched once
    for calls in entry["ground_truth"]:
        for name, args, kwargs in (c for call in calls for c in parse_calls(call)):
            want = truth_env.bound_arguments(name, args, kwargs)
            match = next(
                (
                    m
                    for m in made
                    if m[0] == name and all(k in m[1] and m[1][k] == v for k, v in want.items())
                ),
                None,
            )
            if match is None:
                return 0.0
            made.remove(match)
    return 1.0


def bfcl_check(entry, calls_per_turn):
    """The official multi-turn checker's semantics, without eval: after every turn whose ground
    truth is non-empty, the model must have made a call, the states must match, and the turn's
    ground-truth results must be contained (as a multiset) in all of the model's results so far.
    Returns 1.0 or 0.0."""
    model_results, truth_turns = [], {}
    model_envs = {}

    def on_model_turn(turn, env, results):
        model_results.append(list(results))
        model_envs[turn] = copy.deepcopy(env.state())  # later turns mutate the live objects

    def on_truth_turn(turn, env, results):
        truth_turns[turn] = (list(results), copy.deepcopy(env.state()))

    turns = len(entry["ground_truth"])
    replay(entry, (list(calls_per_turn) + [[]] * turns)[:turns], on_model_turn)
    replay(entry, entry["ground_truth"], on_truth_turn)
    so_far = []
    for turn, truth_calls in enumerate(entry["ground_truth"]):
        so_far += model_results[turn]
        if not truth_calls:
            continue
        if not (calls_per_turn[turn] if turn < len(calls_per_turn) else []):
            return 0.0
        truth_results, truth_state = truth_turns[turn]
        if model_envs[turn] != truth_state:
            return 0.0
        remaining = list(so_far)
        for result in truth_results:
            if result not in remaining:
                return 0.0
            remaining.remove(result)
    return 1.0


# -------------------------------------------------- the toy task: files on a real GorillaFileSystem

TOY_FILES = ["report.txt", "notes.md", "data.csv", "todo.txt", "draft.doc"]
TOY_DIRS = ["docs", "work", "temp", "misc"]


def toy_entries(n, seed, rare_share, n_test=200):
    """BFCL-format entries on the real GorillaFileSystem: "delete F", F in one of four folders.

    The user never says where F is. The expert looks first: [find(name=F), cd(folder=D),
    rm(file_name=F)], D copied from find's result. The folder mix is skewed: F sits in `docs`
    except on a `rare_share` of tasks, spread over the three other folders, and the experts were
    recorded on the common case only: imitation learns `cd docs`, and the rare folders are left to
    what the base model does (it sometimes copies the folder it found).
    """
    rng = random.Random(seed)
    entries = []
    for k in range(n + n_test):
        target = rng.choice(TOY_FILES)
        rare = rng.random() < rare_share
        folder = rng.choice(TOY_DIRS[1:]) if rare else "docs"
        contents = {d: {"type": "directory", "contents": {}} for d in TOY_DIRS}
        contents[folder]["contents"][target] = {"type": "file", "content": f"{target} content"}
        for other in rng.sample([f for f in TOY_FILES if f != target], 2):
            contents[rng.choice(TOY_DIRS)]["contents"][other] = {
                "type": "file", "content": f"{other} content"}
        entries.append(
            {
                "id": f"toy_{k}",
                "category": "toy",
                "involved_classes": ["GorillaFileSystem"],
                "initial_config": {
                    "GorillaFileSystem": {
                        "root": {"workspace": {"type": "directory", "contents": contents}}}
                },
                "question": [[{"role": "user", "content": f"delete {target}"}]],
                "ground_truth": [
                    [
                        f"find(name='{target}')", f"cd(folder='{folder}')",
                        f"rm(file_name='{target}')"]
                ],
                "rare": rare,
                "demonstrated": not rare,  # experts were recorded on the common case only
            }
        )
    return entries[:n], entries[n:]


def toy_call_text(call):
    """A call as the toy LM writes it: one word per token, still valid Python (`[ cd ( folder =
    'docs' ) ]`)."""
    name, args, kwargs = parse_calls(call)[0]
    return (
        "[ "
        + name
        + " ( "
        + " , ".join([repr(a) for a in args] + [f"{k} = {v!r}" for k, v in kwargs.items()])
        + " ) ]"
    )


def toy_observation(text):
    """The toy LM reads tool results as words it knows (folder and file names survive)."""
    return " ".join(re.findall(r"[A-Za-z_]+(?:\.[a-z]+)?", text)) or "None"


def sloppy_agent_steps(entry, rng):
    """The toy's "base model" behaviour: syntax-correct but careless (sometimes looks first, often
    guesses)."""
    target = entry["question"][0][0]["content"].split()[-1]
    folder = parse_calls(entry["ground_truth"][0][1])[0][2]["folder"]
    steps = []
    if rng.random() < 0.4:
        steps.append(f"find(name={target!r})")
        steps.append(f"cd(folder={folder if rng.random() < 0.9 else rng.choice(TOY_DIRS)!r})")
    else:
        steps.append(f"cd(folder={rng.choice(TOY_DIRS)!r})")
    steps.append(f"rm(file_name={target if rng.random() < 0.7 else rng.choice(TOY_FILES)!r})")
    return steps


@dataclasses.dataclass
class World:
    """The environment side of a run: the task split, the model, and how a dialogue is written as
    text. chat=True: the tokenizer's chat template and BFCL's system prompt (full scale); False: the
    toy's words."""

    train: list
    test: list
    tokenizer: object
    model: object
    chat: bool
    end_text: str  # what an expert writes to end a turn
    reveal_message: str = ""


def build_toy(args, device):
    """Tiny Qwen2 "base model" pretrained on a careless agent's trajectories (real env
    observations) on generic tasks, whose files sit in any folder alike."""
    train, test = toy_entries(args.toy_tasks, args.seed, args.rare_share, args.toy_test_tasks)
    generic, _ = toy_entries(args.toy_tasks, args.seed + 1, rare_share=0.75, n_test=0)
    words = [
        "user", "asst", "tool", "delete", "done", "[", "]", "(", ")", ",", "=", "[Reward", "Goal:",
        "None", "matches", "Error", "find", "cd", "rm", "ls", "name", "folder", "file_name",
        *TOY_DIRS, *TOY_FILES, *[repr(w) for w in TOY_DIRS + TOY_FILES]]
    tokenizer = models.make_tokenizer(words, special_tokens=REWARD_TOKENS)
    model = models.tiny_causal_lm(len(tokenizer), seed=args.seed).to(device)
    world = World(train, test, tokenizer, model, chat=False, end_text="done")
    rng = random.Random(args.seed)
    base_data = [
        trajectory_samples(world, e, None, sloppy_agent_steps(e, rng))
        for e in generic
        for _ in range(3)
    ]
    supervised_finetune(
        world, [s for traj in base_data for s in traj], epochs=8, lr=3e-3, batch=32, seed=args.seed,
        token_budget=args.micro_batch_tokens)
    return world


# ------------------------------------------------------- full scale: BFCL v4 with an instruct model


def build_bfcl(args, device):
    """An HF instruct model (LoRA when --lora-rank) on the real BFCL v4 split. The reward tokens
    stay plain text (a few sub-word tokens each): new embedding rows would not be trained by LoRA on
    the linear layers."""
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    tokenizer, model = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing)
    train, test = split_entries(load_bfcl_entries())
    return World(
        train, test, tokenizer, model.to(device), chat=True, end_text="Done.",
        reveal_message=DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC)


def select_entries(entries, args):
    """--tasks (ids) or --max-tasks (stratified), then the laptop knobs --max-turns and --docs."""
    if args.tasks:
        wanted = set(args.tasks.split(","))
        entries = [e for e in entries if e["id"] in wanted]
    elif args.max_tasks:
        entries = stratified(entries, args.max_tasks)
    out = []
    for entry in entries:
        if args.max_turns:  # the first N user turns and their ground truth (DEVIATION 6)
            n = args.max_turns
            entry = entry | {
                "question": entry["question"][:n],
                "ground_truth": entry["ground_truth"][:n],
                "missed_function": {
                    t: f for t, f in entry.get("missed_function", {}).items() if int(t) < n
                },
            }
        out.append(entry | {"docs": args.docs})
    return out


def stratified(entries, n):
    """The first n entries taken round-robin over the categories (the data files are sorted by
    category)."""
    by_category = {}
    for entry in entries:
        by_category.setdefault(entry["category"], []).append(entry)
    mixed = [
        e for group in itertools.zip_longest(*by_category.values()) for e in group if e is not None
    ]
    return mixed[:n]


# ------------------------------------------------------------------ rollouts, one protocol for both


def system_messages(world, entry):
    """BFCL's prompting setup: the function docs in a system message (full scale); none on the
    toy."""
    if not world.chat:
        return []
    return [
        {
            "role": "system",
            "content": (
                "You are an expert in composing functions. Based on the question, make one or "
                "more function calls to achieve the purpose. If none of the functions can be "
                "used, or the question lacks required parameters, point it out. To call "
                "functions, reply ONLY with a Python list in the format "
                "[func_name1(param=value, ...), func_name2(param=value)]. Keep calling functions "
                "until the user's request is fulfilled; when you have no more calls to make, "
                "reply in plain text and the turn ends.\nHere is a list of functions in JSON "
                f"format that you can invoke.\n{json.dumps(function_docs(entry)[0])}"
            ),
        }
    ]


def render(world, messages):
    """The dialogue as the model's prompt: the chat template, or the toy's `role content … asst`."""
    if world.chat:
        return world.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    return (
        " ".join(f"{m['role'].replace('assistant', 'asst')} {m['content']}" for m in messages)
        + " asst"
    )


def call_text(world, call):
    """One ground-truth call as the model writes it."""
    return "[" + call + "]" if world.chat else toy_call_text(call)


def observation(world, text):
    """Tool results as the model reads them."""
    return text[:2000] if world.chat else toy_observation(text)


def add_reward_token(content, token):
    """The first user message + `[Reward Goal: <|…|>]` (RCTP-FT); token None = no conditioning."""
    return content if token is None else f"{content} [Reward Goal: {token}]"  # RCTP-FT


def user_messages(world, entry, turn, token, env):
    """The messages that open user turn `turn`; miss_func's held-out docs arrive on the turn the
    data says."""
    revealed = {int(t): names for t, names in entry.get("missed_function", {}).items()}
    if turn in revealed:
        env.reveal(revealed[turn])
        _, later = function_docs(entry)
        return [{"role": "user", "content": json.dumps(later[turn]) + "\n" + world.reveal_message}]
    messages = [dict(m) for m in entry["question"][turn]]
    if turn == 0 and messages:
        messages[0]["content"] = add_reward_token(messages[0]["content"], token)
    return messages


def decode_calls(text):
    """BFCL's decode: the calls in an output, or [] when it has none, is `[]`, or does not parse. In
    BFCL's protocol an empty or failed decode ends the user turn."""
    stripped = text.strip().strip("`").removeprefix("python").strip()
    if not (stripped.startswith("[") or re.match(r"^[A-Za-z_]\w*\s*\(", stripped)):
        return []
    try:
        return parse_calls(text)
    except ValueError:
        return []


def run_rollouts(world, entries, tokens, temperature, args):
    """Play each entry under its reward token with BFCL's protocol: per user turn, generate → decode
    → execute → append the results, until the output decodes to no call (the turn ends); more than
    `args.max_steps` steps in one turn abandons the entry (BFCL: 20).

    All rollouts advance together (one batched `generate` per step, `args.gen_batch` rows at a
    time). Returns, per rollout, its steps (prompt, completion ids, sampling log-probs),
    `calls_per_turn`, and R = trajectory_reward.
    """
    runs = []
    for entry, token in zip(entries, tokens):
        env = BFCLEnv(entry)
        runs.append(
            {
                "entry": entry,
                "token": token,
                "env": env,
                "turn": 0,
                "turn_steps": 0,
                "steps": [],
                "done": False,
                "calls_per_turn": [[] for _ in entry["question"]],
                "messages": system_messages(world, entry)
                + user_messages(world, entry, 0, token, env),
            }
        )
    while active := [r for r in runs if not r["done"]]:
        prompts = [render(world, r["messages"]) for r in active]
        outputs = common.sample_completions(
            world.model, world.tokenizer, prompts, args.max_new_tokens, temperature,
            batch_rows=args.gen_batch)
        for run, prompt, (text, ids, logp) in zip(active, prompts, outputs):
            run["steps"].append({"prompt": prompt, "ids": ids, "old_logp": logp})
            run["messages"].append({"role": "assistant", "content": text})
            calls = decode_calls(text)
            if calls:
                results = run["env"].execute(calls)
                run["calls_per_turn"][run["turn"]] += [format_call(*c) for c in calls]
                run["messages"].append(
                    {"role": "tool", "content": observation(world, "\n".join(results))})
                run["turn_steps"] += 1
                run["done"] = run["turn_steps"] > args.max_steps  # BFCL's force-quit
                continue
            run["turn"], run["turn_steps"] = run["turn"] + 1, 0
            if run["turn"] < len(run["entry"]["question"]):
                run["messages"] += user_messages(
                    world, run["entry"], run["turn"], run["token"], run["env"])
            else:
                run["done"] = True
    for run in runs:
        run["reward"] = trajectory_reward(run["entry"], run["calls_per_turn"])
    return runs


def trajectory_samples(world, entry, token, steps_per_turn):
    """(prompt, completion ids) for each assistant step of a scripted trajectory: the stage-1 data.

    `steps_per_turn`: a list of call strings (one user turn) or a list of such lists (one per turn);
    each call is one assistant step, then the end-of-turn text. Observations come from a real
    execution.
    """
    if steps_per_turn and isinstance(steps_per_turn[0], str):
        steps_per_turn = [steps_per_turn]
    env = BFCLEnv(entry)
    messages = system_messages(world, entry)
    samples, tokenizer = [], world.tokenizer
    for turn in range(len(entry["question"])):
        messages += user_messages(world, entry, turn, token, env)
        calls = steps_per_turn[turn] if turn < len(steps_per_turn) else []
        for text in [call_text(world, c) for c in calls] + [world.end_text]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append({"prompt": render(world, messages), "ids": ids})
            messages.append({"role": "assistant", "content": text})
            if text != world.end_text:
                results = env.execute(parse_calls(text))
                messages.append({"role": "tool", "content": observation(world, "\n".join(results))})
    return samples


def supervised_finetune(world, samples, epochs, lr, batch, seed, token_budget):
    """Maximum likelihood of the assistant tokens given the history (and reward token): stage 1
    (RCTP-FT). Each batch of `batch` samples is one optimiser step, accumulated over token-bounded
    micro-batches."""
    model, tokenizer = world.model, world.tokenizer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    autocast = common.training_autocast(model.device)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(samples), generator=gen).tolist()
        for start in range(0, len(order), batch):
            chunk = [samples[i] for i in order[start : start + batch]]
            prompts, completions = [s["prompt"] for s in chunk], [s["ids"] for s in chunk]
            token_count = sum(len(c) for c in completions)
            optimizer.zero_grad()
            for rows in common.micro_batches(tokenizer, prompts, completions, token_budget):
                ids, attn, mask = common.pack_completions(
                    tokenizer, [prompts[r] for r in rows], [completions[r] for r in rows],
                    model.device)
                with autocast:
                    logp = common.completion_logprobs(model, ids, attn, mask.shape[1])
                (-(logp * mask).sum() / token_count).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()


def build_rctp_data(world, entries, args):
    """Expert trajectories (ground truth, <|high_reward|>) and the base model's failures (R = 0,
    <|low_reward|>), 1:1 (RCTP-FT). Failures are collected `args.gen_batch` rollouts at a time.
    Returns (samples, number of failures found)."""
    repeated = [e for e in entries for _ in range(args.failure_rollouts)]
    rollouts = []
    for lo in range(0, len(repeated), args.gen_batch):
        chunk = repeated[lo : lo + args.gen_batch]
        rollouts += [
            {"entry": r["entry"], "calls_per_turn": r["calls_per_turn"], "reward": r["reward"]}
            for r in run_rollouts(world, chunk, [None] * len(chunk), 1.0, args)
        ]
    failures = [r for r in rollouts if r["reward"] == 0]
    random.Random(args.seed).shuffle(failures)
    failures = failures[: len(entries)]
    demonstrated = [e for e in entries if e.get("demonstrated", True)]
    experts = stratified(demonstrated, len(failures)) if failures else demonstrated
    samples = [s for e in experts for s in trajectory_samples(world, e, HIGH, e["ground_truth"])]
    for run in failures:
        samples += trajectory_samples(world, run["entry"], LOW, run["calls_per_turn"])
    return samples, len(failures)


# ---------------------------------------------------------------------- the algorithm core: stage 2


def sample_reward_tokens(n, p, generator):
    """r_j ~ Bernoulli(p) i.i.d. per rollout: <|high_reward|> with probability p, else
    <|low_reward|> (RC-GRPO stage 2)."""
    draws = torch.rand(n, generator=generator) < p
    return [HIGH if d else LOW for d in draws.tolist()]  # r_j ~ Bernoulli(p), i.i.d.


def rc_grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, token_count):
    """L = Σ_t [−min(ρ_t·A, clip(ρ_t, 1−ε, 1+ε)·A) + β·KL_t] / N_tokens, ρ_t = π_θ/π_old per token
    (RC-GRPO stage 2).

    Every term is conditioned on the rollout's own reward token (it sits in the prompt, never
    scored). KL_t is k3 to π_ref, the stage-1 model. N_tokens counts the step's completion tokens,
    so micro-batches add up to the one-shot loss. Returns (loss, stats)."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch of the clipped surrogate
    kl = common.kl_penalty(logp, ref_logp, "k3")
    loss = ((pg_loss + beta * kl) * mask).sum() / token_count
    stats = {
        "clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask).item(),
        "kl": common.masked_mean(kl, mask).item()}
    return loss, stats


def evaluate(world, entries, token, args, temperature=0.0):
    """Accuracy of rollouts under `token` (greedy by default) scored with the official checker's
    semantics (bfcl_check)."""
    if not entries:
        return float("nan")
    runs = run_rollouts(world, entries, [token] * len(entries), temperature, args)
    return sum(bfcl_check(r["entry"], r["calls_per_turn"]) for r in runs) / len(runs)


def format_calls(world, entry, token, args):
    """What the policy calls on one entry, turn by turn (greedy, under `token`), beside the
    expected calls: the before/after view of rollouts.txt."""
    (run,) = run_rollouts(world, [entry], [token], 0.0, args)
    lines = [f"{entry['id']} (token {token}): reward {run['reward']:.0f}"]
    for turn, (calls, expected) in enumerate(zip(run["calls_per_turn"], entry["ground_truth"])):
        asked = entry["question"][turn][0]["content"] if entry["question"][turn] else ""
        lines.append(f"  turn {turn}: user {asked[:100]!r}")
        lines.append(f"    called   {calls or '(no call)'}")
        lines.append(f"    expected {expected}")
    return "\n".join(lines)


def grpo_arm(
    args, world, train_model, name, use_tokens, reward_conditioned, logger, checkpoint, accelerator
):
    """Stage 2 from the current weights: G rollouts per task, tokens i.i.d. (RC-GRPO) or fixed
    (GRPO), one group per task across tokens, clipped ratio + β·k3 KL under the rollout's own token
    (RC-GRPO stage 2). π_ref is the stage-1 model: a frozen copy, or (LoRA) the merged stage-1
    weights with the new adapter off. With N processes each rank rolls out its block of tasks with
    its own noise (DDP averages gradients)."""
    model, tokenizer = world.model, world.tokenizer
    reference = None if args.lora_rank else copy.deepcopy(model).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    autocast = common.training_autocast(model.device)
    gen = torch.Generator().manual_seed(args.seed)
    mine = common.local_groups(args.tasks_per_step, accelerator)
    sampler_dev, zero_var, start = 0.0, [], 1
    state_objects = ({"policy": model}, {"optimizer": optimizer}, {"rollouts": gen})
    # TRY NOT TO MODIFY: weights, optimiser, RNGs, metrics so far
    if args.resume and checkpoint.exists():
        done, extra = tracking.load_training_state(checkpoint, *state_objects)
        sampler_dev, zero_var, start = extra["sampler_dev"], extra["zero_var"], done + 1
        logger.restore(extra["records"])
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. draw tasks and, per rollout, a reward token r_j ~ Bernoulli(p) (RC-GRPO) or a fixed one
        #    (GRPO)
        pick = torch.randint(len(world.train), (args.tasks_per_step,), generator=gen)
        tokens = (
            sample_reward_tokens(len(pick) * args.group_size, args.p_high, gen)
            if reward_conditioned
            else [HIGH if use_tokens else None] * len(pick) * args.group_size
        )
        # this rank's groups
        local = slice(mine.start * args.group_size, mine.stop * args.group_size)
        entries = [world.train[i] for i in pick.repeat_interleave(args.group_size).tolist()][local]
        tokens = tokens[local]
        # generate's noise: each rank its own (one process keeps its stream)
        if accelerator.num_processes > 1:
            torch.manual_seed(common.sampling_seed(args.seed, step, accelerator.process_index))
        # 2. G multi-turn rollouts per task, each under its own token; R = R_state·R_action
        #    (RC-GRPO's reward)
        runs = run_rollouts(world, entries, tokens, args.temperature, args)
        rewards = torch.tensor([r["reward"] for r in runs])
        # 3. one group per task across tokens: A_j = (R_j − mean_g R)/(std_g R + ε)
        advantages = common.group_advantages(rewards, args.group_size).tolist()
        # each model step, its A
        rows = [(s, a) for r, a in zip(runs, advantages) for s in r["steps"]]
        prompts, completions = [s["prompt"] for s, _ in rows], [s["ids"] for s, _ in rows]
        token_count = max(1, sum(len(c) for c in completions))
        # 4. one optimiser step, gradients accumulated over token-bounded micro-batches
        model.train()
        optimizer.zero_grad()
        for batch in common.micro_batches(tokenizer, prompts, completions, args.micro_batch_tokens):
            ids, attn, mask = common.pack_completions(
                tokenizer, [prompts[k] for k in batch], [completions[k] for k in batch],
                model.device)
            old_logp = common.place_logprobs(mask, [rows[k][0]["old_logp"] for k in batch])
            batch_adv = torch.tensor([rows[k][1] for k in batch], device=model.device)
            with autocast:
                ref_logp = common.reference_logprobs(
                    model, reference, ids, attn, mask.shape[1], args.temperature)
                logp = common.completion_logprobs(
                    train_model, ids, attn, mask.shape[1], args.temperature)
            sampler_dev = (
                max(sampler_dev, ((logp.detach() - old_logp) * mask).abs().max().item())
                if step == 1
                else sampler_dev
            )
            loss, stats = rc_grpo_loss(
                logp, old_logp, ref_logp, batch_adv, mask, args.clip_eps, args.beta, token_count)
            if not torch.isfinite(loss):
                raise SystemExit(f"error: non-finite loss at step {step} of {name}; lower --lr")
            accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

        # TRY NOT TO MODIFY: the whole step's tokens and rewards for the log (loss stats stay rank
        # 0's)
        runs = gather_object([{"token": r["token"], "reward": r["reward"]} for r in runs])
        rewards = torch.tensor([r["reward"] for r in runs])
        zero_var.append(common.zero_variance_fraction(rewards, args.group_size))
        by_token = {t: [r["reward"] for r in runs if r["token"] == t] for t in REWARD_TOKENS}
        logger.log(
            step,
            reward=rewards.mean().item(),
            zero_var_frac=zero_var[-1],
            loss=loss.item(),
            entropy=-sum(s["old_logp"].sum().item() for s, _ in rows) / token_count,  # −mean log π
            success_high=sum(by_token[HIGH]) / max(1, len(by_token[HIGH])),
            success_low=sum(by_token[LOW]) / max(1, len(by_token[LOW])),
            sampler_logprob_max_dev=sampler_dev,
            **stats,
        )
        if (
            args.save_every
            and (step % args.save_every == 0 or step == args.steps)
            and accelerator.is_main_process
        ):
            tracking.save_training_state(
                checkpoint, step, *state_objects,
                extra={"sampler_dev": sampler_dev, "zero_var": zero_var, "records": logger.records})
    return {
        "zero_variance_fraction": sum(zero_var) / len(zero_var),
        "sampler_logprob_max_dev": sampler_dev}


def validate(args):
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    common.check_args(
        [
            (
                all(a in ("sft+grpo", "sft+rc-grpo", "rctp+grpo", "rctp+rc-grpo") for a in arms)
                and arms,
                "--arms must list sft+grpo, sft+rc-grpo, rctp+grpo or rctp+rc-grpo "
                f"(got {args.arms!r})",
            ),
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (0 < args.p_high < 1, f"--p-high must be in (0, 1) (got {args.p_high})"),
            (
                args.lr > 0 and args.sft_lr > 0 and args.clip_eps > 0 and args.beta >= 0,
                "--lr, --sft-lr, --clip-eps must be > 0"),
            (
                args.temperature > 0,
                "--temperature must be > 0 for training rollouts (evaluation is greedy)"),
            (
                args.steps >= 1 and args.max_steps >= 1 and args.failure_rollouts >= 1,
                "--steps, --max-steps, --failure-rollouts ≥ 1"),
            (
                args.micro_batch_tokens >= 1 and args.gen_batch >= 1,
                "--micro-batch-tokens and --gen-batch must be ≥ 1"),
            (
                not args.lora_rank or len(arms) == 1,
                "--lora-rank trains one arm per run "
                "(stage 1 is merged into the weights before stage 2)",
            ),
        ]
    )
    return arms


def train(args):
    """Base → {SFT, RCTP-FT} (stage 1) → {GRPO, RC-GRPO} (stage 2) for each arm of Table 1; held-out
    accuracy."""
    arms = validate(args)
    start = time.time()
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    world = build_bfcl(args, device) if args.model else build_toy(args, device)
    world.train, world.test = select_entries(world.train, args), select_entries(world.test, args)
    common.check_args(
        [(world.train and world.test, "no train or no test task left after --tasks/--max-tasks")])
    out_dir = Path(args.out_dir)
    config = dataclasses.asdict(args) | {"preset": args.preset}
    # Stage 1 and evaluations run the same on every rank (same seed, same data); stage 2 splits its
    # groups.
    states = {} if args.lora_rank else {"base": copy.deepcopy(world.model.state_dict())}
    rare_test = [e for e in world.test if e.get("rare")]
    summary = {"base_accuracy": evaluate(world, world.test, None, args)}
    shown = ["base model:\n" + format_calls(world, world.test[0], None, args)]
    needed = {a.split("+")[0] for a in arms}
    if "sft" in needed:  # the baseline: expert trajectories only, no token
        expert = [
            s
            for e in world.train
            if e.get("demonstrated", True)
            for s in trajectory_samples(world, e, None, e["ground_truth"])
        ]
        supervised_finetune(
            world, expert, args.sft_epochs, args.sft_lr, args.sft_batch, args.seed,
            args.micro_batch_tokens)
        states["sft"] = None if args.lora_rank else copy.deepcopy(world.model.state_dict())
        summary["sft_accuracy"] = evaluate(world, world.test, None, args)
    if "rctp" in needed:
        if "base" in states:
            world.model.load_state_dict(states["base"])
        samples, n_failures = build_rctp_data(world, world.train, args)
        supervised_finetune(
            world, samples, args.rctp_epochs, args.sft_lr, args.sft_batch, args.seed,
            args.micro_batch_tokens)
        states["rctp"] = None if args.lora_rank else copy.deepcopy(world.model.state_dict())
        high, low = evaluate(world, world.test, HIGH, args), evaluate(world, world.test, LOW, args)
        summary |= {"rctp_accuracy": high, "token_gap": high - low, "rctp_failures": n_failures}
    # stage 1's adapter becomes the weights; stage 2 trains a fresh one, π_ref = adapter off
    if args.lora_rank:
        from peft import get_peft_model

        lora_config = world.model.peft_config["default"]
        world.model = get_peft_model(world.model.merge_and_unload(), lora_config)
        models.check_master_weights(world.model)
    train_model = accelerator.prepare(world.model)  # DDP wrapper (N processes) for the GRPO loss
    curves = {}
    for arm in arms:
        init, algo = arm.split("+")
        if states.get(init) is not None:
            world.model.load_state_dict(states[init])
        use_tokens = init == "rctp" or algo == "rc-grpo"
        common.seed_everything(args.seed)
        logger = tracking.RunLogger(
            out_dir / arm, config | {"arm": arm}, args.steps, arm, quiet=args.quiet,
            main_process=accelerator.is_main_process)
        result = grpo_arm(
            args, world, train_model, arm, use_tokens, algo == "rc-grpo", logger,
            out_dir / arm / "checkpoint.safetensors", accelerator)
        token = HIGH if use_tokens else None
        result["accuracy"] = evaluate(world, world.test, token, args)
        if rare_test:  # the toy: the folders imitation learns poorly, and sampled accuracy
            result["rare_accuracy"] = evaluate(world, rare_test, token, args)
            result["sampled_accuracy"] = evaluate(world, world.test, token, args, 1.0)
        # what the same weights do when asked for a low reward (not used for the result)
        if use_tokens:
            result["accuracy_under_low_token"] = evaluate(world, world.test, LOW, args)
        shown.append(f"after {arm}:\n" + format_calls(world, world.test[0], token, args))
        summary[arm] = logger.finish(
            result,
            [
                ("zero_var.png", ["zero_var_frac"], f"{arm}: zero-variance fraction"),
                ("reward.png", ["reward", "success_high", "success_low"], f"{arm}: reward")],
        )
        curves[arm] = [(r["step"], r["zero_var_frac"]) for r in logger.records]
        if args.model and accelerator.is_main_process:
            world.model.save_pretrained(out_dir / arm / "policy")
            world.tokenizer.save_pretrained(out_dir / arm / "policy")
    summary |= {
        "test_tasks": len(world.test), "wall_seconds": round(time.time() - start, 2),
        "sampler_logprob_max_dev": max(summary[a]["sampler_logprob_max_dev"] for a in arms),
        "peak_rss_mb": max(summary[a]["peak_rss_mb"] for a in arms)}
    if {"sft+grpo", "rctp+rc-grpo"} <= set(arms):  # the row of `make demo`'s table
        summary["claim"] = {"text": "RC-GRPO: zero-var. fraction, SFT+GRPO → RCTP+RC",
                            "before": summary["sft+grpo"]["zero_variance_fraction"],
                            "after": summary["rctp+rc-grpo"]["zero_variance_fraction"]}
    if accelerator.is_main_process:
        tracking.plot_curves(
            curves, out_dir / "zero_variance.png", "zero-variance fraction per GRPO step",
            "fraction")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "rollouts.txt").write_text("\n\n".join(shown) + "\n")
    if not args.quiet:
        print(results_table(summary, arms))
    return summary


def results_table(summary, arms):
    """Table 1 in miniature: held-out accuracy and mean zero-variance fraction per arm."""
    lines = [f"{'arm':<14} {'accuracy':>9} {'zero-var':>9}"]
    lines += [
        f"{a:<14} {summary[a]['accuracy']:>9.3f} {summary[a]['zero_variance_fraction']:>9.3f}"
        for a in arms
    ]
    return "\n".join(lines)


def sweep_row(summaries):
    """One seed of the sweep: held-out accuracy (high token) and zero-variance fraction of the two
    arms the claim compares, RCTP's token gap ε, and the rare-folder accuracy of both."""
    s = summaries[""]
    return {
        "token_gap": s["token_gap"], "acc_sft_grpo": s["sft+grpo"]["accuracy"],
        "acc_rctp_rc": s["rctp+rc-grpo"]["accuracy"],
        "rare_sft_grpo": s["sft+grpo"].get("rare_accuracy", float("nan")),
        "rare_rctp_rc": s["rctp+rc-grpo"].get("rare_accuracy", float("nan")),
        "zv_sft_grpo": s["sft+grpo"]["zero_variance_fraction"],
        "zv_rctp_rc": s["rctp+rc-grpo"]["zero_variance_fraction"]}


def claim_holds(row):
    """The paper's claim on one seed: RCTP+RC-GRPO beats SFT+GRPO in accuracy with fewer
    zero-variance groups, from a stage 1 with a token gap ε ≥ 0.2."""
    return (
        row["acc_rctp_rc"] > row["acc_sft_grpo"]
        and row["zv_rctp_rc"] < row["zv_sft_grpo"]
        and row["token_gap"] >= 0.2
    )


if __name__ == "__main__":
    args = common.parse_args(Args, PRESETS)
    if args.seeds:
        sweep_dir = f"{args.out_dir}-sweep"
        sweep.seed_sweep(train, args, [("", {})], sweep_row, claim_holds, sweep_dir)
    else:
        print(json.dumps(train(args), indent=2))
