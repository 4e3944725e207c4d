"""Test-only: let DeepSpeed's CPU accelerator run fp16 (it reports fp16 as unsupported on most CPUs).

Active only when SDZERO_TEST_FP16_ON_CPU=1 and this folder is on PYTHONPATH, which the fp16 tests set
for the ranks they launch. Never shipped: users on a CPU without fp16 must get DeepSpeed's own error.
"""

import os

if os.environ.get("SDZERO_TEST_FP16_ON_CPU") == "1":
    import torch
    from deepspeed.accelerator import get_accelerator

    _accel = get_accelerator()
    if _accel.device_name() == "cpu":
        _accel.is_fp16_supported = lambda: True
        _dtypes = _accel.supported_dtypes()
        if torch.float16 not in _dtypes:
            _orig = _accel.supported_dtypes
            _accel.supported_dtypes = lambda: [*_orig(), torch.float16]
