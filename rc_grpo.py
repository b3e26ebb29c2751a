"""RC-GRPO: reward-conditioned fine-tuning, then GRPO with sampled reward tokens, for multi-turn tool calling.

Paper: "Reward-Conditioned Group Relative Policy Optimization for multi-turn tool calling", Zhong et al.
2026, arXiv 2602.03025 (no official code). Digest: REFERENCES.md §3. Environment: the real BFCL v4
multi-turn data and backends from the `bfcl-eval` package, executed without eval/exec.

After SFT on expert demonstrations a policy is peaked: a task's G rollouts all succeed or all fail, the
group's reward std is 0, A = 0, and GRPO stops learning ("paradox of perfection", §3.1). RC-GRPO first
fine-tunes on expert *and* failed trajectories, each tagged in the first user message with
`[Reward Goal: <|high_reward|>]` or `<|low_reward|>` (RCTP-FT, §3.2). Then each GRPO rollout draws its own
token (P(high) = p): the low-token rollouts behave differently, so groups keep their variance (§3.3,
Prop. 4.3: E[σ_g²] ≥ ((G−1)/G)·p(1−p)·ε²). Inference uses the high token.

Equation map (REFERENCES.md section → function):
    §3.2  RCTP data: expert (high) + failures (low), 1:1, token appended to the first user message
                                                                  → build_rctp_data, add_reward_token
    §3.2  max-likelihood of assistant tokens only                 → supervised_finetune
    §3.3  r_j ~ Bernoulli(p) i.i.d. per rollout                    → sample_reward_tokens
    §3.3  one group per task across tokens; clipped ratio, k3 KL   → common.group_advantages,
                                                                     common.clipped_policy_loss, common.kl_penalty
    §3.4  R = R_state · R_action                                   → trajectory_reward
    BFCL  the official checker's semantics (per-turn state + results) → bfcl_check
    §3.7  calls parsed with ast, literal arguments only            → parse_calls, BFCLEnv

Deviations (numbered, on purpose):
    1. Model output is never eval'd (the official harness does, §3.7): `parse_calls` accepts only
       `[f(literal, k=literal), ...]` and `BFCLEnv` dispatches to public methods of fresh instances.
    2. Train/test split by id (`id % 10 == 9` → test, 20 per category = 80); the paper's per-category counts
       (18/23/17/22) come from a split it does not publish.
    3. Each assistant step is trained as its own (history → step) sample (the same tokens a whole-dialogue
       pass with an assistant mask would score), so rollouts and training batches share one padding path.

Toy (default, CPU, four arms):   python rc_grpo.py
Full scale (one GPU, BFCL v4):   python rc_grpo.py --preset bfcl
"""
import ast
import copy
import dataclasses
import importlib
import inspect
import json
import random
from pathlib import Path

import torch

import common

# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    model: str = dataclasses.field(default="", metadata={"help": "HF model id or path ('' = tiny toy LM)"})
    arms: str = dataclasses.field(default="sft+grpo,sft+rc-grpo,rctp+grpo,rctp+rc-grpo", metadata={
        "help": "comma-separated arms: {sft|rctp}+{grpo|rc-grpo} (Table 1)"})
    steps: int = dataclasses.field(default=40, metadata={"help": "GRPO steps per arm"})
    tasks_per_step: int = dataclasses.field(default=8, metadata={"help": "tasks per GRPO batch"})
    group_size: int = dataclasses.field(default=5, metadata={"help": "G rollouts per task (paper: 5)"})
    p_high: float = dataclasses.field(default=0.5, metadata={"help": "p = P(<|high_reward|>) per rollout (paper: 0.5)"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "GRPO learning rate (paper: 1e-6)"})
    beta: float = dataclasses.field(default=0.1, metadata={"help": "β of the k3 KL to the reference (paper: 0.1)"})
    clip_eps: float = dataclasses.field(default=0.2, metadata={"help": "ratio clip ε (paper: 0.2)"})
    sft_lr: float = dataclasses.field(default=3e-3, metadata={"help": "stage-1 learning rate (paper: 1e-5)"})
    sft_epochs: int = dataclasses.field(default=2, metadata={"help": "SFT baseline epochs (paper: 2)"})
    rctp_epochs: int = dataclasses.field(default=5, metadata={"help": "RCTP-FT epochs (paper: 5)"})
    sft_batch: int = dataclasses.field(default=16, metadata={"help": "stage-1 batch (paper: 16)"})
    failure_rollouts: int = dataclasses.field(default=4, metadata={"help": "base-model rollouts per train task to find failures"})
    max_steps: int = dataclasses.field(default=20, metadata={"help": "model steps per entry (BFCL: 20)"})
    max_new_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens per model step"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "rollout temperature; evaluation is greedy"})
    toy_tasks: int = dataclasses.field(default=240, metadata={"help": "toy: generated tasks (80% train, 20% test)"})
    lora_rank: int = dataclasses.field(default=0, metadata={"help": "LoRA rank via peft (0 = full fine-tune)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "random seed"})
    out_dir: str = dataclasses.field(default="runs/rc_grpo", metadata={"help": "output folder"})
    device: str = dataclasses.field(default="auto", metadata={"help": "cuda, mps, cpu or auto"})
    quiet: bool = dataclasses.field(default=False, metadata={"help": "no per-step lines or progress bar"})


# Paper recipe (REFERENCES.md §3.2–§3.3): G = 5, p = 0.5, lr 1e-6, β 0.1, clip 0.2; RCTP-FT lr 1e-5, batch 16,
# 5 epochs; SFT 2 epochs. Qwen2.5-7B-Instruct; LoRA so that one GPU holds policy and reference.
PRESETS = {"bfcl": dict(model="Qwen/Qwen2.5-7B-Instruct", arms="rctp+rc-grpo", steps=100, tasks_per_step=16,
                        lr=1e-6, sft_lr=1e-5, failure_rollouts=2, max_new_tokens=256, lora_rank=64)}

HIGH, LOW = "<|high_reward|>", "<|low_reward|>"
REWARD_TOKENS = (HIGH, LOW)

# ----------------------------------------------------------------------------- BFCL v4: data, parsing, execution

CATEGORIES = ["base", "long_context", "miss_func", "miss_param"]
MAX_CALL_CHARS = 16000  # longer model outputs are rejected before parsing (huge literals, bracket bombs)


def bfcl_root():
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent


def load_bfcl_entries(categories=CATEGORIES):
    """The BFCL v4 multi-turn entries with `ground_truth` (per-turn lists of call strings) added."""
    entries = []
    for category in categories:
        data = bfcl_root() / "data" / f"BFCL_v4_multi_turn_{category}.json"
        answers = bfcl_root() / "data" / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json"
        truth = {row["id"]: row["ground_truth"] for row in map(json.loads, answers.read_text().splitlines())}
        for line in data.read_text().splitlines():
            entry = json.loads(line)
            entries.append(entry | {"category": category, "ground_truth": truth[entry["id"]]})
    return entries


def split_entries(entries):
    """DEVIATION 2: numeric id % 10 == 9 → test (80 of 800), the rest train (720)."""
    test = [e for e in entries if int(e["id"].rsplit("_", 1)[1]) % 10 == 9]
    return [e for e in entries if e not in test], test


def function_docs(entry):
    """(docs shown from the start, {turn: docs revealed on that turn}) from bfcl_eval's function-doc files."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs = []
    for cls in entry["involved_classes"]:
        path = bfcl_root() / "data" / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]
        docs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    missed = {int(t): names for t, names in entry.get("missed_function", {}).items()}
    hidden = {name for names in missed.values() for name in names}
    shown = [d for d in docs if d["name"] not in hidden and d["name"] not in entry.get("excluded_function", [])]
    return shown, {t: [d for d in docs if d["name"] in names] for t, names in missed.items()}


def _literal(node):
    """A literal argument value (str, number, bool, None, and lists/tuples/dicts/sets of those)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"argument {ast.unparse(node)[:60]!r} is not a literal") from None


def parse_calls(text):
    """`[f(a=1), g('x', b=[2])]` → [(name, args, kwargs), ...], parsed with `ast`, literal arguments only.

    A bare single call `f(a=1)` is accepted too. Names must be plain identifiers without a leading
    underscore; attribute access, nested calls, names, comprehensions, lambdas, arithmetic and starred
    arguments are rejected with ValueError (its message becomes the observation). Nothing is evaluated.
    """
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("python").strip()
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"output longer than {MAX_CALL_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        raise ValueError(f"not a Python list of calls ({type(err).__name__})") from None
    calls = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    parsed = []
    for call in calls:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            raise ValueError(f"{ast.unparse(call)[:60]!r} is not a call of a plain function name")
        name = call.func.id
        if name.startswith("_"):
            raise ValueError(f"private or dunder function {name!r} is not allowed")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise ValueError(f"*args/**kwargs in {name}() are not allowed")
        parsed.append((name, tuple(_literal(a) for a in call.args), {k.arg: _literal(k.value) for k in call.keywords}))
    return parsed


def format_call(name, args, kwargs):
    """The inverse of parse_calls for one call, in the ground truth's style: f('x', k=1)."""
    return f"{name}({', '.join([repr(a) for a in args] + [f'{k}={v!r}' for k, v in kwargs.items()])})"


class BFCLEnv:
    """Fresh backend instances for one entry; calls dispatch only to allow-listed public methods.

    Every instance is built from a deep copy of the entry's `initial_config`, so parallel rollouts of one
    task never share state (the official harness caches instances in module globals, §3.7).
    """

    def __init__(self, entry):
        from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES

        self.instances, self.methods = {}, {}
        hidden = {n for names in entry.get("missed_function", {}).values() for n in names}
        for cls in entry["involved_classes"]:
            instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[cls]), cls)()
            if cls not in STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(entry["initial_config"].get(cls, {})),
                                        long_context=entry["category"] == "long_context")
            self.instances[cls] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method
        self.hidden = {n: self.methods.pop(n) for n in hidden if n in self.methods}

    def reveal(self, names):
        """miss_func: the held-out functions become callable on the turn the data says."""
        for name in names:
            if name in self.hidden:
                self.methods[name] = self.hidden.pop(name)

    def execute(self, calls):
        """Run parsed calls in order; each result (or error) as a string, as BFCL shows it to the model."""
        results = []
        for name, args, kwargs in calls:
            if name not in self.methods:
                results.append(f"Error during execution: function {name!r} is not available")
                continue
            try:
                out = self.methods[name](*args, **kwargs)
                results.append(out if isinstance(out, str) else json.dumps(out) if isinstance(out, dict) else str(out))
            except Exception as err:  # a backend error is an observation for the model, never a crash
                results.append(f"Error during execution: {err}")
        return results

    def state(self):
        """Public attributes of every instance: what the official state check compares."""
        return {cls: {k: v for k, v in vars(inst).items() if not k.startswith("_")} for cls, inst in self.instances.items()}

    def bound_arguments(self, name, args, kwargs):
        """{parameter: value} for a call, so positional and keyword spellings compare equal."""
        method = self.methods.get(name) or self.hidden.get(name)
        try:
            return dict(inspect.signature(method).bind(*args, **kwargs).arguments)
        except (TypeError, ValueError, AttributeError):
            return {**{f"#{i}": a for i, a in enumerate(args)}, **kwargs}


def replay(entry, calls_per_turn, on_turn=None):
    """Execute a trajectory's calls turn by turn in a fresh env; `on_turn(turn, env, results)` after each."""
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
    """R = R_state · R_action ∈ {0, 1}  (§3.4).

    R_state: the final state equals the ground truth's final state. R_action: every ground-truth call
    appears among the agent's calls with the same name and the same values for the ground truth's
    arguments (extra arguments allowed, order ignored, each agent call used once).
    """
    env, truth_env = replay(entry, calls_per_turn), replay(entry, entry["ground_truth"])
    if env.state() != truth_env.state():
        return 0.0
    made = []
    for calls in calls_per_turn:
        for call in calls:
            try:
                made += [(n, env.bound_arguments(n, a, k)) for n, a, k in parse_calls(call)]
            except ValueError:
                continue
    for calls in entry["ground_truth"]:
        for name, args, kwargs in (c for call in calls for c in parse_calls(call)):
            want = truth_env.bound_arguments(name, args, kwargs)
            match = next((m for m in made if m[0] == name and all(k in m[1] and m[1][k] == v for k, v in want.items())), None)
            if match is None:
                return 0.0
            made.remove(match)
    return 1.0


def bfcl_check(entry, calls_per_turn):
    """The official multi-turn checker's semantics, without eval: after every turn whose ground truth is
    non-empty, the model must have made a call, the states must match, and the turn's ground-truth results
    must be contained (as a multiset) in all of the model's results so far. Returns 1.0 or 0.0."""
    model_results, truth_turns = [], {}
    model_envs = {}

    def on_model_turn(turn, env, results):
        model_results.append(list(results))
        model_envs[turn] = env.state()

    def on_truth_turn(turn, env, results):
        truth_turns[turn] = (list(results), env.state())

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
