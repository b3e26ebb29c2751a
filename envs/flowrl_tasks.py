"""FlowRL's tasks and measurements: the exact toy, math with math-verify, and laptop tasks.

    valleys   4 prompts × 64 three-symbol answers, some rewarded per prompt (--valleys: by default
              six, modes of different heights); π, π_ref and p* ∝ π_ref·exp(β·|y|·r) enumerated
              exactly (exact_metrics)
    math      {prompt|problem, answer} JSONL, the last \\boxed{} checked by math-verify; Avg@k
    addition, numbers   SmolLM2 tasks: one-digit sums (first integer), questions with many
                        correct answers (answer_spread: distinct correct answers and their entropy)
Also the plots of one run and the sweep's rows and claims.
"""

import collections
import dataclasses
import itertools
import json
import re
from pathlib import Path

import torch

import common
from utils import cli, distributed, models, tracking

SYMBOLS = list("abcd")
TOY_PROMPTS = ["x0", "x1", "x2", "x3"]


@dataclasses.dataclass
class Task:
    """Prompts and what each is scored against: the toy's reward table ({answer text: reward}), a
    math answer, or the set of correct integers (the `--task` names the kind)."""

    kind: str
    prompts: list
    answers: list
    eval_rows: list = dataclasses.field(default_factory=list)  # (prompt, answer) for Avg@k

    def reward(self, i, text):
        return score(self.kind, text, self.answers[i])


@dataclasses.dataclass(frozen=True)
class Generation:
    """How FlowRL generates, for its sampler and its evaluations, read off the flags of the same
    names: the run's seed, G, the |y| cap, the rollout and Avg@k temperatures, the k of Avg@k, the
    answer spread's samples, prompts per `generate` call and the forwards' precision."""

    seed: int
    group_size: int
    max_new_tokens: int
    temperature: float
    eval_temperature: float
    eval_k: int
    spread_samples: int
    gen_batch: int
    mixed_precision: str

    @classmethod
    def from_args(cls, args):
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


def score(kind, text, answer):
    """r(x, y): the toy's table entry, math-verify's verdict, or whether the reply's integer is a
    correct one."""
    if kind == "valleys":
        return answer.get(text.strip(), 0.0)
    if kind == "math":
        return math_reward(text, answer)
    return integer_reward(text, answer, first=kind == "addition")


def parse_valleys(text):
    """--valleys "1,1,0.8": the rewards of each prompt's rewarded answers, or None if it is not a
    list of 1-64 numbers in (0, 1]."""
    try:
        rewards = [float(r) for r in text.split(",")]
    except ValueError:
        return None
    ok = 1 <= len(rewards) <= len(SYMBOLS) ** 3 and all(0 < r <= 1 for r in rewards)
    return rewards if ok else None


def toy_reward_table(seed, rewards):
    """For each toy prompt, one random 3-symbol answer per reward in `rewards` (modes of different
    heights); every other answer scores 0."""
    gen = torch.Generator().manual_seed(seed)
    answers = [" ".join(a) for a in itertools.product(SYMBOLS, repeat=3)]
    return [
        {
            answers[j]: r
            for j, r in zip(torch.randperm(len(answers), generator=gen).tolist(), rewards)
        }
        for _ in TOY_PROMPTS
    ]


def build_toy(args):
    """Tiny Qwen2 "base model" that knows the answer format: pretrained on uniform 3-symbol
    strings."""
    tokenizer = models.make_tokenizer([*TOY_PROMPTS, *SYMBOLS])
    model = models.tiny_causal_lm(
        len(tokenizer), seed=args.seed, gradient_checkpointing=args.gradient_checkpointing
    )
    table = toy_reward_table(args.seed, parse_valleys(args.valleys))
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    symbol_ids = torch.tensor(tokenizer.convert_tokens_to_ids(SYMBOLS))
    prompt_ids = torch.tensor(tokenizer.convert_tokens_to_ids(TOY_PROMPTS))
    for _ in range(150):
        x = torch.stack(
            [
                prompt_ids[torch.randint(len(TOY_PROMPTS), (64,), generator=gen)],
                *symbol_ids[torch.randint(len(SYMBOLS), (3, 64), generator=gen)],
            ],
            1,
        )
        logits = model(input_ids=x).logits[:, :-1]
        loss = -common.token_logprobs(logits, x[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if args.lora_rank:  # π_ref is then the same network with the adapter off
        model = models.add_lora(model, args.lora_rank)
    return tokenizer, model, Task("valleys", TOY_PROMPTS, table)


MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def math_reward(text, answer):
    """1 if the completion's final answer equals the reference, else 0, by HF's math-verify: the
    last \\boxed{} (or final expression) of the text, compared symbolically (fractions, LaTeX,
    units, sets)."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return float(bool(gold) and verify(gold, parse(text)))


def load_math_jsonl(path):
    """[(prompt, answer)] from JSONL lines with a 'prompt' or 'problem' field and an 'answer'
    field."""
    rows = cli.read_jsonl(path, "--data", ["prompt|problem", "answer"])
    return [(row["prompt"], row["answer"]) for row in rows]


def chat_prompt(tokenizer, question):
    """The user turn through the model's chat template (plain text + newline when it has none)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    return question + "\n"


def build_full(args, device):
    """HF causal LM (optionally LoRA) + the math task."""
    tokenizer, model = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing
    )
    rows = (  # none for --eval-only
        [(chat_prompt(tokenizer, q + MATH_SUFFIX), a) for q, a in load_math_jsonl(args.data)]
        if args.data
        else []
    )
    eval_rows = (
        [(chat_prompt(tokenizer, q + MATH_SUFFIX), a) for q, a in load_math_jsonl(args.eval_data)]
        if args.eval_data
        else []
    )
    return tokenizer, model, Task("math", [p for p, _ in rows], [a for _, a in rows], eval_rows)


REPLY = " Reply with only the number."


# Many correct answers each. SmolLM2-135M-Instruct starts at 5–35% success and a few distinct
# answers per question, with favourites (7, 5, 1).
NUMBER_QUESTIONS = {
    "a prime number less than 30": {2, 3, 5, 7, 11, 13, 17, 19, 23, 29},
    "a multiple of 5 between 1 and 50": set(range(5, 50, 5)),
    "a perfect square less than 100": {n * n for n in range(1, 10)},
    "a multiple of 7 less than 100": set(range(7, 100, 7)),
}


def reply_integer(text, first):
    """The first (or last) integer written in the reply, or None."""
    found = re.findall(r"-?\d+", text)
    return int(found[0 if first else -1]) if found else None


def integer_reward(text, correct, first):
    """1 if the reply's first (addition) or last (numbers) integer is a correct answer, else 0.
    Addition asks for only the number, so its grader reads the first number written: "17" scores,
    "9 + 8 = 17" does not. A numbers reply that explains itself still scores when it ends on a
    correct answer."""
    return float(reply_integer(text, first) in correct)


def build_laptop(args, device):
    """A real chat model and a task it already sometimes solves, asked through its chat template.

    addition: "What is a + b?" for one-digit a, b — 36 pairs to train on, the other 64 held out for
    greedy accuracy (the same split on every seed). numbers: NUMBER_QUESTIONS, every one with many
    correct answers."""
    tokenizer, model = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing
    )
    if args.task == "addition":
        order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
        rows = [
            (chat_prompt(tokenizer, f"What is {j // 10} + {j % 10}?" + REPLY), {j // 10 + j % 10})
            for j in order
        ]
        return (
            tokenizer,
            model,
            Task("addition", [p for p, _ in rows[:36]], [a for _, a in rows[:36]], rows[36:]),
        )
    questions = list(NUMBER_QUESTIONS)
    prompts = [chat_prompt(tokenizer, f"What is {q}?" + REPLY) for q in questions]
    return tokenizer, model, Task("numbers", prompts, [NUMBER_QUESTIONS[q] for q in questions])


@torch.no_grad()
def exact_metrics(model, ref_model, tokenizer, task, beta, length=3):
    """Enumerate every length-3 answer over the whole vocabulary (V³ per prompt) and compute
    exactly: π_θ(·|x), p*(·|x) ∝ π_ref·exp(β·|y|·r) (DEVIATION 3), KL(π‖p*), KL(p*‖π), E_π[r],
    E_p*[r] and the number of rewarded modes covered (π holds ≥ 50% of the mode's target mass),
    averaged over the toy prompts; per prompt ("prompts", kept in summary.json) each rewarded
    answer's r, π and p*, the modes π keeps (covered, best first) and the answer π holds most.
    ref_model None: π_ref is `model` with its LoRA adapter off."""
    vocab = len(tokenizer)
    answers = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (V³, 3)
    texts = [tokenizer.decode(a) for a in answers.tolist()]
    out = {
        "kl_policy_to_target": 0.0,
        "kl_target_to_policy": 0.0,
        "mean_reward": 0.0,
        "target_mean_reward": 0.0,
        "modes_covered": 0,
        "modes_total": 0,
        "prompts": [],  # per prompt: each rewarded answer's r, π, p*; the modes kept; π's top
        "dists": [],
    }
    for i, prompt in enumerate(task.prompts):
        logp, ref_logp = [], []
        # one prefix tree per first token: a tree's attention grows with the square of its size
        for chunk in answers.split(vocab ** (length - 1)):
            mb = common.pack_micro_batch(
                tokenizer, [prompt] * len(chunk), chunk.tolist(), model.device
            )
            logp.append(common.micro_batch_logprobs(model, mb).sum(-1).cpu())
            ref_logp.append(common.reference_logprobs(model, ref_model, mb).sum(-1).cpu())
        logp, ref_logp = torch.cat(logp), torch.cat(ref_logp)
        reward = torch.tensor([task.reward(i, t) for t in texts])
        log_target = torch.log_softmax(ref_logp + beta * length * reward, 0)
        pi, target = logp.exp(), log_target.exp()
        out["kl_policy_to_target"] += (pi * (logp - log_target)).sum().item() / len(task.prompts)
        out["kl_target_to_policy"] += (target * (log_target - logp)).sum().item() / len(
            task.prompts
        )
        out["mean_reward"] += (pi * reward).sum().item() / len(task.prompts)
        out["target_mean_reward"] += (target * reward).sum().item() / len(task.prompts)
        rewarded = sorted((reward > 0).nonzero().flatten().tolist(), key=lambda j: -reward[j])
        kept = [texts[j] for j in rewarded if pi[j] >= 0.5 * target[j]]
        out["modes_covered"] += len(kept)
        out["modes_total"] += len(rewarded)
        top = int(pi.argmax())
        out["prompts"].append(
            {
                "prompt": prompt,
                "rewarded": {
                    texts[j]: {
                        "r": task.reward(i, texts[j]),
                        "pi": pi[j].item(),
                        "p*": target[j].item(),
                    }
                    for j in rewarded
                },
                "kept": kept,
                "pi_top": {
                    "answer": texts[top],
                    "r": task.reward(i, texts[top]),
                    "pi": pi[top].item(),
                },
            }
        )
        out["dists"].append((texts, pi.tolist(), target.tolist(), reward.tolist()))
    return out


@torch.no_grad()
def avg_at_k(model, tokenizer, task, generation, accelerator):
    """Avg@k: mean reward of k samples per eval question at the eval temperature (FlowRL's
    setup); with k = 1 at T = 0 it is greedy accuracy. Sharded: each rank samples every N-th of
    the k·|eval| rows and the scores are gathered, so no rank waits while another evaluates. Each
    (question, sample) row draws from its own seed, so the k samples differ and Avg@k is the same
    for any number of ranks."""
    from accelerate.utils import gather_object

    rows = [(prompt, answer) for prompt, answer in task.eval_rows for _ in range(generation.eval_k)]
    row_seeds = [distributed.sampling_seed(generation.seed, 0, r) for r in range(len(rows))]
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    my_seeds = row_seeds[accelerator.process_index :: accelerator.num_processes]
    sampled = generation.eval_temperature > 0
    samples = common.sample_completions(
        model,
        tokenizer,
        [prompt for prompt, _ in mine],
        generation.max_new_tokens,
        temperature=generation.eval_temperature,
        batch_rows=generation.gen_batch,
        precision=generation.mixed_precision,
        row_seeds=my_seeds if sampled else None,
    )
    scores = [score(task.kind, text, answer) for (text, _, _), (_, answer) in zip(samples, mine)]
    scores = gather_object(scores) if accelerator.num_processes > 1 else scores
    return {"avg_at_k": sum(scores) / len(scores)}


@torch.no_grad()
def answer_spread(model, tokenizer, task, generation):
    """Where the correct answers go: `spread_samples` replies per question at T = 1 → success rate,
    distinct correct answers (summed over questions), and the entropy (nats) of the correct answers'
    empirical distribution, averaged over questions. A reward maximiser may pile onto one answer
    per question (entropy → 0); p* ∝ π_ref·exp(β·r) keeps π_ref's spread over the correct ones.
    One seed for the whole measurement, so every arm of a seed starts from the same numbers."""
    out = {"spread_reward": 0.0, "distinct_correct": 0, "correct_entropy": 0.0, "counts": []}
    n = generation.spread_samples
    # step 0: never a training step
    torch.manual_seed(distributed.sampling_seed(generation.seed, 0, 0))
    replies = common.sample_completions(
        model,
        tokenizer,
        [prompt for prompt in task.prompts for _ in range(n)],
        generation.max_new_tokens,
        batch_rows=generation.gen_batch,
        precision=generation.mixed_precision,
    )
    for i, correct_set in enumerate(task.answers):
        found = (reply_integer(text, first=False) for text, _, _ in replies[i * n : (i + 1) * n])
        correct = [number for number in found if number in correct_set]
        counts = collections.Counter(correct)
        share = torch.tensor(list(counts.values()), dtype=torch.float) / max(1, len(correct))
        out["spread_reward"] += len(correct) / n / len(task.prompts)
        out["distinct_correct"] += len(counts)
        out["correct_entropy"] += -(share * share.log()).sum().item() / len(task.prompts)
        out["counts"].append({str(number): k for number, k in sorted(counts.items())})
    return out


def plot_answer_counts(before, after, path, algo):
    """One panel per question: how often each correct answer was sampled, at the start and at the
    end (answer_spread's counts)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3 * len(before), 2.8), dpi=100)
    for ax, question, start, end in zip(
        fig.subplots(1, len(before)), NUMBER_QUESTIONS, before, after
    ):
        answers = sorted({*start, *end}, key=int)
        xs = torch.arange(len(answers)).numpy()
        ax.bar(xs - 0.2, [start.get(a, 0) for a in answers], 0.4, label="start")
        ax.bar(xs + 0.2, [end.get(a, 0) for a in answers], 0.4, label=f"{algo} end")
        ax.set_xticks(xs, answers, fontsize=7)
        ax.set_title(question, fontsize=8)
    ax.legend(fontsize=7)
    fig.supylabel("correct samples", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def plot_valleys(prompts, path, algo):
    """One panel per prompt (the paper's Figure 1 view): target p* vs learned π on each rewarded
    answer, labelled with its reward (* = a mode π keeps), on π's top answer when it scores 0, and
    on the rest of the answers together."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * len(prompts), 3.2), dpi=100)
    for ax, row in zip(fig.subplots(1, len(prompts), sharey=True), prompts):
        bars = {
            f"{a.replace(' ', '')}{'*' if a in row['kept'] else ''}\nr {v['r']:g}": (
                v["p*"],
                v["pi"],
            )
            for a, v in row["rewarded"].items()
        }
        top = row["pi_top"]
        if top["answer"] not in row["rewarded"]:
            bars[f"{top['answer'].replace(' ', '')}\nr 0"] = (0.0, top["pi"])
        shown = [sum(column) for column in zip(*bars.values())]
        bars["rest"] = (max(0.0, 1 - shown[0]), max(0.0, 1 - shown[1]))
        xs = torch.arange(len(bars)).numpy()
        ax.bar(xs - 0.2, [t for t, _ in bars.values()], 0.4, label="target p*")
        ax.bar(xs + 0.2, [p for _, p in bars.values()], 0.4, label=f"{algo} π")
        ax.set_xticks(xs, list(bars), fontsize=7)
        ax.set_title(
            f"{row['prompt']}: {len(row['kept'])}/{len(row['rewarded'])} modes kept", fontsize=9
        )
    ax.legend(fontsize=7)
    fig.supylabel("probability", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def plot_kl_comparison(runs_dir):
    """Exact KL(π‖p*) curves of the three arms from runs/flowrl, runs/flowrl-grpo and
    runs/flowrl-grpo-kl (written by `make demo`)."""
    curves = {}
    for name in ["flowrl", "flowrl-grpo", "flowrl-grpo-kl"]:
        path = Path(runs_dir) / name / "metrics.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            curves[name] = [
                (r["step"], r["kl_policy_to_target"]) for r in rows if "kl_policy_to_target" in r
            ]
    tracking.plot_curves(
        curves,
        Path(runs_dir) / "flowrl_vs_grpo_kl.png",
        "exact KL(π‖p*) on the toy",
        "KL",
        logy=True,
    )


CLAIMS = {
    "flowrl": "FlowRL: exact KL(π‖p*) goes down",
    "grpo": "GRPO baseline: exact KL(π‖p*) goes up",
    "grpo-kl": "GRPO-KL control (same target): KL goes down",
}


SWEEP_ARMS = [
    ("flowrl", {"algo": "flowrl"}),
    ("grpo", {"algo": "grpo"}),
    ("grpo-kl", {"algo": "grpo-kl"}),
]


def sweep_row(summaries):
    """One seed of the sweep: exact KL(π‖p*) per arm at the end, and modes covered by FlowRL."""
    return {
        "kl_at_ref": summaries["flowrl"]["before"]["kl_policy_to_target"],
        **{f"kl_{name}": summaries[name]["kl_policy_to_target"] for name, _ in SWEEP_ARMS},
        "covered_at_ref": summaries["flowrl"]["before"]["modes_covered"],
        **{f"covered_{name}": summaries[name]["modes_covered"] for name, _ in SWEEP_ARMS},
    }


def claim_holds(row):
    """The paper's claim on one seed: FlowRL ends within 0.2 nats of p*, ≥ 10× closer than GRPO."""
    return row["kl_flowrl"] <= 0.2 and 10 * row["kl_flowrl"] <= row["kl_grpo"]


SPREAD_ARMS = [("flowrl", {"algo": "flowrl"}), ("grpo", {"algo": "grpo"})]


def spread_row(summaries):
    """One seed of the numbers task: success rate, distinct correct answers and their entropy at
    the start (the same for both arms) and at the end of each arm."""
    row = {}
    for metric, short in [
        ("spread_reward", "reward"),
        ("distinct_correct", "distinct"),
        ("correct_entropy", "entropy"),
    ]:
        row[f"{short}_start"] = summaries["flowrl"]["before"][metric]
        row |= {f"{short}_{name}": summaries[name][metric] for name, _ in SPREAD_ARMS}
    return row


def spread_claim(row):
    """FlowRL's claim on real text: the reward goes up and the correct answers stay more spread
    (higher entropy) than under GRPO."""
    return (
        row["reward_flowrl"] > row["reward_start"] and row["entropy_flowrl"] > row["entropy_grpo"]
    )


def plot_spread_comparison(sweep_dir):
    """The numbers sweep in one figure: each arm's reward per step (one line per seed), then the
    distinct correct answers and their entropy at the start and at each arm's end (one dot per
    seed)."""
    from matplotlib.figure import Figure

    sweep = json.loads((Path(sweep_dir) / "sweep.json").read_text())
    fig = Figure(figsize=(11, 3.2), dpi=100)
    curves, distinct, entropy = fig.subplots(1, 3)
    for color, (name, _) in zip(["C0", "C1"], SPREAD_ARMS):
        for seed in sweep["seeds"]:
            path = Path(sweep_dir) / f"seed{seed}" / name / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            label = name if seed == sweep["seeds"][0] else None
            curves.plot([r["step"] for r in rows], [r["reward"] for r in rows], color, label=label)
    curves.set(title="rollout reward", xlabel="step")
    curves.legend(fontsize=8)
    for ax, short, title in [
        (distinct, "distinct", "distinct correct answers"),
        (entropy, "entropy", "entropy of correct answers (nats)"),
    ]:
        for x, column in enumerate(["start", *(name for name, _ in SPREAD_ARMS)]):
            values = [row[f"{short}_{column}"] for row in sweep["rows"]]
            ax.plot([x] * len(values), values, "o", alpha=0.6)
            ax.hlines(sum(values) / len(values), x - 0.2, x + 0.2, color="gray")
        ax.set_xticks(range(3), ["start", *(name for name, _ in SPREAD_ARMS)])
        ax.set_title(title, fontsize=9)
    fig.suptitle(
        f"SmolLM2-135M, FlowRL vs GRPO: claim holds on {sweep['claim_holds_on']}/"
        f"{len(sweep['rows'])} seeds",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(Path(sweep_dir) / "comparison.png")


def build(args, device):
    """(tokenizer, model on `device`, task) for `args.task`: the toy, math from --data, or a laptop
    task."""
    if args.task == "valleys":
        tokenizer, model, task = build_toy(args)
    else:
        tokenizer, model, task = (build_full if args.task == "math" else build_laptop)(args, device)
    return tokenizer, model.to(device), task


def evaluate(model, ref_model, tokenizer, task, *, beta, generation, accelerator):
    """What this task measures: the toy's exact metrics (p* at `beta`), the answer spread, or Avg@k
    ({} when the task has no held-out rows), sampled as `generation` says. Every rank calls it:
    Avg@k is sharded, the others are computed alike on every rank (exact, or one fixed seed).
    Leaves the model in training mode. A sharded model is gathered once for the whole evaluation
    (`distributed.unsharded`)."""
    with distributed.unsharded(model):
        if task.kind == "valleys":
            metrics = exact_metrics(model, ref_model, tokenizer, task, beta)
        elif task.kind == "numbers":
            metrics = answer_spread(model, tokenizer, task, generation)
        elif task.eval_rows:
            metrics = avg_at_k(model, tokenizer, task, generation, accelerator)
        else:
            metrics = {}
    model.train()
    return metrics


def summary_of(first, final, args, task):
    """summary.json's body: the final metrics, the first evaluation under "before", and on the toy
    the row of `make demo`'s table (exact KL(π‖p*) before → after)."""
    summary = final | {"algo": args.algo, "before": first}
    if task.kind == "valleys" and final:
        summary["claim"] = {
            "text": CLAIMS[args.algo],
            "after": final["kl_policy_to_target"],
            "before": first["kl_policy_to_target"],
        }
    return summary


def run_plots(first, final, args, task, out_dir):
    """Draw the task's own figures (valleys.png, answers.png) and list the curves RunLogger draws
    from the metrics: [(filename, keys, title)]."""
    plots = [("reward.png", ["reward", "zero_var_frac"], f"{args.algo}: reward")]
    if task.kind == "valleys" and final:
        plot_valleys(final["prompts"], Path(out_dir) / "valleys.png", args.algo)
        plots.append(
            ("kl.png", ["kl_policy_to_target", "kl_target_to_policy"], f"{args.algo}: exact KL")
        )
    if task.kind == "numbers" and final:
        plot_answer_counts(
            first["counts"], final["counts"], Path(out_dir) / "answers.png", args.algo
        )
    if task.eval_rows:
        plots.append(("eval.png", ["avg_at_k"], f"{args.algo}: Avg@{args.eval_k}"))
    return plots
