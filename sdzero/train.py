"""DeepSpeed entrypoint: `deepspeed [--num_gpus N | --hostfile H] sdzero/train.py --deepspeed_config ...`.

Parses the run options and hands them to `sdzero.training.trainer.run`; everything else lives in the package.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

# Run as a script, this file's folder (sdzero/) becomes sys.path[0], and its modules (config, data,
# models, ...) would shadow any top-level modules of the same name that libraries import. Drop it.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from sdzero.checkpoint.manifest import MANIFEST, checkpoint_root  # noqa: E402
from sdzero.checkpoint.output_lock import claim_output_dir, release_output_dir  # noqa: E402
from sdzero.cluster.launch_command import decode_argv  # noqa: E402
from sdzero.config.output_folder import (  # noqa: E402
    EXPORT_MARKER,
    check_output_folder,
    check_replaceable_folder,
    refuse_inputs_among_outputs,
)
from sdzero.config.train_config import TrainConfig, parse_train_args, rank_from_env  # noqa: E402
from sdzero.errors import EXIT_USER_ERROR, AgreedError, UserError  # noqa: E402
from sdzero.process.exit import freeze_heap_for_exit  # noqa: E402
from sdzero.process.orphan_guard import die_with_launcher  # noqa: E402
from sdzero.process.preemption import Preempted, exit_now  # noqa: E402
from sdzero.process.rendezvous import world_of_one  # noqa: E402

RUN_RECORDS = ("ds_config.json", "run_config.json", "environment.json", "metrics.jsonl", "library.log")
"""Files a run (re)writes at the top of its --output-dir (sdzero.training.run_output)."""


def holds_committed_checkpoints(out: Path) -> bool:
    """`out/checkpoints` holds a checkpoint sdzero committed (its manifest): a run's checkpoints copied or
    moved into a fresh folder to resume from there are sdzero's own, though the folder has no lock yet."""
    root = checkpoint_root(out)
    return root.is_dir() and any((step / MANIFEST).is_file() for step in root.glob("step_*"))


def check_run_outputs(cfg: TrainConfig) -> None:
    """Rank 0, before anything is created: the output folder rule (sdzero.config.output_folder), a user's
    `final/` that --export-final would replace, and inputs that are files the run rewrites (the run's own
    ds_config.json passed back as --deepspeed_config held the scaled LR, which then compounded per rerun)."""
    out = cfg.output_dir
    check_output_folder(out, "--output-dir", made_by_sdzero=holds_committed_checkpoints)
    if getattr(cfg, "export_final", False):  # (tests hand main a bare namespace of the fields they need)
        check_replaceable_folder(out / "final", EXPORT_MARKER, "a pipeline sdzero exported (--export-final)")
    inputs: dict[str, Path | None] = {"--deepspeed_config": getattr(cfg, "deepspeed_config", None)}
    refuse_inputs_among_outputs([out / name for name in RUN_RECORDS], inputs)


def crash_exit() -> NoReturn:
    """Print the traceback and leave at once, skipping interpreter clean-up.

    Clean-up would join the DataLoader workers, and those ignore SIGTERM (so that a preemption signal to
    the whole process tree cannot kill them before the rank saves): a crashed rank would wait on them
    forever. Its workers notice the parent is gone and exit on their own; the launcher sees exit 1.
    """
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# How long a rank other than 0 waits before reporting a bad input itself; see report_user_error.
PEER_ERROR_GRACE_S = 10.0


def report_user_error(exc: UserError, rank: int, grace_s: float = PEER_ERROR_GRACE_S) -> None:
    """One line for a bad input, from rank 0 when every rank found it.

    Every rank usually finds the same bad input, but the launcher kills all ranks as soon as any one
    exits non-zero: if rank 1 exited first, rank 0 could be killed before printing, and the user would see
    only "exits with return code = 2". So other ranks wait a while; when rank 0 found the error too, the
    launcher kills them during the wait (SIGTERM's default action is restored for it, since the preemption
    handler may already be installed). A rank that is still alive afterwards found an error rank 0 did not
    (a file missing on its node only) and reports it under its own rank.
    """
    if isinstance(exc, AgreedError):
        report_agreed_error(exc, rank)
        return
    if rank == 0:
        print(f"sdzero: error: {exc}", file=sys.stderr, flush=True)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(grace_s)
    print(f"sdzero: error: rank {rank}: {exc}", file=sys.stderr, flush=True)


def report_agreed_error(exc: AgreedError, rank: int) -> None:
    """Every rank raised this from one collective verdict: rank 0 prints it, then all meet at a barrier,
    so that no rank exits (and has its launcher kill rank 0) before the line is out. No grace wait: with
    one launcher per node (Kubernetes pods) the other nodes' ranks would otherwise each wait it out."""
    import torch.distributed as dist

    if rank == 0:
        print(f"sdzero: error: {exc}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    # Without a launcher, rank 0 of a world of one, before anything reads the world size from the
    # environment; the process says so when its group forms (after the inputs are checked, so that a bad
    # one is still one line).
    world_of_one()
    die_with_launcher()  # a rank never outlives its node's launcher (sdzero.process.orphan_guard)
    try:
        cfg = parse_train_args(decode_argv(sys.argv[1:] if argv is None else argv))  # see shell_proof_args
        if rank_from_env() == 0:
            check_run_outputs(cfg)
        if rank_from_env() == 0 and cfg.output_dir.is_dir():
            # A live run in the folder stops this one before any process group or model exists. Rank 0
            # holds the lock for the run's life (find_resume takes it again: a no-op in the same process).
            # A folder that does not exist yet holds no live run, and is not created here: a run refused
            # for a bad input must leave nothing behind.
            claim_output_dir(cfg.output_dir)
        from sdzero.training import trainer

        try:
            summary = trainer.run(cfg)
        finally:
            release_output_dir(cfg.output_dir)
    except Preempted as stop:
        exit_now(int(stop.code))  # the checkpoint is committed; no teardown that could hang
    except UserError as exc:
        report_user_error(exc, rank_from_env())
        return EXIT_USER_ERROR
    except Exception:
        crash_exit()
    if rank_from_env() == 0:
        print(
            f"sdzero: trained {summary.steps} steps; loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}; "
            f"{summary.mean_samples_per_s:.1f} samples/s; metrics in {summary.metrics_path}"
        )
    return 0


def _process_group_up() -> bool:
    torch_dist = sys.modules.get("torch.distributed")
    return bool(torch_dist and torch_dist.is_available() and torch_dist.is_initialized())


def _mpi_is_live() -> bool:
    """MPI was started in this process (mpirun: DeepSpeed's MPI discovery imported mpi4py) and not ended."""
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi and mpi.Is_initialized() and not mpi.Is_finalized())


if __name__ == "__main__":
    code = main()
    freeze_heap_for_exit()
    if _process_group_up() and not _mpi_is_live():
        # Every output is written and closed by now (metrics, checkpoints, trackers, the output lock).
        # Interpreter teardown with a process group still up can abort in a collective library's C++
        # destructor ("terminate called without an active exception": -6 or 250 instead of the code; about
        # 1 run in 7 of a one-rank run here, once in tests/dist/test_elastic_resume.py), so leave without
        # it, as a preempted rank does. Not under MPI: os._exit would skip MPI_Finalize, and mpirun then
        # fails the whole job ("exiting improperly").
        from sdzero.process.preemption import exit_now

        exit_now(code)
    sys.exit(code)
