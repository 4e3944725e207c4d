"""#27: `sdzero cache --hostfile`, the advisor's hostfile trials and its collectives benchmark start their
remote ranks through sdzero.cluster.remote_launch, as `sdzero launch` does: the runner line holds no
folder, no value and no secret, and the payload word carries the exact folder, command and values. The
one-host paths stay what they were. The namespace-cluster proof is
tests/multinode/test_launch_exact_cache_advise.py."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from advisor.measure import collectives_launch, trials
from advisor.measure.grid import TrialSpec
from sdzero.cluster.launch_command import REPO_ROOT, TRAIN_SCRIPT, deepspeed_command
from sdzero.cluster.remote_launch import MODULE, RemoteLaunch
from sdzero.data.cache_build import cache_launch
from sdzero.process.rank_entry import decode_payload

HOSTILE = "my runs $(touch pwned) `id`; it's"
ENV_FILE = 'HF_HOME=/data/hf cache\nSDZERO_ODD=it\'s "$HOME" $(touch pwned2)\nHF_TOKEN=hf_FAKE_unit_1\n'


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """A hostile launching folder with a user's .deepspeed_env, as the current folder; no $HOME file."""
    folder = tmp_path / HOSTILE
    folder.mkdir()
    (folder / ".deepspeed_env").write_text(ENV_FILE)
    (tmp_path / "hosts").write_text("n1 slots=2\nn2 slots=2\n")
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NCCL_SDZERO_TEST", "a b $c")
    return folder


def assert_exact(launch: RemoteLaunch, cwd: Path, command: list[str]) -> None:
    """Nothing of the folder or the values on the runner line; the payload holds them exactly."""
    line = " ".join(launch.command)
    assert HOSTILE not in line and "hf cache" not in line and "hf_FAKE_unit_1" not in line
    assert launch.command[-4:-1] == ["--no_local_rank", "--module", MODULE] or launch.command[-3:-1] == [
        "--module",
        MODULE,
    ]
    assert launch.runner_cwd == REPO_ROOT and launch.runner_env["DS_ENV_FILE"] == os.devnull
    payload = decode_payload(launch.command[-1])
    assert payload.cwd == str(cwd) and payload.command == command
    assert payload.env["HF_HOME"] == "/data/hf cache"
    assert payload.env["SDZERO_ODD"] == 'it\'s "$HOME" $(touch pwned2)'
    assert payload.env["NCCL_SDZERO_TEST"] == "a b $c"  # a name DeepSpeed exports: forwarded exactly
    assert "HF_TOKEN" not in payload.env and launch.secrets == {"HF_TOKEN": "hf_FAKE_unit_1"}
    assert launch.secrets_file is not None and launch.secrets_file.parent == cwd
    assert "NCCL_SDZERO_TEST" not in launch.runner_env  # the runner would have exported it unquoted


def test_cache_with_a_hostfile_runs_each_rank_where_the_user_launched(here):
    launch = cache_launch(["--out", "cache dir", "--data", "$d"], 2, here.parent / "hosts")
    assert_exact(launch, here, ["-m", "sdzero.cli", "cache", "--out", "cache dir", "--data", "$d"])
    assert launch.command[-4] == "--no_local_rank"  # the cache's ranks read LOCAL_RANK from the env
    assert launch.command[launch.command.index("--num_gpus") + 1] == "2"
    assert "--master_addr" not in launch.command  # DeepSpeed finds the first host's, as before


def test_cache_on_one_host_is_the_runner_command_it_was(here):
    launch = cache_launch(["--out", "c"], 2, None)
    expected = deepspeed_command(
        ["--out", "c"], num_gpus=2, entry=["--no_local_rank", "--module", "sdzero.cli", "cache"]
    )
    port = expected.index("--master_port") + 1
    assert launch.command[:port] + launch.command[port + 1 :] == expected[:port] + expected[port + 1 :]
    assert launch.runner_cwd == here and launch.secrets_file is None


def settings(hostfile: Path | None) -> trials.TrialSettings:
    return trials.TrialSettings(
        model="/m",
        data=Path("/d"),
        steps=2,
        warmup_steps=1,
        trial_timeout_s=60,
        stall_timeout_s=None,
        hostfile=hostfile,
    )


def test_a_hostfile_trial_runs_in_its_trial_folder_with_the_launching_folders_values(here, tmp_path):
    trial_dir = tmp_path / "out dir $(x)" / "z2-fp32-mb1"
    trial_dir.mkdir(parents=True)
    spec = TrialSpec(2, "fp32", 1, "none", 2)
    s = settings(tmp_path / "hosts")
    launch = trials.trial_launch(spec, s, tmp_path / "ds.json", trial_dir, dict(os.environ))
    args = trials.trainer_args(s, tmp_path / "ds.json", trial_dir)
    assert_exact(launch, trial_dir, [str(TRAIN_SCRIPT), *args])
    assert launch.command[-3] == "--module"  # the trainer takes --local_rank=N, as under DeepSpeed
    assert launch.command[launch.command.index("--num_gpus") + 1] == "2"
    command = trials.trial_command(spec, s, tmp_path / "ds.json", trial_dir)
    assert decode_payload(command[-1]).command == [str(TRAIN_SCRIPT), *args]  # a fresh secrets name only


def test_a_one_host_trial_is_the_per_node_launcher_as_before(here, tmp_path):
    spec = TrialSpec(2, "fp32", 1, "none", 2)
    command = trials.trial_command(spec, settings(None), tmp_path / "ds.json", tmp_path)
    assert command[1:4] == ["-u", "-m", "deepspeed.launcher.launch"] and "--profile-out" in command


SECRET_CHECK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    print("secret file holds", Path(sys.argv[1]).read_text(), flush=True)
    time.sleep(60)
""")


def test_a_trial_is_killed_as_a_session_and_its_secrets_file_goes_with_it(tmp_path, monkeypatch):
    trial_dir = tmp_path / "trial"
    trial_dir.mkdir()
    secrets = trial_dir / ".sdzero-launch-test.json"

    def launch(*args):
        command = [sys.executable, "-c", SECRET_CHECK, str(secrets)]
        return RemoteLaunch(command, trial_dir, dict(args[-1]), {}, {"HF_TOKEN": "t"}, secrets)

    monkeypatch.setattr(trials, "trial_launch", launch)
    monkeypatch.setattr(trials, "POLL_S", 0.05)
    s = trials.TrialSettings(
        model="m", data=Path("d"), steps=1, warmup_steps=0, trial_timeout_s=1.5, stall_timeout_s=None
    )
    outcome = trials.run_trial(None, s, tmp_path / "ds.json", trial_dir)
    assert "timeout" in outcome.reason and outcome.returncode == -15
    assert 'secret file holds {"HF_TOKEN": "t"}' in (trial_dir / "log.txt").read_text()
    assert not secrets.exists()


def test_the_benchmark_with_a_hostfile_runs_its_ranks_in_the_work_folder(here, tmp_path):
    work = tmp_path / "comm logs $(x)"
    work.mkdir()
    plan = collectives_launch.LaunchPlan(ranks_per_node=1, hosts=("n1", "n2"), hostfile=tmp_path / "hosts")
    launch = collectives_launch.torch_launch(
        plan, ["--csv", str(work / "t.csv")], "gloo", work / "no-hostfile", work
    )
    command = [
        "-m",
        "advisor.measure.collectives_rank",
        "--csv",
        str(work / "t.csv"),
        "--torch-backend",
        "gloo",
    ]
    assert_exact(launch, work, command)
    assert launch.command[-4] == "--no_local_rank"
    assert decode_payload(launch.command[-1]).env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)


def test_sdzero_train_with_a_hostfile_is_sdzero_launch(here, monkeypatch):
    """`sdzero train --hostfile` takes `sdzero launch`'s path (hosts checked, folder and values exact),
    not DeepSpeed's runner line; --num-gpus beside it is one line, exit 2, nothing started."""
    from typer.testing import CliRunner

    from sdzero import cli
    from sdzero.cluster import hostfile as hostfile_module

    seen: dict = {}

    class Plan:
        command = ["deepspeed", "--hostfile", "hosts", "PAYLOAD"]

        class launch:  # noqa: N801 - stands in for RemoteLaunch
            @staticmethod
            def run() -> int:
                seen["ran"] = True
                return 7

    def plan_launch(hostfile, train_args, launcher, master_addr, master_port):
        seen.update(hostfile=hostfile, args=train_args, launcher=launcher, port=master_port)
        return Plan

    monkeypatch.setattr(hostfile_module, "plan_launch", plan_launch)
    monkeypatch.setattr(hostfile_module, "describe", lambda plan: ["checked"])
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("DeepSpeed's runner was called"))
    hosts = here.parent / "hosts"
    result = CliRunner().invoke(cli.app, ["train", "--hostfile", str(hosts), "--", "--model", "m x"])
    assert result.exit_code == 7 and seen["ran"] and seen["args"] == ["--model", "m x"]
    assert seen["hostfile"] == hosts and seen["launcher"] == "pdsh"
    seen.clear()
    both = CliRunner().invoke(
        cli.app, ["train", "--hostfile", str(hosts), "--num-gpus", "2", "--", "--model", "m"]
    )
    assert both.exit_code == 2 and "--num-gpus with --hostfile" in both.output and not seen
