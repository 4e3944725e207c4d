"""Issue #50, the inputs of `sdzero advise --replan FILE|RUN`: one schema (advisor.stages.input_schema), each
probe of the issue as it was tried, and property tests (hypothesis) that feed the reader arbitrary YAML and
JSON and hold that every input ends in a profile or in one line, within bounded time and memory."""

from __future__ import annotations

import json
import math
import os
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdzero.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = (ROOT / "examples" / "profile.yaml").read_text()
ALIAS_BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['x'] * 9)}]\n"
    for prev, name in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=False)
)

PROBES = {
    "rate 0": (EXAMPLE.replace("143.5", "0"), "samples_per_s_per_gpu: must be greater than or equal to"),
    "rate 1e-308": (
        EXAMPLE.replace("143.5", "1e-308"),
        "samples_per_s_per_gpu: must be greater than or equal",
    ),
    "rate infinite": (EXAMPLE.replace("143.5", ".inf"), "samples_per_s_per_gpu: must be a finite number"),
    "rate NaN": (EXAMPLE.replace("143.5", ".nan"), "samples_per_s_per_gpu: must be a finite number"),
    "gpus_per_node 10^9": (EXAMPLE.replace("gpus_per_node: 8", "gpus_per_node: 1000000000"), "gpus_per_node"),
    "nodes infinite": (EXAMPLE + "nodes: .inf\n", "nodes: must be a valid integer (got inf)"),
    "nodes a word": (EXAMPLE + "nodes: four\n", "nodes: must be a valid integer (got 'four')"),
    "optional key of the wrong type": (EXAMPLE + "dataset_images: many\n", "dataset_images"),
    "overlap_comm a word": (EXAMPLE.replace("overlap_comm: true", "overlap_comm: maybe"), "overlap_comm"),
    "alias bomb": (ALIAS_BOMB, "alias bomb"),
    "100,000-deep nesting": ("[" * 100_000, "nested deeper than"),
    "parameters 0": (EXAMPLE.replace("model: sd2-base-unet", "parameters: 0"), "parameters: must be greater"),
    "parameters 10^30": (
        EXAMPLE.replace("model: sd2-base-unet", "parameters: " + "1" + "0" * 30),
        "parameters",
    ),
    "parameters -5": (
        EXAMPLE.replace("model: sd2-base-unet", "parameters: -5"),
        "parameters: must be greater",
    ),
    "step time 0": (EXAMPLE.replace("samples_per_s_per_gpu: 143.5", "step_time_s: 0"), "step_time_s"),
    "step time -1": (EXAMPLE.replace("samples_per_s_per_gpu: 143.5", "step_time_s: -1"), "step_time_s"),
    "lr .nan": (EXAMPLE + "lr: .nan\n", "lr: must be a finite number"),
    "misspelt step_tme_s": (
        EXAMPLE.replace("samples_per_s_per_gpu: 143.5", "step_tme_s: 0.5"),
        "configs[0]: unknown key step_tme_s: did you mean step_time_s?",
    ),
    "two rates": (EXAMPLE.replace("gpu: 143.5", "gpu: 143.5\n    step_time_s: 1.0"), "one rate only"),
}


def one_line_refusal(path: Path) -> str:
    from advisor.stages.profile_source import read_profile

    with pytest.raises(UserError) as refused:
        read_profile(path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--replan {path}"), line
    return line


@pytest.mark.parametrize("probe", list(PROBES), ids=list(PROBES))
def test_each_bad_profile_of_the_issue_is_one_line_naming_the_key(tmp_path, probe):
    text, words = PROBES[probe]
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    assert words in one_line_refusal(path)


def test_a_non_utf8_byte_is_named(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_bytes(EXAMPLE.encode() + b"# \xff\n")
    assert "not UTF-8 text" in one_line_refusal(path)


def test_lr_nan_never_reaches_the_recommended_config_through_the_cli(tmp_path):
    """Before: `lr: .nan` was written into recommended_ds_config.json with exit 0."""
    from typer.testing import CliRunner

    from advisor.cli import app

    path = tmp_path / "profile.yaml"
    path.write_text(EXAMPLE + "lr: .nan\n")
    result = CliRunner().invoke(
        app, ["advise", "--replan", str(path), "--out", str(tmp_path / "o"), "--samples", "1000"]
    )
    assert result.exit_code == 2 and "lr: must be a finite number" in result.output
    assert not (tmp_path / "o" / "recommended_ds_config.json").exists()


def test_a_fifo_as_profile_is_named_not_waited_on(tmp_path):
    path = tmp_path / "profile.yaml"
    os.mkfifo(path)
    assert "a FIFO (named pipe)" in one_line_refusal(path)


# ------------------------------------------------------------------------------------- a run's folder


def run_folder(tmp_path: Path, model: Path, **files: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    defaults = {
        "ds_config.json": json.dumps(config),
        "run_config.json": json.dumps({"model": str(model), "world_size": 1}),
        "metrics.jsonl": "".join(json.dumps({"step": i, "step_time_s": 0.5}) + "\n" for i in range(1, 6)),
    }
    for name, text in {**defaults, **files}.items():
        (run / name.replace("__", ".")).write_text(text)
    return run


RUN_PROBES = {
    "a non-JSON ds_config.json": ({"ds_config.json": "not json {"}, "not JSON"),
    "lr NaN in ds_config.json": (
        {"ds_config.json": '{"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": NaN}}}'},
        "optimizer.params.lr: must be a finite number",
    ),
    "a step time of 0": ({"metrics.jsonl": '{"step": 1, "step_time_s": 0}\n'}, "line 1: step_time_s"),
    "a step time of -1": ({"metrics.jsonl": '{"step": 1, "step_time_s": -1}\n'}, "line 1: step_time_s"),
    "world_size a word": ({"run_config.json": '{"world_size": "many"}'}, "world_size"),
}


@pytest.mark.parametrize("probe", list(RUN_PROBES), ids=list(RUN_PROBES))
def test_each_bad_run_folder_file_is_one_line(tmp_path, tiny_model, probe):
    from advisor.stages.profile_source import read_run_folder

    files, words = RUN_PROBES[probe]
    run = run_folder(tmp_path, tiny_model, **files)
    with pytest.raises(UserError) as refused:
        read_run_folder(run, "h100-80gb")
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_metrics_line_nested_100000_deep_is_skipped_not_a_recursion_error(tmp_path, tiny_model):
    from advisor.stages.profile_source import read_run_folder
    from sdzero.telemetry.metrics import read_metric_lines

    good = "".join(json.dumps({"step": i, "step_time_s": 0.5}) + "\n" for i in range(1, 6))
    run = run_folder(tmp_path, tiny_model, **{"metrics.jsonl": good + "[" * 100_000 + "\n"})
    records, skipped = read_metric_lines(run / "metrics.jsonl", "metrics")
    assert len(records) == 5 and skipped == 1
    assert read_run_folder(run, "h100-80gb").configs[0].step_time_s == 0.5


def test_a_fifo_as_metrics_is_named(tmp_path, tiny_model):
    from advisor.stages.profile_source import read_run_folder

    run = run_folder(tmp_path, tiny_model)
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(UserError, match="is a FIFO"):
        read_run_folder(run, "h100-80gb")


# ------------------------------------------------------------------------ property tests (hypothesis)

KEYS = [
    "device",
    "gpus_per_node",
    "nodes",
    "configs",
    "model",
    "parameters",
    "dataset_images",
    "overlap_comm",
    "lr",
    "zero_stage",
    "precision",
    "micro_batch",
    "grad_accum",
    "step_time_s",
    "samples_per_s",
    "samples_per_s_per_gpu",
    "memory_gib",
    "offload",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["h200", "h100-80gb", "bf16", "fp16", "none", "sd2-base-unet", ""]),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=30,
)
TOP = {"device": "h200", "gpus_per_node": 8, "model": "sd2-base-unet", "dataset_images": 1000}
CONFIG = {"zero_stage": 2, "precision": "bf16", "micro_batch": 8, "samples_per_s": 100.0}
CONFIG_KEYS = KEYS[KEYS.index("zero_stage") :]
documents = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=10),  # anything at all
    st.builds(  # a good profile with a few keys replaced, removed or added, at the top and in its config
        lambda top, config, dropped: {
            **{k: v for k, v in TOP.items() if k != dropped},
            **top,
            "configs": [{**{k: v for k, v in CONFIG.items() if k != dropped}, **config}],
        },
        st.dictionaries(st.sampled_from(KEYS[: KEYS.index("zero_stage")]), values, max_size=2),
        st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.text(max_size=8), values, max_size=2),
        st.sampled_from([None, *TOP, *CONFIG]),
    ),
)
BOUNDED = settings(
    max_examples=60,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
PEAK_BYTES = 64 << 20


def assert_within_the_schema(profile) -> None:
    """What a profile that was let through may hold: positive, finite figures in the schema's ranges (the
    old reader let `parameters: -5`, `lr: .nan` and NaN memory through)."""
    finite = math.isfinite
    assert 1 <= profile.gpus_per_node <= 1024 and 1 <= profile.nodes <= 100_000
    assert profile.numels and all(n >= 1 for n in profile.numels) and sum(profile.numels) <= 10**12
    lr = profile.base["optimizer"]["params"]["lr"]
    assert finite(lr) and 0 < lr <= 1
    for c in profile.configs:
        assert finite(c.step_time_s) and c.step_time_s > 0
        assert math.isnan(c.memory_bytes) or (finite(c.memory_bytes) and c.memory_bytes > 0)
        assert c.micro_batch >= 1 and c.grad_accum >= 1 and c.zero_stage in (0, 1, 2, 3)


def ends_in_a_profile_or_one_line(path: Path) -> None:
    """The property: a Profile, or a UserError of one line; never another exception, within the bounds."""
    from advisor.stages.profile_source import Profile, read_profile

    tracemalloc.start()
    try:
        profile = read_profile(path)
        assert isinstance(profile, Profile)
        assert_within_the_schema(profile)
    except UserError as exc:
        assert "\n" not in str(exc), str(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < PEAK_BYTES


@BOUNDED
@given(document=documents, as_json=st.booleans())
def test_any_yaml_or_json_mapping_ends_in_a_profile_or_one_line(tmp_path, document, as_json):
    path = tmp_path / "profile.yaml"
    try:
        text = json.dumps(document) if as_json else yaml.safe_dump(document)
    except (ValueError, OverflowError):
        text = "{}"
    path.write_text(text)
    ends_in_a_profile_or_one_line(path)


@BOUNDED
@given(text=st.text(max_size=400))
def test_any_text_ends_in_a_profile_or_one_line(tmp_path, text):
    path = tmp_path / "profile.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    ends_in_a_profile_or_one_line(path)


@BOUNDED
@given(
    gpus=st.integers(-5, 2000),
    nodes=st.integers(-5, 200_000),
    mb=st.integers(-5, 2_000_000),
    rate=st.floats(allow_nan=True, allow_infinity=True),
    memory=st.floats(allow_nan=True, allow_infinity=True),
    parameters=st.integers(-(10**31), 10**31),
    lr=st.floats(allow_nan=True, allow_infinity=True),
)
def test_profiles_near_and_past_every_bound_end_in_a_profile_or_one_line(
    tmp_path, gpus, nodes, mb, rate, memory, parameters, lr
):
    """Well-formed profiles whose numbers range over and past each key's bounds."""
    document = {
        "device": "h200",
        "gpus_per_node": gpus,
        "nodes": nodes,
        "parameters": parameters,
        "lr": lr,
        "configs": [
            {
                "zero_stage": 2,
                "precision": "bf16",
                "micro_batch": mb,
                "samples_per_s": rate,
                "memory_gib": memory,
            }
        ],
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(document))
    ends_in_a_profile_or_one_line(path)


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    gpus=st.sampled_from([1, 8, 1024]),
    nodes=st.sampled_from([1, 2, 100_000]),
    parameters=st.sampled_from([1, 10**9, 10**12]),
    mb=st.sampled_from([1, 32, 10**6]),
    rate=st.sampled_from([1e-6, 143.5, 1e12]),
)
def test_profiles_at_the_bounds_end_in_a_plan_or_one_line(tmp_path, gpus, nodes, parameters, mb, rate):
    """The whole replan, from a profile at the edges of what the schema admits: a plan, or one line."""
    from advisor.stages.advise import AdviseRequest, run_advise

    document = {
        "device": "h200",
        "gpus_per_node": gpus,
        "nodes": nodes,
        "parameters": parameters,
        "dataset_images": 1000,
        "configs": [{"zero_stage": 3, "precision": "bf16", "micro_batch": mb, "samples_per_s": rate}],
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(document))
    out = tmp_path / f"plan-{gpus}-{nodes}-{parameters}-{mb}-{rate}"
    try:
        rec = run_advise(AdviseRequest(replan=path, out_dir=out, max_nodes=4)).recommendation
        assert rec["scaling_table"]
    except UserError as exc:
        assert "\n" not in str(exc), str(exc)
