"""RC-GRPO's toy: "delete F" on a real GorillaFileSystem; F sits in `docs` except on rare tasks.

Experts look first (find → cd to the folder found → rm) and were recorded on the common case only,
so imitation learns `cd docs`; the careless base model sometimes copies the folder it found.
"""

import random
import re

from envs import bfcl
from utils import models

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
                "type": "file",
                "content": f"{other} content",
            }
        entries.append(
            {
                "id": f"toy_{k}",
                "category": "toy",
                "involved_classes": ["GorillaFileSystem"],
                "initial_config": {
                    "GorillaFileSystem": {
                        "root": {"workspace": {"type": "directory", "contents": contents}}
                    }
                },
                "question": [[{"role": "user", "content": f"delete {target}"}]],
                "ground_truth": [
                    [
                        f"find(name='{target}')",
                        f"cd(folder='{folder}')",
                        f"rm(file_name='{target}')",
                    ]
                ],
                "rare": rare,
                "demonstrated": not rare,  # experts were recorded on the common case only
            }
        )
    return entries[:n], entries[n:]


class ToyFormat:
    """How the toy LM writes a dialogue: `role content ... asst` in words it knows, no system
    prompt, calls one word per token (`[ cd ( folder = 'docs' ) ]`, still valid Python), tool
    results as the words they contain (folder and file names survive)."""

    def system_messages(self, entry):
        return []

    def render(self, messages):
        turns = [f"{m['role'].replace('assistant', 'asst')} {m['content']}" for m in messages]
        return " ".join(turns) + " asst"

    def call_text(self, call):
        name, args, kwargs = bfcl.parse_calls(call)[0]
        arguments = [repr(a) for a in args] + [f"{k} = {v!r}" for k, v in kwargs.items()]
        return "[ " + name + " ( " + " , ".join(arguments) + " ) ]"

    def observation(self, text):
        return " ".join(re.findall(r"[A-Za-z_]+(?:\.[a-z]+)?", text)) or "None"


def sloppy_agent_steps(entry, rng):
    """The toy's "base model" behaviour: syntax-correct but careless (sometimes looks first, often
    guesses)."""
    target = entry["question"][0][0]["content"].split()[-1]
    folder = bfcl.parse_calls(entry["ground_truth"][0][1])[0][2]["folder"]
    steps = []
    if rng.random() < 0.4:
        steps.append(f"find(name={target!r})")
        steps.append(f"cd(folder={folder if rng.random() < 0.9 else rng.choice(TOY_DIRS)!r})")
    else:
        steps.append(f"cd(folder={rng.choice(TOY_DIRS)!r})")
    steps.append(f"rm(file_name={target if rng.random() < 0.7 else rng.choice(TOY_FILES)!r})")
    return steps


def build_toy(args, device, special_tokens):
    """The toy world with an untrained tiny Qwen2, and the data its "base model" is pretrained on:
    a careless agent's trajectories (real env observations) on generic tasks, whose files sit in
    any folder alike. `special_tokens` (the reward tokens) are never split."""
    train, test = toy_entries(args.toy_tasks, args.seed, args.rare_share, args.toy_test_tasks)
    generic, _ = toy_entries(args.toy_tasks, args.seed + 1, rare_share=0.75, n_test=0)
    words = [
        "user",
        "asst",
        "tool",
        "delete",
        "done",
        "[",
        "]",
        "(",
        ")",
        ",",
        "=",
        "[Reward",
        "Goal:",
        "None",
        "matches",
        "Error",
        "find",
        "cd",
        "rm",
        "ls",
        "name",
        "folder",
        "file_name",
        *TOY_DIRS,
        *TOY_FILES,
        *[repr(w) for w in TOY_DIRS + TOY_FILES],
    ]
    tokenizer = models.make_tokenizer(words, special_tokens=special_tokens)
    model = models.tiny_causal_lm(
        len(tokenizer), seed=args.seed, gradient_checkpointing=args.gradient_checkpointing
    )
    model = model.to(device)
    world = bfcl.World(
        train,
        test,
        tokenizer,
        model,
        text_format=ToyFormat(),
        end_text="done",
        limits=bfcl.Limits.from_args(args),
    )
    rng = random.Random(args.seed)
    base_data = [
        s
        for e in generic
        for _ in range(3)
        for s in bfcl.trajectory_samples(world, e, None, sloppy_agent_steps(e, rng))
    ]
    return world, base_data


def folder_success(outcomes, high, low):
    """The toy's success per folder kind (common "docs" or rare) and token (high, low, untagged),
    from a step's gathered outcomes ({token, reward, rare}); {} outside the toy (no rare tasks)."""
    if not any(o["rare"] for o in outcomes):
        return {}
    record = {}
    for kind in ("common", "rare"):
        for tag, token in (("high", high), ("low", low), ("untagged", None)):
            hits = [
                o["reward"]
                for o in outcomes
                if bool(o["rare"]) == (kind == "rare") and o["token"] == token
            ]
            if hits:
                record[f"success_{tag}_{kind}"] = sum(hits) / len(hits)
    return record


def results_table(summary, arms):
    """Table 1 in miniature: held-out accuracy and mean zero-variance fraction per arm."""
    lines = [f"{'arm':<14} {'accuracy':>9} {'zero-var':>9}"]
    lines += [
        f"{a:<14} {summary[a]['accuracy']:>9.3f} {summary[a]['zero_variance_fraction']:>9.3f}"
        for a in arms
    ]
    return "\n".join(lines)


TABLE_1 = ("sft+grpo", "sft+rc-grpo", "rctp+grpo", "rctp+rc-grpo")


def sweep_row(summaries):
    """One seed of the sweep: RCTP's token gap ε; the rare-folder accuracy and zero-variance
    fraction of the two arms the claim compares; then the held-out accuracy (high token) and final
    entropy of every arm of Table 1 the run trained."""
    s = summaries[""]
    return {
        "token_gap": s["token_gap"],
        "rare_sft_grpo": s["sft+grpo"].get("rare_accuracy", float("nan")),
        "rare_rctp_rc": s["rctp+rc-grpo"].get("rare_accuracy", float("nan")),
        "zv_sft_grpo": s["sft+grpo"]["zero_variance_fraction"],
        "zv_rctp_rc": s["rctp+rc-grpo"]["zero_variance_fraction"],
        **{f"acc_{arm}": s[arm]["accuracy"] for arm in TABLE_1 if arm in s},
        **{f"entropy_{arm}": s[arm]["entropy"] for arm in TABLE_1 if arm in s},
    }


def claim_holds(row):
    """The paper's claim on one seed: RCTP+RC-GRPO beats SFT+GRPO in accuracy with fewer
    zero-variance groups, from a stage 1 with a token gap ε ≥ 0.2."""
    return (
        row["acc_rctp+rc-grpo"] > row["acc_sft+grpo"]
        and row["zv_rctp_rc"] < row["zv_sft_grpo"]
        and row["token_gap"] >= 0.2
    )
