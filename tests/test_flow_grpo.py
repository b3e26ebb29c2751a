"""flow_grpo.py: the SDE step on hand-checkable cases, marginal preservation, the toy end to end,
tiny SD3."""

import math

import pytest
import torch
import torch.nn.functional as F

import flow_grpo
from envs import sd3
from utils import cli, distributed


@pytest.fixture
def cache_dir(flow_grpo_cache):
    return flow_grpo_cache  # the toy's base model is trained once per session (conftest)


def toy_args(tmp_path, cache_dir, *extra):
    return cli.parse_args(
        flow_grpo.Args,
        flow_grpo.PRESETS,
        ["--quiet", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir), *extra],
    )


def gaussian_velocity(mu, s0):
    """Exact rectified-flow velocity E[x1 − x0 | x_t] for data x0 ~ N(mu, s0²), noise x1 ~ N(0,
    1)."""

    def velocity(x, t, cond):
        t = float(t)
        var = (1 - t) ** 2 * s0**2 + t**2
        centered = x - (1 - t) * mu
        return t / var * centered - (mu + (1 - t) * s0**2 / var * centered)

    return velocity


def test_sde_mean_reduces_to_the_euler_step_as_noise_vanishes():
    torch.manual_seed(0)
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    _, _, mean, std = flow_grpo.sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=1e-6)
    torch.testing.assert_close(mean, x + (0.5 - 0.6) * v)
    assert std < 1e-6
    _, _, mean_big, _ = flow_grpo.sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=0.7)
    assert (mean_big - mean).abs().max() > 1e-3  # the score correction is really there


def test_sde_step_hand_numbers_and_the_t_equals_one_substitution():
    x, v = torch.tensor([[1.0]]), torch.tensor([[2.0]])
    # t = 0.5, dt = −0.1, a = 1: σ_t² = 1, mean = 1 + (2 + 1·(1 + 0.5·2)/(2·0.5))·(−0.1) = 1 − 0.4 =
    # 0.6
    _, _, mean, std = flow_grpo.sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=1.0)
    assert mean.item() == pytest.approx(0.6) and std == pytest.approx(math.sqrt(0.1))
    # t = 1 would divide by zero: σ_t uses 1 − sigma_next there (Eqs. 7–9), so the step is finite
    _, log_prob, mean, std = flow_grpo.sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7)
    assert (
        std == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1))
        and torch.isfinite(log_prob).all()
    )


def test_logprob_is_the_gaussian_density_and_rescoring_reproduces_it():
    torch.manual_seed(0)
    x, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    prev, log_prob, mean, std = flow_grpo.sde_step_with_logprob(v, x, 0.8, 0.7, 0.7)
    independent = torch.distributions.Normal(mean, std).log_prob(prev).flatten(1).mean(1)
    torch.testing.assert_close(log_prob, independent)
    _, rescored, _, _ = flow_grpo.sde_step_with_logprob(v, x, 0.8, 0.7, 0.7, prev_sample=prev)
    assert torch.equal(rescored, log_prob)


def test_the_ode_has_no_logprob():
    with pytest.raises(ValueError, match="no log-prob"):
        flow_grpo.sde_step_with_logprob(
            torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, noise_level=0.0
        )


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_sde_and_ode_sampling_reach_the_same_marginal(noise_level):
    mu, s0 = 2.0, 0.5
    velocity = gaussian_velocity(mu, s0)
    sigmas = flow_grpo.schedule(200, 1.0, torch.device("cpu"))
    noise = torch.randn(20000, 4, generator=torch.Generator().manual_seed(0))
    ode, _ = flow_grpo.rollout(velocity, noise, sigmas, (None,), (None,), 1.0, 0.0)
    step_noise = torch.randn(200, 20000, 4, generator=torch.Generator().manual_seed(1))
    sde, log_probs = flow_grpo.rollout(
        velocity, noise, sigmas, (None,), (None,), 1.0, noise_level, step_noise
    )
    for final in (ode[-1], sde[-1]):
        assert final.mean().item() == pytest.approx(mu, abs=0.01)
        assert final.std().item() == pytest.approx(s0, abs=0.01)
    assert log_probs.shape == (200, 20000)
    # the same noise without the score correction lands elsewhere: the test can tell
    x = noise.clone()
    for j in range(200):
        dt = float(sigmas[j + 1] - sigmas[j])
        t = float(sigmas[j])
        sigma_t = noise_level * math.sqrt(t / (1 - (float(sigmas[j + 1]) if t >= 1 else t)))
        x = x + dt * velocity(x, t, None) + sigma_t * math.sqrt(-dt) * torch.randn_like(x)
    assert abs(x.std().item() - s0) > 0.1


def test_kl_is_zero_for_equal_means_and_hand_checked_otherwise():
    mean = torch.randn(2, 3)
    assert flow_grpo.gaussian_mean_kl(mean, mean, 0.5).abs().max() == 0
    kl = flow_grpo.gaussian_mean_kl(torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), 0.5)
    assert kl.item() == pytest.approx((1 + 9) / 2 / (2 * 0.25))


def test_classifier_free_guidance():
    velocity = lambda x, t, cond: x * cond[0]  # noqa: E731  (v_c = 3x, v_∅ = x)
    x = torch.ones(2, 1)
    out = flow_grpo.guided_velocity(
        velocity, x, 0.5, (torch.full((2, 1), 3.0),), (torch.ones(2, 1),), 4.5
    )
    torch.testing.assert_close(out, x * (1 + 4.5 * 2))


@pytest.mark.slow
def test_toy_flow_grpo_learns_and_keeps_diversity(tmp_path, cache_dir):
    s = flow_grpo.train(toy_args(tmp_path, cache_dir, "--seed", "1"))
    # Margins (five-seed sweep, docs/flow_grpo.md): accuracy 0.46–0.55 → ≥ 0.99 on every seed, so
    # 0.75 is half-way from the start to the worst seed; the independent judge gives ≥ 0.985.
    # Diversity keeps ≥ 0.735 of its start on every seed; the test asks for half.
    assert s["accuracy_before"] < 0.7
    assert s["accuracy_after"] >= 0.75 and s["accuracy_judge_after"] >= 0.75
    assert s["diversity_after"] >= 0.5 * s["diversity_before"]


def sd3_args(tmp_path, tiny, *extra):
    sd3, clip, prompts = tiny
    return cli.parse_args(
        flow_grpo.Args,
        flow_grpo.PRESETS,
        [
            "--preset",
            "sd3",
            "--model",
            str(sd3),
            "--reward",
            "clip",
            "--reward-model",
            str(clip),
            "--prompts",
            str(prompts),
            "--epochs",
            "2",
            "--prompts-per-epoch",
            "2",
            "--group-size",
            "2",
            "--resolution",
            "16",
            "--train-steps",
            "3",
            "--eval-steps",
            "2",
            "--eval-per-prompt",
            "2",
            "--mixed-precision",
            "fp32",
            "--device",
            "cpu",
            "--quiet",
            "--eval-prompts",
            str(prompts),
            "--eval-batch",
            "4",
            "--no-gradient-checkpointing",
            "--out-dir",
            str(tmp_path),
            *extra,
        ],
    )


def test_sd3_preset_path_with_tiny_components_and_lora_round_trip(tmp_path, tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    # --ema 0: the EMA first moves at the 7th optimiser step, after this short run
    summary = flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--lr", "1e-2", "--ema", "0"))
    assert summary["sampler_ratio_max_dev"] < 1e-5
    assert math.isfinite(summary["reward_after"])
    # the saved LoRA loads with diffusers' standard loader and changes the transformer's output
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3[0])
    x, t = torch.randn(1, 4, 16, 16), torch.tensor([500.0])
    embeds, pooled = torch.randn(1, 8, 32), torch.randn(1, 64)
    with torch.no_grad():
        base = pipe.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled
        )[0]
        pipe.load_lora_weights(tmp_path / "lora")
        tuned = pipe.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled
        )[0]
    assert (tuned - base).abs().max() > 1e-6


def test_sd3_reference_is_the_disabled_adapter(tmp_path, tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    task = sd3.SD3Task(sd3_args(tmp_path, tiny_sd3, "--lora-rank", "4"), torch.device("cpu"))
    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd3[0]).transformer
    cond = task.encode(["a red cat"])
    x, sigma = torch.randn(1, 4, 16, 16), torch.tensor(0.5)
    with torch.no_grad():
        for name, p in task.policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)  # move the adapter away from its zero init
        policy_v, ref_v = (
            task.velocity(task.policy, x, sigma, cond),
            task.ref_velocity(x, sigma, cond),
        )
        base_v = base(
            hidden_states=x,
            timestep=1000 * sigma[None],
            encoder_hidden_states=cond[0],
            pooled_projections=cond[1],
        )[0]
    torch.testing.assert_close(ref_v, base_v)
    assert (policy_v - ref_v).abs().max() > 1e-4
    # and the adapter is back on after the reference pass
    torch.testing.assert_close(task.velocity(task.policy, x, sigma, cond), policy_v)


def test_ode_rollout_equals_the_diffusers_pipeline(tmp_path, tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    task = sd3.SD3Task(
        sd3_args(tmp_path, tiny_sd3, "--lora-rank", "4", "--guidance", "4.5"), torch.device("cpu")
    )
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3[0])
    noise = torch.randn(2, *task.latent_shape, generator=torch.Generator().manual_seed(0))
    cond, empty = task.encode(["a red cat", "a dog"]), task.empty(2)
    latents, _ = flow_grpo.rollout(
        lambda x, s, c: task.velocity(task.policy, x, s, c),
        noise,
        flow_grpo.schedule(6, 3.0, torch.device("cpu")),
        cond,
        empty,
        4.5,
        0.0,
    )
    expected = pipe(
        prompt_embeds=cond[0],
        pooled_prompt_embeds=cond[1],
        negative_prompt_embeds=empty[0],
        negative_pooled_prompt_embeds=empty[1],
        latents=noise.clone(),
        num_inference_steps=6,
        guidance_scale=4.5,
        output_type="latent",
    ).images
    torch.testing.assert_close(latents[-1], expected, atol=1e-5, rtol=1e-5)


def test_evaluation_runs_in_chunks_and_needs_a_held_out_file(tmp_path, tiny_sd3):
    _, _, prompts = tiny_sd3
    # 9 images, chunks of 2
    args = sd3_args(tmp_path, tiny_sd3, "--eval-batch", "2", "--eval-per-prompt", "3")
    task = sd3.SD3Task(args, torch.device("cpu"))
    accelerator, _ = distributed.setup_accelerator("cpu")
    seen = []
    reward = task.reward
    task.reward = lambda images, batch: seen.append(len(batch)) or reward(images, batch)
    velocity = lambda x, s, c: task.velocity(task.policy, x, s, c)  # noqa: E731
    metrics, _ = flow_grpo.evaluate(
        task, args, velocity, flow_grpo.schedule(2, 3.0, torch.device("cpu")), accelerator
    )
    assert seen == [2, 2, 2, 2, 1] and math.isfinite(metrics["reward"])
    args.eval_prompts = ""
    with pytest.raises(SystemExit, match="--eval-prompts"):
        flow_grpo.train(args)


def tiny_full_size_transformer():
    """SD3's latent shape at 512 px (16×64×64, patch 2 → 1024 tokens), small only in width, LoRA
    on."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    net = SD3Transformer2DModel(
        sample_size=64,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_projection_dim=16,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        out_channels=16,
    ).requires_grad_(False)
    net.add_adapter(
        LoraConfig(
            r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=sd3.SD3_LORA_TARGETS
        )
    )
    for name, p in net.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)  # as after some training
    return net


def policy_gradient(net, dtype, j, loss_scale=1.0):
    """∂L/∂θ_LoRA of the real per-step loss (A = 1, weight 1/(9 steps · 4 rows)), CFG 4.5, at step
    j."""
    objective = flow_grpo.Objective(noise_level=0.7, clip_range=1e-4, beta=0.0)
    sigmas = flow_grpo.schedule(10, 3.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(j)
    x, embeds, pooled = (
        torch.randn(2, 16, 64, 64, generator=gen),
        torch.randn(2, 8, 32, generator=gen),
        torch.randn(2, 32, generator=gen),
    )

    def velocity(x, sigma, cond):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return net(
                hidden_states=x,
                timestep=(1000 * sigma).expand(len(x)),
                encoder_hidden_states=cond[0],
                pooled_projections=cond[1],
                return_dict=False,
            )[0].float()

    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    v = flow_grpo.guided_velocity(
        velocity, x, sigmas[j], (embeds, pooled), (embeds * 0, pooled * 0), 4.5
    )
    x_next, old_logp, _, _ = flow_grpo.sde_step_with_logprob(
        v.detach(), x, sigmas[j], sigmas[j + 1], 0.7, noise=torch.randn(x.shape, generator=gen)
    )
    loss, _ = flow_grpo.step_loss(
        v,
        None,
        x,
        x_next,
        sigmas=sigmas[j : j + 2],
        old_logp=old_logp,
        advantages=torch.ones(2),
        objective=objective,
    )
    (loss * loss_scale / 36).backward()
    return torch.cat([p.grad.flatten() / loss_scale for p in params])


def test_bf16_keeps_the_tiny_policy_gradient_that_plain_fp16_loses():
    net = tiny_full_size_transformer()
    for j in [0, 4, 8]:  # high → low noise; the gradient is ~1e-9 at step 0
        exact = policy_gradient(net, torch.float32, j)
        bf16 = policy_gradient(net, torch.bfloat16, j)
        fp16 = policy_gradient(net, torch.float16, j)
        kept = lambda g: ((g != 0) & (exact != 0)).sum() / (exact != 0).sum()  # noqa: E731
        cosine = lambda g: F.cosine_similarity(g, exact, 0)  # noqa: E731
        assert kept(bf16) >= 0.95 and cosine(bf16) >= 0.99, j
        assert kept(fp16) < 0.5 and cosine(fp16) < 0.9, j  # underflow: why fp16 needs loss scaling
    scaled = policy_gradient(net, torch.float16, 8, loss_scale=2.0**16)  # what GradScaler does
    assert F.cosine_similarity(scaled, exact, 0) >= 0.99


def test_the_ema_steps_once_per_training_batch_as_the_original(tmp_path, tiny_sd3, monkeypatch):
    """The EMA after 24 optimiser steps of 2 training batches each equals a reference loop written
    from the original's rule: per training batch, s = optimiser steps so far, and when s + 1 is a
    multiple of 8, ema ← d·ema + (1 − d)·θ with d = min(0.9, (1 + s)/(10 + s))."""
    weights = []  # θ after each optimiser step
    adamw_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        out = adamw_step(self, *args, **kwargs)
        weights.append([p.detach().clone() for p in self.param_groups[0]["params"]])
        return out

    used = []  # the EMA values swapped in for each evaluation

    def recording_swap(params, ema):
        used.append([e.detach().clone() for e in ema])
        return swap(params, ema)

    swap = flow_grpo.swapped
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    monkeypatch.setattr(flow_grpo, "swapped", recording_swap)
    # 4 rows per epoch → 2 mini-batches (optimiser steps) of 2 training batches of 1 row
    flow_grpo.train(
        sd3_args(
            tmp_path,
            tiny_sd3,
            "--epochs",
            "12",
            "--minibatches",
            "2",
            "--micro-batch",
            "1",
            "--no-drop-zero-advantage",
            "--ema",
            "0.9",
            "--lr",
            "1e-2",
        )
    )
    assert len(weights) == 24
    ema = [w.clone() for w in used[0]]  # the weights before any step
    updates = 0
    for s in range(24):  # one optimiser step: its window of 2 training batches
        for batch in range(2):
            if batch == 1:
                s += 1  # the step ends the window
            if (s + 1) % 8 == 0:
                decay = min(0.9, (1 + s) / (10 + s))
                theta = weights[s - 1] if s else used[0]
                ema = [decay * e + (1 - decay) * w for e, w in zip(ema, theta)]
                updates += 1
    assert updates == 6
    for got, expected in zip(used[-1], ema):
        torch.testing.assert_close(got, expected)
    assert max((a - b).abs().max() for a, b in zip(used[-1], weights[-1])) > 1e-4


@pytest.mark.parametrize("what", ["loss", "gradient norm"])
def test_a_non_finite_loss_or_gradient_stops_the_run_before_the_weights_step(
    tmp_path, tiny_sd3, poison, what
):
    """fp32 and bf16 have no GradScaler to skip a step: the run stops with one line instead."""
    taken = poison(flow_grpo, "step_loss", what)
    with pytest.raises(SystemExit, match=f"non-finite {what} at step 1;"):
        flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--epochs", "1"))
    assert not taken
