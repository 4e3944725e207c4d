"""Trials where the GPUs are: `sdzero advise --hostfile` on a machine without an accelerator (a login node)
runs its trials on the hostfile's first host through the launcher, with that host's slots as ranks, and the
scale-out check runs its 1-host leg there (slots ranks), then hosts x slots across the hosts. Stand-ins
replace the launches; tests/multinode/test_advise_hostfile.py runs it for real on the namespace hosts."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import advisor.measure.profile as profile_module
import advisor.stages.inputs as inputs_module
from advisor.measure.grid import TrialSpec
from advisor.measure.profile import TrialsHost, trials_on_first_host
from advisor.measure.trials import TrialSettings, first_host_hostfile, trial_launch
from advisor.stages.request import AdviseRequest
from sdzero.cluster.hostfile import HostEntry

GPU_HOST = {
    "device": "cuda",
    "count": 1,
    "bf16": True,
    "fp16": True,
    "host": "gpu1",
    "memory_bytes": 80 * 2**30,
}


def write_hostfile(path: Path, slots: int = 4) -> Path:
    path.write_text(f"# the allocation\ngpu1 slots={slots}\ngpu2 slots={slots}\n")
    return path


def test_the_first_hosts_hostfile_names_that_host_and_its_slots(tmp_path):
    first = first_host_hostfile(write_hostfile(tmp_path / "hosts"), tmp_path / "out" / "one")
    assert (first.host, first.slots) == ("gpu1", 4)
    assert (tmp_path / "out" / "one").read_text() == "gpu1 slots=4\n"


def test_a_trial_with_the_one_host_hostfile_goes_through_the_launcher(tmp_path):
    one = tmp_path / "trials-hostfile"
    first_host_hostfile(write_hostfile(tmp_path / "hosts"), one)
    settings = TrialSettings("/m", tmp_path / "data", 2, 1, 60.0, None, hostfile=one, hosts=1)
    launch = trial_launch(TrialSpec(2, "bf16", 1, "none", 4), settings, tmp_path / "ds.json", tmp_path / "t")
    command = launch.command
    assert command[command.index("--hostfile") + 1] == str(one)
    assert command[command.index("--num_gpus") + 1] == "4"
    assert "deepspeed.launcher.launch" not in " ".join(command)  # the runner, not this host's launcher
    assert "--force_multi" in command  # else the runner starts a one-host hostfile's ranks on this machine


def test_the_device_is_asked_on_the_first_host_through_the_launcher(monkeypatch, tmp_path):
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        line = (
            'gpu1: SDZERO_DEVICE {"device": "cuda", "count": 1, "bf16": true, "fp16": true, "host": "gpu1", '
        )
        return subprocess.CompletedProcess(command, 0, line + '"memory_bytes": 85899345920}\n', "")

    monkeypatch.setattr(profile_module, "subprocess", SimpleNamespace(run=run))
    (tmp_path / "out").mkdir()
    found = trials_on_first_host(write_hostfile(tmp_path / "hosts"), tmp_path / "out")
    assert (found.host, found.slots) == ("gpu1", 4)
    assert found.device["device"] == "cuda" and found.device["count"] == 4  # slots=, not the one rank's view
    assert found.hostfile.read_text() == "gpu1 slots=4\n"
    [command] = calls
    assert command[command.index("--hostfile") + 1] == str(found.hostfile)
    assert command[command.index("--num_gpus") + 1] == "1" and "--force_multi" in command


@pytest.fixture
def read(monkeypatch, tmp_path, tiny_model, synth_data):
    """read_inputs with this machine's device and the first host's answer stood in for."""
    asked: list[Path] = []

    def first_host(hostfile: Path, out_dir: Path) -> TrialsHost:
        asked.append(hostfile)
        one = out_dir / "trials-hostfile"
        first = first_host_hostfile(hostfile, one)
        return TrialsHost(first.host, first.slots, one, {**GPU_HOST, "count": first.slots})

    monkeypatch.setattr(profile_module, "trials_on_first_host", first_host)
    monkeypatch.setattr(
        inputs_module,
        "prepare_hostfile",
        lambda hostfile, say: [HostEntry("gpu1", 4, 2), HostEntry("gpu2", 4, 3)],
    )
    lines: list[str] = []

    def run(here: dict, hostfile: Path | None):
        monkeypatch.setattr(profile_module, "device_support", lambda: here)
        request = AdviseRequest(
            model=str(tiny_model),
            data=synth_data,
            out_dir=tmp_path / "out",
            hostfile=hostfile,
            log=lines.append,
        )
        return inputs_module.read_inputs(request)

    return SimpleNamespace(run=run, asked=asked, lines=lines)


def test_a_login_node_plans_and_runs_the_trials_on_the_first_host(read, tmp_path):
    hostfile = write_hostfile(tmp_path / "hosts")
    inputs = read.run({"device": "cpu", "count": 1, "bf16": True, "fp16": False}, hostfile)
    assert read.asked == [hostfile]
    assert inputs.trials_host is not None and inputs.trials_host.host == "gpu1"
    assert inputs.settings.hostfile == (tmp_path / "out" / "trials-hostfile").resolve()
    assert inputs.settings.hosts == 1 and inputs.settings.hostfile.read_text() == "gpu1 slots=4\n"
    assert inputs.ranks == 4 and inputs.device["device"] == "cuda" and not inputs.on_cpu
    assert {s.ranks_per_node for ladder in inputs.plan.ladders for s in ladder} == {4}
    assert "trials run on gpu1 (4 ranks) through the launcher: this machine has no accelerator" in read.lines


def test_with_an_accelerator_here_the_trials_stay_here(read, tmp_path):
    inputs = read.run(
        {"device": "cuda", "count": 2, "bf16": True, "fp16": True}, write_hostfile(tmp_path / "hosts")
    )
    assert read.asked == [] and inputs.trials_host is None
    assert inputs.settings.hostfile is None and inputs.ranks == 2


def test_the_trials_hosts_memory_is_its_own(read, tmp_path):
    from advisor.stages.measure import trials_host_memory

    assert trials_host_memory(GPU_HOST, 4, "gpu1") == (
        80 * 2**30,
        "measured (cuda device 0 total memory on gpu1)",
    )
    cpu = {"device": "cpu", "memory_bytes": 64 * 2**30}
    assert trials_host_memory(cpu, 2, "n1")[0] == 32 * 2**30  # a CPU host's memory, shared by its ranks


# ---------------------------------------------------------------------------------------- the scale-out check


def test_the_one_host_leg_runs_slots_ranks_on_the_first_host(monkeypatch, tmp_path):
    from test_scaleout import fits, one_host_trial

    import advisor.stages.scaleout_check as scaleout
    from advisor.measure.alphabeta import FIT_SCHEMA
    from sdzero.atomic import write_json_atomic

    legs = []

    def trial_table(spec, settings, base, trial_dir, nodes):
        legs.append((spec.ranks_per_node, settings.hostfile, settings.hosts, nodes))
        ranks = spec.ranks_per_node
        return one_host_trial().assign(
            ranks_per_node=ranks, world_size=ranks * nodes, trial_dir=str(trial_dir)
        )

    monkeypatch.setattr(scaleout, "trial_table", trial_table)
    fit = tmp_path / "fit.json"
    write_json_atomic(fit, {"schema": FIT_SCHEMA, "fits": fits(1.0)})
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu1 slots=2\ngpu2 slots=2\n")
    hosts = [HostEntry("gpu1", 2, 1), HostEntry("gpu2", 2, 2)]
    best = {"zero_stage": 2, "dtype": "bf16", "micro_batch": 4, "offload": "none"}
    settings = TrialSettings("/m", tmp_path / "data", 2, 1, 60.0, None)
    said: list[str] = []
    check = scaleout.scaleout_check(best, {}, settings, hostfile, hosts, fit, tmp_path / "out", said.append)
    one_host, multi_host = legs
    assert one_host[0] == 2 and one_host[2:] == (1, 1)  # slots ranks on one host, not hosts x slots here
    assert one_host[1] is not None and one_host[1].read_text() == "gpu1 slots=2\n"
    assert multi_host == (2, hostfile.resolve(), 2, 2)
    assert check["one_host_leg"]["host"] == "gpu1" and check["one_host_leg"]["ranks"] == 2
    assert check["multi_host_leg"] == {"hosts": ["gpu1", "gpu2"], "ranks_per_host": 2}
    assert "on 1 host (gpu1) x 2 ranks, then 2 hosts x 2" in said[0]


def test_a_one_rank_leg_costs_the_collectives_from_the_networks_sizes(tmp_path):
    """One slot per host: the 1-host trial ran no collective, so only the trained sizes give the
    prediction its inter-host communication."""
    from test_scaleout import fits, one_host_trial

    from advisor.measure.alphabeta import FIT_SCHEMA
    from advisor.model.memory import ZeroSettings
    from advisor.stages.scaleout_check import TrainedSizes, predict_step
    from sdzero.atomic import write_json_atomic

    fit = tmp_path / "fit.json"
    write_json_atomic(fit, {"schema": FIT_SCHEMA, "fits": fits(10.0)})
    alone = one_host_trial(comm_s=0.0).assign(ranks_per_node=1, world_size=1, comm_ops=None)
    sized, _ = predict_step(alone, fit, 2, 1, sizes=TrainedSizes((1_000_000,), ZeroSettings()))
    assert sized.exposed_comm_s > 0
    assert sized.step_time_s > float(pd.to_numeric(alone["step_time_median_s"]).iloc[0])


def test_the_bench_keeps_its_own_one_host_trial(monkeypatch, tmp_path):
    """check_config with a 1-host trial given runs only the multi-host leg (bench/scaleout_accuracy.py)."""
    from test_scaleout import fits, one_host_trial

    import advisor.stages.scaleout_check as scaleout
    from advisor.measure.alphabeta import FIT_SCHEMA
    from sdzero.atomic import write_json_atomic

    ran = []
    monkeypatch.setattr(
        scaleout,
        "trial_table",
        lambda spec, *args, nodes: ran.append(nodes) or one_host_trial().assign(nodes=nodes),
    )
    fit = tmp_path / "fit.json"
    write_json_atomic(fit, {"schema": FIT_SCHEMA, "fits": fits(1.0)})
    settings = TrialSettings("/m", tmp_path / "data", 2, 1, 60.0, None)
    spec = TrialSpec(2, "bf16", 4, "none", 1)
    remote = replace(settings, hostfile=tmp_path / "hosts", hosts=2)
    row, given = scaleout.check_config(
        spec, {}, settings, remote, fit, 2, 1, tmp_path, one_host=one_host_trial()
    )
    assert ran == [2] and int(given["ranks_per_node"].iloc[0]) == 2 and row.hosts == 2
