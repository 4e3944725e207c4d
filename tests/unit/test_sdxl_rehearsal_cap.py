"""bench/sdxl_rehearsal.py's memory cap: chosen from the grid's measured peaks so that the fastest config
that fits needs gradient checkpointing (the SDXL-at-1024-px case at this machine's scale)."""

import pytest
from bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("sdxl_rehearsal")


def row(mb: int, gc: bool, rate: float, peak_mib: float) -> dict:
    return {
        "id": f"z1-bf16-mb{mb}-off-none-r2-ga1" + ("-gc" if gc else ""),
        "stage": 1,
        "micro_batch": mb,
        "gc": gc,
        "rate": rate,
        "half": 0.02,
        "peak": peak_mib * 2**20,
    }


def test_the_cap_makes_a_checkpointed_config_the_fastest_that_fits(bench):
    rows = [
        row(1, False, 4.0, 430),
        row(2, False, 5.9, 470),  # within noise of micro-batch 4 checkpointed: not clearly slower
        row(4, False, 8.0, 560),  # the fastest, without checkpointing: over the cap
        row(1, True, 3.0, 390),
        row(4, True, 6.0, 400),  # the fastest that fits: checkpointed
        row(8, True, 9.0, 410),  # out of the global batch's reach: ignored
    ]
    cap = bench.choose_cap(rows)
    usable = cap["usable_bytes"]
    assert 430 * 2**20 < usable < 470 * 2**20  # the widest gap where checkpointing clearly wins
    assert cap["fastest_fitting"].endswith("-mb4-off-none-r2-ga1-gc")
    assert cap["fastest_plain_fitting"].endswith("-mb1-off-none-r2-ga1")  # fits, clearly slower
    fitting = [r for r in rows if r["peak"] <= usable and bench.in_reach(r["micro_batch"])]
    assert max(fitting, key=lambda r: r["rate"])["id"].endswith("-mb4-off-none-r2-ga1-gc")
    assert cap["device_memory_gib"] == pytest.approx(usable / (1 - bench.HEADROOM) / 2**30)


def test_no_cap_where_checkpointing_never_wins(bench):
    rows = [row(1, False, 4.0, 300), row(1, True, 3.0, 290), row(4, False, 8.0, 280), row(4, True, 6.0, 320)]
    with pytest.raises(SystemExit, match="no cap"):
        bench.choose_cap(rows)
