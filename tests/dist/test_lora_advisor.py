"""The advisor's picture of a LoRA run against real trials (2 ranks, the embedded default's tiny SD 1.x,
`--lora-rank 16`): the collectives DeepSpeed's comms logger records per step are the adapters' (and, at
ZeRO-3, the frozen base's gathers), as advisor.model.lora_sizing derives them, and the model states a
rank holds are the adapters' plus the frozen base's parameters (whole at ZeRO-1, partitioned at ZeRO-3).

One profile of two trials (ZeRO-1, the stage the embedded default's plan picks, and ZeRO-3) serves all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from advisor.measure.grid import GridRequest
from advisor.measure.profile import run_profile
from advisor.model.collective_mix import collective_mix, logger_view
from advisor.model.lora_sizing import lora_plan
from advisor.model.memory import DEFAULT_BYTES_PER_ELEMENT, ZeroSettings, state_elements
from sdzero.cluster.launch_command import REPO_ROOT

pytestmark = pytest.mark.dist

LORA = ("--lora-rank", "16")
ZERO_KNOBS = {"stage3_param_persistence_threshold": 20_000, "stage3_prefetch_bucket_size": 150_000}
"""Below the tiny UNet's largest layers: ZeRO-3 partitions and gathers the base's big parameters."""


@pytest.fixture(scope="module")
def lora_trials(tiny_model: Path, synth_data: Path, tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    out = tmp_path_factory.mktemp("lora-mix")
    base = json.loads((REPO_ROOT / "ds_configs" / "zero2_bf16.json").read_text())
    base["zero_optimization"].update(ZERO_KNOBS)
    (out / "base.json").write_text(json.dumps(base))
    result = run_profile(
        model=str(tiny_model),
        data=synth_data,
        out_dir=out / "profile",
        grid=GridRequest(stages=(1, 3), precisions=("bf16",), micro_batches=(1,), ranks_per_node=(2,)),
        base_config=out / "base.json",
        steps=1,
        warmup_steps=1,
        trial_timeout_s=400.0,
        stall_timeout_s=120.0,
        train_args=["--num-workers", "0", *LORA],
    )
    return result.table.set_index("zero_stage"), base


@pytest.mark.parametrize("stage", [1, 3])
def test_a_lora_trials_collectives_are_the_adapters(lora_trials, tiny_model, stage):
    table, base = lora_trials
    assert table.loc[stage, "status"] == "ok"
    plan = lora_plan(tiny_model, LORA)
    assert plan is not None and int(table.loc[stage, "trained_params"]) == plan.adapter_params
    zero = ZeroSettings.from_config(
        {**base, "zero_optimization": {**base["zero_optimization"], "stage": stage}}
    )
    accum = int(table.loc[stage, "grad_accum"])
    derived = logger_view(collective_mix(plan.numels(), stage, 2, zero), 2, accum)
    logged = json.loads(table.loc[stage, "comm_ops"])
    for op, figures in derived.items():
        assert op in logged, (stage, op, logged)
        for key in ("count_per_step", "bytes_per_step"):
            assert logged[op][key] == pytest.approx(figures[key], rel=0.05), (stage, op, key, logged)
    adapter_bytes = 2 * plan.adapter_params  # bf16
    if stage == 1:  # every byte reduced or gathered is the adapter's: all-reduce 1x, gather of shards 1/2
        assert logged["all_reduce"]["bytes_per_step"] == pytest.approx(adapter_bytes, rel=0.05)
        assert logged["all_gather_into_tensor"]["bytes_per_step"] == pytest.approx(
            adapter_bytes / 2, rel=0.05
        )
    else:  # reduce-scatter: the adapters' gradients only; the gathers carry the frozen base too
        assert logged["reduce_scatter_tensor"]["bytes_per_step"] == pytest.approx(adapter_bytes, rel=0.05)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_lora_trials_model_states_follow_the_stage(lora_trials, tiny_model, stage):
    table, base = lora_trials
    plan = lora_plan(tiny_model, LORA)
    threshold = ZERO_KNOBS["stage3_param_persistence_threshold"] if stage == 3 else 0
    elements = state_elements(plan.numels(), stage, 2, threshold, False)
    for states in json.loads(table.loc[stage, "model_state_bytes_per_rank"]):
        # parameters: adapters + the frozen base (whole at ZeRO-1, partitioned at ZeRO-3), in bf16
        assert states["params"] == pytest.approx(
            elements["params"] * DEFAULT_BYTES_PER_ELEMENT["params"], rel=0.02
        )
        # fp32 master and Adam's moments: the adapters' share only
        assert states["master"] <= 4 * plan.adapter_params
    if stage == 1:
        assert elements["params"] >= plan.base_params
    else:  # the layers above the persistence threshold are partitioned
        assert elements["params"] < plan.adapter_params + plan.base_params
