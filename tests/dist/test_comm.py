"""`sdzero comm`: the collectives benchmark with 2 real ranks (deepspeed launcher + gloo, mpirun + mpi4py).

The dist-marked tests share one short run (4 KiB .. 4 MiB, a few seconds per backend). The unmarked tests
below them run in this process: the correctness check, the budget stop and the user-facing errors.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from advisor.commands.comm import comm_command
from advisor.measure import collectives_launch as comm_module
from advisor.measure.alphabeta import COLLECTIVES, bus_factor, load_fits
from advisor.measure.collectives_launch import CommResult, parse_bytes, run_comm
from advisor.measure.collectives_rank import CSV_COLUMNS, SweepSettings, Topology, _check_once, sweep
from advisor.measure.communicators import Buffers, input_pattern, make_buffers
from sdzero.errors import UserError

# Both halves: mpirun without mpi4py in this venv (Open MPI installed after `make venv`) cannot run it.
HAVE_MPIRUN = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
NO_MPIRUN = (
    "mpirun or mpi4py is missing: install openmpi-bin libopenmpi-dev, then mpi4py, to test the MPI backend"
)
MAX_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> CommResult:
    out = tmp_path_factory.mktemp("comm")
    # No backends named: what `sdzero comm` does with no flags (every backend installed here).
    return run_comm(out, num_ranks=2, min_bytes=4096, max_bytes=MAX_BYTES, budget_s=8.0)


def _backend_rows(result: CommResult, backend: str) -> pd.DataFrame:
    rows = result.table[result.table["backend"] == backend]
    assert not rows.empty, f"no rows for {backend}"
    return rows


@pytest.mark.dist
def test_csv_has_the_columns_and_every_collective(result: CommResult) -> None:
    on_disk = pd.read_csv(result.csv_path, keep_default_na=False)
    assert tuple(on_disk.columns) == CSV_COLUMNS
    assert len(on_disk) == len(result.table)
    for _, rows in result.table.groupby("backend"):
        assert set(rows["collective"]) == set(COLLECTIVES)
        sizes = sorted(rows["size_bytes"].unique())
        assert sizes[0] == 4096 and sizes[-1] <= MAX_BYTES
        assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))  # doubling, as nccl-tests -f 2
    assert set(result.table["ranks"]) == {2} and set(result.table["link_level"]) == {"intra"}
    sweep_rows = result.table[result.table["in_flight"] == 1]
    assert (sweep_rows["repeats"] == 3).all() and (result.table["time_spread"] >= 0).all()
    assert (result.table["time_s"] > 0).all() and (result.table["iters"] >= 1).all()


@pytest.mark.dist
def test_reductions_are_exact(result: CommResult) -> None:
    assert result.all_correct
    assert (result.table["max_abs_error"] == 0.0).all()


@pytest.mark.dist
def test_busbw_follows_nccl_tests_definitions(result: CommResult) -> None:
    table = result.table
    algbw = table["size_bytes"] / table["time_s"] / 1e9
    np.testing.assert_allclose(table["algbw_gbps"], algbw, rtol=1e-12)
    factors = [bus_factor(c, n) for c, n in zip(table["collective"], table["ranks"], strict=True)]
    np.testing.assert_allclose(table["busbw_gbps"], table["algbw_gbps"] * factors, rtol=1e-12)
    # with 2 ranks: all-reduce busbw = algbw; reduce-scatter and all-gather busbw = algbw / 2
    ar = table[table["collective"] == "all_reduce"]
    np.testing.assert_allclose(ar["busbw_gbps"], ar["algbw_gbps"], rtol=1e-12)
    other = table[table["collective"] != "all_reduce"]
    np.testing.assert_allclose(other["busbw_gbps"], other["algbw_gbps"] / 2, rtol=1e-12)


def _assert_positive_fits(result: CommResult, backend: str) -> None:
    fits = [f for f in result.fits if f.backend == backend]
    assert sorted(f.collective for f in fits) == sorted(COLLECTIVES)
    for fit in fits:
        assert np.isfinite(fit.alpha_s) and fit.alpha_s > 0, fit
        assert np.isfinite(fit.beta_s_per_byte) and fit.beta_s_per_byte > 0, fit
        assert fit.bandwidth_gbps > 0 and fit.latency_us > 0
        assert fit.n_points >= 2 and fit.link_level == "intra"


@pytest.mark.dist
def test_gloo_fit_is_positive_and_reduce_scatter_is_flagged_emulated(result: CommResult) -> None:
    rows = _backend_rows(result, "torch")
    assert set(rows["library"]) == {"gloo"}
    _assert_positive_fits(result, "torch")
    reduce_scatter = rows[rows["collective"] == "reduce_scatter"]
    assert reduce_scatter["emulated"].all() and reduce_scatter["note"].str.contains("emulated").all()
    assert not rows[rows["collective"] != "reduce_scatter"]["emulated"].any()


@pytest.mark.dist
@pytest.mark.skipif(not HAVE_MPIRUN, reason=NO_MPIRUN)
def test_mpi_fit_is_positive_and_native(result: CommResult) -> None:
    rows = _backend_rows(result, "mpi")
    assert rows["library"].str.contains("MPI").all()
    assert not rows["emulated"].any()
    _assert_positive_fits(result, "mpi")


@pytest.mark.dist
def test_burst_of_all_gathers_is_measured_and_kept_out_of_the_line_fit(result: CommResult) -> None:
    for backend, rows in result.table.groupby("backend"):
        burst = rows[rows["in_flight"] > 1]
        assert len(burst) == 1 and burst["collective"].tolist() == ["all_gather"], backend
        assert burst["size_bytes"].iloc[0] == rows["size_bytes"].min() and burst["correct"].all()
        assert (rows.loc[rows["in_flight"] == 1, "iters"] >= 1).all()
        fits = {f.collective: f for f in result.fits if f.backend == backend}
        gather = fits["all_gather"]
        assert gather.burst_in_flight == 32 and gather.burst_alpha_s is not None and gather.burst_alpha_s >= 0
        blocking = rows[(rows["in_flight"] == 1) & (rows["collective"] == "all_gather")]
        assert gather.n_points == len(blocking) - gather.noisy_points_dropped  # the burst is not a line point
        assert fits["all_reduce"].burst_alpha_s is None


@pytest.mark.dist
def test_fit_json_matches_and_logs_are_kept(result: CommResult) -> None:
    assert load_fits(result.fit_path) == result.fits
    for log in result.log_paths.values():
        assert "[comm]" in log.read_text()


# --------------------------------------------------------------------------------------------------
# In-process tests: no launcher


class LocalComm:
    """A 2-rank communicator played by one process: rank `rank`'s view, the other rank simulated."""

    backend = "fake"
    library = "fake"
    size = 2
    device = torch.device("cpu")
    in_place_all_reduce = False

    def __init__(self, rank: int = 0, wrong: bool = False, seconds_per_byte: float = 0.0) -> None:
        self.rank, self.wrong, self.seconds_per_byte = rank, wrong, seconds_per_byte

    def run(self, collective: str, buffers: Buffers) -> None:
        count = buffers.send.numel() * (self.size if collective == "all_gather" else 1)
        everyone = [input_pattern(count, r, self.device) for r in range(self.size)]
        chunk = count // self.size
        if collective == "all_gather":
            result = torch.cat([everyone[r][r * chunk : (r + 1) * chunk] for r in range(self.size)])
        else:
            result = sum(everyone)
            if collective == "reduce_scatter":
                result = result[self.rank * chunk : (self.rank + 1) * chunk]
        if self.wrong:
            result = result.clone()
            result[-1] += 1  # one element off is enough to fail
        buffers.recv.copy_(result)
        time.sleep(self.seconds_per_byte * count * 4)

    def all_gather_burst(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        for send, recv in zip(sends, recvs, strict=True):
            self.run("all_gather", Buffers(send, recv, recv))

    def barrier(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def max_over_ranks(self, value: float) -> float:
        return value

    def emulation_note(self, collective: str) -> str:
        return ""


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("rank", [0, 1])
def test_check_accepts_exact_results_and_catches_wrong_ones(collective: str, rank: int) -> None:
    buffers = make_buffers(collective, 1024, rank, 2, torch.device("cpu"))
    assert _check_once(LocalComm(rank), collective, buffers) == 0.0
    assert _check_once(LocalComm(rank, wrong=True), collective, buffers) == 1.0


def test_budget_stops_growing_sizes() -> None:
    settings = SweepSettings(min_bytes=4096, max_bytes=256 * 2**20, budget_s=0.4, collectives=("all_gather",))
    start = time.perf_counter()
    points = sweep(LocalComm(seconds_per_byte=2e-9), settings, settings.budget_s, log=lambda _: None)
    assert 4096 <= max(p["size_bytes"] for p in points) < 256 * 2**20
    assert [p["in_flight"] for p in points if "in_flight" in p] == [32]  # the burst, last
    assert time.perf_counter() - start < 3 * settings.budget_s


def test_topology_levels() -> None:
    one_node = Topology.from_hostnames(["a", "a"])
    assert one_node.levels() == ["intra"] and one_node.leaders == (0,)
    two_nodes = Topology.from_hostnames(["a", "b", "a", "b"])
    assert two_nodes.nodes == ((0, 2), (1, 3)) and two_nodes.leaders == (0, 1)
    assert two_nodes.levels() == ["intra", "inter"]
    assert Topology.from_hostnames(["a", "b"]).levels() == ["inter"]


@pytest.mark.dist
def test_no_flags_measure_what_is_installed_and_name_what_was_skipped(result: CommResult) -> None:
    measured = set(result.table["backend"])
    assert "torch" in measured and measured.isdisjoint(result.skipped)
    assert measured | set(result.skipped) == {"torch", "mpi"}
    if "mpi" in result.skipped:
        assert "mpirun" in result.skipped["mpi"] or "mpi4py" in result.skipped["mpi"]


def test_without_mpirun_the_default_is_torch_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = comm_module.shutil.which
    monkeypatch.setattr(
        comm_module.shutil, "which", lambda name: None if name == "mpirun" else real_which(name)
    )
    chosen, skipped = comm_module.available_backends()
    assert chosen == ("torch",) and "--backend mpi needs `mpirun`" in skipped["mpi"]


def test_missing_mpirun_is_a_clear_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm_module.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="--backend mpi needs `mpirun`"):
        run_comm(tmp_path, backends=["mpi"], max_bytes=8192, budget_s=1.0)
    assert not (tmp_path / "comm.csv").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ranks": 1}, "--ranks 1"),
        ({"min_bytes": 4}, "--min-bytes 4"),
        ({"min_bytes": 8192, "max_bytes": 4096}, "--max-bytes 4096"),
        ({"budget_s": 0.0}, "--budget-s 0.0"),
        ({"backends": ["nccl"]}, "--backend nccl"),
        ({"hostfile": Path("/nonexistent/hosts")}, "--hostfile /nonexistent/hosts: no such file"),
    ],
)
def test_bad_input_names_the_flag(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_comm(tmp_path, **kwargs)


def test_malformed_hostfile_names_the_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\nnode1 slots=2\nnode2 gpus=2\n")
    with pytest.raises(UserError, match=r"hosts:3: expected `node2 slots=N`"):
        run_comm(tmp_path, hostfile=hostfile)


def test_parse_bytes() -> None:
    assert parse_bytes("4096", "--min-bytes") == 4096
    assert parse_bytes("4KiB", "--min-bytes") == 4096
    assert parse_bytes("256M", "--max-bytes") == 256 * 2**20
    assert parse_bytes("1gib", "--max-bytes") == 2**30
    with pytest.raises(UserError, match="--max-bytes '12 parsecs'"):
        parse_bytes("12 parsecs", "--max-bytes")


def test_command_parses_options_and_delegates(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer
    from typer.testing import CliRunner

    seen: dict = {}

    def fake_run_comm(**kwargs: object) -> None:
        seen.update(kwargs)
        raise UserError("stop here")

    import advisor.commands.comm as comm_command_module  # the command calls run_comm by its own name

    monkeypatch.setattr(comm_command_module, "run_comm", fake_run_comm)
    app = typer.Typer()
    app.command()(comm_command)
    args = ["--ranks", "4", "--backend", "mpi", "--min-bytes", "8KiB", "--max-bytes", "1M", "--budget-s", "5"]
    outcome = CliRunner().invoke(app, args)
    assert isinstance(outcome.exception, UserError)
    assert seen["num_ranks"] == 4 and seen["backends"] == ["mpi"]
    assert seen["min_bytes"] == 8192 and seen["max_bytes"] == 2**20 and seen["budget_s"] == 5.0
    CliRunner().invoke(app, [])
    assert seen["backends"] is None  # no flags: what is installed, not a demand for every backend


def test_a_hung_launch_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    with pytest.raises(comm_module.CommRunError, match="did not finish"):
        comm_module.launch(command, tmp_path / "hung.log", timeout_s=1.0)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not _running(child):
            return  # the grandchild went with the session
        time.sleep(0.1)
    pytest.fail(f"child {child} of the hung launcher is still running")


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's PID 1 may never reap the orphan)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
