"""Loading without unpickling (issue #27): a real pickle payload planted in each kind of checkpoint file
sdzero loads is refused in one line naming the file and the type, and never runs; the manifest's types
and paths are checked; exports cannot overlap their source; a process no launcher started is a world of
one. Real files, real torch.load and DeepSpeed's own zero_to_fp32 (no process group needed)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from payloads import Payload, payload_is_live, plant_raw_pickle, reseal
from safetensors.torch import save_file

from sdzero.checkpoint.export import EXPORT_MARKER, check_export_target, consolidated_weights
from sdzero.checkpoint.manifest import MANIFEST, ManifestError, load_manifest
from sdzero.checkpoint.safe_load import UnsafeFileError, guarded_loads, inside, load_tensors, scan_for_code
from sdzero.errors import UserError
from sdzero.process.rendezvous import world_of_one

MANIFEST_FIELDS = {
    "zero_stage": 2,
    "dtype": "fp32",
    "world_size": 1,
    "seed": 0,
    "model": "m",
    "prediction_type": "epsilon",
    "tag": "step_00000001",
    "step": 1,
    "serial": 1,
    "ema": False,
    "files": {},
}


def checkpoint(folder: Path, stage: int, states: dict) -> Path:
    """A checkpoint folder with DeepSpeed's model-states file name and a manifest sealing it."""
    folder.mkdir(parents=True)
    name = "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save(states, folder / name)
    (folder / MANIFEST).write_text(json.dumps({**MANIFEST_FIELDS, "zero_stage": stage, "files": {}}))
    reseal(folder)
    return folder


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_payload_in_a_model_states_file_is_refused_unrun(tmp_path, stage):
    marker = tmp_path / "PWNED"
    folder = checkpoint(
        tmp_path / "run" / "step_00000001", stage, {"module": {"w": torch.ones(2)}, "x": Payload(marker)}
    )
    assert payload_is_live(next(folder.glob("*model_states.pt")), marker)  # it would create the file
    with pytest.raises(UnsafeFileError) as err:
        consolidated_weights(folder, stage)  # stage 0 read by sdzero, 1-3 by DeepSpeed's zero_to_fp32
    message = str(err.value)
    assert "\n" not in message and "model_states.pt" in message and "io.open" in message
    assert not marker.exists()


def test_a_file_the_manifest_does_not_list_is_never_opened(tmp_path):
    marker = tmp_path / "PWNED"
    folder = tmp_path / "run" / "step_00000001"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("listed")
    (folder / MANIFEST).write_text(json.dumps(MANIFEST_FIELDS))
    reseal(folder)
    # Planted after the seal, where zero_to_fp32's glob finds it.
    torch.save({"x": Payload(marker)}, folder / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafeFileError, match="not one of the files"):
        consolidated_weights(folder, 2)
    assert not marker.exists()


def test_the_guard_makes_deepspeeds_unsafe_loads_weights_only_and_restores_torch_load(tmp_path):
    marker = tmp_path / "PWNED"
    torch.save({"x": Payload(marker)}, tmp_path / "a.pt")
    before = torch.load
    with guarded_loads(inside(tmp_path, ["a.pt"])), pytest.raises(UnsafeFileError, match="io.open"):
        torch.load(tmp_path / "a.pt", weights_only=False)  # what DeepSpeed's checkpoint engine calls
    assert torch.load is before and not marker.exists()
    torch.save({"t": torch.arange(3)}, tmp_path / "b.pt")
    assert torch.equal(load_tensors(tmp_path / "b.pt")["t"], torch.arange(3))


def test_the_opcode_scan_refuses_a_payload_without_building_anything(tmp_path):
    """scan_for_code (every rank's check before DeepSpeed's loader): the payload's type named, in the
    loader's own line; a clean DeepSpeed-like state passes; garbage is one line too."""
    marker = tmp_path / "PWNED"
    clean = {"module": {"w": torch.ones(2)}, "ds_version": "0.19", "step": 3, "mix": [1.5, "a", None]}
    torch.save(clean, tmp_path / "clean.pt")
    scan_for_code(tmp_path / "clean.pt")
    torch.save({**clean, "x": Payload(marker)}, tmp_path / "planted.pt")
    assert payload_is_live(tmp_path / "planted.pt", marker)
    with pytest.raises(UnsafeFileError) as err:
        scan_for_code(tmp_path / "planted.pt")
    assert "\n" not in str(err.value) and "planted.pt" in str(err.value) and "io.open" in str(err.value)
    assert "refused without running it" in str(err.value) and not marker.exists()
    (tmp_path / "b.pt").write_bytes(b"\x00garbage")
    with pytest.raises(UnsafeFileError, match="b.pt: not a readable torch checkpoint file"):
        scan_for_code(tmp_path / "b.pt")


def test_a_plain_pickle_or_garbage_under_a_torch_name_is_one_line(tmp_path):
    marker = tmp_path / "PWNED"
    plant_raw_pickle(tmp_path / "a.pt", marker)
    (tmp_path / "b.pt").write_bytes(b"\x00garbage")
    for name in ("a.pt", "b.pt"):
        with pytest.raises(UnsafeFileError) as err:
            load_tensors(tmp_path / name)
        assert name in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_ema_files_must_be_listed_and_be_safetensors(tmp_path):
    from sdzero.checkpoint.checkpointer import check_ema_files

    marker = tmp_path / "PWNED"
    folder = checkpoint(tmp_path / "run" / "step_00000001", 2, {"module": {"w": torch.ones(2)}})
    (folder / "ema").mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "ema" / "rank_00000.safetensors"))
    reseal(folder)
    check_ema_files(folder, load_manifest(folder))  # a good one passes
    plant_raw_pickle(folder / "ema" / "rank_00000.safetensors", marker)
    reseal(folder)
    with pytest.raises(UnsafeFileError, match="rank_00000.safetensors: not a readable safetensors"):
        check_ema_files(folder, load_manifest(folder))
    save_file({"w": torch.ones(2)}, str(folder / "ema" / "rank_00000.safetensors"))
    reseal(folder)
    save_file({"w": torch.ones(2)}, str(folder / "ema" / "rank_00001.safetensors"))  # planted, unlisted
    with pytest.raises(UnsafeFileError, match="rank_00001.safetensors: not one of the files"):
        check_ema_files(folder, load_manifest(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"step": "x"}, '"step" is str'),
        ({"serial": True}, '"serial" is bool'),
        ({"files": []}, '"files" is list'),
        ({"world_size": None}, '"world_size" is NoneType'),
        ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0"}}}, "not a file inside"),
        ({"files": {"/etc/passwd": {"bytes": 1, "sha256": "0"}}}, "not a file inside"),
        ({"files": {"a.pt": {"bytes": "1", "sha256": "0"}}}, "malformed"),
        ({"surprise": 1}, "unknown"),
    ],
)
def test_a_manifest_with_a_wrong_type_or_path_is_one_clear_line(tmp_path, change, says):
    (tmp_path / MANIFEST).write_text(
        json.dumps({**MANIFEST_FIELDS, "files": {"a.pt": {"bytes": 1, "sha256": "0"}}, **change})
    )
    with pytest.raises(ManifestError) as err:
        load_manifest(tmp_path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_listed_symlink_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "outside.pt").write_bytes(b"x")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "a.pt").symlink_to(tmp_path / "outside.pt")
    (folder / MANIFEST).write_text(
        json.dumps({**MANIFEST_FIELDS, "files": {"a.pt": {"bytes": 1, "sha256": "0"}}})
    )
    with pytest.raises(ManifestError, match="not a file inside"):
        load_manifest(folder)


# ---------------------------------------------------------------------------------------- export target


def test_an_export_never_overlaps_its_source(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "link").symlink_to(run)
    for out, how in [
        (run, "is"),
        (run / "final", "is inside"),
        (tmp_path, "holds"),
        (tmp_path / "link", "is"),
    ]:
        with pytest.raises(UserError, match=f" {how} "):
            check_export_target(run, None, out, overwrite=True)
    chosen = run / "checkpoints" / "step_00000001"
    with pytest.raises(UserError, match="is inside"):
        check_export_target(tmp_path / "link" / "checkpoints", chosen, chosen / "x", overwrite=True)
    check_export_target(run, chosen, tmp_path / "exported", overwrite=False)  # beside it: fine


def test_overwrite_replaces_only_an_export_and_never_a_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a pipeline sdzero exported"):
        check_export_target(run, None, mine, overwrite=True)
    (mine / EXPORT_MARKER).write_text("{}")
    check_export_target(run, None, mine, overwrite=True)
    with pytest.raises(UserError, match="not empty"):
        check_export_target(run, None, mine, overwrite=False)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    with pytest.raises(UserError, match="is a file"):
        check_export_target(run, None, afile, overwrite=True)
    assert afile.read_text() == "keep" and (mine / "notes.txt").read_text() == "mine"


def test_export_run_onto_itself_with_overwrite_changes_nothing(tmp_path, monkeypatch, capsys):
    """The report's case: `sdzero export RUN RUN --overwrite` deleted the run. Now: exit 2, one line."""
    from sdzero import cli

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setattr(sys, "argv", ["sdzero", "export", str(run), str(run), "--overwrite"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("sdzero: error:") and "\n" not in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and (run / "checkpoints").is_dir()


# ------------------------------------------------------------------------------------------ world of one


def test_without_a_launcher_a_process_is_rank_0_of_one_and_a_launched_one_is_left_alone():
    env: dict[str, str] = {"PATH": "/bin"}
    assert world_of_one(env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    for launched in ({"RANK": "3", "WORLD_SIZE": "4"}, {"OMPI_COMM_WORLD_SIZE": "2"}, {"PMI_RANK": "1"}):
        before = dict(launched)
        assert not world_of_one(launched) and launched == before


def test_train_py_without_a_launcher_trains_one_rank_without_mpi4py(tmp_path, tiny_model):
    """`python sdzero/train.py` on an install without mpi4py (an mpi4py that cannot be imported is put
    first on the path): it trains one step as a world of one and its first line says so."""
    import subprocess

    from sdzero.cluster.launch_command import TRAIN_SCRIPT
    from sdzero.models.tiny import write_synthetic_dataset

    blocker = tmp_path / "no_mpi" / "mpi4py"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n")
    data = write_synthetic_dataset(tmp_path / "data", images=4, size=32)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker.parent), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            str(TRAIN_SCRIPT),
            "--deepspeed_config",
            str(config),
            "--model",
            str(tiny_model),
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "1",
            "--num-workers",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[0].startswith("sdzero: no launcher"), done.stderr[:500]
    assert "ModuleNotFoundError" not in done.stderr and (tmp_path / "out" / "metrics.jsonl").is_file()
