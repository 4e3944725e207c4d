"""SDXL and SD3 in one process: loading per family, text conditioning as the pipelines compute it, SDXL's
micro-conditioning, SD3's flow-matching densities and weights against diffusers' own functions, the
per-sample determinism of SD3's sigma, and the flags that only one family takes."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from launch import CONFIGS
from step_input_fakes import step_input
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.config.train_config import WEIGHTING_SCHEMES, TrainConfig, parse_train_args
from sdzero.data.images import CaptionedImages, SampleSpec, flow_u, read_metadata
from sdzero.errors import UserError
from sdzero.models.families import as_family, family_named
from sdzero.models.loading import detect_family, encode_prompts, ensure_frozen, load_components, tokenize
from sdzero.models.objectives import FlowSettings, LossInputs, Objective, flow_matching_loss, flow_timesteps
from sdzero.models.step_input import PromptEmbeds
from sdzero.models.tiny import write_tiny_model

PROMPT = "a small red circle on a blue background"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_models")
    return {f: write_tiny_model(root / f, family=f) for f in ("sdxl", "sd3")}


@pytest.fixture(scope="module")
def comps(models):
    return {f: load_components(str(m), "fp32", "cpu", max_sequence_length=8) for f, m in models.items()}


def test_family_comes_from_model_index(models, tiny_model, tmp_path):
    assert detect_family(str(tiny_model)) == "sd"
    assert detect_family(str(models["sdxl"])) == "sdxl"
    assert detect_family(str(models["sd3"])) == "sd3"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UserError, match="'FluxPipeline' is not supported yet"):
        detect_family(str(tmp_path))


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_frozen_false_skips_encoders_but_keeps_the_geometry(family, models, comps):
    full = comps[family]
    bare = load_components(str(models[family]), "fp32", "cpu", frozen=False)
    assert bare.vae is None and bare.text_encoder is None and bare.text_encoder_2 is None
    assert bare.frozen_modules() == () and not bare.frozen_loaded
    assert len(full.frozen_modules()) == {"sdxl": 3, "sd3": 4}[family]
    for name in (
        "vae_scale_factor",
        "native_resolution",
        "latent_channels",
        "latent_scaling_factor",
        "latent_shift_factor",
        "trained_subfolder",
        "sampler_class",
    ):
        assert getattr(bare, name) == getattr(full, name), name
    assert full.latent_shift_factor == (0.06 if family == "sd3" else 0.0)
    batch = tuple(ids[None] for ids in tokenize(bare, PROMPT))
    with pytest.raises(RuntimeError, match="frozen=False"):
        encode_prompts(bare, batch)
    from sdzero.checkpoint.export import build_pipeline

    pipe = build_pipeline(bare, bare.network)  # validation and export in a cache run load them when due
    assert bare.frozen_loaded and pipe.vae is bare.vae and pipe.text_encoder_2 is bare.text_encoder_2
    ensure_frozen(bare, "cpu")  # loaded once: a second call keeps them
    assert pipe.vae is bare.vae
    for key, value in encode_prompts(bare, batch).by_name().items():
        torch.testing.assert_close(value, encode_prompts(full, batch).by_name()[key])


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_training_conditioning_equals_the_pipelines(family, comps):
    """What the trainer conditions on is exactly what the diffusers pipeline computes at inference."""
    from sdzero.checkpoint.export import build_pipeline

    c = comps[family]
    pipe = build_pipeline(c, c.network)
    batch = tuple(ids[None] for ids in tokenize(c, PROMPT))
    assert len(batch) == (3 if family == "sd3" else 2)  # CLIP-L, CLIP-G (and T5)
    ours = encode_prompts(c, batch)
    extra = {"prompt_2": None, "prompt_3": None, "max_sequence_length": 8} if family == "sd3" else {}
    embeds, _, pooled, _ = pipe.encode_prompt(
        PROMPT, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False, **extra
    )
    torch.testing.assert_close(ours.encoder_hidden_states, embeds)
    torch.testing.assert_close(ours.pooled_prompt_embeds, pooled)
    if family == "sd3":
        assert batch[2].shape == (1, 8)  # --max-sequence-length
        assert embeds.shape[1] == 16 + 8  # CLIP tokens, then T5 tokens


def test_sdxl_micro_conditioning_reaches_the_unet():
    seen = {}

    def model(noisy, timesteps, text, return_dict, added_cond_kwargs):
        seen.update(added_cond_kwargs)
        return (torch.zeros_like(noisy),)

    from diffusers import DDPMScheduler

    batch = step_input(
        noise=torch.randn(2, 4, 8, 8),
        timestep=torch.tensor([10, 900]),
        original_size=torch.tensor([[40, 50], [64, 48]]),
        crop_top_left=torch.tensor([[3, 9], [0, 8]]),
        target_size=torch.tensor([[32, 32], [32, 32]]),
    )
    cond = PromptEmbeds(torch.randn(2, 16, 48), pooled_prompt_embeds=torch.randn(2, 24))
    inputs = LossInputs(model, torch.float32, DDPMScheduler(), torch.randn(2, 4, 8, 8), cond, batch)
    family_named("sdxl").loss(inputs, Objective("epsilon"))
    expected = [[40, 50, 3, 9, 32, 32], [64, 48, 0, 8, 32, 32]]  # (orig h, w, crop top, left, target h, w)
    assert seen["time_ids"].tolist() == expected
    assert torch.equal(seen["text_embeds"], cond.pooled_prompt_embeds)


# ------------------------------------------------------------------------------------------------------
# SD3 flow matching


def _settings(scheme: str) -> FlowSettings:
    return FlowSettings(weighting_scheme=scheme, logit_mean=0.3, logit_std=0.8, mode_scale=1.1)


@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_timestep_density_is_diffusers(scheme):
    s = _settings(scheme)
    for seed in range(20):
        ours = flow_u(s, torch.Generator().manual_seed(seed))
        theirs = compute_density_for_timestep_sampling(
            scheme, 1, s.logit_mean, s.logit_std, s.mode_scale, generator=torch.Generator().manual_seed(seed)
        )
        assert ours == pytest.approx(float(theirs[0]), abs=0)
        # and what the SD3 paper defines, computed here independently
        g = torch.Generator().manual_seed(seed)
        if scheme == "logit_normal":
            expected = torch.sigmoid(torch.normal(0.3, 0.8, (1,), generator=g))
        else:
            r = torch.rand((1,), generator=g)
            expected = 1 - r - 1.1 * (torch.cos(math.pi * r / 2) ** 2 - 1 + r) if scheme == "mode" else r
        assert ours == pytest.approx(float(expected[0]), rel=1e-6)
        assert 0 <= ours <= 1


@pytest.fixture(scope="module")
def flow_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_loss_weights_are_diffusers(scheme, flow_scheduler):
    torch.manual_seed(0)
    latents, noise = torch.randn(5, 4, 8, 8), torch.randn(5, 4, 8, 8)
    u = torch.tensor([0.02, 0.3, 0.5, 0.81, 0.999])
    batch = step_input(5, noise=noise, flow_u=u)
    cond = PromptEmbeds(torch.randn(5, 6, 64), pooled_prompt_embeds=torch.randn(5, 48))

    def zero_model(hidden_states, **_):
        return (torch.zeros_like(hidden_states),)

    inputs = LossInputs(zero_model, torch.float32, flow_scheduler, latents, cond, batch)
    loss = flow_matching_loss(inputs, _settings(scheme))
    _, sigmas = flow_timesteps(flow_scheduler, u)
    # diffusers' SD3 scripts pick sigma = scheduler.sigmas[index of timesteps[int(u * N)]]
    assert torch.equal(sigmas, flow_scheduler.sigmas[(u * 1000).long()])
    weights = compute_loss_weighting_for_sd3(scheme, sigmas)
    closed = {"sigma_sqrt": sigmas**-2.0, "cosmap": 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))}
    torch.testing.assert_close(weights, closed.get(scheme, torch.ones_like(sigmas)))
    per_sample = ((noise - latents) ** 2).mean(dim=(1, 2, 3))  # target = noise - x, prediction 0
    torch.testing.assert_close(loss, (weights * per_sample).mean())


@pytest.mark.parametrize("precondition", [False, True])
def test_flow_target_and_preconditioning(precondition, flow_scheduler):
    """The exact velocity scores 0 both ways: preconditioning turns it into x0 = x_s - sigma * v."""
    torch.manual_seed(1)
    latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    batch = step_input(3, noise=noise, flow_u=torch.tensor([0.1, 0.5, 0.9]))
    cond = PromptEmbeds(torch.randn(3, 6, 64), pooled_prompt_embeds=torch.randn(3, 48))
    seen = {}

    def oracle(hidden_states, timestep, **_):
        seen["noisy"], seen["timestep"] = hidden_states, timestep
        return (noise - latents,)

    settings = FlowSettings(weighting_scheme="none", precondition_outputs=precondition)
    loss = flow_matching_loss(
        LossInputs(oracle, torch.float32, flow_scheduler, latents, cond, batch), settings
    )
    assert float(loss) < 1e-10
    timesteps, sigmas = flow_timesteps(flow_scheduler, batch.flow_u)
    s = sigmas.view(-1, 1, 1, 1)
    torch.testing.assert_close(seen["noisy"], (1 - s) * latents + s * noise)
    torch.testing.assert_close(seen["timestep"], timesteps)
    torch.testing.assert_close(timesteps, sigmas * 1000)


def test_sigma_is_a_function_of_seed_epoch_index(synth_data, comps, flow_scheduler):
    c = comps["sd3"]
    flow = FlowSettings()
    spec = SampleSpec(resolution=32, latent_shape=(4, 16, 16), num_train_timesteps=1000, seed=7, flow=flow)
    records = read_metadata(synth_data)[:6]
    ds = CaptionedImages(records, spec, functools.partial(tokenize, c))
    plain = CaptionedImages(
        records, SampleSpec(**{**spec.__dict__, "flow": None}), functools.partial(tokenize, c)
    )
    u = {(i, e): float(ds[(i, e)].flow_u) for i in range(6) for e in range(2)}
    again = CaptionedImages(records, spec, functools.partial(tokenize, c))
    assert all(float(again[key].flow_u) == value for key, value in u.items())  # same key, same draw
    assert len(set(u.values())) == len(u)  # other index or epoch: another draw
    other_seed = CaptionedImages(
        records, SampleSpec(**{**spec.__dict__, "seed": 8}), functools.partial(tokenize, c)
    )
    assert float(other_seed[(0, 0)].flow_u) != u[(0, 0)]
    # The draw comes after the sample's other randomness, which stays what it is without SD3.
    item, base = ds[(3, 1)], plain[(3, 1)]
    assert base.flow_u is None
    for key in ("noise", "latent_eps", "timestep", "pixel_values"):
        assert torch.equal(getattr(item, key), getattr(base, key)), key
    _, sigmas = flow_timesteps(flow_scheduler, torch.tensor([u[(3, 1)], u[(3, 1)]]))
    assert sigmas[0] == sigmas[1]


# ------------------------------------------------------------------------------------------------------
# Flags


def _cfg(tmp_path: Path, model: Path, *flags: str) -> TrainConfig:
    (tmp_path / "data").mkdir(exist_ok=True)
    return parse_train_args(
        [
            "--deepspeed_config",
            "ds.json",
            "--model",
            str(model),
            "--data",
            str(tmp_path / "data"),
            "--output-dir",
            str(tmp_path / "out"),
            *flags,
        ]
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--logit-std", "0"], "--logit-std must be positive"),
        (["--logit-std", "-1"], "--logit-std must be positive"),
        (["--mode-scale", "1.0"], "--mode-scale only applies to --weighting-scheme mode"),
        (["--weighting-scheme", "cosmap", "--logit-mean", "0.5"], "--logit-mean only applies to"),
        (["--weighting-scheme", "mode", "--mode-scale", "3"], "--mode-scale must be in [-1, 1.752]"),
        (["--max-sequence-length", "0"], "--max-sequence-length must be in [1, 512]"),
        (["--max-sequence-length", "600"], "--max-sequence-length must be in [1, 512]"),
    ],
)
def test_bad_flow_flags_are_refused(flags, message, models, tmp_path):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _cfg(tmp_path, models["sd3"], *flags)


def test_flags_of_the_other_family_are_refused(models, tiny_model, tmp_path):
    cfg = _cfg(tmp_path, models["sdxl"], "--weighting-scheme", "cosmap", "--precondition-outputs")
    with pytest.raises(
        UserError, match="--weighting-scheme, --precondition-outputs: SD3 .* is a sdxl pipeline"
    ):
        as_family("sdxl").check_options(cfg)
    with pytest.raises(UserError, match="--max-sequence-length: SD3"):
        as_family("sd").check_options(_cfg(tmp_path, tiny_model, "--max-sequence-length", "64"))
    cfg = _cfg(tmp_path, models["sd3"], "--snr-gamma", "5", "--prediction-type", "v_prediction")
    with pytest.raises(UserError, match="--prediction-type, --snr-gamma: DDPM options, but .* is SD3"):
        as_family("sd3").check_options(cfg)
    ok = _cfg(tmp_path, models["sd3"], "--weighting-scheme", "mode", "--mode-scale", "0.5")
    as_family("sd3").check_options(ok)
    assert FlowSettings.from_config(ok) == FlowSettings(weighting_scheme="mode", mode_scale=0.5)
    assert FlowSettings.from_config(_cfg(tmp_path, models["sd3"])) == FlowSettings()


def test_trainer_refuses_sd3_flags_on_sdxl_before_any_process_group(models, synth_data, tmp_path):
    import torch.distributed as dist

    from sdzero.training.trainer import run

    cfg = parse_train_args(
        [
            "--deepspeed_config",
            str(CONFIGS / "zero3_bf16.json"),
            "--model",
            str(models["sdxl"]),
            "--data",
            str(synth_data),
            "--output-dir",
            str(tmp_path / "out"),
            "--logit-mean",
            "0.5",
        ]
    )
    with pytest.raises(UserError, match="--logit-mean: SD3"):
        run(cfg)
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_tiny_model_command_families(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["tiny-model", str(tmp_path / "xl"), "--family", "sdxl"])
    assert result.exit_code == 0, result.output
    index = json.loads((tmp_path / "xl" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    result = runner.invoke(app, ["tiny-model", str(tmp_path / "f"), "--family", "flux"])
    assert (
        result.exit_code == 2 and "unknown --family 'flux'; choose one of: sd15, sdxl, sd3" in result.output
    )


def test_advisor_counts_the_sd3_transformer(models, comps):
    from advisor.model.memory import trained_numels

    numels = trained_numels(models["sd3"])
    assert sum(numels) == sum(p.numel() for p in comps["sd3"].network.parameters())
