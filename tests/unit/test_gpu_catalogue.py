"""The one GPU catalogue (advisor.model.gpu_catalogue): every name it gives and every name given elsewhere
resolves, and the tables the stages read are views of it, so adding a GPU is one entry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from advisor.model.gpu_catalogue import GPUS, gpu_named
from advisor.model.network import GPU_MACHINE, MACHINES, PRESETS, build_network, machine_intra
from advisor.model.target_compute import GPU_ANCHORS, MODEL_SHAPES, target_rate
from advisor.stages.target import TARGET_GPUS, target_memory

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(GPUS))
def test_every_gpu_has_memory_and_its_machine_and_rate_resolve(name):
    gpu = GPUS[name]
    assert gpu.memory_gib > 0
    assert target_memory(None, None, name) == (
        gpu.memory_gib,
        f"assumed (--target-gpu {name} nominal memory)",
    )
    if gpu.machine is not None:
        assert gpu.machine in MACHINES, gpu.machine
        link, note = machine_intra(None, name)
        assert gpu.machine in note and link.busbw_bytes_s == MACHINES[gpu.machine].intra_busbw_gbyte_s * 1e9
    if gpu.anchor is not None:
        assert gpu.anchor.shape in MODEL_SHAPES and gpu.anchor.samples_per_s_per_gpu > 0
        assert target_rate(name, None) is not None
    else:
        assert target_rate(name, None) is None  # the user gives --target-tflops
    assert gpu_named(name.upper()) is gpu
    assert len(gpu.sources) == 1 + (gpu.machine is not None) + (gpu.anchor is not None)


def test_the_stages_tables_are_views_of_the_catalogue():
    assert {name: gpu.memory_gib for name, gpu in GPUS.items()} == TARGET_GPUS
    assert {name: gpu.machine for name, gpu in GPUS.items() if gpu.machine} == GPU_MACHINE
    assert {name: gpu.anchor for name, gpu in GPUS.items() if gpu.anchor} == GPU_ANCHORS
    assert {"h100-80gb", "h200", "a100-80gb"} <= set(GPU_ANCHORS)  # the published rates the docs cite


@pytest.mark.parametrize("name", list(MACHINES))
def test_every_machine_names_a_catalogued_gpu_and_builds(name):
    machine = MACHINES[name]
    assert machine.gpu in GPUS, machine.gpu
    network, _ = build_network(None, machine.gpus_per_node, name, gpu_target=machine.gpu)
    assert network.gpus_per_node == machine.gpus_per_node


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_fabric_preset_builds(name):
    network, _ = build_network(None, 8, name)
    assert network.inter.busbw_bytes_s > 0


def test_every_name_the_docs_and_examples_give_resolves():
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    presets = set(re.findall(r"--preset[ =]([a-z0-9][a-z0-9-]*)", text))
    gpus = set(re.findall(r"--target-gpu[ =]([a-z0-9][a-z0-9-]*)", text)) - {"name"}
    assert presets and gpus
    assert presets <= {*PRESETS, *MACHINES}, presets - {*PRESETS, *MACHINES}
    assert gpus <= set(GPUS), gpus - set(GPUS)
    profile = yaml.safe_load((ROOT / "examples" / "profile.yaml").read_text())
    assert profile["device"] in GPUS and profile["model"] in MODEL_SHAPES
