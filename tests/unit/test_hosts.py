"""`sdzero launch`'s hostfile checks and .deepspeed_env merge, without a cluster (ssh is a stand-in)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.cluster import hostfile as hosts
from sdzero.errors import UserError
from sdzero.process.rank_entry import decode_payload


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts"
    path.write_text(text)
    return path


def answers(**by_host: tuple[int, str, str]):
    """A stand-in for ssh: (exit code, stdout, stderr) per host; commands are recorded."""
    calls: list[tuple[str, str]] = []

    def runner(host: str, command: str) -> subprocess.CompletedProcess[str]:
        calls.append((host, command))
        code, out, err = by_host[host]
        return subprocess.CompletedProcess(["ssh", host], code, out, err)

    runner.calls = calls  # type: ignore[attr-defined]
    return runner


def test_parses_comments_blank_lines_and_slots(tmp_path):
    path = hostfile(tmp_path, "# the cluster\n\nnode-1 slots=8   # first\n10.0.0.2 slots=4\n")
    assert [(e.host, e.slots, e.line) for e in hosts.parse_hostfile(path)] == [
        ("node-1", 8, 3),
        ("10.0.0.2", 4, 4),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1 slots=0\n", "slots='0' must be a whole number >= 1"),
        ("node1 slots=two\n", "slots='two' must be a whole number"),
        ("node1\n", "expected `node1 slots=N`"),
        ("node1 slots=2 extra\n", "expected `node1 slots=N`"),
        ("node1 slots=1\nnode2 slots=1\nnode1 slots=2\n", "host node1 is listed twice (first on line 1)"),
        ("node1;reboot slots=1\n", "contains ';'"),
        ("$(whoami) slots=1\n", "contains '$()'"),
        ("# only a comment\n", "no hosts in it"),
    ],
)
def test_bad_hostfiles_are_refused_with_the_line(tmp_path, text, expected):
    with pytest.raises(UserError, match=None) as err:
        hosts.parse_hostfile(hostfile(tmp_path, text))
    assert expected in str(err.value)
    if "no hosts" not in expected:
        assert f"{tmp_path / 'hosts'}:" in str(err.value)  # names the file and line


def test_missing_hostfile(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        hosts.parse_hostfile(tmp_path / "nope")


def test_unresolvable_host():
    with pytest.raises(UserError, match="does not resolve"):
        hosts.resolve("no-such-host.invalid")


def test_unreachable_hosts_are_all_named(tmp_path):
    entries = hosts.parse_hostfile(hostfile(tmp_path, "a slots=1\nb slots=1\nc slots=1\n"))
    runner = answers(
        a=(0, "", ""),
        b=(255, "", "ssh: connect to host b port 22: Connection refused\n"),
        c=(255, "", "Permission denied (publickey).\n"),
    )
    with pytest.raises(UserError) as err:
        hosts.check_reachable(entries, runner)
    message = str(err.value)
    assert "b: ssh: connect to host b port 22: Connection refused" in message
    assert "c: Permission denied (publickey)." in message and "a:" not in message
    assert {command for _, command in runner.calls} == {"true"}


def test_interface_is_the_one_that_routes_to_the_master(tmp_path):
    entries = hosts.parse_hostfile(hostfile(tmp_path, "m slots=1\nw slots=1\n"))
    master_side = (
        "local 10.1.0.1 dev lo src 10.1.0.1 uid 0 \\    cache <local>\n"
        "3: ib0    inet 10.1.0.1/16 brd 10.1.255.255 scope global ib0\n"
    )
    worker_side = "10.1.0.1 dev ib0 src 10.1.0.2 uid 0 \\    cache\n"
    runner = answers(m=(0, master_side, ""), w=(0, worker_side, ""))
    assert hosts.pick_interface(entries, "10.1.0.1", runner) == "ib0"


def test_differently_named_interfaces_are_refused(tmp_path):
    entries = hosts.parse_hostfile(hostfile(tmp_path, "m slots=1\nw slots=1\n"))
    runner = answers(
        m=(0, "10.1.0.1 dev eth0 src 10.1.0.1\n", ""), w=(0, "10.1.0.1 dev ens5 src 10.1.0.2\n", "")
    )
    with pytest.raises(UserError, match="m: eth0, w: ens5"):
        hosts.pick_interface(entries, "10.1.0.1", runner)


def test_env_file_keeps_the_users_keys_and_says_what_it_added(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("NCCL_SOCKET_IFNAME=ib0\nMY_FLAG=1")  # no final newline
    merge = hosts.merge_env_file(path, {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"})
    assert path.read_text() == "NCCL_SOCKET_IFNAME=ib0\nMY_FLAG=1\nGLOO_SOCKET_IFNAME=eth0\n"
    assert merge.added == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert merge.kept == {"NCCL_SOCKET_IFNAME": ("ib0", "eth0")}
    again = hosts.merge_env_file(path, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert again.added == {} and path.read_text().count("GLOO_SOCKET_IFNAME") == 1


def test_env_file_line_deepspeed_cannot_read(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("export FOO\n")
    with pytest.raises(UserError, match="not KEY=VALUE"):
        hosts.merge_env_file(path, {"A": "1"})
    assert path.read_text() == "export FOO\n"


def test_remote_environment_carries_paths_and_interface():
    env = hosts.remote_environment("ib0", {"PYTHONPATH": "/opt/lib", "HF_HOME": "/shared/hf"})
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["PYTHONPATH"].split(":")[1:] == ["/opt/lib"] and env["HF_HOME"] == "/shared/hf"
    assert env["TORCH_EXTENSIONS_DIR"]


def test_plan_checks_before_anything_is_written(tmp_path, monkeypatch):
    path = hostfile(tmp_path, "127.0.0.1 slots=2\n")
    runner = answers(**{"127.0.0.1": (255, "", "Host key verification failed.\n")})
    with pytest.raises(UserError, match="Host key verification failed"):
        hosts.plan_launch(path, ["--max-steps", "2"], workdir=tmp_path, runner=runner)
    assert not (tmp_path / ".deepspeed_env").exists()


def test_plan_builds_the_openmpi_command(tmp_path):
    path = hostfile(tmp_path, "127.0.0.1 slots=2\n")
    runner = answers(
        **{"127.0.0.1": (0, "local 127.0.0.1 dev lo\n1: lo    inet 127.0.0.1/8 scope host lo\n", "")}
    )
    plan = hosts.plan_launch(
        path, ["--max-steps", "2"], launcher="openmpi", master_port=29999, workdir=tmp_path, runner=runner
    )
    cmd = plan.command
    assert (
        cmd[cmd.index("--launcher") + 1] == "openmpi"
        and "btl_tcp_if_include lo" in cmd[cmd.index("--launcher_args") + 1]
    )
    assert cmd[cmd.index("--master_addr") + 1] == "127.0.0.1" and cmd[-2] == "sdzero.process.rank_entry"
    payload = decode_payload(cmd[-1])  # the trainer's options travel inside the rank entry's word
    assert payload.command[-2:] == ["--max-steps", "2"] and payload.cwd == str(tmp_path)
    assert "GLOO_SOCKET_IFNAME=lo" in (tmp_path / ".deepspeed_env").read_text()
    assert payload.env["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("n1 slots=1\nn1 slots=1\n", "listed twice"),
        ("n1 slots=x\n", "whole number"),
        ("a|b slots=1\n", "'|'"),
        ("n1 slots=\u00b2\n", "slots='\u00b2' must be a whole number"),  # str.isdigit() says yes to '²'
    ],
)
def test_cli_exits_2_with_one_line(tmp_path, text, expected):
    result = CliRunner().invoke(
        app, ["launch", "--hostfile", str(hostfile(tmp_path, text)), "--", "--max-steps", "1"]
    )
    assert result.exit_code == 2
    assert expected in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_unknown_launcher(tmp_path):
    path = hostfile(tmp_path, "localhost slots=1\n")
    result = CliRunner().invoke(app, ["launch", "--hostfile", str(path), "--launcher", "srun"])
    assert result.exit_code == 2 and "choose one of pdsh, openmpi" in result.output


def test_env_file_keeps_its_mode_and_its_symlink(tmp_path):
    real = tmp_path / "secrets" / "ds_env"
    real.parent.mkdir()
    real.write_text("HF_TOKEN=hf_secret\n")
    real.chmod(0o600)
    link = tmp_path / ".deepspeed_env"
    link.symlink_to(real)
    hosts.merge_env_file(link, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert link.is_symlink() and link.resolve() == real
    assert real.read_text() == "HF_TOKEN=hf_secret\nGLOO_SOCKET_IFNAME=eth0\n"
    assert real.stat().st_mode & 0o777 == 0o600  # tokens stay private
    assert sorted(p.name for p in real.parent.iterdir()) == ["ds_env"]  # no temp file left


def test_env_file_temp_name_is_unique_not_a_planted_path(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    (tmp_path / ".deepspeed_env.tmp").symlink_to(victim)  # a fixed temp name could be pre-planted
    path = tmp_path / ".deepspeed_env"
    path.write_text("A=1\n")
    hosts.merge_env_file(path, {"B": "2"})
    assert victim.read_text() == "untouched\n" and path.read_text() == "A=1\nB=2\n"


def test_env_file_bad_lines_are_each_refused_by_number(tmp_path):
    path = tmp_path / ".deepspeed_env"
    text = "A=1\n\n# X=1\nexport B=2\nC=3\n"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        hosts.merge_env_file(path, {"D": "4"})
    message = str(err.value)
    assert "line 2 is blank" in message and "line 3 '# X=1'" in message and "line 4 'export B=2'" in message
    assert "line 1" not in message and "line 5" not in message and "\n" not in message
    assert path.read_text() == text


def test_env_values_are_written_unquoted(tmp_path):
    """Quoted, `/data/hf cache` reached the ranks as `'/data/hf cache'`: values are literal now."""
    path = tmp_path / ".deepspeed_env"
    hosts.merge_env_file(path, {"PYTHONPATH": "/my code/lib", "HF_HOME": "/plain"})
    assert path.read_text() == "PYTHONPATH=/my code/lib\nHF_HOME=/plain\n"
    again = hosts.merge_env_file(path, {"PYTHONPATH": "/my code/lib"})
    assert again.added == {} and again.kept == {}
    assert hosts.read_env_file(path) == {"PYTHONPATH": "/my code/lib", "HF_HOME": "/plain"}


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("10.0.0.1;reboot", "a host name or IP address only"),
        ("$(id)", "a host name or IP address only"),
        ("no-such-host.invalid", "does not resolve"),
    ],
)
def test_master_addr_is_validated_before_any_ssh(tmp_path, addr, expected):
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n")
    runner = answers(**{"127.0.0.1": (0, "local 127.0.0.1 dev lo\n", "")})
    with pytest.raises(UserError, match=None) as err:
        hosts.plan_launch(path, [], master_addr=addr, workdir=tmp_path, runner=runner)
    assert expected in str(err.value) and runner.calls == []


def test_master_addr_name_is_resolved_for_the_route_query(tmp_path):
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n")
    runner = answers(
        **{"127.0.0.1": (0, "local 127.0.0.1 dev lo\n1: lo    inet 127.0.0.1/8 scope host lo\n", "")}
    )
    plan = hosts.plan_launch(path, [], master_addr="localhost", workdir=tmp_path, runner=runner)
    assert plan.master_addr == "127.0.0.1"
    assert any("route get 127.0.0.1" in command for _, command in runner.calls)


HOSTILE = [
    "--validation-prompts",
    "a $100 bill",
    "it's",
    "`id`",
    "a;b",
    'say "hi"',
    "\u00fcber \u00e9t\u00e9 \u2603",
    "",
    "  two  spaces ",
    "$(touch /tmp/pwned)",
    "back\\slash",
    "--max-steps",
    "3",
]


def test_trainer_options_survive_a_remote_shell(tmp_path):
    """What pdsh does with DeepSpeed's command: one string, run by the remote shell (sh here)."""
    from sdzero.cluster.launch_command import decode_argv, shell_proof_args

    args = shell_proof_args(HOSTILE)
    assert all(" " not in a and "'" not in a and "$" not in a for a in args)  # nothing for DeepSpeed to wrap
    line = " ".join(
        ["python3", "-c", "'import json,sys; print(json.dumps(sys.argv[1:]))'", "--local_rank=0", *args]
    )
    echoed = json.loads(subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout)
    assert decode_argv(echoed) == ["--local_rank=0", *HOSTILE]
    assert shell_proof_args(["--max-steps", "3", "--output-dir", "/runs/a_b-1"]) == [
        "--max-steps",
        "3",
        "--output-dir",
        "/runs/a_b-1",
    ]
    with pytest.raises(UserError, match="--sdzero-argv-b64"):
        decode_argv(["--sdzero-argv-b64", "not base64!"])


def test_cache_build_options_are_shell_proof_too(tmp_path):
    """`sdzero cache --hostfile` starts `python -m sdzero.cli cache ARGS` on every node through pdsh."""
    import sys

    from sdzero.cluster.launch_command import deepspeed_command, shell_proof_args

    hosts_path = hostfile(tmp_path, "127.0.0.1 slots=1\n")
    args = [str(tmp_path / "it's $HOME"), "--images", "2"]
    cmd = deepspeed_command(args, hostfile=hosts_path, entry=["--module", "sdzero.cli", "synth-data"])
    assert cmd[-2:] == shell_proof_args(args) and cmd[-2] == "--sdzero-argv-b64"
    line = " ".join([sys.executable, "-m", "sdzero.cli", "synth-data", *cmd[-2:]])
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "it's $HOME" / "metadata.jsonl").is_file()


# ---------------------------------------------------------------------------------- one command builder


def test_the_one_builder_places_every_launcher_option(tmp_path):
    from sdzero.cluster.launch_command import ARGV_FLAG, deepspeed_command

    hosts_file = hostfile(tmp_path, "a slots=4\nb slots=4\n")
    cmd = deepspeed_command(
        ["--x", "1"],
        hostfile=hosts_file,
        num_nodes=2,
        num_gpus=4,
        master_addr="10.0.0.1",
        master_port=1234,
        launcher="openmpi",
        launcher_args="--mca btl_tcp_if_include eth0",
        entry=["e.py"],
        executable="deepspeed",
    )
    assert cmd == [
        "deepspeed",
        *("--hostfile", str(hosts_file), "--num_nodes", "2", "--num_gpus", "4"),
        *("--master_addr", "10.0.0.1", "--master_port", "1234"),
        *("--launcher", "openmpi", "--launcher_args", "--mca btl_tcp_if_include eth0"),
        *("e.py", "--x", "1"),
    ]
    risky = ["--resolution", "64", "--validation-prompts", "a $HOME `id`"]
    assert deepspeed_command(risky, hostfile=hosts_file)[-2] == ARGV_FLAG  # remote shells see one word
    assert deepspeed_command(risky, hostfile=hosts_file, shell_proof=False)[-4:] == risky
    with pytest.raises(UserError, match="--hostfile .*: no such file"):
        deepspeed_command([], hostfile=tmp_path / "absent")
    printed = deepspeed_command([], hostfile=tmp_path / "absent", check_hostfile=False, pick_port=False)
    assert "--master_port" not in printed and str(tmp_path / "absent") in printed


def test_one_host_command_is_what_the_runner_starts_on_one_host():
    from deepspeed.launcher.runner import encode_world_info

    from sdzero.cluster.launch_command import TRAIN_SCRIPT, one_host_command

    cmd = one_host_command(["--x", "1"], 2, master_port=1234)
    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"]
    assert cmd[4] == f"--world_info={encode_world_info({'localhost': [0, 1]})}"  # the runner's own encoding
    assert cmd[5:] == ["--master_addr=127.0.0.1", "--master_port=1234", str(TRAIN_SCRIPT), "--x", "1"]
    assert one_host_command([], 1, entry=["--module", "sdzero.cli", "cache"])[-3:] == [
        "--module",
        "sdzero.cli",
        "cache",
    ]
    with pytest.raises(UserError, match="at least 1"):
        one_host_command([], 0)


def test_recommended_and_benchmark_commands_come_from_the_builder(tmp_path, monkeypatch):
    from advisor.decide.recommend import launch_command
    from advisor.measure import collectives_launch
    from sdzero.cluster import launch_command as launch

    built: list[list[str]] = []
    real = launch.deepspeed_command
    monkeypatch.setattr(launch, "deepspeed_command", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    printed = launch_command(Path("c.json"), "m", Path("d"), 2, 8, None, Path("run"), ("--resolution", "64"))
    assert printed.split() == built[-1]
    assert printed.startswith("deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 ")
    assert "--master_port" not in printed  # the target cluster's default port, not one free here

    plan = collectives_launch.LaunchPlan(ranks_per_node=2, hosts=(), hostfile=None)
    cmd = collectives_launch.torch_command(plan, ["--csv", "c.csv"], "gloo", tmp_path / "no-hostfile")
    assert cmd == built[-1] and cmd[1:3] == ["--hostfile", str(tmp_path / "no-hostfile")]
    assert cmd[-7:] == [
        *("--no_local_rank", "--module", "advisor.measure.collectives_rank"),
        *("--csv", "c.csv", "--torch-backend", "gloo"),
    ]


def test_no_module_builds_a_deepspeed_command_by_hand():
    """`deepspeed` command lines come from sdzero.cluster.launch_command.deepspeed_command only (issue #16)."""
    repo = Path(__file__).resolve().parents[2]
    sources = [*repo.glob("sdzero/**/*.py"), *repo.glob("advisor/**/*.py"), *repo.glob("bench/*.py")]
    sources += [repo / "tests" / "launch.py", *repo.glob("tests/support/**/*.py")]
    by_hand = [
        str(path.relative_to(repo))
        for path in sources
        if path != repo / "sdzero" / "cluster" / "launch_command.py"
        and any(
            word in path.read_text() for word in ('"--master_port"', '"--num_gpus"', 'with_name("deepspeed")')
        )
    ]
    assert by_hand == []


# -- #27: the hostfile's smaller items: each bad input is one line naming the problem and the fix, before any
#    ssh and before .deepspeed_env is touched.

LONG_LABEL = "a" * 70


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fd00::1 slots=1\n", "IPv6 addresses cannot be hostfile hosts"),
        ("[fd00::1] slots=1\n", "IPv6 addresses cannot be hostfile hosts"),
        ("fe80::1%eth0 slots=1\n", "IPv6 addresses cannot be hostfile hosts"),
        ("node1:22 slots=1\n", "holds ':', which DeepSpeed (`host:slots`) and pdsh"),
        ("node1 slots=1025\n", "slots=1025 is more ranks than one host runs (at most 1024)"),
        ("node1 slots=99999999999999999999\n", "at most 1024"),
        ("Node1 slots=1\nnode1. slots=1\n", "host node1. is listed twice (first on line 1, as Node1)"),
        (f"{LONG_LABEL}.example slots=1\n", "has a part of 70 characters (DNS allows 63 between dots)"),
        (f"{LONG_LABEL} slots=1\n", "has a part of 70 characters"),
        (("a." * 130) + "b slots=1\n", "characters long (DNS allows 253)"),
        ("a..b slots=1\n", "has an empty part between dots"),
    ],
)
def test_hostfile_smaller_items_are_one_clear_line(tmp_path, text, expected):
    with pytest.raises(UserError) as err:
        hosts.parse_hostfile(hostfile(tmp_path, text))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_hostfile_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"node1 slots=1\nn\xffde2 slots=1\n")
    with pytest.raises(UserError, match=r"hosts:2: byte 15 is not UTF-8"):
        hosts.parse_hostfile(path)


@pytest.mark.parametrize(
    "text",
    [
        "n\xffde slots=1\n",  # written below as raw bytes
        f"{LONG_LABEL} slots=1\n",
        "fd00::1 slots=1\n",
        "node1 slots=5000\n",
    ],
)
def test_cli_bad_hostfile_exits_2_one_line_nothing_written(tmp_path, monkeypatch, text):
    path = tmp_path / "hosts"
    path.write_bytes(text.encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["launch", "--hostfile", str(path), "--", "--max-steps", "1"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts"]  # no .deepspeed_env, no secrets file


def test_resolve_long_label_is_a_user_error_not_a_unicode_traceback():
    with pytest.raises(UserError, match="not a name DNS can hold"):
        hosts.resolve(LONG_LABEL)


def test_a_name_resolving_only_to_ipv6_is_accepted(monkeypatch):
    import socket

    def only_v6(host, port, family=0, type=0, *rest):
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 0, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", only_v6)
    assert hosts.resolve("v6only") == "fd00::7"


def test_two_lines_for_one_machine_are_refused_after_resolution(tmp_path):
    path = hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    runner = answers()
    with pytest.raises(UserError) as err:
        hosts.plan_launch(path, [], workdir=tmp_path, runner=runner)
    message = str(err.value)
    assert "host 127.0.0.1 is the same machine as localhost on line 1 (both 127.0.0.1)" in message
    assert runner.calls == [] and not (tmp_path / ".deepspeed_env").exists()
