"""Checkpoint bookkeeping without launches: manifests, verification, discovery, retention, EMA, RNG state."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sdzero.atomic import write_text_atomic
from sdzero.checkpoint import checkpointer as ck
from sdzero.checkpoint import rng_state
from sdzero.config.train_config import parse_train_args
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
            tag=folder.name,
            step=step,
            serial=step if serial is None else serial,
            zero_stage=2,
            dtype="bf16",
            world_size=2,
            seed=0,
            model="m",
            prediction_type="epsilon",
            ema=True,
            files=files,
        )
        write_text_atomic(folder / ck.MANIFEST, manifest.to_json())
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
    [
        (None, "missing"),
        ("{not json", "unreadable"),
        ('{"tag": "x"}', "not an sdzero manifest"),
        ('{"format": 99}', "not an sdzero manifest"),
    ],
)
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
    args = [
        "--deepspeed_config",
        "x.json",
        "--model",
        "org/model",
        "--data",
        str(tmp_path),
        "--output-dir",
        str(tmp_path / "out"),
        "--keep-last",
        str(keep),
    ]
    with pytest.raises(UserError, match="at least 2 checkpoints.*nothing to resume from"):
        parse_train_args(args)


def test_checkpoint_flags_parse(tmp_path):
    cfg = parse_train_args(
        [
            "--deepspeed_config",
            "x.json",
            "--model",
            "org/model",
            "--data",
            str(tmp_path),
            "--output-dir",
            str(tmp_path),
            "--checkpoint-every",
            "5",
            "--keep-last",
            "0",
            "--resume",
            "auto",
            "--ema-decay",
            "0.999",
            "--validation-prompts",
            "a cat",
            "a dog",
            "--validation-every",
            "10",
        ]
    )
    assert (cfg.checkpoint_every, cfg.keep_last, cfg.resume, cfg.ema_decay) == (5, 0, "auto", 0.999)
    assert cfg.validation_prompts == ["a cat", "a dog"] and cfg.validation_every == 10
    with pytest.raises(UserError, match="--resume"):
        parse_train_args(
            [
                "--deepspeed_config",
                "x.json",
                "--model",
                "m",
                "--data",
                str(tmp_path),
                "--output-dir",
                str(tmp_path),
                "--resume",
                str(tmp_path / "nope"),
            ]
        )


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
    ck.check_compatible(folder, manifest, {"zero_stage": 2, "dtype": "bf16", "world_size": 2})
    for key, value, said in [
        ("zero_stage", 3, "ZeRO stage 2 -> 3"),
        ("dtype", "fp32", "precision bf16 -> fp32"),
    ]:
        with pytest.raises(UserError) as err:
            ck.check_compatible(
                folder, manifest, {"zero_stage": 2, "dtype": "bf16", "world_size": 2, key: value}
            )
        message = str(err.value)
        assert said in message and "sdzero export" in message and "\n" not in message


def test_another_world_size_is_refused_naming_resume_elastic_and_allowed_with_it(tmp_path):
    """Without --resume-elastic a new world size (and the batch shape that comes with it) is one line
    naming the flag; with it, exactly that is allowed and everything else still refused."""
    folder = fake_checkpoint(tmp_path, 2)
    manifest = ck.load_manifest(folder)
    shrunk = {"zero_stage": 2, "dtype": "bf16", "world_size": 1}
    with pytest.raises(UserError) as err:
        ck.check_compatible(folder, manifest, shrunk)
    assert "world size (ranks) 2 -> 1" in str(err.value) and "--resume-elastic" in str(err.value)
    assert "\n" not in str(err.value)
    ck.check_compatible(folder, manifest, shrunk, elastic=True)
    with pytest.raises(UserError, match="ZeRO stage 2 -> 3") as err:
        ck.check_compatible(folder, manifest, {**shrunk, "zero_stage": 3}, elastic=True)
    assert "pass --resume-elastic" not in str(err.value)
    with pytest.raises(UserError, match="ZeRO stage 2 -> 3"):  # not the flag's hint: it would not help
        ck.check_compatible(folder, manifest, {**shrunk, "zero_stage": 3})


def run_identity(model: Path, data: Path, tmp_path: Path, *extra: str, micro: int = 4, accum: int = 1):
    from launch import fp32_config, write_config

    from sdzero.checkpoint.identity import describe_run
    from sdzero.config.train_config import load_ds_config, parse_train_args

    config = write_config(tmp_path / f"ds_{micro}_{accum}.json", fp32_config(2, micro=micro, accum=accum))
    cfg = parse_train_args(
        [
            "--deepspeed_config",
            str(config),
            "--model",
            str(model),
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "out"),
            *extra,
        ]
    )
    comps = type("Comps", (), {"family": "sd", "native_resolution": 32})()
    return describe_run(cfg, load_ds_config(config, 2), comps, "epsilon", str(model))


def test_resume_compares_everything_that_makes_a_continuation_exact(tiny_model, synth_data, tmp_path):
    """Each change is named in one line; options that cannot change the trajectory pass."""
    import dataclasses
    import shutil

    saved = run_identity(tiny_model, synth_data, tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    manifest = ck.Manifest(
        tag="step_00000002",
        step=2,
        serial=1,
        ema=False,
        files={"f": {"bytes": 1, "sha256": "x"}},
        **dataclasses.asdict(saved),
    )
    write_text_atomic(folder / ck.MANIFEST, manifest.to_json())
    manifest = ck.load_manifest(folder)  # through JSON, as a resume reads it
    same = run_identity(
        tiny_model,
        synth_data,
        tmp_path,
        "--max-steps",
        "9",
        "--checkpoint-every",
        "3",
        "--validation-prompts",
        "a cat",
        "--num-workers",
        "0",
        "--keep-last",
        "5",
    )
    ck.check_compatible(folder, manifest, dataclasses.asdict(same))

    other_model = shutil.copytree(tiny_model, tmp_path / "other_model")
    weights = next((other_model / "unet").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 1  # another checkpoint of the model (its weights are sampled, not read whole)
    weights.write_bytes(bytes(raw))
    other_data = shutil.copytree(synth_data, tmp_path / "other_data")
    (other_data / "000000.png").unlink()
    (other_data / "000000.png").symlink_to(other_data / "000001.png")  # same name, another image size
    changes = {
        "micro-batch (DeepSpeed JSON) 4 -> 2": run_identity(tiny_model, synth_data, tmp_path, micro=2),
        "gradient accumulation (DeepSpeed JSON) 1 -> 2": run_identity(
            tiny_model, synth_data, tmp_path, accum=2
        ),
        "--resolution 32 -> 48": run_identity(tiny_model, synth_data, tmp_path, "--resolution", "48"),
        "--buckets False -> True": run_identity(tiny_model, synth_data, tmp_path, "--buckets"),
        "--snr-gamma None -> 5.0": run_identity(tiny_model, synth_data, tmp_path, "--snr-gamma", "5"),
        "--noise-offset 0.0 -> 0.1": run_identity(tiny_model, synth_data, tmp_path, "--noise-offset", "0.1"),
        "model weights/config (--model) changed": run_identity(other_model, synth_data, tmp_path),
        "data (--data / --cache-dir: files, sizes or captions) changed": run_identity(
            tiny_model, other_data, tmp_path
        ),
    }
    for said, now in changes.items():
        with pytest.raises(UserError) as err:
            ck.check_compatible(folder, manifest, dataclasses.asdict(now))
        message = str(err.value)
        assert said in message and message.count(" -> ") + message.count(" changed") == 1, (said, message)
        assert "\n" not in message and "--max-steps" in message  # the safe options are listed
    moved = shutil.copytree(tiny_model, tmp_path / "moved_model")  # the same weights elsewhere: allowed
    ck.check_compatible(folder, manifest, dataclasses.asdict(run_identity(moved, synth_data, tmp_path)))
    both = dataclasses.replace(
        run_identity(tiny_model, synth_data, tmp_path, micro=2), prediction_type="v_prediction"
    )
    with pytest.raises(UserError, match="--prediction-type epsilon -> v_prediction; micro-batch .* 4 -> 2"):
        ck.check_compatible(folder, manifest, dataclasses.asdict(both))


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "latest"
    write_text_atomic(target, "step_00000002")
    write_text_atomic(target, "step_00000004")
    assert target.read_text() == "step_00000004"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = rng_state.capture_rng()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)  # no pickled numpy objects inside
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    rng_state.restore_rng(loaded)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1])
    assert again[2] == expected[2]


# ------------------------------------------------------------------------------------------------- CLI


def test_export_of_a_folder_without_checkpoints_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from sdzero import cli

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(sys, "argv", ["sdzero", "export", str(tmp_path / "run"), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdzero: error:") and "no complete checkpoint" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ preemption


def test_sigusr1_sets_the_flag_and_the_watchdog_bounds_the_exit(monkeypatch):
    from sdzero.process import preemption

    class ManualTimer:
        """threading.Timer's interface; the test decides when the watchdog's time is up."""

        made: list[ManualTimer] = []

        def __init__(self, interval, function, args=()):
            self.interval, self.function, self.args = interval, function, args
            self.started = self.cancelled = False
            ManualTimer.made.append(self)

        def start(self):
            self.started = True

        def cancel(self):
            self.cancelled = True

        def expire(self):
            if self.started and not self.cancelled:
                self.function(*self.args)

    exits: list[int] = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    saved = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    try:
        flag = preemption.PreemptionFlag(timeout_s=30, timer=ManualTimer).install()
        assert not flag.requested and ManualTimer.made == []  # no watchdog before a signal
        signal.raise_signal(signal.SIGUSR1)
        assert flag.requested and flag.signum == signal.SIGUSR1
        watchdog = ManualTimer.made[-1]
        assert watchdog.started and watchdog.interval == 30
        watchdog.expire()  # the save "hangs" past the timeout: the process ends, and not with 143
        assert exits == [preemption.EXIT_WATCHDOG] == [75]

        saved_in_time = preemption.PreemptionFlag(timeout_s=30, timer=ManualTimer).install()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGUSR1)  # a second signal starts no second watchdog
        assert len(ManualTimer.made) == 2
        saved_in_time.disarm()  # what the loop does once the checkpoint is committed
        ManualTimer.made[-1].expire()
        assert exits == [75]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_preempted_exits_the_interpreter_with_143():
    from sdzero.process.preemption import Preempted

    with pytest.raises(SystemExit) as exit_info:
        raise Preempted()
    assert exit_info.value.code == 143


def test_a_kill_between_the_renames_of_a_resaved_step_leaves_it_listed(tmp_path, monkeypatch):
    """Re-saving a step (a resumed run passing it again) moves the old copy aside, then the new one in:
    killed in between, the old copy must still be found, with nothing at the step's own name."""
    root = tmp_path / "checkpoints"
    old = fake_checkpoint(root, 4)
    staging = fake_checkpoint(root, 40, commit=False).rename(root / f"{ck.STAGING_PREFIX}{old.name}")
    saver = object.__new__(ck.Checkpointer)
    saver.root, saver.keep_last, saver.ema = root, 3, object()
    saver.ident = ck.RunIdentity(
        zero_stage=2, dtype="bf16", world_size=2, seed=0, model="m", prediction_type="epsilon"
    )
    real_replace, calls = os.replace, []

    def killed_on_the_second(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the manifest's rename, the old copy's, then the new copy's: killed there
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", killed_on_the_second)
    files = {n: ck.describe_file(staging / n) for n in ck.list_files(staging)}
    with pytest.raises(KeyboardInterrupt):
        saver._commit(staging, old, 4, files)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    listed = ck.complete_checkpoints(root)
    assert [m.step for _, m in listed] == [4] and ck.verify_files(*listed[0]) == []
    assert ck.retention_victims(root, 3) == [staging]  # the half-committed new copy, not the old one

    saver._commit(staging, old, 4, files)  # done again, uninterrupted: one copy, the new one
    assert [(p.name, m.serial) for p, m in ck.complete_checkpoints(root)] == [(old.name, 5)]


def test_elastic_allows_the_batch_shape_only_with_a_new_world_size():
    from dataclasses import replace

    from sdzero.checkpoint.identity import differences

    saved = ck.RunIdentity(
        zero_stage=2,
        dtype="bf16",
        world_size=2,
        seed=0,
        model="m",
        prediction_type="epsilon",
        micro_batch=4,
        grad_accum=1,
        buckets=False,
    )
    now = {"zero_stage": 2, "dtype": "bf16", "world_size": 1, "micro_batch": 4, "grad_accum": 2}
    assert differences(saved, now, elastic=True) == []
    assert differences(saved, now) == [
        "world size (ranks) 2 -> 1",
        "gradient accumulation (DeepSpeed JSON) 1 -> 2",
    ]
    same_world = {**now, "world_size": 2}  # a batch shape change alone is not what the flag is for
    assert differences(saved, same_world, elastic=True) == ["gradient accumulation (DeepSpeed JSON) 1 -> 2"]
    # --buckets plans each epoch in global batches: 2 x 4 x 1 = 8 must stay 8.
    bucketed = replace(saved, buckets=True)
    assert differences(bucketed, {**now, "buckets": True}, elastic=True) == []
    assert differences(bucketed, {**now, "grad_accum": 1, "buckets": True}, elastic=True) == [
        "global batch under --buckets 8 -> 4 (keep micro-batch x accumulation x ranks)"
    ]


def test_universal_support_follows_deepspeeds_loaders():
    from dataclasses import replace

    from sdzero.checkpoint.universal import unsupported

    manifest = ck.load_manifest(fake_checkpoint(Path(tempfile.mkdtemp()), 2))
    for stage in (1, 2, 3):
        for optimizer in (None, "AdamW", "Adam"):
            assert unsupported(replace(manifest, zero_stage=stage), optimizer) is None
    assert unsupported(replace(manifest, zero_stage=2), "SGD") is None  # ZeRO-1/2 re-slice every state
    assert "exp_avg" in unsupported(replace(manifest, zero_stage=3), "SGD")
    assert "stage 0" in unsupported(replace(manifest, zero_stage=0), None)
    assert "NVMe" in unsupported(manifest, None, nvme_offload=True)


def test_retention_removes_a_universal_conversion_with_its_checkpoint(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    for name in (".universal-step_00000002", ".universal-step_00000006", ".universal-step_00000008.tmp-1"):
        (tmp_path / name).mkdir()
    victims = {p.name for p in ck.retention_victims(tmp_path, keep_last=2)}
    # step 2 goes, and its conversion with it; a crashed conversion goes; step 6's stays with step 6.
    assert victims == {"step_00000002", ".universal-step_00000002", ".universal-step_00000008.tmp-1"}
