"""AgentFlow at full scale: the frozen LLM modules and the toolset.

The executor, verifier and generator are the base model with the planner's LoRA adapter off; the
tools are the isolated Python tool, TF-IDF retrieval over a local corpus and the base model as a
generalist; QA data and answer matching.
"""

import dataclasses
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import common
from envs import agent_toy, sandbox
from utils import cli, models


def make_retriever(corpus_path, top_k=3, max_chars=600):
    """TF-IDF search over a local JSONL corpus of {"text"} (scikit-learn); no web access."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    docs = [row["text"] for row in cli.read_jsonl(corpus_path, "--corpus", ["text"])]
    try:
        vectorizer = TfidfVectorizer().fit(docs)
    except ValueError as err:  # e.g. only stop words: an empty vocabulary
        raise SystemExit(f"error: --corpus {corpus_path}: {err}") from None
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


MAX_CARELESS = 8  # the warm-start demonstrator's most `generate` replies to one query
FULL_TOOLS = {
    "python": (
        "Runs Python code and returns what it prints.",
        "a complete Python program that prints the result",
    ),
    "retrieve": ("Searches a local document collection.", "a short keyword search query"),
    "generate": ("Asks a general language model.", "a self-contained question or instruction"),
}


def load_qa_jsonl(path, flag="--data"):
    """[{question, answer}] from a JSONL file, with one-line errors for a missing, binary or empty
    file and for null, NaN or empty fields (never a gold answer "None")."""
    return cli.read_jsonl(path, flag, ["question", "answer"])


def answers_match(prediction, answer):
    """A numeric gold answer equals the prediction's last number; a text one appears in it as
    whole words, case and spacing aside (a small model's "X lives in Y." counts for Y)."""
    if prediction is None:
        return False
    pred = " ".join(str(prediction).lower().split())
    gold = " ".join(str(answer).strip().strip(".").lower().split())
    if not gold:  # an empty gold answer would match any prediction
        return False
    try:
        value = float(gold.replace(",", ""))
    except ValueError:
        return re.search(rf"(?<!\w){re.escape(gold)}(?!\w)", pred) is not None
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", pred)
    return bool(numbers) and abs(float(numbers[-1].replace(",", "")) - value) < 1e-6


@dataclasses.dataclass
class ToolSystem:
    """Full scale: the planner is an HF model with LoRA; the query analyser, executor, verifier and
    generator are the same model with the adapter off (the paper's frozen modules), sampled at
    `frozen_temperature`: the training temperature in training, 0 (greedy) at evaluation, as the
    original code does. Tools: Python (sandboxed), retrieval over a local corpus, and the base
    generator, always greedy (the paper's App. C.1)."""

    train: list
    test: list
    tokenizer: object
    planner: object
    retrieve: object
    tool_timeout: float
    generation: dict  # how the planner and the frozen modules sample (`generation_settings`)
    hidden_files: tuple
    unsafe_python_tool: bool = False  # the user's opt-in to run model code unisolated
    planner_temperature: float = 0.0  # greedy as built; `sampling` gives the training copy
    frozen_temperature: float = 0.0

    def sampling(self, temperature):
        """This system with its planner and frozen modules sampled at `temperature` (training
        rollouts)."""
        return dataclasses.replace(
            self, planner_temperature=temperature, frozen_temperature=temperature
        )

    def plan(self, prompts):
        """The planner's turn for each prompt (adapter on) → [(text, completion ids, sampler
        log-probs)]."""
        return common.sample_completions(
            self.planner,
            self.tokenizer,
            prompts,
            temperature=self.planner_temperature,
            **self.generation,
        )

    def chat(self, text):
        """One user turn in the chat template. Its text (questions, tool output, model-written
        sub-goals and commands) cannot open or close a turn: special tokens are escaped."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": escape_special_tokens(text, self.tokenizer)}],
            tokenize=False,
            add_generation_prompt=True,
        )

    def run_python(self, program):
        return sandbox.python_tool(
            program,
            self.tool_timeout,
            hidden_files=self.hidden_files,
            unsafe=self.unsafe_python_tool,
        )

    def frozen(self, prompts, module, temperature=None):
        """The frozen modules: base weights (adapter off), sampled at `frozen_temperature` unless
        `temperature` is given, each `module` at most its MODULE_TOKENS (and the planner's cap)."""
        if temperature is None:
            temperature = self.frozen_temperature
        cap = min(MODULE_TOKENS[module], self.generation["max_new_tokens"])
        with self.planner.disable_adapter():
            out = common.sample_completions(
                self.planner,
                self.tokenizer,
                [self.chat(p) for p in prompts],
                temperature=temperature,
                **(self.generation | {"max_new_tokens": cap}),
            )
        return [text for text, _, _ in out]

    def analyse(self, queries):
        """The query analysis the planner reads before every step (the original planner's first
        call): what the question asks and which skills and tools would help. Written by the frozen
        model, so it is never a trained turn."""
        return self.frozen(
            [
                f"Question: {q['question']}\nTools: {', '.join(FULL_TOOLS)}\n"
                "Analyse the question in two sentences: what it asks, and which skills and "
                "tools would help."
                for q in queries
            ],
            "analysis",
        )

    def demonstrations(self, queries, rng, careless, memory_type, max_turns):
        """The warm start's (prompt, completion) pairs, first turns only: `Sub-Goal: <the
        question>` and a tool. The demonstrator's whole reply distribution, the same for every
        query: each specialised tool once, and the generalist `generate` (a careless habit RL must
        unlearn) as many times (0 to MAX_CARELESS) as brings its share nearest `careless`.
        Supervised learning fits that mix on every query, so no seed decides which queries the
        planner learns to answer with which tool. `rng` is unused (the toy's demonstrator draws).
        A 135M model never writes the format on its own, examples in the prompt included."""
        specialised = [tool for tool in FULL_TOOLS if tool != "generate"]
        n_careless = min(
            range(MAX_CARELESS + 1), key=lambda n: abs(n / (n + len(specialised)) - careless)
        )
        mix = ["generate"] * n_careless + specialised
        return [
            (
                self.planner_prompt(query, memory_type(), analysis, 1, max_turns),
                f"Sub-Goal: {query['question']}\nTool: {tool}{self.tokenizer.eos_token}",
            )
            for query, analysis in zip(queries, self.analyse(queries))
            for tool in mix
        ]

    def planner_prompt(self, query, memory, analysis, step, max_turns):
        tools = "\n".join(
            f"- {name}: {desc} Input: {fmt}." for name, (desc, fmt) in FULL_TOOLS.items()
        )
        return self.chat(
            f"Question: {query['question']}\nQuery analysis: {analysis.strip()}\nTools:\n{tools}\n"
            f"Memory:\n{render_memory(memory)}\nThis is step {step} of at most {max_turns}. Plan "
            "the next step. Reply exactly:\nSub-Goal: <what to find out next>\nTool: <tool name>"
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
        far, then the tool runs. (The official executor reads the query, the sub-goal, the tool's
        name and metadata, and a "Context" the planner wrote; the paper's Eq. 2 conditions it on the
        planner's action and the toolset only. DEVIATION 4 in agentflow.py.)"""
        commands = self.frozen(
            [
                f"Question: {q['question']}\nContext (earlier steps):\n{render_memory(m)}\n"
                f"Sub-Goal: {goal}\nWrite the input for the tool '{tool}': {FULL_TOOLS[tool][1]}. "
                "Reply with the input only."
                for q, tool, goal, m in calls
            ],
            "executor",
        )
        asked = [command for (_, tool, _, _), command in zip(calls, commands) if tool == "generate"]
        # the generate tool: one batch, greedy ("the LLM engines within the tools are set to a
        # temperature of 0.0", App. C.1)
        generated = iter(self.frozen(asked, "generate", temperature=0.0) if asked else [])
        programs = [
            python_program(command)
            for (_, tool, _, _), command in zip(calls, commands)
            if tool == "python"
        ]
        with ThreadPoolExecutor(max_workers=PYTHON_WORKERS) as pool:  # the turn's programs at once
            ran = iter(list(pool.map(self.run_python, programs)))
        results = []
        for (_, tool, _, _), command in zip(calls, commands):
            if tool == "python":
                results.append((command, *next(ran)))
            elif tool == "retrieve":
                results.append((command, self.retrieve(command), True))
            else:
                results.append((command, next(generated), True))
        return results

    def verify(self, items):
        verdicts = self.frozen(
            [
                f"Question: {q['question']}\nMemory:\n{render_memory(m)}\nIs the memory enough to "
                "answer? Reply STOP or CONTINUE."
                for q, m in items
            ],
            "verifier",
        )
        return ["STOP" in v.upper() for v in verdicts]

    def generate(self, items):
        """The final answer from M, the question last (where a small model reads it best)."""
        texts = self.frozen(
            [
                f"Memory:\n{render_memory(m)}\nQuestion: {q['question']}\nAnswer "
                "the question in a few words."
                for q, m in items
            ],
            "answer",
        )
        return [(re.findall(r"Answer:\s*(.+)", t) or [t.strip() or None])[-1] for t in texts]

    def judge(self, query, answer):
        return answers_match(answer, query["answer"])


PYTHON_WORKERS = 8  # Python tool calls of one turn that run at once
# each frozen module's generation cap (at most the planner's): the analysis asks for two sentences,
# the verifier for one word; the executor's command and the generate tool may be code or prose
MODULE_TOKENS = {"analysis": 128, "executor": 512, "generate": 512, "verifier": 8, "answer": 128}
MEMORY_FIELD_CHARS = 500  # each sub-goal, command and result as the modules read them


def python_program(command):
    """The executor's command as a program: its fenced block if it wrote one."""
    block = re.search(r"```(?:python)?\n(.*?)```", command, re.S)
    return block.group(1) if block else command


def escape_special_tokens(text, tokenizer):
    """`text` with every special token's string (`<|im_end|>`, `<|im_start|>`, …) broken by a zero
    width space after its first character, so it is encoded as plain text, never as a token that
    ends a turn or starts a new one."""
    specials = set(tokenizer.all_special_tokens) | {
        token.content for token in tokenizer.added_tokens_decoder.values() if token.special
    }
    for special in sorted(specials, key=len, reverse=True):
        if len(special) > 1:
            text = text.replace(special, special[0] + "\u200b" + special[1:])
    return text


def render_memory(memory):
    """M as text for the LLM modules, one line per step."""
    return (
        "\n".join(
            f"Step {e['step']}: tool={e['tool']} "
            f"sub-goal={e['subgoal'][:MEMORY_FIELD_CHARS]!r} "
            f"command={e['command'][:MEMORY_FIELD_CHARS]!r} "
            f"result={str(e['result'])[:MEMORY_FIELD_CHARS]!r}"
            for e in memory.entries
        )
        or "(empty)"
    )


def format_rollout(trajectory):
    """One rollout turn by turn: the question, each plan, tool call, result and verdict, then the
    answer."""
    lines = [f"q: {trajectory['query']['question']}   (gold: {trajectory['query']['answer']})"]
    for turn, entry, verdict in zip(
        trajectory["turns"], trajectory["memory"].entries, trajectory["verdicts"]
    ):
        lines.append(
            f"  turn {entry['step']}: planner {turn['text']!r} → tool {entry['tool']}, sub-goal "
            f"{entry['subgoal']!r}, command {entry['command']!r} → "
            f"{str(entry['result'])[:80]!r}; verifier {verdict}"
        )
    lines.append(f"  answer: {trajectory['answer']!r}  reward {trajectory['reward']:.0f}")
    return "\n".join(lines)


def build_full(args, device):
    """HF planner with LoRA; the frozen modules are the same model with the adapter off. Says at
    once whether the Python tool is isolated, disabled, or (the user's opt-in) unisolated."""
    problem = sandbox.isolation_problem()
    if args.unsafe_python_tool:
        print(
            "WARNING: --unsafe-python-tool: model-written code runs as you, WITHOUT isolation "
            "(your files, keys and network are within its reach)",
            file=sys.stderr,
        )
    elif problem:
        print(
            f"note: the Python tool is disabled: {problem}; its calls return that error "
            "(--unsafe-python-tool runs them unisolated)",
            file=sys.stderr,
        )
    tokenizer, planner = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing
    )
    retrieve = (
        make_retriever(args.corpus) if args.corpus else (lambda query: "error: no --corpus given")
    )
    # the tool cannot read them
    hidden = tuple(f for f in (args.data, args.eval_data, args.corpus) if f)
    return ToolSystem(
        load_qa_jsonl(args.data),
        load_qa_jsonl(args.eval_data, "--eval-data") if args.eval_data else [],
        tokenizer,
        planner.to(device),
        retrieve,
        args.tool_timeout,
        agent_toy.generation_settings(args),
        hidden,
        args.unsafe_python_tool,
    )
