"""Constants named once: byte units and the phase columns of metrics.jsonl.

Kept free of heavy imports (no torch), so that reports and the CLI can use them cheaply.
"""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
# Largest first, for formatters that pick the biggest unit a value reaches.
BINARY_UNITS: tuple[tuple[str, int], ...] = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))

# Where a training step's time goes: one column each in metrics.jsonl, in this order.
STEP_PHASES: tuple[str, ...] = ("data_s", "encode_s", "forward_s", "backward_s", "optimizer_s")
