"""The test-only fp16-on-CPU patch (tests/support/sitecustomize.py) as the fp16 dist tests' ranks get it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"

# A fresh process as a rank starts: an fp16-less CPU is simulated (this one may have fp16), then DeepSpeed's
# accelerator is asked, and py-cpuinfo (whose probe is another process that reads sitecustomize too).
PROBE = """
import json, torch
torch.ops.mkldnn._is_mkldnn_fp16_supported = lambda: False  # a CPU without fp16
from deepspeed.accelerator import get_accelerator
import cpuinfo
accel = get_accelerator()
print(json.dumps({"fp16": bool(accel.is_fp16_supported()), "dtypes": str(accel.supported_dtypes()),
                  "arch": cpuinfo.get_cpu_info().get("arch")}))
"""


def probe(patched: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SDZERO_TEST_FP16_ON_CPU"}
    if patched:
        env["SDZERO_TEST_FP16_ON_CPU"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_patch_turns_fp16_on_for_deepspeed_and_leaves_other_processes_alone():
    plain, patched = probe(patched=False), probe(patched=True)
    assert plain["fp16"] is False and "torch.float16" not in plain["dtypes"]  # the simulated CPU lacks fp16
    assert patched["fp16"] is True and "torch.float16" in patched["dtypes"]
    # py-cpuinfo's probe process starts with the patch's PYTHONPATH too; it must still answer (it used to
    # print DeepSpeed's start-up warning into its JSON, and DeepSpeed fell back to lscpu).
    assert patched["arch"] == plain["arch"] and patched["arch"]
