"""Test-only: let DeepSpeed's CPU accelerator run fp16 (it reports fp16 as unsupported on most CPUs).

Active only when SDZERO_TEST_FP16_ON_CPU=1 and this folder is on PYTHONPATH, which the fp16 tests set
for the ranks they launch. Never shipped: users on a CPU without fp16 must get DeepSpeed's own error.

The patch is applied when `deepspeed.accelerator` is first imported, not at interpreter start: every
Python process of the launch reads this file, including helpers that never touch DeepSpeed (py-cpuinfo's
probe, whose stdout is its JSON answer). Importing torch and DeepSpeed here cost each of them 3-4 s and
broke that JSON with DeepSpeed's start-up warning, so DeepSpeed fell back to lscpu: 15 s of every fp16
launch.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "deepspeed.accelerator"


def _allow_fp16(module) -> None:
    import torch

    accel = module.get_accelerator()
    if accel.device_name() != "cpu":
        return
    accel.is_fp16_supported = lambda: True
    if torch.float16 not in accel.supported_dtypes():
        original = accel.supported_dtypes
        accel.supported_dtypes = lambda: [*original(), torch.float16]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for TARGET it asks the other finders, then patches the module once loaded."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and not while asking the others below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _allow_fp16(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SDZERO_TEST_FP16_ON_CPU") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
