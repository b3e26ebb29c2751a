"""flow_grpo.py: the SDE step on hand-checkable cases, marginal preservation, the toy end to end, tiny SD3."""
import json
import math

import pytest
import torch

import common
import flow_grpo
from tiny_sd3 import save_tiny_sd3


@pytest.fixture
def cache_dir(flow_grpo_cache):
    return flow_grpo_cache  # the toy's base model is trained once per session (conftest)


def toy_args(tmp_path, cache_dir, *extra):
    return common.parse_args(flow_grpo.Args, flow_grpo.PRESETS,
                             ["--quiet", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir), *extra])


def gaussian_velocity(mu, s0):
    """Exact rectified-flow velocity E[x1 − x0 | x_t] for data x0 ~ N(mu, s0²), noise x1 ~ N(0, 1)."""
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
    # t = 0.5, dt = −0.1, a = 1: σ_t² = 1, mean = 1 + (2 + 1·(1 + 0.5·2)/(2·0.5))·(−0.1) = 1 − 0.4 = 0.6
    _, _, mean, std = flow_grpo.sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=1.0)
    assert mean.item() == pytest.approx(0.6) and std == pytest.approx(math.sqrt(0.1))
    # t = 1 would divide by zero: σ_t uses 1 − sigma_next there (§1.2), so the step is finite
    _, log_prob, mean, std = flow_grpo.sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7)
    assert std == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1)) and torch.isfinite(log_prob).all()


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
        flow_grpo.sde_step_with_logprob(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, noise_level=0.0)


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_sde_and_ode_sampling_reach_the_same_marginal(noise_level):
    mu, s0 = 2.0, 0.5
    velocity = gaussian_velocity(mu, s0)
    sigmas = flow_grpo.schedule(200, 1.0, torch.device("cpu"))
    noise = torch.randn(20000, 4, generator=torch.Generator().manual_seed(0))
    ode, _ = flow_grpo.rollout(velocity, noise, sigmas, (None,), (None,), 1.0, 0.0)
    step_noise = torch.randn(200, 20000, 4, generator=torch.Generator().manual_seed(1))
    sde, log_probs = flow_grpo.rollout(velocity, noise, sigmas, (None,), (None,), 1.0, noise_level, step_noise)
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
    out = flow_grpo.guided_velocity(velocity, x, 0.5, (torch.full((2, 1), 3.0),), (torch.ones(2, 1),), 4.5)
    torch.testing.assert_close(out, x * (1 + 4.5 * 2))


def test_toy_run_is_on_policy_and_deterministic(tmp_path, cache_dir):
    runs = []
    for name in ["a", "b"]:
        summary = flow_grpo.train(toy_args(tmp_path / name, cache_dir, "--epochs", "3", "--eval-every", "2",
                                           "--eval-per-prompt", "4"))
        assert summary["first_step_ratio_max_dev"] < 1e-6  # ratio = 1 before any update
        runs.append([{k: v for k, v in json.loads(line).items() if k != "sec"}
                     for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    assert runs[0] == runs[1] and len(runs[0]) == 3
    for key in ["accuracy_before", "accuracy_after", "reward_before", "reward_after", "diversity_before",
                "diversity_after", "first_step_ratio_max_dev", "wall_seconds"]:
        assert key in summary
    assert summary["reward_model_test_accuracy"] >= 0.95
    assert (tmp_path / "b" / "samples.png").stat().st_size > 0


@pytest.mark.slow
def test_toy_flow_grpo_learns_and_keeps_diversity(tmp_path, cache_dir):
    s = flow_grpo.train(toy_args(tmp_path, cache_dir))
    assert s["accuracy_before"] < 0.7
    assert s["accuracy_after"] >= 0.95 and s["accuracy_judge_after"] >= 0.9  # the independent judge agrees
    assert s["diversity_after"] >= 0.7 * s["diversity_before"]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_sd3")
    sd3, clip = save_tiny_sd3(folder)
    prompts = folder / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\na green bird\n")
    return sd3, clip, prompts


def sd3_args(tmp_path, tiny, *extra):
    sd3, clip, prompts = tiny
    return common.parse_args(flow_grpo.Args, flow_grpo.PRESETS, [
        "--preset", "sd3", "--model", str(sd3), "--reward", "clip", "--reward-model", str(clip), "--prompts", str(prompts),
        "--epochs", "2", "--prompts-per-epoch", "2", "--group-size", "2", "--resolution", "16", "--train-steps", "3",
        "--eval-steps", "2", "--eval-per-prompt", "2", "--mixed-precision", "fp32", "--device", "cpu", "--quiet",
        "--out-dir", str(tmp_path), *extra])


def test_sd3_preset_path_with_tiny_components_and_lora_round_trip(tmp_path, tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    summary = flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--lr", "1e-2"))
    assert summary["first_step_ratio_max_dev"] < 1e-5
    assert math.isfinite(summary["reward_after"])
    # the saved LoRA loads with diffusers' standard loader and changes the transformer's output
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3[0])
    x, t = torch.randn(1, 4, 16, 16), torch.tensor([500.0])
    embeds, pooled = torch.randn(1, 8, 32), torch.randn(1, 64)
    with torch.no_grad():
        base = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled)[0]
        pipe.load_lora_weights(tmp_path / "lora")
        tuned = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled)[0]
    assert (tuned - base).abs().max() > 1e-6


def test_sd3_reference_is_the_disabled_adapter(tmp_path, tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    args = sd3_args(tmp_path, tiny_sd3, "--lora-rank", "4")
    world = flow_grpo.build_sd3(args, torch.device("cpu"))
    base = StableDiffusion3Pipeline.from_pretrained(tiny_sd3[0]).transformer
    cond = world["encode"](["a red cat"])
    x, sigma = torch.randn(1, 4, 16, 16), torch.tensor(0.5)
    with torch.no_grad():
        for name, p in world["policy"].named_parameters():
            if "lora_B" in name:
                p.add_(0.1)  # move the adapter away from its zero init
        velocity = world["velocity_of"](world["policy"])
        policy_v, ref_v = velocity(x, sigma, cond), world["ref_velocity"](x, sigma, cond)
        base_v = base(hidden_states=x, timestep=1000 * sigma[None], encoder_hidden_states=cond[0],
                      pooled_projections=cond[1])[0]
    torch.testing.assert_close(ref_v, base_v)
    assert (policy_v - ref_v).abs().max() > 1e-4
    # and the adapter is back on after the reference pass
    torch.testing.assert_close(velocity(x, sigma, cond), policy_v)


@pytest.mark.parametrize("extra, message", [
    (["--noise-level", "0"], "ODE"),
    (["--group-size", "1"], "group-size"),
    (["--prompts", "/nonexistent.txt"], "not a file"),
    (["--reward", "no_such_module:score"], "--reward"),
    (["--model", "/nonexistent/sd3"], "could not load"),
])
def test_bad_input_gets_one_clear_message(tmp_path, tiny_sd3, extra, message):
    with pytest.raises(SystemExit, match=message):
        flow_grpo.train(sd3_args(tmp_path, tiny_sd3, *extra))


def nan_reward(images, prompts):
    return torch.full((len(prompts),), float("nan"))


def raising_reward(images, prompts):
    raise RuntimeError("reward server down")


@pytest.mark.parametrize("fn, message", [("nan_reward", "finite score"), ("raising_reward", "reward server down")])
def test_a_reward_that_returns_nan_or_raises_gets_one_clear_message(tmp_path, tiny_sd3, fn, message):
    with pytest.raises(SystemExit, match=message):
        flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--reward", f"test_flow_grpo:{fn}"))


def test_empty_and_malformed_prompt_files(tmp_path, tiny_sd3):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    for name, message in [("empty.txt", "no prompts"), ("bad.jsonl", "'prompt' key")]:
        with pytest.raises(SystemExit, match=message):
            flow_grpo.train(sd3_args(tmp_path, tiny_sd3, "--prompts", str(tmp_path / name)))
