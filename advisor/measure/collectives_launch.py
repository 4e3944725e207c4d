"""`sdzero comm`: run the collectives benchmark under real launchers and fit alpha-beta models.

The torch.distributed ranks start through the `deepspeed` launcher (the same launcher the trainer uses),
the MPI ranks through `mpirun`; each runs `python -m advisor.measure.collectives_rank`. Rank 0 of each writes a CSV;
this driver joins them into `<out>/comm.csv`, fits t = alpha + size_bytes * beta per backend, collective
and link level (advisor.measure.alphabeta), and writes `<out>/comm_fit.json`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

import advisor
from advisor.measure.alphabeta import NOISY_SPREAD, AlphaBetaFit, fit_table, fits_payload
from sdzero.atomic import open_no_follow, write_csv_atomic, write_json_atomic
from sdzero.constants import MIB
from sdzero.errors import UserError

if TYPE_CHECKING:
    from sdzero.cluster.remote_launch import RemoteLaunch

BACKENDS: tuple[str, ...] = ("torch", "mpi")
# Starting ranks (imports, rendezvous) is not part of the budget; this much slack covers it before a
# run that has not finished is declared hung and killed.
STARTUP_SLACK_S = 180.0


@dataclass
class CommResult:
    """What `run_comm` measured and where it wrote it."""

    csv_path: Path
    fit_path: Path
    table: pd.DataFrame
    fits: list[AlphaBetaFit]
    log_paths: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Backends left out because this machine lacks them (only when none were named): why, per backend."""

    @property
    def all_correct(self) -> bool:
        return bool(self.table["correct"].astype(bool).all())

    @property
    def noisy_fraction(self) -> float:
        """Share of points whose timed repeats disagreed by more than NOISY_SPREAD of their median."""
        return float((self.table["time_spread"] > NOISY_SPREAD).mean())


class CommRunError(RuntimeError):
    """A benchmark run failed or hung; the message names its log file."""


@dataclass(frozen=True)
class LaunchPlan:
    """Ranks and hosts, shared by both launchers."""

    ranks_per_node: int
    hosts: tuple[str, ...]
    hostfile: Path | None

    @property
    def total_ranks(self) -> int:
        return self.ranks_per_node * max(len(self.hosts), 1)


# --------------------------------------------------------------------------------------------------
# Input checks: each raises UserError with one line that names the flag and the fix


def read_hostfile(path: Path) -> tuple[str, ...]:
    """Hosts of a DeepSpeed/Open MPI hostfile, checked by the project's one parser (sdzero.cluster.hostfile)."""
    from sdzero.cluster.hostfile import parse_hostfile

    return tuple(entry.host for entry in parse_hostfile(path))


def check_sweep(num_ranks: int, min_bytes: int, max_bytes: int, budget_s: float, hosts: int) -> None:
    if num_ranks < 1:
        raise UserError(f"--ranks {num_ranks}: need at least 1 rank per node")
    if num_ranks * max(hosts, 1) < 2:
        raise UserError("--ranks 1 on one node: a collective needs 2 ranks or more; use --ranks 2")
    if min_bytes < 4 * num_ranks * max(hosts, 1):
        raise UserError(f"--min-bytes {min_bytes}: must hold one float32 per rank; use 4KiB or more")
    if max_bytes < min_bytes:
        raise UserError(f"--max-bytes {max_bytes} is below --min-bytes {min_bytes}; raise --max-bytes")
    if not budget_s > 0:
        raise UserError(f"--budget-s {budget_s}: must be a positive number of seconds")


def check_backends(backends: Sequence[str]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(backends))  # keep order, drop repeats
    unknown = [b for b in chosen if b not in BACKENDS]
    if not chosen or unknown:
        raise UserError(f"--backend {', '.join(unknown) or '(none)'}: choose from {', '.join(BACKENDS)}")
    return chosen


def deepspeed_launcher() -> str:
    """The `deepspeed` script of this interpreter's environment, else the one on PATH."""
    from sdzero.cluster.launch_command import deepspeed_executable

    try:
        return deepspeed_executable()
    except UserError:
        raise UserError(
            "--backend torch needs the `deepspeed` launcher; install it with `pip install deepspeed`"
        ) from None


def available_backends() -> tuple[tuple[str, ...], dict[str, str]]:
    """What `sdzero comm` measures when no --backend is named: every backend whose launcher is here,
    and for each one left out, why (the UserError it would raise)."""
    found, skipped = [], {}
    for backend, check in (("torch", deepspeed_launcher), ("mpi", mpirun_launcher)):
        try:
            check()
            found.append(backend)
        except UserError as exc:
            skipped[backend] = str(exc)
    if not found:
        raise UserError(f"no collectives backend is installed: {'; '.join(skipped.values())}")
    return tuple(found), skipped


def mpirun_launcher() -> str:
    found = shutil.which("mpirun")
    if found is None:
        raise UserError(
            "--backend mpi needs `mpirun`, which is not on PATH: install Open MPI "
            "(`apt-get install openmpi-bin libopenmpi-dev`) or leave mpi out with --backend torch"
        )
    if importlib.util.find_spec("mpi4py") is None:
        raise UserError(
            "--backend mpi needs mpi4py in this environment: `pip install mpi4py` (after Open MPI is installed)"
        )
    return found


def free_port() -> int:
    """A TCP port free right now (the OS picks it); the launcher binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------------------
# Launch commands


def rank_args(backend: str, csv_path: Path, min_bytes: int, max_bytes: int, budget_s: float) -> list[str]:
    return [
        "--backend",
        backend,
        "--csv",
        str(csv_path),
        "--min-bytes",
        str(min_bytes),
        "--max-bytes",
        str(max_bytes),
        "--budget-s",
        f"{budget_s:g}",
    ]


def torch_launch(
    plan: LaunchPlan, args: list[str], torch_backend: str, no_hostfile: Path, work_dir: Path
) -> RemoteLaunch:
    """The torch ranks' launch under DeepSpeed's runner: this host's alone, or the hostfile's through
    sdzero.cluster.remote_launch, each remote rank in `work_dir` (whatever its name) with the values
    of this folder's env file exactly and its secrets by file, never on a pdsh command line."""
    from advisor.measure.trials import on_the_hosts
    from sdzero.cluster.launch_command import deepspeed_command
    from sdzero.cluster.remote_launch import launch_from_here, local_launch

    argv = [*args, "--torch-backend", torch_backend]
    if plan.hostfile is not None:  # on its hosts, one host's too (the within-host link there)
        return on_the_hosts(
            launch_from_here(
                argv,
                ["-m", "advisor.measure.collectives_rank"],
                work_dir,
                hostfile=plan.hostfile,
                num_gpus=plan.ranks_per_node,
                master_port=free_port(),
                local_rank=False,  # the rank reads LOCAL_RANK from the environment
                environ=rank_environment(),
            )
        )
    # DeepSpeed reads /job/hostfile when no --hostfile is given; a path that does not exist keeps a local
    # run local, as mpirun's is.
    command = deepspeed_command(
        argv,
        num_gpus=plan.ranks_per_node,
        hostfile=no_hostfile,
        master_port=free_port(),
        entry=["--no_local_rank", "--module", "advisor.measure.collectives_rank"],
        executable=deepspeed_launcher(),
        check_hostfile=False,  # no_hostfile must not exist
        shell_proof=False,  # no remote shell on one host
    )
    return local_launch(command, rank_environment())


def torch_command(plan: LaunchPlan, args: list[str], torch_backend: str, no_hostfile: Path) -> list[str]:
    """The runner command alone (what the log's first line shows); `torch_launch` is what runs."""
    return torch_launch(plan, args, torch_backend, no_hostfile, no_hostfile.parent).command


def mpi_command(plan: LaunchPlan, args: list[str], extra: Sequence[str]) -> list[str]:
    command = [mpirun_launcher(), "--allow-run-as-root", "--oversubscribe", "-np", str(plan.total_ranks)]
    if plan.hostfile:
        command += ["--hostfile", str(plan.hostfile), "--npernode", str(plan.ranks_per_node)]
    # -x forwards PYTHONPATH to remote ranks so they import this checkout's advisor package
    command += [
        "-x",
        "PYTHONPATH",
        *extra,
        sys.executable,
        "-u",
        "-m",
        "advisor.measure.collectives_rank",
        *args,
    ]
    return command


def rank_environment() -> dict[str, str]:
    """This environment plus the directory that holds the advisor package on PYTHONPATH."""
    env = os.environ.copy()
    root = str(Path(advisor.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(command: list[str] | RemoteLaunch, log_path: Path, timeout_s: float) -> None:
    """Run a launcher in its own session, output to `log_path`; kill the whole session if it hangs. A
    plain command runs here with `rank_environment()`; a RemoteLaunch in its folder and environment, its
    secrets file there only while it runs."""
    from sdzero.cluster.remote_launch import local_launch

    started = local_launch(command, rank_environment()) if isinstance(command, list) else command
    name = started.command[0]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open_no_follow(log_path, "w") as log, started.secrets_written():
        log.write("$ " + " ".join(started.command) + "\n")
        log.flush()
        process = started.popen(stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            raise CommRunError(f"{name} did not finish in {timeout_s:.0f} s; see {log_path}") from None
        finally:
            if process.poll() is None:  # interrupted (Ctrl-C, SIGTERM, SIGHUP: sdzero.process.children)
                _kill_session(process)
    if returncode != 0:
        raise CommRunError(f"{Path(name).name} exited with {returncode}; see {log_path}:\n{_tail(log_path)}")


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """The launcher's whole session (its ranks share it): SIGTERM, a grace, then SIGKILL for whatever is
    left, also when the launcher itself has exited (ranks can outlive it)."""
    for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --------------------------------------------------------------------------------------------------
# The driver


def run_backend(
    backend: str,
    plan: LaunchPlan,
    work_dir: Path,
    sweep: tuple[int, int, float],
    torch_backend: str = "auto",
    mpirun_args: Sequence[str] = (),
) -> tuple[pd.DataFrame, Path]:
    """Launch one backend's ranks, wait, and read rank 0's CSV."""
    min_bytes, max_bytes, budget_s = sweep
    work_dir = Path(os.path.abspath(work_dir))  # remote torch ranks run in it: no path relative to here
    csv_path = work_dir / f"{backend}.csv"
    csv_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    args = rank_args(backend, csv_path, min_bytes, max_bytes, budget_s)
    work_dir.mkdir(parents=True, exist_ok=True)  # the secrets file goes there before the log does
    if backend == "torch":
        command = torch_launch(plan, args, torch_backend, work_dir / "no-hostfile", work_dir)
    else:
        # mpirun hands its ranks their folder and -x values itself (orted chdirs, no remote shell line
        # holds them), so it stays a plain command.
        command = mpi_command(plan, args, mpirun_args)
    log_path = work_dir / f"{backend}.log"
    launch(command, log_path, timeout_s=2.0 * budget_s + STARTUP_SLACK_S)
    if not csv_path.is_file():
        raise CommRunError(f"{backend}: the ranks exited without writing {csv_path}; see {log_path}")
    table = pd.read_csv(csv_path, keep_default_na=False)  # an empty note stays "", not NaN
    if table.empty:
        raise CommRunError(f"{backend}: no measurements in {csv_path}; see {log_path}")
    return table, log_path


def run_comm(
    out_dir: Path,
    num_ranks: int = 2,
    hostfile: Path | None = None,
    backends: Sequence[str] | None = None,
    min_bytes: int = 4096,
    max_bytes: int = 256 * MIB,
    budget_s: float = 120.0,
    torch_backend: str = "auto",
    mpirun_args: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> CommResult:
    """Benchmark all-reduce, reduce-scatter and all-gather with each backend; write CSV and fits.

    num_ranks is ranks per node (the whole job without a hostfile). budget_s is the measuring time for all
    backends together, split evenly; starting the ranks comes on top. Prerequisites of every requested
    backend are checked before anything starts, so a missing mpirun fails fast with a UserError; with
    `backends` None, every backend installed here is measured and each missing one is skipped, and said so.
    """
    say = log or (lambda message: None)
    out_dir = Path(out_dir)
    skipped: dict[str, str] = {}
    if backends is None:
        chosen, skipped = available_backends()
        for backend, why in skipped.items():
            say(f"{backend}: skipped ({why})")
    else:
        chosen = check_backends(backends)
    hosts = read_hostfile(hostfile) if hostfile else ()
    check_sweep(num_ranks, min_bytes, max_bytes, budget_s, len(hosts))
    if torch_backend not in ("auto", "gloo", "nccl"):
        raise UserError(f"--torch-backend {torch_backend}: choose auto, gloo or nccl")
    for backend in chosen:  # fail before any run, not after the first one
        if backend == "torch":
            deepspeed_launcher()
        else:
            mpirun_launcher()
    plan = LaunchPlan(num_ranks, hosts, hostfile.resolve() if hostfile else None)
    work_dir = out_dir / "comm_logs"
    per_backend_s = budget_s / len(chosen)
    tables, logs = [], {}
    for backend in chosen:
        say(
            f"{backend}: {plan.total_ranks} ranks, {per_backend_s:.0f} s budget, log {work_dir / backend}.log"
        )
        started = time.perf_counter()
        table, logs[backend] = run_backend(
            backend, plan, work_dir, (min_bytes, max_bytes, per_backend_s), torch_backend, mpirun_args
        )
        say(f"{backend}: {len(table)} points in {time.perf_counter() - started:.1f} s")
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    fits = fit_table(table)
    csv_path, fit_path = out_dir / "comm.csv", out_dir / "comm_fit.json"
    write_csv_atomic(table, csv_path)
    meta = _meta(plan, chosen, (min_bytes, max_bytes, budget_s), table)
    write_json_atomic(fit_path, fits_payload(fits, meta))
    return CommResult(csv_path, fit_path, table, fits, logs, skipped)


def _meta(
    plan: LaunchPlan, backends: Sequence[str], sweep: tuple[int, int, float], table: pd.DataFrame
) -> dict[str, Any]:
    import torch

    min_bytes, max_bytes, budget_s = sweep
    return {
        "created_unix_s": time.time(),
        "host": platform.node(),
        "ranks_per_node": plan.ranks_per_node,
        "hosts": list(plan.hosts) or [platform.node()],
        "hostfile": str(plan.hostfile) if plan.hostfile else None,
        "backends": list(backends),
        "libraries": sorted(table["library"].unique().tolist()),
        "requested_min_bytes": min_bytes,
        "requested_max_bytes": max_bytes,
        "measured_max_bytes": int(table["size_bytes"].max()),
        "budget_s": budget_s,
        "all_correct": bool(table["correct"].astype(bool).all()),
        "noisy_fraction": float((table["time_spread"] > NOISY_SPREAD).mean()),
        "torch_version": torch.__version__,
    }


# --------------------------------------------------------------------------------------------------
# CLI


def parse_bytes(text: str, flag: str) -> int:
    """'4096', '4K', '4KiB', '256M', '1GiB' -> bytes (binary multiples)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise UserError(
            f"{flag} {text!r}: give bytes as a number with an optional K, M or G (e.g. 4KiB, 256MiB)"
        )
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")
