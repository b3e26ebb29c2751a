"""Flow-GRPO's toy: a flow-matching model of 8×8 digit images (scikit-learn's digits), class-
conditioned, pretrained on partly mislabelled data so that its samples match the prompt only half
the time. The reward is a classifier's probability of the prompted digit; an independent judge
(another classifier on the other half of the data) checks the result. Also the diversity measure,
the sample grid and the sweep's claim.
"""

import copy
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import tracking


def mean_pairwise_distance(images, prompt_ids):
    """Diversity: mean L2 distance between two samples of the same prompt, averaged over prompts."""
    flat, labels, out = images.flatten(1).float(), torch.tensor(prompt_ids), []
    for p in labels.unique():
        group = flat[(labels == p).to(flat.device)]
        if len(group) > 1:
            d = torch.cdist(group, group)
            out.append(d.sum().item() / (len(group) * (len(group) - 1)))
    return float(np.mean(out))


class DigitVelocity(nn.Module):
    """v_θ(x, t, c) for flattened 8×8 digits: an MLP on [x, Fourier features of t, class embedding].

    Class 10 is the empty prompt (trained by label dropout) so classifier-free guidance works.
    """

    def __init__(self, dim=64, hidden=256, classes=10):
        super().__init__()
        self.embed = nn.Embedding(classes + 1, 32)
        self.net = nn.Sequential(
            nn.Linear(dim + 32 + 16, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, dim),
        )

    def forward(self, x, t, labels):
        freqs = t[:, None] * torch.pi * 2.0 ** torch.arange(8, device=x.device)  # (N, 8)
        return self.net(torch.cat([x, freqs.sin(), freqs.cos(), self.embed(labels)], 1))


def digits_split(seed):
    """scikit-learn's bundled 8×8 digits scaled to [−1, 1]: (train_x, train_y, test_x, test_y),
    80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 8.0 - 1.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def pretrain_velocity(x, y, label_noise, seed, steps=3000):
    """Conditional rectified flow: min ‖v_θ(x_t, t, c) − (x1 − x0)‖², x_t = (1−t)·x0 + t·x1.

    `label_noise` of the labels are replaced by random digits, so the base model follows its prompt
    only part of the time (the toy's analogue of SD3.5-M's 63% on GenEval); 10% go to the empty
    prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    model = DigitVelocity()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    noisy = torch.where(
        torch.rand(len(y), generator=gen) < label_noise,
        torch.randint(10, y.shape, generator=gen),
        y,
    )
    for _ in range(steps):
        idx = torch.randint(len(x), (256,), generator=gen)
        x0, c = x[idx], noisy[idx]
        c = torch.where(torch.rand(len(c), generator=gen) < 0.1, torch.full_like(c, 10), c)
        x1 = torch.randn(x0.shape, generator=gen)
        t = torch.rand(len(x0), generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        loss = F.mse_loss(model(xt, t, c), x1 - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sched.step()
    return model


def train_classifier(x, y, seed, steps=600):
    """The reward model: a small MLP classifier of digits (cross-entropy, light input noise)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-3)
    for _ in range(steps):
        idx = torch.randint(len(x), (128,), generator=gen)
        loss = F.cross_entropy(
            model(x[idx] + 0.1 * torch.randn(x[idx].shape, generator=gen)), y[idx]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False)


def cached_models(cache, base, classifier):
    """Load the toy's base model and classifier from `cache`; False when there is none, or it is
    unreadable (it is then trained again and rewritten, with a note)."""
    if not cache.exists():
        return False
    try:
        tensors, _ = tracking.load_checkpoint(cache)
        base.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("base.")})
        classifier.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("clf.")})
    except Exception as err:  # noqa: BLE001 - a cache: rebuilt, whatever broke it
        print(
            f"note: {cache} is unreadable ({type(err).__name__}); training the toy's models again",
            file=sys.stderr,
        )
        return False
    return True


class DigitsTask:
    """The toy: prompts are the digits 0–9 (10 = empty), images flattened 8×8 in [−1, 1], the reward
    P(prompted digit) under a classifier, and an independent logistic-regression judge (never a
    reward)."""

    def __init__(self, args, device):
        from sklearn.linear_model import LogisticRegression

        train_x, train_y, test_x, test_y = digits_split(args.seed)
        key = hashlib.sha1(json.dumps([args.seed, args.label_noise]).encode()).hexdigest()[:10]
        cache = Path(args.cache_dir) / f"digits-{key}.safetensors"
        base, classifier = (
            DigitVelocity(),
            nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10)),
        )
        # TRY NOT TO MODIFY: the base model and reward are trained once and cached
        if not cached_models(cache, base, classifier):
            base = pretrain_velocity(train_x, train_y, args.label_noise, args.seed)
            classifier = train_classifier(train_x, train_y, args.seed)
            tracking.save_checkpoint(
                cache,
                {
                    **{f"base.{k}": v for k, v in base.state_dict().items()},
                    **{f"clf.{k}": v for k, v in classifier.state_dict().items()},
                },
                {},
            )
        self.device = device
        self.classifier = classifier.eval().requires_grad_(False).to(device)
        self.judge = LogisticRegression(max_iter=2000).fit(train_x.numpy(), train_y.numpy())
        self.prompts = self.eval_prompts = list(range(10))
        self.latent_shape = (64,)
        self.policy = base.to(device)
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)  # DEVIATION 4
        self.info = {
            "reward_model_test_accuracy": (
                self.classifier(test_x.to(device)).argmax(1).cpu() == test_y
            )
            .float()
            .mean()
            .item(),
            "judge_test_accuracy": self.judge.score(test_x.numpy(), test_y.numpy()),
            "diversity_test_data": mean_pairwise_distance(test_x, test_y.tolist()),
        }

    def velocity(self, net, x, sigma, cond):
        return net(x, sigma.expand(len(x)), cond[0])

    def ref_velocity(self, x, sigma, cond):
        return self.reference(x, sigma.expand(len(x)), cond[0])

    def encode(self, prompts):
        return (torch.tensor(prompts, device=self.device),)

    def empty(self, n):
        return (torch.full((n,), 10, device=self.device),)

    def decode(self, latents):
        return latents.clamp(-1, 1)

    def reward(self, images, prompts):
        probs = self.classifier(images.to(self.device)).softmax(-1)
        return probs.gather(1, torch.tensor(prompts, device=self.device)[:, None])[:, 0]

    def accuracy(self, images, prompts):
        """Accuracy under the reward classifier, and under the independent judge (catches reward
        hacking)."""
        wanted = torch.tensor(prompts)
        return {
            "accuracy": (self.classifier(images.to(self.device)).argmax(1).cpu() == wanted)
            .float()
            .mean()
            .item(),
            "accuracy_judge": float(
                np.mean(self.judge.predict(images.cpu().numpy()) == wanted.numpy())
            ),
        }

    def save(self, out):
        torch.save(self.policy.state_dict(), out / "policy.pt")


def plot_digit_grid(before, after, per_prompt, path, columns=8):
    """Before/after ODE samples, one row per prompted digit (the same noise in both panels)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=100)
    axes = fig.subplots(1, 2)
    for ax, images, title in [(axes[0], before, "base model"), (axes[1], after, "after Flow-GRPO")]:
        grid = images.view(10, per_prompt, 8, 8)[:, :columns].cpu()  # (digit, sample, row, col)
        grid = F.pad(grid, (1, 1, 1, 1), value=-1.0)  # a white frame around each sample
        ax.imshow(
            grid.permute(0, 2, 1, 3).reshape(100, 10 * grid.shape[1]).numpy(),
            cmap="gray_r",
            vmin=-1,
            vmax=1,
        )
        ax.set(title=title, xticks=[], yticks=[5 + 10 * i for i in range(10)])
        ax.set_yticklabels([f"'{d}'" for d in range(10)])
    fig.tight_layout()
    fig.savefig(path)


def sweep_row(summaries):
    """One seed of the sweep: ODE accuracy before and after, and diversity kept (after / before)."""
    s = summaries[""]
    return {
        "accuracy_before": s["accuracy_before"],
        "accuracy_after": s["accuracy_after"],
        "judge_after": s["accuracy_judge_after"],
        "diversity_kept": s["diversity_after"] / s["diversity_before"],
    }


def claim_holds(row):
    """The toy's claim on one seed: accuracy ≥ 0.95 with ≥ 70% of the base model's diversity."""
    return row["accuracy_after"] >= 0.95 and row["diversity_kept"] >= 0.7
