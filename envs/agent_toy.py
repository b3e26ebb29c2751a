"""AgentFlow's toy: questions over a small knowledge base that need two lookups and a calculation.

The planner is a tiny Qwen2; the executor, verifier and generator are deterministic rules
(DEVIATION 2 of agentflow.py). A careless demonstrator repeats attr1 in its second lookup, so a
warm-started planner is wrong in a middle turn: the case where broadcasting the outcome to every
turn matters.
"""

import dataclasses
import random

import common
from utils import models, tracking

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
        make(entities[30:], test_shapes + train_shapes, 200),
        kb,
    )


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
    generation: dict  # how the planner samples (`generation_settings`)
    planner_temperature: float = 0.0  # greedy as built; `sampling` gives the training copy

    def sampling(self, temperature):
        """This system with its planner sampled at `temperature` (training rollouts); the
        rule-based modules have no temperature."""
        return dataclasses.replace(self, planner_temperature=temperature)

    def plan(self, prompts):
        """The planner's turn for each prompt → [(text, completion ids, sampler log-probs)]."""
        return common.sample_completions(
            self.planner,
            self.tokenizer,
            prompts,
            temperature=self.planner_temperature,
            **self.generation,
        )

    def analyse(self, queries):
        """The toy has no query analysis: its prompt's slots already are one."""
        return [""] * len(queries)

    def demonstrations(self, queries, rng, careless, memory_type, max_turns):
        """The warm start's (prompt, completion) pairs: the golden plan turn by turn, executed, or
        a careless demonstrator's (share `careless`) that repeats attr1 in its second lookup, so
        the planner starts right on some questions and wrong in a middle turn on the others."""
        pairs = []
        for query in queries:
            memory = memory_type()
            for text in toy_demonstration(query, careless=rng.random() < careless):
                pairs.append((self.planner_prompt(query, memory), text + " <eos>"))
                tool, subgoal = self.parse_plan(text)
                memory.add(tool, subgoal, *self.execute([(query, tool, subgoal, memory)])[0])
        return pairs

    def planner_prompt(self, query, memory, analysis="", step=1, max_turns=1):
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
                        (f"calc({words[0]})", "error: calc needs two looked-up values", False)
                    )
                else:
                    results.append(
                        (f"{values[0]} {words[0]} {values[1]}", OPERATIONS[words[0]](*values), True)
                    )
            else:
                results.append(
                    (f"{tool}({subgoal})", f"error: bad arguments {subgoal!r} for {tool}", False)
                )
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


def generation_settings(args):
    """`common.sample_completions`' settings for the planner, from the flags: the plan's token cap,
    prompts and padded tokens per `generate` call, the forwards' precision."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "batch_rows": args.gen_batch,
        "token_budget": args.gen_tokens,
        "precision": args.mixed_precision,
    }


def build_toy(args, device):
    """The toy system with a tiny Qwen2 planner, untrained (agentflow.warm_start teaches it the
    format)."""
    train, test, kb = toy_queries(args.seed)
    turns = [f"t{k}" for k in range(1, args.eval_max_turns + 2)]
    words = ["q", "k", "m", "p", "ok", "error", "A", "B", *ATTRIBUTES, *OPERATIONS, *TOY_TOOLS]
    tokenizer = models.make_tokenizer(words + turns)
    planner = models.tiny_causal_lm(
        len(tokenizer), seed=args.seed, gradient_checkpointing=args.gradient_checkpointing
    )
    planner = planner.to(device)
    return ToySystem(train, test, kb, tokenizer, planner, generation_settings(args))


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
    credit, and the start's sampled success and share of flat groups."""
    s = summaries[""]
    return {
        "start_reward": s["start_reward"],
        "start_zero_var": s["start_zero_var_frac"],
        "accuracy_before": s["accuracy_before"],
        "broadcast": s["accuracy_after"],
        "final_turn": s["accuracy_final_turn_credit"],
    }


def claim_holds(row):
    """The paper's claim on one seed: broadcast credit gains ≥ 0.25 and beats final-turn credit."""
    return (
        row["broadcast"] - row["accuracy_before"] >= 0.25 and row["broadcast"] > row["final_turn"]
    )
