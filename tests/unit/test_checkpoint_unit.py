"""Checkpoint bookkeeping without launches: manifests, verification, discovery, retention, EMA, RNG state."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sdzero import checkpoint as ck
from sdzero import ema as ema_mod
from sdzero.config import parse_train_args
from sdzero.errors import UserError


def fake_checkpoint(root: Path, step: int, serial: int | None = None, commit: bool = True) -> Path:
    """A folder shaped like a DeepSpeed ZeRO-2 checkpoint, committed (with a manifest) or not."""
    folder = root / ck.step_tag(step)
    (folder / "ema").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"model" * (100 + step))
    for r in range(2):
        (folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(bytes([r, step]) * 500)
        (folder / "ema" / f"rank_{r:05d}.safetensors").write_bytes(b"e" * (10 + r))
    if commit:
        files = {n: ck.describe_file(folder / n) for n in ck.list_files(folder)}
        manifest = ck.Manifest(
            tag=folder.name, step=step, serial=step if serial is None else serial, zero_stage=2, dtype="bf16",
            world_size=2, seed=0, model="m", prediction_type="epsilon", ema=True, files=files,
        )  # fmt: skip
        ck.atomic_write_text(folder / ck.MANIFEST, manifest.to_json())
    return folder


def test_manifest_round_trip_lists_every_file_with_size_and_hash(tmp_path):
    folder = fake_checkpoint(tmp_path, 4)
    manifest = ck.load_manifest(folder)
    assert set(manifest.files) == {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "ema/rank_00000.safetensors",
        "ema/rank_00001.safetensors",
    }
    entry = manifest.files["mp_rank_00_model_states.pt"]
    assert entry["bytes"] == 5 * 104 and len(entry["sha256"]) == 64
    assert manifest.step == 4 and manifest.total_bytes == sum(f["bytes"] for f in manifest.files.values())
    assert ck.verify_files(folder, manifest) == []


@pytest.mark.parametrize(
    "content, reason",
    [(None, "missing"), ("{not json", "unreadable"), ('{"tag": "x"}', "not an sdzero manifest"),
     ('{"format": 99}', "not an sdzero manifest")],
)  # fmt: skip
def test_invalid_manifests_are_refused_with_the_reason(tmp_path, content, reason):
    folder = fake_checkpoint(tmp_path, 2, commit=False)
    if content is not None:
        (folder / ck.MANIFEST).write_text(content)
    with pytest.raises(ck.ManifestError, match=reason):
        ck.load_manifest(folder)
    assert ck.read_manifest(folder) is None


def test_wrong_format_version_is_refused(tmp_path):
    folder = fake_checkpoint(tmp_path, 2)
    raw = json.loads((folder / ck.MANIFEST).read_text())
    raw["format"] = 99
    (folder / ck.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ck.ManifestError, match="format 99"):
        ck.load_manifest(folder)


def test_verify_names_truncated_deleted_and_corrupted_files(tmp_path):
    folder = fake_checkpoint(tmp_path, 6)
    manifest = ck.load_manifest(folder)
    truncated = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (folder / "ema" / "rank_00000.safetensors").unlink()
    corrupted = folder / "mp_rank_00_model_states.pt"
    corrupted.write_bytes(b"X" + corrupted.read_bytes()[1:])  # same size, other bytes
    problems = ck.verify_files(folder, manifest)
    assert len(problems) == 3
    assert any(str(truncated) in p and "100 bytes" in p for p in problems)
    assert any("rank_00000.safetensors is missing" in p for p in problems)
    assert any(str(corrupted) in p and "sha256" in p for p in problems)


def test_folders_without_a_valid_manifest_are_not_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, commit=False)  # a DeepSpeed save that never committed
    staging = tmp_path / f"{ck.STAGING_PREFIX}step_00000008"
    staging.mkdir()
    (staging / ck.MANIFEST).write_text("{}")
    found = [m.step for _, m in ck.complete_checkpoints(tmp_path)]
    assert found == [4, 2]


def test_newest_means_last_committed_not_highest_step(tmp_path):
    """A run resumed from step 4 writes step 6 after an abandoned step 8: step 6 is the newer one."""
    fake_checkpoint(tmp_path, 4, serial=1)
    fake_checkpoint(tmp_path, 8, serial=2)
    fake_checkpoint(tmp_path, 6, serial=3)
    assert [m.step for _, m in ck.complete_checkpoints(tmp_path)] == [6, 8, 4]
    assert ck.next_serial(tmp_path) == 4


def test_retention_keeps_the_newest_k_complete_ones_and_drops_stale_staging(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    incomplete = fake_checkpoint(tmp_path, 10, commit=False)
    staging = tmp_path / f"{ck.STAGING_PREFIX}step_00000012"
    staging.mkdir()
    victims = ck.retention_victims(tmp_path, keep_last=2)
    # The incomplete folder is not one of the two kept (6 and 8 are), and is not ours to delete either.
    assert victims == [tmp_path / "step_00000004", tmp_path / "step_00000002", staging]
    assert incomplete not in victims
    assert ck.retention_victims(tmp_path, keep_last=0) == [staging]


@pytest.mark.parametrize("keep", [1, -1])
def test_keep_last_below_two_is_refused_with_the_reason(tmp_path, keep):
    args = ["--deepspeed_config", "x.json", "--model", "org/model", "--data", str(tmp_path),
            "--output-dir", str(tmp_path / "out"), "--keep-last", str(keep)]  # fmt: skip
    with pytest.raises(UserError, match="at least 2 checkpoints.*nothing to resume from"):
        parse_train_args(args)


def test_checkpoint_flags_parse(tmp_path):
    cfg = parse_train_args(
        ["--deepspeed_config", "x.json", "--model", "org/model", "--data", str(tmp_path), "--output-dir",
         str(tmp_path), "--checkpoint-every", "5", "--keep-last", "0", "--resume", "auto", "--ema-decay",
         "0.999", "--validation-prompts", "a cat", "a dog", "--validation-every", "10"]
    )  # fmt: skip
    assert (cfg.checkpoint_every, cfg.keep_last, cfg.resume, cfg.ema_decay) == (5, 0, "auto", 0.999)
    assert cfg.validation_prompts == ["a cat", "a dog"] and cfg.validation_every == 10
    with pytest.raises(UserError, match="--resume"):
        parse_train_args(["--deepspeed_config", "x.json", "--model", "m", "--data", str(tmp_path),
                          "--output-dir", str(tmp_path), "--resume", str(tmp_path / "nope")])  # fmt: skip


def test_first_verified_falls_back_and_names_the_bad_file(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    shard = newest / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"")
    warnings: list[str] = []
    chosen = ck.first_verified(ck.complete_checkpoints(tmp_path), ck.verify_files, warnings.append)
    assert chosen is not None and chosen[1].step == 2
    assert len(warnings) == 1 and str(shard) in warnings[0] and "falling back" in warnings[0]


def test_locate_accepts_a_checkpoint_a_folder_of_them_or_a_run(tmp_path):
    root = tmp_path / "run" / ck.CHECKPOINTS
    one = fake_checkpoint(root, 2)
    fake_checkpoint(root, 4)
    assert [m.step for _, m in ck.locate(tmp_path / "run")[0]] == [4, 2]
    assert [m.step for _, m in ck.locate(root)[0]] == [4, 2]
    assert ck.locate(one) == ([(one, ck.load_manifest(one))], True)
    bare = fake_checkpoint(tmp_path / "plain_deepspeed", 6, commit=False)
    with pytest.raises(UserError, match="not a complete checkpoint.*missing"):
        ck.locate(bare)


def test_resuming_another_stage_precision_or_world_size_stops_with_the_fix(tmp_path):
    folder = fake_checkpoint(tmp_path, 2)
    manifest = ck.load_manifest(folder)
    ck.check_compatible(folder, manifest, 2, "bf16", 2)
    for now in [(3, "bf16", 2), (2, "fp32", 2), (2, "bf16", 4)]:
        with pytest.raises(UserError) as err:
            ck.check_compatible(folder, manifest, *now)
        message = str(err.value)
        assert "ZeRO-2 bf16 on 2 ranks" in message and f"ZeRO-{now[0]} {now[1]} on {now[2]} ranks" in message
        assert "optimizer state" in message and "sdzero export" in message and "\n" not in message


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "latest"
    ck.atomic_write_text(target, "step_00000002")
    ck.atomic_write_text(target, "step_00000004")
    assert target.read_text() == "step_00000004"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = ck.capture_rng()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)  # no pickled numpy objects inside
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    ck.restore_rng(loaded)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1])
    assert again[2] == expected[2]


# ------------------------------------------------------------------------------------------------- EMA

PARAMS = {"down.weight": (3, 4), "up.bias": (5,)}
# Two "ranks" that split the flat parameters the way ZeRO-1/2 does: one parameter spans both.
LAYOUT = {0: [("down.weight", 0, 7)], 1: [("down.weight", 7, 5), ("up.bias", 0, 5)]}


def fragments_for(rank: int, params: dict[str, torch.Tensor]):
    return [
        (ema_mod.Fragment(name, start, numel, PARAMS[name]), params[name].reshape(-1)[start : start + numel])
        for name, start, numel in LAYOUT[rank]
    ]


def test_ema_decay_matches_diffusers_ema_model():
    from diffusers.training_utils import EMAModel

    reference = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=0.999)
    for step in range(1, 40):
        assert ema_mod.ema_decay(0.999, step) == reference.get_decay(step)


def test_sharded_ema_equals_diffusers_ema_of_the_full_weights(tmp_path, monkeypatch):
    """Each rank averaging its own slice, then joining, gives what EMAModel gives on the whole model."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    params = {n: torch.randn(s) for n, s in PARAMS.items()}
    monkeypatch.setattr(ema_mod, "local_fp32_fragments", lambda rank: fragments_for(rank, params))
    shards = [ema_mod.ShardedEMA(rank, decay=0.8) for rank in (0, 1)]
    reference = EMAModel([torch.nn.Parameter(p.clone()) for p in params.values()], decay=0.8, foreach=True)
    for _ in range(6):
        for p in params.values():
            p.add_(torch.randn_like(p))  # an "optimizer step", in place like DeepSpeed's masters
        for shard in shards:
            shard.update()
        reference.step([torch.nn.Parameter(p.clone()) for p in params.values()])
    for rank, shard in enumerate(shards):
        shard.save(tmp_path, rank)
    joined, updates = ema_mod.assemble(tmp_path)
    assert updates == 6
    for (name, value), expected in zip(params.items(), reference.shadow_params, strict=True):
        torch.testing.assert_close(joined[name], expected, rtol=0, atol=1e-6, msg=name)
        assert not torch.allclose(joined[name], value)  # an average, not a copy of the weights

    # Resume: same layout reads its own file; a different layout re-slices the joined tensors.
    same = ema_mod.ShardedEMA(1, decay=0.8)
    same.load(tmp_path, 1)
    assert same.updates == 6 and torch.equal(same.shadow[1], shards[1].shadow[1])
    LAYOUT[2] = [("up.bias", 1, 4)]
    try:
        other = ema_mod.ShardedEMA(2, decay=0.8)
        other.load(tmp_path, 2)
        assert torch.equal(other.shadow[0], joined["up.bias"][1:])
    finally:
        del LAYOUT[2]


def test_assemble_refuses_incomplete_coverage(tmp_path, monkeypatch):
    params = {n: torch.zeros(s) for n, s in PARAMS.items()}
    monkeypatch.setattr(ema_mod, "local_fp32_fragments", lambda rank: fragments_for(rank, params))
    ema_mod.ShardedEMA(1, decay=0.9).save(tmp_path, 1)  # rank 0's file is missing
    with pytest.raises(ValueError, match="down.weight cover 5 of 12"):
        ema_mod.assemble(tmp_path)


# ------------------------------------------------------------------------------------------------- CLI


def test_export_of_a_folder_without_checkpoints_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from sdzero import cli

    monkeypatch.setattr(sys, "argv", ["sdzero", "export", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdzero: error:") and "no complete checkpoint" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ preemption


def test_sigusr1_sets_the_flag_and_the_watchdog_bounds_the_exit(monkeypatch):
    from sdzero import preemption

    exits: list[int] = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    saved = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    try:
        flag = preemption.PreemptionFlag(timeout_s=0.05).install()
        assert not flag.requested
        signal.raise_signal(signal.SIGUSR1)
        assert flag.requested and flag.signum == signal.SIGUSR1
        time.sleep(0.5)  # the save "hangs": the watchdog must end the process with 143
        assert exits == [preemption.EXIT_PREEMPTED] == [143]

        saved_in_time = preemption.PreemptionFlag(timeout_s=0.05).install()
        signal.raise_signal(signal.SIGTERM)
        saved_in_time.disarm()  # what the loop does once the checkpoint is committed
        time.sleep(0.3)
        assert exits == [143]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_preempted_exits_the_interpreter_with_143():
    from sdzero.preemption import Preempted

    with pytest.raises(SystemExit) as exit_info:
        raise Preempted()
    assert exit_info.value.code == 143
