"""With a hostfile: check the hosts, then predict the recommended config on them from a 1-host trial plus
the measured link, run it there, and record the prediction's error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def prepare_hostfile(hostfile: Path | None, say: Callable[[str], None]) -> list[Any]:
    """Check the hosts (as `sdzero launch` does) and write the .deepspeed_env their ranks need."""
    if hostfile is None:
        return []
    from sdzero.hosts import prepare_hosts

    entries, master, interface, env_file, merge = prepare_hosts(Path(hostfile))
    say(
        f"{len(entries)} hosts; master {master} over {interface}; {env_file}: added {sorted(merge.added) or 'nothing'}"
    )
    return entries


def scaleout_check(
    best: Any,
    base: dict[str, Any],
    settings: Any,
    hostfile: Path,
    hosts: list[Any],
    fit_path: Path,
    out_dir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Predict the recommended config on the hostfile's hosts from a 1-host trial plus the measured link,
    then run it there: the prediction's error, measured, in recommendation.json and scaleout.csv."""
    from dataclasses import replace

    from advisor.measure.grid import TrialSpec
    from advisor.model.scaleout import check_config, rows_table

    slots = hosts[0].slots
    if any(h.slots != slots for h in hosts):
        return {"skipped": "hosts with different slots= counts; the check needs the same ranks on each"}
    spec = TrialSpec(
        int(best["zero_stage"]), str(best["dtype"]), int(best["micro_batch"]), str(best["offload"]), slots
    )
    remote = replace(settings, hostfile=Path(hostfile).resolve(), hosts=len(hosts))
    say(
        f"scale-out check: {spec.trial_id} on 1 host x {len(hosts) * slots} ranks, then {len(hosts)} hosts x {slots}"
    )
    try:
        row, _ = check_config(spec, base, settings, remote, fit_path, len(hosts), slots, out_dir / "scaleout")
    except RuntimeError as exc:
        return {"failed": str(exc).splitlines()[0]}
    rows_table([row]).to_csv(out_dir / "scaleout.csv", index=False)
    say(
        f"scale-out check: predicted {row.predicted_step_s:.3f} s/step, measured {row.measured_step_s:.3f} s "
        f"({row.error:+.1%})"
    )
    return {**vars(row), "error": row.error}
