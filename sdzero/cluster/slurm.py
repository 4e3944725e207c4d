"""`sdzero slurm`: a batch script that trains across a Slurm allocation and survives preemption.

The script
1. writes a DeepSpeed-format hostfile from the allocation (`scontrol show hostnames`), one line per node
   with `slots=` ranks, kept beside the run (the same file `sdzero launch`/`sdzero advise --hostfile` take);
2. starts the ranks with `srun` (one task per rank): Slurm, not ssh, owns the processes, so its signals
   reach every rank, and `--kill-on-bad-exit` ends the job when one rank dies;
3. on Slurm's warning signal (`#SBATCH --signal=B:USR1@LEAD`, sent to this batch shell LEAD seconds before
   the time limit or on preemption) forwards SIGUSR1 to srun, which hands it to every task: the trainer
   checkpoints at the next step boundary and exits 143 (sdzero/process/preemption.py);
4. then `scontrol requeue`s the job, whose next start resumes with `--resume auto` from the newest
   complete checkpoint;
5. on SIGTERM (Slurm ending the job: scancel, a failed node, its own preemption) asks the ranks to save
   the same way but does not requeue: a cancelled job stays cancelled (a plain `scancel` used to bring it
   back), and where Slurm requeues (a failed node, PreemptMode=REQUEUE) it does so itself.

The working folder goes into the script twice: in the body, shell-quoted like every path there, and in
the `#SBATCH --output` line, which sbatch parses itself (sbatch_file_pattern).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, StrictUndefined

from sdzero.cluster.launch_command import TRAIN_SCRIPT
from sdzero.config.output_folder import LOCK_NAME
from sdzero.errors import UserError
from sdzero.process.stall_watch import EXIT_STALLED

TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")
NAME = re.compile(r"^[A-Za-z0-9._-]+$")

TEMPLATE = r"""#!/bin/bash
# Written by `sdzero slurm`. Submit with: sbatch {{ script_name }}
#SBATCH --job-name={{ job_name }}
#SBATCH --nodes={{ nodes }}
#SBATCH --ntasks-per-node={{ ranks_per_node }}
{% if gpus %}#SBATCH --gpus-per-node={{ ranks_per_node }}
{% endif %}{% if cpus_per_task %}#SBATCH --cpus-per-task={{ cpus_per_task }}
{% endif %}#SBATCH --time={{ time_limit }}
{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% if account %}#SBATCH --account={{ account }}
{% endif %}#SBATCH --signal=B:USR1@{{ signal_lead_s }}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={{ log_pattern }}
set -uo pipefail
cd {{ workdir }}

OUT={{ output_dir }}
mkdir -p "$OUT"
# sdzero's output-folder rule (docs/faults.md): a folder of files sdzero did not write is refused, before
# the hostfile goes in; a folder sdzero uses carries its lock file, the mark the trainer looks for.
if [ ! -e "$OUT/{{ lock_name }}" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "sdzero: error: --output-dir $OUT holds files sdzero did not write; choose a new or empty folder" >&2
  exit 2
fi
touch "$OUT/{{ lock_name }}"
HOSTFILE="$OUT/hostfile.$SLURM_JOB_ID"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/$/ slots={{ ranks_per_node }}/' > "$HOSTFILE"
export MASTER_ADDR=$(head -n 1 "$HOSTFILE" | cut -d ' ' -f 1)
export MASTER_PORT={{ master_port }}
echo "sdzero: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0}: $(wc -l < "$HOSTFILE") nodes x {{ ranks_per_node }} ranks; master $MASTER_ADDR:$MASTER_PORT; hostfile $HOSTFILE"

# Each task: rank numbers from Slurm, and the interface that reaches the master (on the master itself, the
# one holding its address), unless the environment names one already.
read -r -d '' RANK_WRAPPER <<'WRAPPER'
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
# MASTER_ADDR is a node name from `scontrol show hostnames`; `ip route get` takes only addresses.
addr=$(getent ahostsv4 "$MASTER_ADDR" | awk '{print $1; exit}')
if [ -z "$addr" ]; then echo "sdzero: master node $MASTER_ADDR does not resolve on $(hostname)" >&2; exit 2; fi
dev=$(ip -o -4 route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
if [ "$dev" = lo ]; then dev=$(ip -o -4 addr show to "$addr" | awk '{print $2; exit}'); fi
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$dev} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev}
exec "$@"
WRAPPER

# USR1 is Slurm's warning (the time limit is near, or `scancel --signal=USR1 --batch`): save and requeue.
# TERM is Slurm ending the job (scancel, a node lost, its own preemption): the ranks are asked to save
# before KillWait's SIGKILL, and Slurm decides what comes next (a cancelled job stays cancelled; one whose
# node failed, or preempted in REQUEUE mode, is requeued by Slurm itself: #SBATCH --requeue).
warned=0
ending=0
forward() {
  echo "sdzero: got SIG$1; asking every rank to checkpoint and stop"
  kill -USR1 "$RANKS_PID" 2>/dev/null  # srun hands SIGUSR1 to every task
}
trap 'warned=1; forward USR1' USR1
trap 'ending=1; forward TERM' TERM

srun --kill-on-bad-exit=1 --ntasks-per-node={{ ranks_per_node }} --export=ALL \
  bash -c "$RANK_WRAPPER" sdzero-rank \
  {{ python }} -u {{ train_script }} {{ train_args }} &
RANKS_PID=$!
# `wait` returns early when a trapped signal arrives; keep waiting until srun itself has ended.
while :; do
  wait "$RANKS_PID"
  code=$?
  kill -0 "$RANKS_PID" 2>/dev/null || break
done

# Exit 143 without a signal here: the ranks were signalled themselves (`scancel --signal=USR1`, steps only).
if [ "$warned" -eq 1 ] || { [ "$code" -eq 143 ] && [ "$ending" -eq 0 ]; }; then
  echo "sdzero: stopped with exit $code after a preemption warning; requeueing job $SLURM_JOB_ID (resumes with --resume auto)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
# A stall named by the ranks' watcher (stall.json in the output folder): no new checkpoint, but the job
# can go on from the newest complete one, on another allocation if a node is bad.
if [ "$code" -eq {{ stalled_code }} ] && [ "$ending" -eq 0 ]; then
  echo "sdzero: the run stalled (see $OUT/stall.json); requeueing job $SLURM_JOB_ID (resumes with --resume auto)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [ "$ending" -eq 1 ]; then
  echo "sdzero: Slurm is ending job $SLURM_JOB_ID (SIGTERM); ranks ended with exit $code; not requeued by this script"
  exit "$code"
fi
echo "sdzero: ranks ended with exit $code"
exit "$code"
"""


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    ranks_per_node: int
    train_args: list[str]
    gpus: bool = True
    time_limit: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "sdzero"
    signal_lead_s: int = 120
    master_port: int = 29500
    cpus_per_task: int | None = None
    script_name: str = "job.sbatch"


def output_dir_of(train_args: list[str]) -> str:
    """The trainer's --output-dir among `train_args`: the last one given, as the trainer's parser takes it
    (the first was once checked against the shared volume while the trainer wrote to a second one)."""
    found = None
    for i, arg in enumerate(train_args):
        if arg == "--output-dir" and i + 1 < len(train_args):
            found = train_args[i + 1]
        elif arg.startswith("--output-dir="):
            found = arg.split("=", 1)[1]
    if found is not None:
        return found
    raise UserError(
        "pass the trainer's --output-dir after `--`: checkpoints, metrics and the hostfile go there, and a "
        "requeued job resumes from it"
    )


def with_resume_auto(train_args: list[str]) -> list[str]:
    """A requeued job must continue, not start over: `--resume auto` unless the user chose otherwise."""
    if any(a == "--resume" or a.startswith("--resume=") for a in train_args):
        return list(train_args)
    return [*train_args, "--resume", "auto"]


LOG_NAME = "slurm-%x-%j.log"
"""The job's log: %x the job name, %j its id (the same file across requeues: --open-mode=append)."""


def sbatch_file_pattern(folder: Path, name_pattern: str) -> str:
    """`folder/name_pattern` as an #SBATCH file value: in double quotes, the folder's own `%` doubled.

    sbatch splits its directive lines at blanks unless quoted (an unquoted folder with a space makes it
    refuse the whole script: "Invalid directive found in batch script"), and expands `%j`, `%x` ... in
    file names, where `%%` is a percent sign. What the quotes cannot carry is refused: a double quote ends
    them, a backslash escapes the next character and turns every `%` pattern off, a line break ends the
    directive.
    """
    text = str(folder)
    bad = sorted({c for c in text if c in '"\\' or ord(c) < 32})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise UserError(
            f"working folder {text!r}: holds {shown}, which an #SBATCH line cannot carry (the job log "
            "goes there); run `sdzero slurm` from a folder without double quotes, backslashes or control "
            "characters in its path"
        )
    return '"' + text.replace("%", "%%") + "/" + name_pattern + '"'


def allocation_nodes(environ: dict[str, str] | None = None) -> list[str] | None:
    """Inside a Slurm allocation (a batch script, salloc, srun): its node names, in Slurm's order, as
    `scontrol show hostnames` expands SLURM_JOB_NODELIST (`gpu[01-03]` -> gpu01 gpu02 gpu03); None outside
    one. The batch script builds its hostfile the same way."""
    nodelist = (os.environ if environ is None else environ).get("SLURM_JOB_NODELIST", "").strip()
    if not nodelist:
        return None
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UserError(
            f"SLURM_JOB_NODELIST={nodelist} but no `scontrol` on PATH to expand it; pass --hostfile"
        )
    shown = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60
    )
    names = shown.stdout.split()
    if shown.returncode != 0 or not names:
        reason = (shown.stderr.strip().splitlines() or [f"exit {shown.returncode}"])[-1]
        raise UserError(f"`scontrol show hostnames {nodelist}` failed: {reason}; pass --hostfile")
    return names


def check_job(job: SlurmJob) -> None:
    if job.nodes < 1:
        raise UserError(f"--nodes {job.nodes}: must be at least 1")
    if job.ranks_per_node < 1:
        raise UserError(f"--gpus-per-node {job.ranks_per_node}: must be at least 1 (ranks per node)")
    if not TIME_LIMIT.fullmatch(job.time_limit):
        raise UserError(f"--time {job.time_limit!r}: use Slurm's format, e.g. 24:00:00 or 2-00:00:00")
    for flag, value in (
        ("--partition", job.partition),
        ("--account", job.account),
        ("--job-name", job.job_name),
    ):
        if value is not None and not NAME.fullmatch(value):
            raise UserError(f"{flag} {value!r}: letters, digits, '.', '_' and '-' only")
    if not 10 <= job.signal_lead_s <= 3600:
        raise UserError(
            f"--signal-lead-s {job.signal_lead_s}: between 10 and 3600 s; it must cover one training step "
            "plus a checkpoint save"
        )
    if not 1024 <= job.master_port <= 65535:
        raise UserError(f"--master-port {job.master_port}: must be in 1024-65535")


def render(job: SlurmJob) -> str:
    check_job(job)
    out = output_dir_of(job.train_args)
    env = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(TEMPLATE).render(
        **{k: getattr(job, k) for k in job.__dataclass_fields__ if k != "train_args"},
        output_dir=shlex.quote(str(Path(out).absolute())),
        lock_name=LOCK_NAME,
        stalled_code=EXIT_STALLED,
        workdir=shlex.quote(str(Path.cwd())),
        # Slurm opens the log before the script runs, so it goes to a folder that exists at submit time.
        log_pattern=sbatch_file_pattern(Path.cwd(), LOG_NAME),
        python=shlex.quote(sys.executable),
        train_script=shlex.quote(str(TRAIN_SCRIPT)),
        train_args=" ".join(shlex.quote(a) for a in with_resume_auto(job.train_args)),
    )
