"""Resume on another world size (--resume-elastic): 2 ranks -> 1 rank -> 2 ranks through DeepSpeed's
universal checkpoint, under the real `deepspeed` launcher (gloo, CPU), bf16.

What makes the comparison with an uninterrupted run sound: the global batch is kept (2 ranks x micro 4 x
accumulation 1 = 1 rank x micro 4 x accumulation 2 = 8), the data position is kept in samples, and each
sample's noise and timestep are keyed by (seed, epoch, index), so every step trains on the same 8 samples
with the same noise whatever the world size. What differs is only the summation order of the gradient
(2 ranks' bf16 all-reduce vs one rank's fp32 accumulation of two micro-batches), so the losses agree to
bf16 rounding, not bit for bit: see LOSS_RTOL.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ckpt_helpers import ok, run
from launch import CONFIGS, metrics, write_config
from support.fault_callbacks import SAMPLE_LOG, fault_env
from torch.utils.data import DistributedSampler

from sdzero.checkpoint import checkpointer as ck

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-3
"""Resumed losses vs the uninterrupted run's, relative. bf16 keeps 8 significant bits; the two runs round
the gradient sums in a different order, and the difference grows a little with each step. Measured on
the tiny model: at most 1.1e-4 over steps 3-6 (docs/checkpointing.md), so 1e-3 leaves a margin of ~10x,
while a restarted optimizer, a restarted schedule or other samples move the loss by percents."""
WARMUP = ("--lr-warmup-steps", "8")  # a schedule that moves every step, so a restarted one would show


def samples_by_step(folder: Path, ranks: int, accum: int) -> list[set[int]]:
    """The sample indices each optimizer step trained on, from the SAMPLE_LOG record of every rank."""
    lines = [
        [json.loads(x)["index"] for x in (folder / f"rank_{r}.jsonl").read_text().splitlines()]
        for r in range(ranks)
    ]
    steps = len(lines[0]) // accum
    assert all(len(rank_lines) == steps * accum for rank_lines in lines)
    return [
        {i for rank_lines in lines for batch in rank_lines[s * accum : (s + 1) * accum] for i in batch}
        for s in range(steps)
    ]


def test_resume_on_another_world_size_continues_through_the_universal_checkpoint(
    tiny_model, synth_data, tmp_path
):
    bf16 = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    two = write_config(tmp_path / "two.json", bf16)  # 2 ranks x 4 x 1 = 8
    one = write_config(tmp_path / "one.json", {**bf16, "gradient_accumulation_steps": 2})  # 1 x 4 x 2 = 8

    def launch(config: Path, out: Path, *extra: str, steps: int, ranks: int, log: Path | None = None):
        env = fault_env({SAMPLE_LOG: str(log)}) if log else None
        if log:
            log.mkdir()
        return run(config, tiny_model, synth_data, out, *WARMUP, *extra, steps=steps, env=env, ranks=ranks)

    ref = tmp_path / "ref"
    ok(launch(two, ref, "--checkpoint-every", "2", steps=6, ranks=2, log=tmp_path / "ref_samples"))
    ref_rows = {r["step"]: r for r in metrics(ref)}

    # A node is lost after step 2: the job comes back on one rank, from step 2's checkpoint.
    out = tmp_path / "elastic"
    shutil.copytree(ck.checkpoint_root(ref) / ck.step_tag(2), ck.checkpoint_root(out) / ck.step_tag(2))
    code, log = launch(one, out, "--resume", "auto", steps=4, ranks=1)
    errors = [line for line in log.splitlines() if "sdzero: error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert "world size (ranks) 2 -> 1" in errors[0] and "--resume-elastic" in errors[0]

    elastic = ("--resume", "auto", "--resume-elastic", "--checkpoint-every", "2")
    log = ok(launch(one, out, *elastic, steps=4, ranks=1, log=tmp_path / "one_samples"))
    universal = ck.checkpoint_root(out) / f"{ck.UNIVERSAL_PREFIX}{ck.step_tag(2)}"
    assert f"resumed from {ck.checkpoint_root(out) / ck.step_tag(2)} (step 2, 2 -> 1 ranks" in log
    assert (universal / ck.step_tag(2) / "zero" / "optimizer_state.pt").is_file()
    rows = metrics(out)
    # ... and back on two ranks from the checkpoint the single rank wrote at step 4.
    log = ok(launch(two, out, *elastic, steps=6, ranks=2, log=tmp_path / "two_samples"))
    assert f"resumed from {ck.checkpoint_root(out) / ck.step_tag(4)} (step 4, 1 -> 2 ranks" in log
    rows += metrics(out)

    # The step counter and the LR schedule continue; the losses follow the uninterrupted run.
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    assert [r["world_size"] for r in rows] == [1, 1, 2, 2]
    assert [r["lr"] for r in rows] == [ref_rows[s]["lr"] for s in (3, 4, 5, 6)]
    assert len({r["lr"] for r in rows}) == 4  # warm-up: a schedule restarted at 0 would not match
    for r in rows:
        expected = ref_rows[r["step"]]["loss"]
        assert abs(r["loss"] - expected) <= LOSS_RTOL * abs(expected), (r["step"], r["loss"], expected)
    print(
        "losses (step: resumed / uninterrupted):",
        [(r["step"], r["loss"], ref_rows[r["step"]]["loss"]) for r in rows],
    )

    # Samples: every step trained on the same 8 as the uninterrupted run's; over the runs, the epoch's
    # order from its start, none repeated, none skipped.
    reference = samples_by_step(tmp_path / "ref_samples", ranks=2, accum=1)
    chain = (
        reference[:2]
        + samples_by_step(tmp_path / "one_samples", ranks=1, accum=2)
        + samples_by_step(tmp_path / "two_samples", ranks=2, accum=1)
    )
    assert chain == reference and all(len(step) == 8 for step in chain)
    order = DistributedSampler(
        range(64),
        num_replicas=1,
        rank=0,
        shuffle=True,
        seed=json.loads((ref / "run_config.json").read_text())["seed"],
    )
    order.set_epoch(0)
    seen = [i for step in chain for i in step]
    assert len(seen) == len(set(seen)) == 48 and set(seen) == set(list(order)[:48])
