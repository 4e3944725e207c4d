"""Host RAM in the plan (issue #53, item 2): per node, offloaded states, pinned buffers, a CPU EMA, loader
workers and a latent cache's page cache against the node's RAM; a config over it leaves the pick with a
one-line reason."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from test_advisor_model import BASE, NUMELS, ZERO, grid_trials, nets

from advisor.decide.recommend import recommend
from advisor.model.host_memory import (
    FP32,
    HOST_RAM_GIB,
    PREFETCH_FACTOR,
    HostSetup,
    add_host_memory,
    host_bytes,
    host_setup,
    node_ram,
)
from advisor.model.predict import Candidate, node_counts, predict_table
from advisor.model.prediction_error import fit_models
from sdzero.constants import GIB


def _table(setup: HostSetup | None = None) -> tuple[pd.DataFrame, object]:
    measured_net, net = nets(gpus=8)
    models = fit_models(grid_trials(noise=False), NUMELS, ZERO, measured_net)
    cands = [Candidate(s, "bf16", mb, off) for s in (1, 2) for mb in (1, 4) for off in ("none", "optimizer")]
    table = predict_table(cands, node_counts(2), models.memory, models.timing, net, 1e12, None)
    return (add_host_memory(table, models.memory, setup) if setup else table), models


def test_an_offloaded_config_needs_its_states_pinned_buffers_ema_workers_and_the_cache_per_node():
    setup = HostSetup(
        8, 1e12, "--host-memory-gib", num_workers=3, ema=True, sample_bytes=1000.0, cache_bytes=5e6
    )
    table, models = _table()
    row = table[(table["config_id"] == "z2-bf16-mb4-off-optimizer") & (table["node_count"] == 2)].iloc[0]
    need = host_bytes(models.memory, setup, row)
    states = models.memory.state_bytes(2, "bf16", 16)
    partition = states["master"]  # fp32 master: 4 bytes an element, the fp32 gradient partition alike
    assert need["offloaded_states"] == pytest.approx(8 * (states["master"] + states["optimizer"]))
    assert need["pinned_buffers"] >= 8 * partition and need["cpu_ema"] == pytest.approx(8 * partition)
    assert need["loader_workers"] == pytest.approx(8 * 1000.0 * 4 * (PREFETCH_FACTOR * 3 + 1))
    assert need["page_cache"] == 5e6
    assert need["total"] == pytest.approx(sum(v for k, v in need.items() if k != "total"))
    # without offload nothing of the optimizer is on the host, and the EMA stays on the device
    plain = table[(table["config_id"] == "z2-bf16-mb4-off-none") & (table["node_count"] == 2)].iloc[0]
    bare = host_bytes(models.memory, setup, plain)
    assert bare["offloaded_states"] == bare["pinned_buffers"] == bare["cpu_ema"] == 0


def test_a_config_over_the_declared_host_ram_leaves_the_pick_with_its_reason():
    _, models = _table()
    roomy, _ = _table(HostSetup(8, 1e12, "--host-memory-gib"))
    assert roomy["host_fits"].all()
    offload = roomy[roomy["offload"] == "optimizer"]["host_bytes_per_node"]
    # RAM for every config without offload, and not for one with it
    ram = float(offload.min()) * 0.5
    tight, _ = _table(HostSetup(8, ram, "--host-memory-gib"))
    over = tight[tight["offload"] == "optimizer"]
    assert not over["feasible"].any() and tight[tight["offload"] == "none"]["feasible"].all()
    reason = over["host_reason"].iloc[0]
    assert reason.startswith("host RAM: needs ") and "offloaded states" in reason
    assert reason.endswith(f"over the node's {ram / GIB:.3g} GiB (--host-memory-gib)")
    # the fastest config is an offloaded one: with the RAM it is picked, without it another is
    fast = roomy.assign(samples_per_s=roomy["samples_per_s"] * (1 + (roomy["offload"] == "optimizer")))
    best, *_ = recommend(fast, BASE, 1e12, "sqrt", 8, node_count=2)
    assert best["offload"] == "optimizer"
    refused = tight.assign(samples_per_s=fast["samples_per_s"])
    best, _, runners, _ = recommend(refused, BASE, 1e12, "sqrt", 8, node_count=2)
    assert best["offload"] == "none"
    lines = [r["why_not"] for r in runners if r["config_id"].endswith("off-optimizer")]
    assert lines and all(line.startswith("host RAM: needs ") for line in lines)


def test_the_nodes_ram_is_declared_a_presets_or_measured_here():
    assert node_ram(512.0, "dgx-h100", True) == (512.0 * GIB, "--host-memory-gib")
    assert node_ram(None, "dgx-h100", False) == (
        HOST_RAM_GIB["dgx-h100"] * GIB,
        "the dgx-h100 preset's datasheet",
    )
    here, source = node_ram(None, None, True)
    assert source == "measured here" and here == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    unknown, why = node_ram(None, "ib-200", False)
    assert unknown is None and "--host-memory-gib" in why
    # unknown RAM refuses nothing
    table, _ = _table(HostSetup(8, None, why))
    assert table["host_fits"].all() and (table["host_reason"] == "").all()


def test_the_setup_reads_the_trainer_options_and_measures_the_cache(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shard-0.bin").write_bytes(b"x" * 3000)
    (cache / "shard-1.bin").write_bytes(b"x" * 1000)
    args = ("--num-workers", "4", "--ema-decay=0.999", "--cache-dir", str(cache))
    setup = host_setup(args, 8, 64, 100, (1e12, "measured here"), 2)
    assert (setup.num_workers, setup.ema, setup.cache_bytes) == (4, True, 4000.0)
    assert setup.sample_bytes == pytest.approx(40.0)  # the cache's bytes per sample
    pixels = host_setup((), 8, 64, 100, (None, "unknown"), 2)
    assert (pixels.num_workers, pixels.ema, pixels.cache_bytes) == (2, False, 0.0)
    assert pixels.sample_bytes == 3 * 64 * 64 * FP32
