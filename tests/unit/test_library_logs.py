"""Library chatter goes to the log file, real warnings and errors still show (sdzero.library_logs)."""

from __future__ import annotations

import io
import logging
import warnings

from sdzero.library_logs import ChatterFilter, ChatterLog, library_chatter_to


def test_library_records_below_error_go_to_the_file_and_errors_still_show(tmp_path, capsys):
    log_path = tmp_path / "advise.log"
    seen = io.StringIO()
    # a library root logger with its own console handler (as DeepSpeed and transformers have)
    ds = logging.getLogger("DeepSpeed")
    handler = logging.StreamHandler(seen)
    ds.addHandler(handler)
    ds.propagate = False
    root = logging.getLogger("transformers")
    late = io.StringIO()
    late_handler = logging.StreamHandler(late)
    try:
        with library_chatter_to(log_path):
            ds.warning("Setting accelerator to CPU")
            ds.error("a real failure")
            # a child module's record reaches its root's handler, added after the diversion started
            root.addHandler(late_handler)
            logging.getLogger("transformers.utils.import_utils").warning(
                "requires torchvision (not installed)"
            )
        ds.warning("after the block")  # the diversion ended with it
    finally:
        ds.removeHandler(handler)
        root.removeHandler(late_handler)
    text = log_path.read_text()
    assert "Setting accelerator to CPU" in text and "requires torchvision" in text
    assert "a real failure" not in text and "after the block" not in text
    console = seen.getvalue()
    assert "a real failure" in console and "after the block" in console
    assert "Setting accelerator" not in console and late.getvalue() == ""


def test_warnings_from_libraries_go_to_the_file_and_ours_show(tmp_path):
    log_path = tmp_path / "x.log"
    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with library_chatter_to(log_path):
            warnings.warn_explicit("old API", FutureWarning, "/x/site-packages/torch/c10d_logger.py", 83)
            warnings.warn_explicit("fallback", UserWarning, "/x/site-packages/torchvision/io.py", 7)
            warnings.warn("the LR was capped", UserWarning, stacklevel=1)  # this project's own: shown
    assert shown == ["the LR was capped"]
    text = log_path.read_text()
    assert "FutureWarning: old API" in text and "fallback" in text


def test_a_childs_output_keeps_its_own_lines_and_loses_the_chatter(tmp_path):
    launcher_output = (
        b"[2026-12-01 23:02:26,207] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n"
        b"[2026-12-01 23:02:28,197] [INFO] [runner.py:618:main] cmd = python -u -m deepspeed.launcher.launch\n"
        b"DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n"
        b"Loading weights:   0%|          | 0/36\rLoading weights: 100%|##########| 36/36\n"
        b"[sdzero] ZeRO-2 bf16 | 2 ranks x micro-batch 4\n"
        b"/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: deprecated.\n"
        b"  return func(*args, **kwargs)\n"
        b"train:  33%|###3      | 1/3\rtrain: 100%|##########| 3/3\n"
        b"sdzero: error: --data x: no such folder\n"
    )
    log = ChatterLog(tmp_path / "demo.log")
    out = io.StringIO()
    ChatterFilter(log, out).pump(io.BufferedReader(io.BytesIO(launcher_output)))
    log.close()
    shown = out.getvalue()
    assert shown == (
        "[sdzero] ZeRO-2 bf16 | 2 ranks x micro-batch 4\n"
        "train:  33%|###3      | 1/3\rtrain: 100%|##########| 3/3\n"
        "sdzero: error: --data x: no such folder\n"
    )
    kept = (tmp_path / "demo.log").read_text()
    for chatter in (
        "Setting accelerator",
        "cmd = python",
        "built successfully",
        "FutureWarning",
        "return func",
    ):
        assert chatter in kept
