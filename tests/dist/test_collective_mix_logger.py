"""The first-principles collective mix against DeepSpeed's comms logger, in real trials: 2 ranks, the tiny
model, gradient accumulation 4, small buckets, prefetch and persistence so that every rule is exercised.

One profile of two trials (ZeRO-0 and ZeRO-3, ~30 s each on 2 busy cores) serves all tests here: it is
also the `make test` coverage of a ZeRO-0 trial and of an accumulation-4 trial.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from advisor.measure.grid import GridRequest
from advisor.measure.profile import run_profile
from advisor.model.collective_mix import collective_mix, logger_view
from advisor.model.memory import DEFAULT_BYTES_PER_ELEMENT, ZeroSettings, state_elements, trained_numels
from sdzero.cluster.launch_command import REPO_ROOT

pytestmark = pytest.mark.dist

ACCUM = 4
ZERO_KNOBS = {
    "overlap_comm": True,
    "reduce_bucket_size": 200_000,
    "stage3_prefetch_bucket_size": 150_000,
    "stage3_param_persistence_threshold": 20_000,
}
"""The tiny UNet (985,444 parameters, the largest 73,728) then fills 6 reduce buckets, 4 prefetch chunks
and keeps 193 small parameters whole at ZeRO-3."""


@pytest.fixture(scope="module")
def mixed(tiny_model: Path, synth_data: Path, tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    out = tmp_path_factory.mktemp("mix")
    base = json.loads((REPO_ROOT / "ds_configs" / "zero0_bf16.json").read_text())
    base["gradient_accumulation_steps"] = ACCUM
    base["zero_optimization"].update(ZERO_KNOBS)
    (out / "base.json").write_text(json.dumps(base))
    result = run_profile(
        model=str(tiny_model),
        data=synth_data,
        out_dir=out / "profile",
        grid=GridRequest(stages=(0, 3), precisions=("bf16",), micro_batches=(1,), ranks_per_node=(2,)),
        base_config=out / "base.json",
        steps=1,
        warmup_steps=1,
        trial_timeout_s=400.0,
        stall_timeout_s=120.0,
        train_args=["--num-workers", "0"],
    )
    return result.table.set_index("zero_stage"), base


def test_zero0_and_accumulation_4_trials_run(mixed):
    table, _ = mixed
    assert list(table["status"]) == ["ok", "ok"]
    assert (table["grad_accum"] == ACCUM).all() and (table["global_batch"] == 2 * ACCUM).all()


@pytest.mark.parametrize("stage", [0, 3])
def test_the_derived_mix_matches_the_comms_logger(mixed, tiny_model, stage):
    table, base = mixed
    zero = ZeroSettings.from_config(
        {**base, "zero_optimization": {**base["zero_optimization"], "stage": stage}}
    )
    derived = logger_view(collective_mix(trained_numels(tiny_model), stage, 2, zero), 2, ACCUM)
    logged = json.loads(table.loc[stage, "comm_ops"])
    for op, figures in derived.items():
        assert op in logged, (stage, op, logged)
        for key in ("count_per_step", "bytes_per_step"):
            assert logged[op][key] == pytest.approx(figures[key], rel=0.05), (stage, op, key)
    if stage == 0:  # plain data parallel: one all-reduce of the bf16 gradients per step, at the boundary
        assert derived == {
            "all_reduce": {"count_per_step": 1, "bytes_per_step": logged["all_reduce"]["bytes_per_step"]}
        }


def test_zero0_holds_every_state_whole(mixed, tiny_model):
    table, _ = mixed
    numels = trained_numels(tiny_model)
    elements = state_elements(numels, 0, 2)
    for states in json.loads(table.loc[0, "model_state_bytes_per_rank"]):
        assert states == {k: elements[k] * DEFAULT_BYTES_PER_ELEMENT[k] for k in states}
    assert table.loc[0, "bucket_bytes"] == 0
