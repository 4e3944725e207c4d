"""The input rate model (advisor.model.input_rate): each node count's input rate from one worker's rate,
the workers a node runs and the storage, every prediction bounded by it, and the note that names the
bound and its remedy."""

from __future__ import annotations

import pandas as pd
import pytest

from advisor.decide.outcome import input_clause
from advisor.measure.input_figures import keep_input, launch_input_sections
from advisor.model.input_rate import LOADER, SHARED_STORAGE, InputPlan, bound_predictions, plan_from

SECTION = {
    "kind": "images",
    "worker": {"samples_per_s": 10.0},
    "storage": {"bytes_per_s": 8e6, "files_per_s": 8.0, "bytes_per_file": 1e6},
    "workers_per_rank": 1,
    "local_ranks": 2,
    "cpu_count": 4,
}


def predictions(rates: dict[int, float]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"node_count": n, "global_batch": 64, "samples_per_s": r, "step_time_s": 64 / r}
            for n, r in rates.items()
        ]
    )


def test_the_plan_is_the_median_of_the_launches_and_the_node_settings():
    slower = {**SECTION, "worker": {"samples_per_s": 6.0}}
    plan = plan_from([SECTION, slower, {**SECTION, "worker": {"samples_per_s": 20.0}}], 8, 2, 12, 16.0)
    assert plan.worker_samples_per_s == 10.0 and plan.workers_per_rank == 2
    assert plan.workers_per_node == 12  # 2 per rank x 8 ranks, at most one per core
    assert plan.limits(4) == {
        LOADER: 4 * 12 * 10.0,
        "storage": 4 * 8e6 / 1e6,
        SHARED_STORAGE: 16e9 / 8 / 1e6,  # 2,000 images/s whatever the node count
    }
    assert plan_from([], 8, None, None, None) is None
    assert plan_from([SECTION], 8, None, None, None).workers_per_rank == 1  # the trials' own


def test_rows_above_the_input_take_its_rate_and_say_so_with_the_remedy():
    plan = InputPlan(10.0, "images", 1, 2, 4, None, 1e6, 60e6)
    table = bound_predictions(predictions({1: 15.0, 2: 50.0, 4: 90.0}), plan)
    # 1 node: 2 workers x 10 = 20 >= 15 (compute binds); 2 nodes: 40 < 50; 4 nodes: the shared 60 < 80
    assert table["input_bound"].tolist() == [False, True, True]
    assert table["samples_per_s"].tolist() == [15.0, 40.0, 60.0]
    assert table["step_time_s"].tolist() == pytest.approx([64 / 15, 64 / 40, 64 / 60])
    # the step's parts still add up: the held rows wait for their input the rest of the step
    assert table["input_wait_s"].tolist() == pytest.approx([0.0, 64 / 40 - 64 / 50, 64 / 60 - 64 / 90])
    assert table["training_samples_per_s"].tolist() == [15.0, 50.0, 90.0]
    assert table["input_note"][0] == ""
    assert table["input_note"][1] == (
        "input-bound: 2 nodes need 50 images/s, the loader workers give 40; remedy: a latent cache "
        "(`sdzero cache`, then --cache-dir: workers read latents, not images)"
    )
    assert table["input_note"][2].startswith(
        "input-bound: 4 nodes need 90 images/s, the shared storage gives 60"
    )
    assert "tar shards" in table["input_note"][2]


def test_with_a_cache_the_remedy_is_more_workers_where_cores_are_spare():
    plan = InputPlan(10.0, "cache", 1, 2, 8)
    note = bound_predictions(predictions({1: 100.0}), plan)["input_note"][0]
    assert (
        note
        == "input-bound: 1 node needs 100 samples/s, the loader workers give 20; remedy: more loader workers (--num-workers 4)"
    )


def test_no_measurement_leaves_the_predictions_as_they_are():
    table = predictions({1: 15.0})
    assert bound_predictions(table, None) is table


def test_the_verdict_names_an_input_bound_choice():
    rec = {
        "node_count": 2,
        "scaling_table": [{"node_count": 1}, {"node_count": 2, "input_note": "input-bound: x"}],
    }
    assert input_clause(rec) == "; input-bound: x"
    assert input_clause({**rec, "node_count": 1}) == ""


def test_sections_are_read_from_the_launches_and_kept_for_a_replan(tmp_path):
    launch = tmp_path / "profile" / "trials" / "l1"
    launch.mkdir(parents=True)
    (launch / "profile.json").write_text('{"configs": {}, "input": {"worker": {"samples_per_s": 3}}}')
    sections = launch_input_sections(tmp_path)
    assert sections == [{"worker": {"samples_per_s": 3}}]
    (tmp_path / "other").mkdir()
    keep_input(tmp_path / "other", sections, None)
    assert launch_input_sections(tmp_path / "other") == sections


def test_where_ranks_take_cpu_the_workers_get_what_is_left_of_the_cores():
    # 2 cores; the ranks spend 0.05 CPU-s per sample, a worker 1 / 10: 2 / 0.15 = 13.3 samples/s
    plan = InputPlan(10.0, "images", 1, 2, 2, rank_cpu_s_per_sample=0.05)
    table = bound_predictions(predictions({1: 40.0, 2: 80.0}), plan)
    assert table["samples_per_s"].tolist() == pytest.approx([2 / 0.15, 4 / 0.15])
    assert table["input_link"].tolist() == ["CPU cores"] * 2
    assert table["input_note"][0].startswith("input-bound: 1 node needs 40 images/s, the CPU cores give 13.3")
    # the ranks' CPU not measured (or another kind of node): the two workers' 20/s
    assert (
        bound_predictions(predictions({1: 40.0}), InputPlan(10.0, "images", 1, 2, 2))["samples_per_s"][0]
        == 20
    )
    starved = {**SECTION, "rank_cpu_s_per_sample": 0.05, "loader_wait_share": 0.4}
    assert plan_from([starved], 2, None, 2, None).rank_cpu_s_per_sample == 0.05
    # trials whose workers kept up measured their rate with the workers on the same cores already
    kept_up = {**starved, "loader_wait_share": 0.01}
    assert plan_from([kept_up], 2, None, 2, None).rank_cpu_s_per_sample is None


def test_the_report_table_has_an_input_column():
    from advisor.report.answer import SCALING_SHOWN, input_cell

    assert SCALING_SHOWN[SCALING_SHOWN.index("samples/s") + 1] == "input"
    bound = {"input_samples_per_s": 12.0, "input_bound": True, "input_link": "loader workers"}
    assert input_cell(bound) == "input-bound (loader workers)"
    assert input_cell({**bound, "input_bound": False}) == "12"
    assert input_cell({}) == ""


def test_cores_filled_by_the_ranks_own_compute_cap_the_row_without_calling_it_input_bound():
    # a cache read of 300 samples/s (1/300 CPU-s) beside ranks taking 0.015 CPU-s per sample: the
    # cores give 2 / 0.0183 = 109/s, below a training rate of 132, but the workers' part is 18%
    plan = InputPlan(300.0, "cache", 1, 2, 2, rank_cpu_s_per_sample=0.015)
    table = bound_predictions(predictions({1: 132.0}), plan)
    assert table["samples_per_s"][0] == pytest.approx(2 / (0.015 + 1 / 300))
    assert not table["input_bound"][0] and table["input_note"][0] == ""
    assert table["input_link"][0] == "CPU cores"
