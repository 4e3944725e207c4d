"""Hostfile launches whose working folder and forwarded values reach every remote rank exactly.

DeepSpeed's runner turns a hostfile launch into one shell line per node (pdsh) or `-x K=V` options
(mpirun): `export K="V"; cd /launch/folder; python -u -m deepspeed.launcher.launch ... SCRIPT ARGS`. The
folder is not quoted at all and values only in double quotes, so a folder `my runs` is split, one named
`x$(touch f)` runs on every node, `$`/backticks in values are expanded, and every value, tokens
included, is printed in the runner's INFO log and visible in `ps` on every host.

So sdzero hands that line nothing a shell could change and nothing secret:
- the runner starts in sdzero's own folder (REPO_ROOT, which every node has at the same path since
  the ranks import sdzero from it, and whose name is checked to be shell-safe), so `cd` is harmless;
- it reads no env file (DS_ENV_FILE=/dev/null) and the launching environment loses the variables it
  would export (PYTHON*, NCCL*, ...): sdzero forwards all of those itself;
- the rank entry (sdzero.process.rank_entry) gets one base64 word: the real folder, the rank command and
  the values that are not secret; secrets (names with TOKEN, KEY, SECRET, PASSWORD, ...) go into a file in
  the launch folder that only the user can read (0600), removed when the launch ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdzero.cluster.env_file import env_file_name, read_env_file
from sdzero.cluster.launch_command import REPO_ROOT, SHELL_SAFE, decode_argv, deepspeed_command
from sdzero.errors import UserError
from sdzero.process.rank_entry import MODULE, Payload, encode_payload
from sdzero.process.stall_exit import output_dir_of

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
"""Names whose values never go on a command line (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY,
MLFLOW_TRACKING_PASSWORD, ...). Too wide is harmless: such a value only travels by file instead."""
DEEPSPEED_EXPORTED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "HCCL", "CCL", "I_MPI", "FI_")
"""Launching-environment variables DeepSpeed's runner exports to remote nodes on its own: its
EXPORT_ENVS plus the accelerators' export_envs() (a unit test checks this covers the installed
DeepSpeed). sdzero removes them from the runner's environment and forwards them exactly instead."""
DEEPSPEED_EXCLUDED = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
"""DeepSpeed's EXCLUDE_ENVS: with the key set, the runner does not forward those names; nor does sdzero."""
SECRETS_PREFIX = ".sdzero-launch-"


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def deepspeed_exported(environ: Mapping[str, str]) -> dict[str, str]:
    """The launching-environment variables DeepSpeed's runner would have put on the remote command line."""
    excluded = {name for key, names in DEEPSPEED_EXCLUDED.items() if key in environ for name in names}
    return {
        k: v for k, v in environ.items() if k.startswith(DEEPSPEED_EXPORTED_PREFIXES) and k not in excluded
    }


def forwarded_values(workdir: Path, environ: Mapping[str, str], home: Path | None = None) -> dict[str, str]:
    """Every value DeepSpeed's runner would forward, in its order (later wins): the launching environment's
    exported names, then $HOME's env file, then the working folder's."""
    values = deepspeed_exported(environ)
    name = env_file_name(dict(environ))
    folders = [home or Path.home(), workdir]
    seen: set[Path] = set()
    for folder in folders:
        path = folder / name
        if name == os.devnull:
            continue
        if os.path.lexists(path) and path.resolve() not in seen:  # a FIFO is refused there, not skipped
            seen.add(path.resolve())
            values.update(read_env_file(path))
    return values


def shell_safe_or_refuse(what: str, value: str) -> str:
    if not SHELL_SAFE.match(value):
        raise UserError(
            f"{what} {value!r} holds characters a remote shell would interpret, and DeepSpeed's runner "
            "writes it unquoted into every node's command; install sdzero (and its virtual environment) "
            "under a path of letters, digits and ./_-"
        )
    return value


@dataclass(frozen=True)
class RemoteLaunch:
    """A hostfile launch, ready to run: the runner command, where and with what it starts."""

    command: list[str]
    runner_cwd: Path
    runner_env: dict[str, str]
    forwarded: dict[str, str]
    """Values handed to every rank in the payload word (none of them secret)."""
    secrets: dict[str, str]
    secrets_file: Path | None
    launch_id: str | None = None
    """On every rank's command line (`-X sdzero_launch=ID`): how a signal finds the remote ranks."""
    remote_hosts: tuple[str, ...] = ()
    """The hosts a pdsh launch starts ranks on through ssh (empty: every rank is a local process)."""
    output_dir: Path | None = None
    """The trainer's --output-dir, where its ranks write stall.json (sdzero.process.stall_exit)."""

    def write_secrets(self) -> None:
        """The secrets, in a new file only this user can read (O_EXCL: never one planted beforehand)."""
        if self.secrets_file is None:
            return
        import json

        try:
            fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise UserError(
                f"{self.secrets_file}: already exists (not written by this launch); remove it and relaunch"
            ) from None
        except OSError as exc:
            raise UserError(
                f"{self.secrets_file}: cannot write the launch's secrets file ({exc.strerror}); launch from "
                "a folder you can write, on storage every host shares"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(self.secrets, handle, ensure_ascii=True)
            handle.flush()
            os.fsync(handle.fileno())

    @contextlib.contextmanager
    def secrets_written(self) -> Iterator[None]:
        """The secrets file exists while the body runs the launch, and is removed however it ends."""
        self.write_secrets()
        try:
            yield
        finally:
            if self.secrets_file is not None:
                self.secrets_file.unlink(missing_ok=True)

    def popen(self, **kwargs: Any) -> subprocess.Popen[bytes]:
        """The runner started in its folder with its environment (inside `secrets_written`); for callers
        that watch it themselves (own session, log file, timeouts). A launch in a session of its own is
        guarded: it ends, here and on the remote hosts, if this process dies (sdzero.process.orphan_guard)."""
        from sdzero.process.orphan_guard import popen_guarded

        if kwargs.pop("start_new_session", False):
            return popen_guarded(
                self.command, self.remote_kill(), cwd=self.runner_cwd, env=self.runner_env, **kwargs
            )
        return subprocess.Popen(self.command, cwd=self.runner_cwd, env=self.runner_env, **kwargs)

    def run(self) -> int:
        """Start the runner, pass SIGTERM/SIGUSR1/SIGINT/SIGHUP on to the ranks (sdzero.process.launch_signals)
        and exit with their code (143 after a preemption save); remove the secrets file when it ends."""
        from sdzero.process.launch_signals import pdsh_remote_signal, wait_forwarding

        remote = None
        if self.launch_id is not None and self.remote_hosts:
            remote = pdsh_remote_signal(self.remote_hosts, self.launch_id, self.runner_env)
        output_dir = self.output_dir or output_dir_of(decode_argv(self.command))
        with self.secrets_written():
            runner = self.popen(start_new_session=True)
            return wait_forwarding(runner, remote, output_dir=output_dir)

    def remote_kill(self) -> list[str] | None:
        """The command that SIGKILLs this launch's ranks on every remote host (None: no remote ranks)."""
        from sdzero.process.launch_signals import pdsh_signal_command

        if self.launch_id is None or not self.remote_hosts:
            return None
        return pdsh_signal_command(self.remote_hosts, self.launch_id, signal.SIGKILL)


def local_launch(command: list[str], environ: Mapping[str, str] | None = None) -> RemoteLaunch:
    """A launch that starts no remote shell (this host's ranks only): `command` as it is, in this folder,
    so callers run one-host and hostfile launches alike."""
    return RemoteLaunch(command, Path.cwd(), dict(os.environ if environ is None else environ), {}, {}, None)


def remote_launch(
    train_args: list[str],
    entry: Path | Sequence[str],
    values: dict[str, str],
    workdir: Path,
    *,
    hostfile: Path,
    master_addr: str | None,
    master_port: int | None = None,
    launcher: str | None = None,
    launcher_args: str | None = None,
    environ: Mapping[str, str] | None = None,
    num_gpus: int | None = None,
    local_rank: bool = True,
) -> RemoteLaunch:
    """The runner command that starts `entry TRAIN_ARGS` on every host of `hostfile`, in `workdir`, with
    `values` set (secrets by file), through sdzero.process.rank_entry.

    `entry` is a script or `["-m", MODULE]`; `local_rank=False` is DeepSpeed's `--no_local_rank`, for
    ranks that read LOCAL_RANK from the environment (`sdzero cache`, the collectives benchmark), whose
    argv has no place for `--local_rank=N`. `master_addr=None` leaves it to DeepSpeed (the first host's
    `hostname -I`), as a plain `deepspeed --hostfile` launch does."""
    env = dict(os.environ if environ is None else environ)
    shell_safe_or_refuse("the Python interpreter", sys.executable)
    runner_cwd = Path(shell_safe_or_refuse("sdzero's folder", str(REPO_ROOT)))
    workdir = Path(os.path.abspath(workdir))
    hidden = {k: v for k, v in values.items() if is_secret(k)}
    plain = {k: v for k, v in values.items() if k not in hidden}
    secrets_file = workdir / f"{SECRETS_PREFIX}{secrets.token_hex(8)}.json" if hidden else None
    launch_id = secrets.token_hex(6)
    payload = Payload(
        cwd=str(workdir),
        command=[str(entry), *train_args] if isinstance(entry, Path) else [*entry, *train_args],
        env=plain,
        secrets_file=None if secrets_file is None else str(secrets_file),
        launch_id=launch_id,
    )
    command = deepspeed_command(
        [encode_payload(payload)],
        num_gpus=num_gpus,
        hostfile=Path(os.path.abspath(hostfile)),  # the runner starts elsewhere: no relative path
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
        launcher_args=launcher_args,
        entry=["--module", MODULE] if local_rank else ["--no_local_rank", "--module", MODULE],
        shell_proof=False,  # one base64 word already
    )
    exported = deepspeed_exported(env)
    runner_env = {k: v for k, v in env.items() if k not in exported}
    runner_env["DS_ENV_FILE"] = os.devnull  # not a regular file: DeepSpeed reads no env file at all
    return RemoteLaunch(
        command,
        runner_cwd,
        runner_env,
        plain,
        hidden,
        secrets_file,
        launch_id,
        output_dir=output_dir_of(train_args),
    )


def launch_from_here(
    args: list[str],
    entry: Path | Sequence[str],
    workdir: Path,
    *,
    hostfile: Path,
    num_gpus: int | None = None,
    master_port: int | None = None,
    local_rank: bool = True,
    environ: Mapping[str, str] | None = None,
) -> RemoteLaunch:
    """`remote_launch` with the values a plain `deepspeed --hostfile` started from this folder would have
    forwarded (this environment's exported names, $HOME's and this folder's env file: where
    `sdzero advise --hostfile` and the user put them), the ranks running in `workdir`.

    The launches that once called DeepSpeed's runner directly (`sdzero cache --hostfile`, the advisor's
    hostfile trials and collectives benchmark) go through here, so none of them hands a remote shell an
    unquoted folder, a value to expand or a secret to print."""
    env = dict(os.environ if environ is None else environ)
    return remote_launch(
        args,
        entry,
        forwarded_values(Path.cwd(), env),
        workdir,
        hostfile=hostfile,
        master_addr=None,
        master_port=master_port,
        environ=env,
        num_gpus=num_gpus,
        local_rank=local_rank,
    )
