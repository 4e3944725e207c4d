"""bench/scaleout_accuracy.py's round summary: errors, their communication part and the 1-host repeat."""

import pandas as pd
import pytest
from bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("scaleout_accuracy")


def case(rate: str, predicted: float, measured: float, comm: tuple[float, float], spread: float) -> dict:
    """One row as the bench appends it (the columns print_table reads)."""
    predicted_comm, measured_comm = comm
    return {
        "round": 6,
        "hosts": 2,
        "slots": 2,
        "rate": rate,
        "delay_ms": 1.0,
        "config": "ZeRO-2 bf16 mb4",
        "inter_busbw_gbit_s": 0.2,
        "one_host_step_s": 0.5,
        "predicted_step_s": predicted,
        "predicted_comm_s": predicted_comm,
        "predicted_compute_s": predicted - predicted_comm,
        "predicted_wait_s": 0.01,
        "measured_step_s": measured,
        "measured_comm_s": measured_comm,
        "error": predicted / measured - 1,
        "one_host_spread": spread,
    }


def test_the_summary_counts_each_pair_of_1_host_trials_once(bench, capsys):
    table = pd.DataFrame(
        [
            case("200mbit", 1.00, 1.00, (0.20, 0.20), -0.08),  # exact
            case("1gbit", 1.15, 1.00, (0.10, 0.04), -0.08),  # +15%: 6 points of it communication
        ]
    )
    bench.print_table(table)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    # 1 of 2 within 10%; median |error| 7.5%, largest 15%; communication 3.0% median, 1 of 2 within
    # 5% of the step; the two rates share one pair of 1-host trials: its spread counted once (8.0%);
    # 1 of 2 inside its own interval (half the 8% spread: the exact case, not the +15% one)
    assert summary == "| 6 | 2 | 1 | 1 | 7.5% | 15.0% | 3.0%, 1 of 2 | 8.0%, 8.0% |"


def test_rows_without_a_repeat_say_so(bench):
    rows = pd.DataFrame([case("1gbit", 1.0, 1.0, (0.1, 0.1), float("nan"))])
    assert bench.repeat_spread(rows) == "-"
    assert bench.repeat_spread(rows.drop(columns="one_host_spread")) == "-"
