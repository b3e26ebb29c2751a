"""The BFCL v4 multi-turn harness: the real data and backends of `bfcl-eval`, without eval/exec.

load_bfcl_entries, split_entries, function_docs   the data, the id split, the docs per turn
parse_calls, decode_calls                         model output → calls, by `ast`, literals only
BFCLEnv, run_timed, run_forked                    fresh backend instances, an allow-list of
                                                  public methods, a time limit per call
trajectory_reward, bfcl_check                     R = R_state·R_action; the official checker
World, run_rollouts, trajectory_samples           BFCL's turn-by-turn protocol, batched
"""

import ast
import copy
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import re
import select
import signal
import threading
import time
from pathlib import Path

import common
from utils import distributed, models

CATEGORIES = ["base", "long_context", "miss_func", "miss_param"]
SHORT_SYSTEM_PROMPT = (  # the laptop preset's shortened paraphrase of bfcl-eval's system prompt
    "You are an expert in composing functions. Based on the question, make one or "
    "more function calls to achieve the purpose. If none of the functions can be "
    "used, or the question lacks required parameters, point it out. To call "
    "functions, reply ONLY with a Python list in the format "
    "[func_name1(param=value, ...), func_name2(param=value)]. Keep calling functions "
    "until the user's request is fulfilled; when you have no more calls to make, "
    "reply in plain text and the turn ends.\nHere is a list of functions in JSON "
    "format that you can invoke.\n{functions}"
)


MAX_CALL_CHARS = (
    16000  # longer model outputs are rejected before parsing (huge literals, bracket bombs)
)


# The SmolLM2 preset's entries (`rc_grpo.py --preset smollm2-bfcl`): multi_turn_base entries on one
# backend whose first user turn takes one or two calls: the first 12 of the training split and the
# 7 of the test split (ids ending in 9).
LAPTOP_TASKS = ",".join(
    f"multi_turn_base_{n}"
    for n in (1, 3, 6, 10, 12, 25, 26, 37, 50, 66, 73, 83, 9, 29, 39, 79, 99, 159, 179)
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
    by_name = {}
    for doc in docs:
        by_name.setdefault(doc["name"], doc)
    # a turn's held-out docs in the data's order, as bfcl-eval's loader lists them
    return shown, {t: [by_name[n] for n in names if n in by_name] for t, names in missed.items()}


def _literal(node):
    """A literal argument value (str, number, bool, None, and lists/tuples/dicts/sets of those)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"an argument ({type(node).__name__}) is not a literal") from None


def parse_calls(text):
    """`[f(a=1), g('x', b=[2])]` → [(name, positional, kwargs), ...], parsed with `ast`, literal
    arguments only.

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
    """One `ast.Call` of a plain, public name with literal arguments → (name, positional,
    kwargs)."""
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
        name,
        tuple(_literal(a) for a in call.args),
        {k.arg: _literal(k.value) for k in call.keywords},
    )


def format_call(name, positional, kwargs):
    """The inverse of parse_calls for one call, in the ground truth's style: f('x', k=1)."""
    written = [repr(a) for a in positional] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(written)})"


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
        for cls in entry["involved_classes"]:
            instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[cls]), cls)()
            if cls not in STATELESS_CLASSES:
                instance._load_scenario(
                    copy.deepcopy(entry["initial_config"].get(cls, {})),
                    long_context=entry["category"] == "long_context",
                )
            self.instances[cls] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method
                    if cls in STATELESS_CLASSES:
                        self.stateless.add(name)

    def execute(self, calls):
        """Run parsed calls in order; each result (or error) as a string, as BFCL shows it to the
        model.

        A call gets CALL_SECONDS: stateless backends (MathAPI) run in a forked child that is killed
        at the limit (`power(9, 999999999)` is all literals and C-level work no in-process timer can
        stop); stateful ones run here under a SIGALRM timer. Results come back whole (the checker
        compares them so; `observation` cuts what the model reads). miss_func's held-out functions
        are callable throughout, as in the official harness: only their descriptions wait for their
        turn. Over the time limit → an error observation; the rollout goes on."""
        results = []
        for name, positional, kwargs in calls:
            if name not in self.methods:
                results.append(f"Error during execution: function {name!r} is not available")
            elif name in self.stateless:
                results.append(run_forked(self.methods[name], positional, kwargs))
            else:
                results.append(run_timed(self.methods[name], positional, kwargs))
        return results

    def state(self):
        """Public attributes of every instance: what the official state check compares."""
        return {
            cls: {k: v for k, v in vars(inst).items() if not k.startswith("_")}
            for cls, inst in self.instances.items()
        }

    def bound_arguments(self, name, positional, kwargs):
        """{parameter: value} for a call, so positional and keyword spellings compare equal."""
        method = self.methods.get(name)
        try:
            return dict(inspect.signature(method).bind(*positional, **kwargs).arguments)
        except (TypeError, ValueError, AttributeError):
            return {**{f"#{i}": a for i, a in enumerate(positional)}, **kwargs}


CALL_SECONDS = 2.0  # per backend call


MAX_RESULT_CHARS = 4000  # per call result, in what the model reads (observation)


def format_result(out):
    """A backend's return value as text, as the official harness writes it: strings as they are,
    dicts as JSON or, when JSON cannot encode them (an mpf, a Decimal), with str(); the rest
    str()."""
    if isinstance(out, dict):
        try:
            return json.dumps(out)
        except (TypeError, ValueError):
            return str(out)
    return out if isinstance(out, str) else str(out)


def run_timed(method, positional, kwargs):
    """Call a stateful backend method here, interrupted by SIGALRM after CALL_SECONDS (main thread
    only)."""
    timed = threading.current_thread() is threading.main_thread()

    def expire(*_):
        raise TimeoutError(f"call took longer than {CALL_SECONDS:g} s")

    if timed:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
    try:
        return format_result(method(*positional, **kwargs))
    except Exception as err:  # a backend error is an observation for the model, never a crash
        return f"Error during execution: {format_result(str(err))}"
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def run_forked(method, positional, kwargs):
    """Call a stateless backend method in a forked child, killed after CALL_SECONDS; its text comes
    back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write, exit without running the parent's cleanup
        os.close(read_end)
        try:
            text = format_result(method(*positional, **kwargs))
        except BaseException as err:
            text = f"Error during execution: {format_result(str(err))}"
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(write_end, data) :]
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
    for turn, calls in enumerate(calls_per_turn):
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
        for name, positional, kwargs in (c for call in calls for c in parse_calls(call)):
            want = truth_env.bound_arguments(name, positional, kwargs)
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


def harness_system_prompt(entry_id, docs):
    """The system prompt bfcl-eval's harness sends a prompting model on this entry: what its
    `formulate_system_prompt` builds for DEFAULT_SYSTEM_PROMPT_FORMAT (python calls, no tool-call
    tag, JSON docs, plain text, classic style) from bfcl-eval's own templates, with the docs as
    json.dumps(docs, indent=4) after the language hint its loader adds to each description. (That
    function's module imports the Java/JS call parsers and API retry clients, bfcl-eval
    dependencies this project does not install; tests/test_rc_grpo.py checks the two agree on
    every entry.)"""
    from bfcl_eval.constants import default_prompts as bfcl_prompts
    from bfcl_eval.utils import add_language_specific_hint_to_function_doc

    (hinted,) = add_language_specific_hint_to_function_doc(
        [{"id": entry_id, "function": copy.deepcopy(docs)}]
    )
    style = bfcl_prompts.PROMPT_STYLE_TEMPLATES["classic"]
    call_format = style["tool_call_no_tag"].format(
        output_format=bfcl_prompts.OUTPUT_FORMAT_MAPPING["python"],
        param_types=bfcl_prompts.PARAM_TYPE_MAPPING["python"],
    )
    tools = style["available_tools"].format(
        format="json", functions=json.dumps(hinted["function"], indent=4)
    )
    return bfcl_prompts.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=call_format,
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=tools,
    )


def harness_reveal(docs):
    """The user message bfcl-eval's harness sends a prompting model on a miss_func turn: the
    held-out docs as Python writes the list, then its "I have updated some more functions…"."""
    from bfcl_eval.constants.default_prompts import (
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    )

    return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=docs)


class ChatFormat:
    """How a dialogue is written at full scale: the tokenizer's chat template, a system prompt with
    the function docs and miss_func's later docs (system_prompt="bfcl": what bfcl-eval's harness
    sends a prompting model, `harness_system_prompt` and `harness_reveal`; "short": the laptop
    preset's paraphrase, compact JSON docs), calls as the Python list BFCL asks for, results cut
    at 2 000 characters. (The toy's words are `bfcl_toy.ToyFormat`.)"""

    def __init__(self, tokenizer, system_prompt="bfcl"):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def system_messages(self, entry):
        docs = function_docs(entry)[0]
        if self.system_prompt == "bfcl":
            return [{"role": "system", "content": harness_system_prompt(entry["id"], docs)}]
        return [
            {
                "role": "system",
                "content": SHORT_SYSTEM_PROMPT.replace("{functions}", json.dumps(docs)),
            }
        ]

    def reveal(self, docs):
        """The user message that brings miss_func's held-out docs on their turn."""
        if self.system_prompt == "bfcl":
            return harness_reveal(docs)
        from bfcl_eval.constants import default_prompts

        reveal = default_prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        return json.dumps(docs) + "\n" + reveal

    def render(self, messages):
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def call_text(self, call):
        return "[" + call + "]"

    def observation(self, text):
        return text[:2000]


@dataclasses.dataclass
class World:
    """The environment side of a run: the task split, the model, how a dialogue is written as text
    (`text_format`: ChatFormat at full scale, bfcl_toy.ToyFormat on the toy) and the rollout's caps
    (`limits`, read off the run's flags once)."""

    train: list
    test: list
    tokenizer: object
    model: object
    text_format: object
    end_text: str  # what an expert writes to end a turn
    limits: "Limits"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a rollout reads off the flags of the same names: tokens per model step, rows and padded
    tokens per `generate` call, model steps per user turn, prompt tokens before a dialogue is
    abandoned, the forwards' precision."""

    max_new_tokens: int
    gen_batch: int
    gen_tokens: int
    max_steps: int
    max_prompt_tokens: int
    mixed_precision: str

    @classmethod
    def from_args(cls, args):
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


def build_bfcl(args, device):
    """An HF instruct model (LoRA when --lora-rank) on the real BFCL v4 split. The reward tokens
    stay plain text (a few sub-word tokens each): new embedding rows would not be trained by LoRA on
    the linear layers."""
    tokenizer, model = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing
    )
    train, test = split_entries(load_bfcl_entries())
    return World(
        train,
        test,
        tokenizer,
        model.to(device),
        text_format=ChatFormat(tokenizer, args.system_prompt),
        end_text="Done.",
        limits=Limits.from_args(args),
    )


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


def system_messages(world, entry):
    """The messages before the first user turn (BFCL's system prompt and docs at full scale)."""
    return world.text_format.system_messages(entry)


def render(world, messages):
    """The dialogue as the model's prompt."""
    return world.text_format.render(messages)


def call_text(world, call):
    """One ground-truth call as the model writes it."""
    return world.text_format.call_text(call)


def observation(world, results):
    """Tool results as the model reads them: each cut at MAX_RESULT_CHARS, the whole cut by the
    text format (the checker compares them whole)."""
    text = "\n".join(r[:MAX_RESULT_CHARS] for r in results)
    return world.text_format.observation(text)


def user_messages(world, entry, turn, goal):
    """The messages that open user turn `turn`; miss_func's held-out docs arrive on the turn the
    data says."""
    revealed = {int(t): names for t, names in entry.get("missed_function", {}).items()}
    if turn in revealed:
        _, later = function_docs(entry)
        return [{"role": "user", "content": world.text_format.reveal(later[turn])}]
    messages = [dict(m) for m in entry["question"][turn]]
    if turn == 0 and messages and goal is not None:
        messages[0]["content"] = f"{messages[0]['content']} {goal}"  # RC-GRPO's reward goal
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


def run_rollouts(world, entries, goals, temperature, seeds=None):
    """Play each entry with BFCL's protocol, its first user message ending in its goal text (None =
    none): per user turn, generate → decode → execute → append the results, until the output
    decodes to no call (the turn ends); more than `limits.max_steps` steps in one turn abandons
    the entry (BFCL: 20); `limits` are the world's. With `seeds` (one per entry), each model step
    of a dialogue draws from its own seed, so a dialogue samples the same whatever it is batched
    with (or on which rank).

    All rollouts advance together (one batched `generate` per step, `limits.gen_batch` rows at a
    time); a dialogue's next step computes only its tokens after what its last step computed (the
    keys and values kept in its "computed" dict while it lasts). Returns, per rollout, its steps
    (prompt, completion ids, sampling log-probs), `calls_per_turn`, and R = trajectory_reward.
    """
    runs, limits = [], world.limits
    for k, (entry, goal) in enumerate(zip(entries, goals)):
        env = BFCLEnv(entry)
        runs.append(
            {
                "seed": seeds[k] if seeds else None,
                "entry": entry,
                "goal": goal,
                "env": env,
                "turn": 0,
                "turn_steps": 0,
                "steps": [],
                "done": False,
                "calls_per_turn": [[] for _ in entry["question"]],
                "messages": system_messages(world, entry) + user_messages(world, entry, 0, goal),
                "computed": {},
            }
        )
    while active := [r for r in runs if not r["done"]]:
        for run in runs:  # an ended dialogue's keys and values are freed
            if run["done"]:
                run["computed"].clear()
        prompts = [render(world, r["messages"]) for r in active]
        # a dialogue past --max-prompt-tokens is abandoned, as past the step cap: the prefill of a
        # longer one may not fit, and its calls so far are what gets scored
        encoded = world.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        lengths = [len(ids) for ids in encoded]
        for run, length in zip(active, lengths):
            run["done"] = run["abandoned"] = length > limits.max_prompt_tokens
        keep = [k for k, run in enumerate(active) if not run["done"]]
        active, prompts = [active[k] for k in keep], [prompts[k] for k in keep]
        if not active:
            break
        row_seeds = None
        if seeds:  # the dialogue's seed and its step
            row_seeds = [distributed.sampling_seed(r["seed"], len(r["steps"]), 0) for r in active]
        outputs = common.sample_completions(
            world.model,
            world.tokenizer,
            prompts,
            limits.max_new_tokens,
            temperature=temperature,
            batch_rows=limits.gen_batch,
            token_budget=limits.gen_tokens,
            precision=limits.mixed_precision,
            row_seeds=row_seeds,
            dialogues=[r["computed"] for r in active],
        )
        for run, prompt, (text, ids, logp) in zip(active, prompts, outputs):
            run["steps"].append({"prompt": prompt, "ids": ids, "sampler_logp": logp})
            run["messages"].append({"role": "assistant", "content": text})
            calls = decode_calls(text)
            if calls:
                results = run["env"].execute(calls)
                run["calls_per_turn"][run["turn"]] += [format_call(*c) for c in calls]
                run["messages"].append({"role": "tool", "content": observation(world, results)})
                run["turn_steps"] += 1
                run["done"] = run["turn_steps"] > limits.max_steps  # BFCL's force-quit
                continue
            run["turn"], run["turn_steps"] = run["turn"] + 1, 0
            if run["turn"] < len(run["entry"]["question"]):
                run["messages"] += user_messages(world, run["entry"], run["turn"], run["goal"])
            else:
                run["done"] = True
    for run in runs:
        del run["computed"]
        run["reward"] = trajectory_reward(run["entry"], run["calls_per_turn"])
    return runs


def format_rollout(run):
    """What the policy called in one rollout of `run_rollouts`, turn by turn (under its reward goal
    text), beside the expected calls: the before/after view of rollouts.txt."""
    entry = run["entry"]
    lines = [f"{entry['id']} ({run['goal'] or 'no reward goal'}): reward {run['reward']:.0f}"]
    for turn, (calls, expected) in enumerate(zip(run["calls_per_turn"], entry["ground_truth"])):
        asked = entry["question"][turn][0]["content"] if entry["question"][turn] else ""
        lines.append(f"  turn {turn}: user {asked[:100]!r}")
        lines.append(f"    called   {calls or '(no call)'}")
        lines.append(f"    expected {expected}")
    return "\n".join(lines)


def trajectory_samples(world, entry, goal, steps_per_turn):
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
        messages += user_messages(world, entry, turn, goal)
        calls = steps_per_turn[turn] if turn < len(steps_per_turn) else []
        for text in [call_text(world, c) for c in calls] + [world.end_text]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append({"prompt": render(world, messages), "ids": ids})
            messages.append({"role": "assistant", "content": text})
            if text != world.end_text:
                results = env.execute(parse_calls(text))
                messages.append({"role": "tool", "content": observation(world, results)})
    return samples
