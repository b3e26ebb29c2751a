"""FlowRL: matching the reward distribution with trajectory balance and a learned log Z(x).

Paper: "FlowRL: Matching Reward Distributions for LLM Reasoning", Zhu et al. 2025, arXiv 2509.15207.
"The original code" below is the authors' release (a verl fork).

Reward maximisers (PPO, GRPO) pile their mass onto the single best mode. FlowRL instead fits the
target p*(y|x) ∝ π_ref(y|x)·exp(β·r(x,y)) by minimising KL(π_θ‖p*); in expected gradient that KL
equals the GFlowNet trajectory-balance (TB) loss, whose unknown normaliser Z(x) is a small learned
head (Proposition 1 of the paper).

Equation map (paper → function):
    TB loss  w·(log Z(x) + logπ_θ(y|x)/|y| − β·r̂ − logπ_ref(y|x)/|y|)²
                                                                → trajectory_balance_loss
    w        clip(π_θ/π_old, 1−ε, 1+ε), detached                → importance_weight
    log Z    3-layer MLP on the mean-pooled prompt hidden state  → LogZHead
    p*       π_ref·exp(β·r), exact on the toy by enumeration     → exact_metrics
    GRPO     −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A), the baseline (`--algo grpo`)
                                                                → grpo_loss
    control  GRPO on r − log(π/π_ref)/(β·|y|), whose optimum is also p* (`--algo grpo-kl`)

Deviations (numbered, on purpose):
    1. The toy uses the raw reward (`--reward-norm none`) so p* is exactly defined; the paper's r̂
       is the group-normalised reward (`--reward-norm group`, the full preset's default).
    2. w clips the sequence ratio to [1−ε, 1+ε] as the paper writes; the original code used it
       unclipped (its clipped copy was computed but unused). Clipping bounds the weight of stale
       samples.
    3. With length-normalised log-probs the TB fixed point is π ∝ π_ref·exp(β·|y|·r); the toy's
       responses all have |y| = 3, so its exact target uses β·|y| (the family of Proposition 1 with
       a rescaled β).
    4. log Z has its own learning rate (`--logz-lr`), as GFlowNet practice gives it (FlowRL's log Z
       head).
    5. The toy samples G = 64 per prompt (paper: 8) and takes 8 optimiser steps on each batch for
       300 batches. At π = π_ref the KL part of TB's expected gradient, −β∇E[r] + ∇KL(π‖π_ref)/|y|,
       is zero, so the first updates are REINFORCE on β·r with log Z as the baseline; at β = 1 with
       ~9% of samples rewarded one step per batch barely moves π (measured: near π_ref for 100–175
       batches at 2 steps per batch; a 3× or 10× learning rate did not help, 8 steps per batch
       did). Every arm gets the same rollouts and the same number of optimiser steps.
    6. `--algo grpo-kl`, a control the paper does not run: GRPO on the sequence-level regularised
       reward r − log(π_old(y|x)/π_ref(y|x))/(β·|y|). Its optimum is the same p* (maximising E[r] −
       KL(π‖π_ref)/(β·|y|) gives π ∝ π_ref·exp(β·|y|·r)), so it separates "match a target" from
       "match it with trajectory balance".

Toy (CPU, about 2 minutes per arm; docs/flowrl.md):
    python flowrl.py                   # exact KL(π‖p*) 0.48 → below 0.1, 22–24 of 24 answers kept
    python flowrl.py --algo grpo       # the reward maximiser: KL 0.48 → above 2, a few answers kept
    python flowrl.py --algo grpo-kl    # the control with FlowRL's target
    python flowrl.py --seeds 0-4       # all three arms on five seeds, one table
A real model on a laptop (the bundled SmolLM2-135M-Instruct, CPU; `make demo-real`):
    python flowrl.py --preset smollm2-addition --algo grpo   # greedy 0.125 → 0.83, ~20 min
    python flowrl.py --preset smollm2-numbers --seeds 0-2    # FlowRL vs GRPO spread: held 1/3 seeds
Full scale (one GPU, math recipe):
    python flowrl.py --preset full --data train.jsonl --eval-data test.jsonl
N GPUs (DDP, docs/full_scale.md):
    accelerate launch --num_processes N flowrl.py --preset full ...
Sample from the trained policy (full preset; a plain causal LM folder, no log Z head):
    python -m utils.sample runs/flowrl/policy "What is 7 + 5?"
"""

import collections
import copy
import dataclasses
import itertools
import json
import re

from pathlib import Path

import torch
import torch.nn as nn

import common
from utils import models, sweep, tracking


# ----------------------------------------------------------------------------- args


@dataclasses.dataclass
class Args:
    algo: str = common.arg(
        "flowrl",
        "flowrl: trajectory balance; grpo: the reward-maximising baseline; grpo-kl: GRPO on "
        "r − log(π/π_ref)/(β·|y|), the KL-regularised control with FlowRL's target",
        ["flowrl", "grpo", "grpo-kl"],
    )
    task: str = common.arg(
        "valleys",
        "valleys: the exact toy; math: --data JSONL (full preset); addition, numbers: tasks a "
        "real chat model already sometimes solves (the smollm2 presets)",
        ["valleys", "math", "addition", "numbers"],
    )
    model: str = common.arg("", "HF model id, a path, or smollm2 (bundled); '' = the toy's tiny LM")
    data: str = common.arg("", "JSONL of {prompt|problem, answer} for --task math")
    eval_data: str = common.arg("", "JSONL for Avg@k evaluation (full preset)")
    steps: int = common.arg(300, "rollout batches")
    prompts_per_step: int = common.arg(4, "B, prompts per rollout batch")
    group_size: int = common.arg(64, "G, samples per prompt (paper: 8)")
    inner_steps: int = common.arg(8, "optimiser steps per rollout batch")
    max_new_tokens: int = common.arg(3, "|y| cap")
    beta: float = common.arg(1.0, "β, reward scale in p* ∝ π_ref·exp(β·r) (paper: 15)")
    reward_norm: str = common.arg(
        "none", "r̂: 'group' = group-normalised (paper), 'none' = raw reward", ["group", "none"])
    clip_eps: float = common.arg(0.2, "ε for w (FlowRL) and the GRPO clip")
    lr: float = common.arg(1e-3, "policy learning rate (paper: 1e-6)")
    logz_lr: float = common.arg(1e-2, "log Z head learning rate")
    detach_logz: bool = common.arg(False, "stop log Z's gradient into the backbone")
    temperature: float = common.arg(1.0, "rollout temperature (paper: 1.0)")
    eval_temperature: float = common.arg(0.6, "Avg@k temperature (paper: 0.6)")
    eval_k: int = common.arg(4, "k of Avg@k (paper: 16)")
    eval_every: int = common.arg(25, "steps between evaluations")
    spread_samples: int = common.arg(
        64, "numbers task: samples per question for the answer spread at the start and the end")
    lora_rank: int = common.arg(0, "LoRA rank via peft (0 = full fine-tune)")
    micro_batch_tokens: int = common.arg(
        4096,
        "padded tokens per forward pass; gradients accumulate over micro-batches (bounds memory)")
    gen_batch: int = common.arg(64, "prompts per `generate` call")
    gradient_checkpointing: bool = common.arg(
        False, "recompute activations in the backward pass (full preset: on)")
    seed: int = common.arg(0, "random seed")
    seeds: str = common.arg("", "seed sweep, e.g. 0-4: all three --algo arms per seed, one table")
    out_dir: str = common.arg("", "output folder (default runs/flowrl[-grpo|-grpo-kl])")
    device: str = common.arg(
        "auto", "auto: cuda:<local rank>, mps or cpu (as Accelerate picks); cpu: force the CPU",
        ["auto", "cpu"])
    quiet: bool = common.arg(False, "no per-step lines or progress bar")
    report_to: str = common.arg(
        "none", "also log the metrics to TensorBoard (out_dir/tensorboard)", ["none", "tensorboard"]
    )
    save_every: int = common.arg(50, "steps between checkpoints (0 = never)")
    resume: bool = common.arg(False, "continue from out_dir/checkpoint.safetensors")


# Paper recipe: G = 8, β = 15, lr 1e-6, group-normalised r̂, temperature 1.0 for
# rollouts and 0.6 for Avg@16. 8k-token responses do not fit one GPU with 8 samples; 1024 here.
# With inner_steps = 1 every sample is on-policy, so w ≡ 1: the clip matters only with --inner-steps
# > 1.
PRESETS = {
    "full": dict(
        task="math", model="Qwen/Qwen2.5-1.5B-Instruct", steps=200, prompts_per_step=8,
        group_size=8, inner_steps=1, max_new_tokens=1024, beta=15.0, reward_norm="group", lr=1e-6,
        logz_lr=1e-6, eval_k=16, eval_every=50, micro_batch_tokens=8192, gen_batch=16,
        gradient_checkpointing=True),
    # A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct (bundled by a registry package,
    # no download), full fine-tuning in fp32. Greedy accuracy on the 64 held-out sums is Avg@1 at
    # T = 0. The numbers preset: β = 1 on the group-normalised r̂ (β = 15 would dwarf the log-ratio
    # term that keeps π near π_ref) and a slow log Z (at 1e-3 it jumped by ±2 per step).
    "smollm2-addition": dict(
        task="addition", model="smollm2", steps=40, prompts_per_step=4, group_size=8, inner_steps=1,
        max_new_tokens=12, lr=3e-6, eval_k=1, eval_temperature=0.0, eval_every=5),
    "smollm2-numbers": dict(
        task="numbers", model="smollm2", steps=12, prompts_per_step=2, group_size=8, inner_steps=1,
        max_new_tokens=10, beta=1.0, reward_norm="group", lr=6e-6, logz_lr=1e-4, gen_batch=256,
        eval_every=1000),
}


# ----------------------------------------------------------------------------- the toy task

SYMBOLS = list("abcd")
TOY_PROMPTS = ["x0", "x1", "x2", "x3"]
VALLEYS = (1.0, 1.0, 0.8, 0.8, 0.5, 0.5)  # rewarded answers per prompt; every other answer scores 0


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


def score(kind, text, answer):
    """r(x, y): the toy's table entry, math-verify's verdict, or whether the reply's integer is a
    correct one."""
    if kind == "valleys":
        return answer.get(text.strip(), 0.0)
    if kind == "math":
        return math_reward(text, answer)
    return integer_reward(text, answer, first=kind == "addition")


def toy_reward_table(seed):
    """For each toy prompt, six 3-symbol answers with rewards VALLEYS (modes of different
    fertility)."""
    gen = torch.Generator().manual_seed(seed)
    answers = [" ".join(a) for a in itertools.product(SYMBOLS, repeat=3)]
    return [
        {
            answers[j]: r
            for j, r in zip(
                torch.randperm(len(answers), generator=gen)[: len(VALLEYS)].tolist(), VALLEYS)
        }
        for _ in TOY_PROMPTS
    ]


def build_toy(args):
    """Tiny Qwen2 "base model" that knows the answer format: pretrained on uniform 3-symbol
    strings."""
    tokenizer = models.make_tokenizer([*TOY_PROMPTS, *SYMBOLS])
    model = models.tiny_causal_lm(len(tokenizer), seed=args.seed)
    table = toy_reward_table(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    symbol_ids = torch.tensor(tokenizer.convert_tokens_to_ids(SYMBOLS))
    prompt_ids = torch.tensor(tokenizer.convert_tokens_to_ids(TOY_PROMPTS))
    for _ in range(150):
        x = torch.stack(
            [
                prompt_ids[torch.randint(len(TOY_PROMPTS), (64,), generator=gen)],
                *symbol_ids[torch.randint(len(SYMBOLS), (3, 64), generator=gen)]],
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


# ----------------------------------------------------------------------------- the full-scale task

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
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: data file {str(path)!r} not found")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((row.get("prompt") or row["problem"], str(row["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SystemExit(
                f"error: {path}:{n} is not a JSON object with 'prompt'/'problem' and 'answer'"
            ) from None
    if not rows:
        raise SystemExit(f"error: {path} has no rows")
    return rows


def chat_prompt(tokenizer, question):
    """The user turn through the model's chat template (plain text + newline when it has none)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return question + "\n"


def build_full(args, device):
    """HF causal LM (optionally LoRA) + the math task."""
    tokenizer, model = models.load_causal_lm(
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing)
    rows = [(chat_prompt(tokenizer, q + MATH_SUFFIX), a) for q, a in load_math_jsonl(args.data)]
    eval_rows = (
        [(chat_prompt(tokenizer, q + MATH_SUFFIX), a) for q, a in load_math_jsonl(args.eval_data)]
        if args.eval_data
        else []
    )
    return tokenizer, model, Task("math", [p for p, _ in rows], [a for _, a in rows], eval_rows)


# ----------------------------------------------------------------------------- the laptop tasks

REPLY = " Reply with only the number."
# Many correct answers each. SmolLM2-135M-Instruct starts at 5–35% success and a few distinct
# answers per question, with favourites (7, 5, 1).
NUMBER_QUESTIONS = {
    "a prime number less than 30": {2, 3, 5, 7, 11, 13, 17, 19, 23, 29},
    "a multiple of 5 between 1 and 50": set(range(5, 50, 5)),
    "a perfect square less than 100": {n * n for n in range(1, 10)},
    "a multiple of 7 less than 100": set(range(7, 100, 7))}


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
        args.model, device, args.lora_rank, gradient_checkpointing=args.gradient_checkpointing)
    if args.task == "addition":
        order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
        rows = [
            (chat_prompt(tokenizer, f"What is {j // 10} + {j % 10}?" + REPLY), {j // 10 + j % 10})
            for j in order
        ]
        return (
            tokenizer, model,
            Task("addition", [p for p, _ in rows[:36]], [a for _, a in rows[:36]], rows[36:]))
    questions = list(NUMBER_QUESTIONS)
    prompts = [chat_prompt(tokenizer, f"What is {q}?" + REPLY) for q in questions]
    return tokenizer, model, Task("numbers", prompts, [NUMBER_QUESTIONS[q] for q in questions])


# ----------------------------------------------------------------------------- the algorithm


class LogZHead(nn.Module):
    """log Z_φ(x): Linear–GELU–LayerNorm–Dropout(0.1) twice, then Linear → 1 (FlowRL's log Z head).

    Input: the policy's last hidden state mean-pooled over the prompt tokens, so Z(x) is conditioned
    on the prompt and (unless detached) its gradient shapes the shared backbone.
    """

    def __init__(self, hidden_size):
        super().__init__()
        block = lambda: [
            nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.LayerNorm(hidden_size),
            nn.Dropout(0.1)]
        self.net = nn.Sequential(*block(), *block(), nn.Linear(hidden_size, 1))

    def forward(self, hidden, prompt_mask):
        pooled = (hidden * prompt_mask[..., None]).sum(1) / prompt_mask.sum(1, keepdim=True).clamp(
            min=1)
        return self.net(pooled.float()).squeeze(-1)


def importance_weight(logp_sum, old_logp_sum, clip_eps):
    """w = clip(π_θ(y|x)/π_old(y|x), 1−ε, 1+ε), detached (FlowRL's practical loss; DEVIATION 2)."""
    return torch.exp(logp_sum - old_logp_sum).clamp(1 - clip_eps, 1 + clip_eps).detach()


def trajectory_balance_loss(log_z, logp, ref_logp, reward, beta, weight, num_rows=None):
    """L = (1/N)·Σ_i w_i·(log Z(x_i) + logπ_θ(y_i|x_i)/|y_i| − β·r̂_i − logπ_ref(y_i|x_i)/|y_i|)²

    logp, ref_logp: length-normalised sequence log-probs (B,); reward: r̂ (B,); weight: w (B,).
    N = num_rows (the whole step's rows, so micro-batches add up to the step's mean; default B).
    Returns (loss, residual). At the optimum every residual is 0: π ∝ π_ref·exp(β·r) with Z its
    normaliser.
    """
    residual = log_z + logp - beta * reward - ref_logp  # the TB residual
    return (weight * residual**2).sum() / (num_rows or len(residual)), residual


def grpo_loss(logp, old_logp, advantages, mask, clip_eps, token_count):
    """The baseline's clipped surrogate (GRPO): L = −Σ_t min(ρ_t·A, clip(ρ_t, 1−ε, 1+ε)·A) /
    N_tokens.

    ρ_t = exp(logp − old_logp) per token; N_tokens counts the step's completion tokens (token-mean),
    so micro-batches add up to the one-shot loss. Returns (loss, stats)."""
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # the pessimistic branch
    stats = {"clipfrac": common.masked_mean((pg_loss2 > pg_loss1).float(), mask).item()}
    return (pg_loss * mask).sum() / token_count, stats


@torch.no_grad()
def exact_metrics(model, ref_model, tokenizer, task, beta, length=3):
    """Enumerate every length-3 answer over the whole vocabulary (V³ per prompt) and compute
    exactly: π_θ(·|x), p*(·|x) ∝ π_ref·exp(β·|y|·r) (DEVIATION 3), KL(π‖p*), KL(p*‖π), E_π[r],
    E_p*[r] and the number of rewarded modes covered (π holds ≥ 50% of the mode's target mass),
    averaged over the toy prompts. ref_model None: π_ref is `model` with its LoRA adapter off."""
    vocab = len(tokenizer)
    answers = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (V³, 3)
    texts = [tokenizer.decode(a) for a in answers.tolist()]
    out = {
        "kl_policy_to_target": 0.0, "kl_target_to_policy": 0.0, "mean_reward": 0.0,
        "target_mean_reward": 0.0, "modes_covered": 0, "modes_total": 0, "dists": []}
    for i, prompt in enumerate(task.prompts):
        prompt_ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        seq = torch.cat([prompt_ids.expand(len(answers), -1), answers], 1).to(model.device)
        mask = torch.ones_like(seq)
        logp = common.completion_logprobs(model, seq, mask, length).sum(-1).cpu()
        ref_logp = common.reference_logprobs(model, ref_model, seq, mask, length).sum(-1).cpu()
        reward = torch.tensor([task.reward(i, t) for t in texts])
        log_target = torch.log_softmax(ref_logp + beta * length * reward, 0)
        pi, target = logp.exp(), log_target.exp()
        out["kl_policy_to_target"] += (pi * (logp - log_target)).sum().item() / len(task.prompts)
        out["kl_target_to_policy"] += (target * (log_target - logp)).sum().item() / len(
            task.prompts)
        out["mean_reward"] += (pi * reward).sum().item() / len(task.prompts)
        out["target_mean_reward"] += (target * reward).sum().item() / len(task.prompts)
        rewarded = reward > 0
        out["modes_covered"] += int((pi[rewarded] >= 0.5 * target[rewarded]).sum())
        out["modes_total"] += int(rewarded.sum())
        out["dists"].append((texts, pi.tolist(), target.tolist(), reward.tolist()))
    return out


@torch.no_grad()
def avg_at_k(model, tokenizer, task, args):
    """Avg@k: mean reward of k samples per eval question at the eval temperature (FlowRL's
    setup); with k = 1 at T = 0 it is greedy accuracy."""
    prompts = [prompt for prompt, _ in task.eval_rows for _ in range(args.eval_k)]
    answers = [answer for _, answer in task.eval_rows for _ in range(args.eval_k)]
    samples = common.sample_completions(
        model, tokenizer, prompts, args.max_new_tokens, args.eval_temperature,
        batch_rows=args.gen_batch)
    return {
        "avg_at_k": sum(score(task.kind, text, a) for (text, _, _), a in zip(samples, answers))
        / len(samples)
    }


@torch.no_grad()
def answer_spread(model, tokenizer, task, args):
    """Where the correct answers go: `spread_samples` replies per question at T = 1 → success rate,
    distinct correct answers (summed over questions), and the entropy (nats) of the correct answers'
    empirical distribution, averaged over questions. A reward maximiser may pile onto one answer
    per question (entropy → 0); p* ∝ π_ref·exp(β·r) keeps π_ref's spread over the correct ones.
    One seed for the whole measurement, so every arm of a seed starts from the same numbers."""
    out = {"spread_reward": 0.0, "distinct_correct": 0, "correct_entropy": 0.0, "counts": []}
    n = args.spread_samples
    torch.manual_seed(common.sampling_seed(args.seed, 0, 0))  # step 0: never a training step
    replies = common.sample_completions(
        model, tokenizer, [prompt for prompt in task.prompts for _ in range(n)],
        args.max_new_tokens, batch_rows=args.gen_batch)
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


# ----------------------------------------------------------------------------- rollouts


@torch.no_grad()
def sample_groups(model, tokenizer, prompts, group_size, seeds, args, stop_at_eos):
    """G completions of each prompt → [(text, completion ids, sampler log-probs)], a group's G
    contiguous.

    `generate` draws from torch's global RNG, so seeding it per group (not per process) makes a
    group's samples the same whichever rank draws them: N processes sample exactly what one process
    would."""
    samples = []
    for prompt, seed in zip(prompts, seeds):
        torch.manual_seed(seed)
        samples += common.sample_completions(
            model, tokenizer, [prompt] * group_size, args.max_new_tokens, args.temperature,
            stop_at_eos, args.gen_batch)
    return samples


# ----------------------------------------------------------------------------- the loop


def validate(args):
    common.check_args(
        [
            (args.group_size >= 2, f"--group-size must be ≥ 2 (got {args.group_size})"),
            (args.lr > 0, f"--lr must be > 0 (got {args.lr})"),
            (args.logz_lr > 0, f"--logz-lr must be > 0 (got {args.logz_lr})"),
            (args.clip_eps > 0, f"--clip-eps must be > 0 (got {args.clip_eps})"),
            (args.steps >= 1 and args.inner_steps >= 1, "--steps and --inner-steps must be ≥ 1"),
            (
                args.micro_batch_tokens >= 1 and args.gen_batch >= 1,
                "--micro-batch-tokens and --gen-batch must be ≥ 1"),
            (args.temperature == 1.0, "--temperature must be 1.0: log-probs are scored at T = 1"),
            (
                (args.task == "math") == bool(args.data),
                "--task math (--preset full) needs --data FILE.jsonl; the other tasks take none"),
            (
                (args.task == "valleys") != bool(args.model),
                f"--task {args.task} needs --model (or a preset: full, smollm2-addition, "
                "smollm2-numbers); the valleys toy builds its own model",
            ),
            (args.spread_samples >= 1, "--spread-samples must be ≥ 1"),
        ]
    )


def train(args):
    """Roll out G answers per prompt, score them, then TB (FlowRL) or clipped-surrogate (GRPO)
    updates."""
    validate(args)
    common.seed_everything(args.seed)
    accelerator, device = common.setup_accelerator(args.device)
    if args.task == "valleys":
        tokenizer, model, task = build_toy(args)
    elif args.task == "math":
        tokenizer, model, task = build_full(args, device)
    else:
        tokenizer, model, task = build_laptop(args, device)
    model.to(device)
    toy = args.task == "valleys"
    # π_ref: the same network with LoRA disabled, or a frozen copy of the starting weights .
    ref_model = None if args.lora_rank else copy.deepcopy(model).eval().requires_grad_(False)
    head = LogZHead(model.config.hidden_size).to(device)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.lr}]
    if args.algo == "flowrl":  # the log Z head learns only under TB
        groups.append({"params": head.parameters(), "lr": args.logz_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    autocast = common.training_autocast(device)
    # TRY NOT TO MODIFY: more than one process (`accelerate launch`) → DDP wrappers for the training
    # forward; sampling and evaluation use the plain modules. Each rank rolls out its own block of
    # groups.
    train_model = accelerator.prepare(model)
    train_head = accelerator.prepare(head) if args.algo == "flowrl" else head
    mine = common.local_groups(args.prompts_per_step, accelerator)
    name = "flowrl" + ("" if args.task in ("valleys", "math") else f"-{args.task}")
    out_dir = Path(args.out_dir or f"runs/{name}{'' if args.algo == 'flowrl' else '-' + args.algo}")
    logger = tracking.RunLogger(
        out_dir, dataclasses.asdict(args) | {"preset": args.preset}, args.steps, f"{args.algo}",
        quiet=args.quiet, main_process=accelerator.is_main_process)
    gen = torch.Generator().manual_seed(args.seed)

    def evaluate():
        if not accelerator.is_main_process:  # only rank 0 logs, so only it evaluates
            return {}
        metrics = (
            exact_metrics(model, ref_model, tokenizer, task, args.beta)
            if toy
            else answer_spread(model, tokenizer, task, args)
            if args.task == "numbers"
            else avg_at_k(model, tokenizer, task, args)
            if task.eval_rows
            else {}
        )
        model.train()
        return metrics

    first = evaluate()
    sampler_dev, start = 0.0, 1
    checkpoint = out_dir / "checkpoint.safetensors"
    state_objects = ({"model": model, "head": head}, {"optimizer": optimizer}, {"rollouts": gen})
    # weights, optimiser, RNGs and metrics so far: continues bit-exactly
    if args.resume and checkpoint.exists():
        done, extra = tracking.load_training_state(checkpoint, *state_objects)
        first, sampler_dev, start = extra["first"], extra["sampler_dev"], done + 1
        logger.restore(extra["records"])
    for step in range(start, args.steps + 1):
        # ALGO LOGIC
        # 1. sample G completions per prompt (this rank's groups), keeping the sampler's log-probs
        picked = torch.randint(len(task.prompts), (args.prompts_per_step,), generator=gen)[
            mine.start : mine.stop
        ]
        seeds = [common.sampling_seed(args.seed, step, g) for g in mine]
        idx = picked.repeat_interleave(args.group_size).tolist()
        prompts = [task.prompts[i] for i in idx]
        samples = sample_groups(
            model, tokenizer, [task.prompts[i] for i in picked], args.group_size, seeds, args,
            stop_at_eos=not toy)
        # 2. rewards r
        rewards = torch.tensor([task.reward(i, text) for i, (text, _, _) in zip(idx, samples)])
        # 3. micro-batches bounded by --micro-batch-tokens; π_ref's log-probs once (all but GRPO)
        completions = [ids for _, ids, _ in samples]
        token_count = max(1, sum(len(c) for c in completions))
        with autocast:
            batches = common.scored_micro_batches(
                tokenizer, prompts, completions, [logp for _, _, logp in samples],
                args.micro_batch_tokens, device, model if args.algo != "grpo" else None, ref_model)
        # 4. what each objective learns from. TB: r̂ = the group-normalised reward (the paper) or r
        #    itself (DEVIATION 1). GRPO: A from r. GRPO-KL: A from r − log(π_old/π_ref)/(β·|y|),
        #    the sequence-level KL-regularised reward whose optimum is TB's target p* (DEVIATION 6)
        reward_hat = (
            common.group_advantages(rewards, args.group_size)
            if args.reward_norm == "group"
            else rewards
        ).to(device)
        shaped = rewards
        if args.algo == "grpo-kl":
            log_ratio = torch.zeros(len(samples))
            for mb in batches:
                sampled = torch.stack([samples[r][2].sum() for r in mb.rows])
                log_ratio[mb.rows] = sampled - (mb.ref_logp * mb.mask).sum(1).float().cpu()
            lengths = torch.tensor([max(1, len(c)) for c in completions], dtype=torch.float)
            shaped = rewards - log_ratio / (args.beta * lengths)
        advantages = common.group_advantages(shaped, args.group_size).to(device)
        # 5. inner_steps optimiser steps on this batch, gradients accumulated over the micro-batches
        model.train()
        for inner in range(args.inner_steps):
            optimizer.zero_grad()
            for mb in batches:
                ids, attn, mask, rows = mb.ids, mb.attn, mb.mask, mb.rows
                with autocast:
                    scored = common.completion_logprobs(  # (B, W), and hidden (B, P+W, H)
                        train_model, ids, attn, mask.shape[1], return_hidden=args.algo == "flowrl")
                logp, hidden = scored if args.algo == "flowrl" else (scored, None)
                if inner == 0:  # not yet updated: training must score what the sampler drew
                    sampler_dev = max(
                        sampler_dev, ((logp.detach() - mb.old_logp) * mask).abs().max().item())
                if args.algo == "flowrl":
                    plen = ids.shape[1] - mask.shape[1]
                    prompt_hidden = hidden[:, :plen]
                    if args.detach_logz:
                        prompt_hidden = prompt_hidden.detach()
                    log_z = train_head(prompt_hidden, attn[:, :plen].float())  # log Z_φ(x), (B,)
                    weight = importance_weight(
                        common.sequence_logprob(logp, mask),
                        common.sequence_logprob(mb.old_logp, mask), args.clip_eps)
                    loss, residual = trajectory_balance_loss(
                        log_z, common.sequence_logprob(logp, mask, length_normalize=True),
                        common.sequence_logprob(mb.ref_logp, mask, length_normalize=True),
                        reward_hat[rows], args.beta, weight, num_rows=len(samples))
                    stats = {"log_z": log_z.mean().item(), "w_mean": weight.mean().item(),
                             "residual_abs": residual.abs().mean().item()}
                else:
                    loss, stats = grpo_loss(
                        logp, mb.old_logp, advantages[rows], mask, args.clip_eps, token_count)
                if not torch.isfinite(loss):
                    raise SystemExit(
                        f"error: non-finite loss at step {step}; lower --lr or check the reward")
                accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        # TRY NOT TO MODIFY: logging and checkpoints
        # the whole step's rewards; loss stats are rank 0's
        rewards = accelerator.gather(rewards.to(device)).cpu()
        record = {
            "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            "loss": loss.item(),
            "zero_var_frac": common.zero_variance_fraction(rewards, args.group_size),
            "sampler_logprob_max_dev": sampler_dev, **stats}
        if step % args.eval_every == 0 and step < args.steps:
            record |= scalars(evaluate())
        if step == args.steps:
            final = evaluate()
            record |= scalars(final)
        logger.log(step, **record)
        if args.save_every and step % args.save_every == 0 and accelerator.is_main_process:
            tracking.save_training_state(
                checkpoint,
                step,
                *state_objects,
                extra={
                    "first": {k: v for k, v in first.items() if k != "dists"},
                    "sampler_dev": sampler_dev, "records": logger.records},
            )

    if sampler_dev > 1e-3:
        print(f"WARNING: training log-probs differ from the sampler's by up to {sampler_dev:.2e}")
    if start > args.steps:  # resumed a finished run
        final = evaluate()
    summary = {k: v for k, v in final.items() if k != "dists"} | {
        "algo": args.algo, "sampler_logprob_max_dev": sampler_dev,
        "before": {k: v for k, v in first.items() if k != "dists"}}
    if toy and final:  # the row of `make demo`'s table
        summary["claim"] = {"text": CLAIMS[args.algo], "before": first["kl_policy_to_target"],
                            "after": final["kl_policy_to_target"]}
    plots = [("reward.png", ["reward", "zero_var_frac"], f"{args.algo}: reward")]
    if toy and final:
        plot_valleys(final["dists"][0], out_dir / "valleys.png", args.algo)
        plots.append(
            ("kl.png", ["kl_policy_to_target", "kl_target_to_policy"], f"{args.algo}: exact KL"))
    if args.task == "numbers" and final and accelerator.is_main_process:
        plot_answer_counts(first["counts"], final["counts"], out_dir / "answers.png", args.algo)
    if task.eval_rows:
        plots.append(("eval.png", ["avg_at_k"], f"{args.algo}: Avg@{args.eval_k}"))
    if not toy and accelerator.is_main_process:
        model.save_pretrained(out_dir / "policy")  # the log Z head stays out of the exported model
        tokenizer.save_pretrained(out_dir / "policy")
    return logger.finish(summary, plots)


def scalars(metrics):
    """The numbers among an evaluation's results (what metrics.jsonl logs per step)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def plot_answer_counts(before, after, path, algo):
    """One panel per question: how often each correct answer was sampled, at the start and at the
    end (answer_spread's counts)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3 * len(before), 2.8), dpi=100)
    for ax, question, start, end in zip(
        fig.subplots(1, len(before)), NUMBER_QUESTIONS, before, after):
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


def plot_valleys(dist, path, algo, top=16):
    """Bars of target p* vs learned π over the answers with the most target mass (the paper's Figure
    1 view)."""
    from matplotlib.figure import Figure

    texts, pi, target, _ = dist
    order = sorted(range(len(texts)), key=lambda j: -target[j])[:top]
    fig = Figure(figsize=(6, 3), dpi=100)
    ax = fig.subplots()
    xs = torch.arange(len(order)).numpy()
    ax.bar(xs - 0.2, [target[j] for j in order], 0.4, label="target p*")
    ax.bar(xs + 0.2, [pi[j] for j in order], 0.4, label=f"{algo} π")
    ax.set_xticks(xs, [texts[j].replace(" ", "") for j in order], rotation=90, fontsize=7)
    ax.set(title=f"{algo}: probability of each answer (prompt x0)", ylabel="probability")
    ax.legend(fontsize=8)
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
        curves, Path(runs_dir) / "flowrl_vs_grpo_kl.png", "exact KL(π‖p*) on the toy", "KL",
        logy=True)


CLAIMS = {"flowrl": "FlowRL: exact KL(π‖p*) goes down",
          "grpo": "GRPO baseline: exact KL(π‖p*) goes up",
          "grpo-kl": "GRPO-KL control (same target): KL goes down"}
SWEEP_ARMS = [
    ("flowrl", {"algo": "flowrl"}), ("grpo", {"algo": "grpo"}), ("grpo-kl", {"algo": "grpo-kl"})]


def sweep_row(summaries):
    """One seed of the sweep: exact KL(π‖p*) per arm at the end, and modes covered by FlowRL."""
    return {
        "kl_at_ref": summaries["flowrl"]["before"]["kl_policy_to_target"],
        **{f"kl_{name}": summaries[name]["kl_policy_to_target"] for name, _ in SWEEP_ARMS},
        "covered_at_ref": summaries["flowrl"]["before"]["modes_covered"],
        **{f"covered_{name}": summaries[name]["modes_covered"] for name, _ in SWEEP_ARMS}}


def claim_holds(row):
    """The paper's claim on one seed: FlowRL ends within 0.2 nats of p*, ≥ 10× closer than GRPO."""
    return row["kl_flowrl"] <= 0.2 and 10 * row["kl_flowrl"] <= row["kl_grpo"]


SPREAD_ARMS = [("flowrl", {"algo": "flowrl"}), ("grpo", {"algo": "grpo"})]


def spread_row(summaries):
    """One seed of the numbers task: success rate, distinct correct answers and their entropy at
    the start (the same for both arms) and at the end of each arm."""
    row = {}
    for metric, short in [
        ("spread_reward", "reward"), ("distinct_correct", "distinct"),
        ("correct_entropy", "entropy")]:
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
        (entropy, "entropy", "entropy of correct answers (nats)")]:
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


if __name__ == "__main__":
    args = common.parse_args(Args, PRESETS)
    if args.seeds and args.task == "numbers":
        sweep_dir = args.out_dir or "runs/flowrl-numbers-sweep"
        sweep.seed_sweep(train, args, SPREAD_ARMS, spread_row, spread_claim, sweep_dir)
        plot_spread_comparison(sweep_dir)
    elif args.seeds:
        sweep_dir = args.out_dir or "runs/flowrl-sweep"
        sweep.seed_sweep(train, args, SWEEP_ARMS, sweep_row, claim_holds, sweep_dir)
    else:
        print(json.dumps(train(args), indent=2))
