"""Old import paths of the training loop, which became `sdzero.trainer` (the Trainer) and
`sdzero.data_feed` (the data it draws from). Kept only for tests/unit/test_buckets.py, test_data.py and
test_families_unit.py, which import `Batches` and `run` from here; delete it once they import from the new
modules."""

from sdzero.data_feed import Batches, build_data
from sdzero.trainer import RunSummary, run

__all__ = ["Batches", "RunSummary", "build_data", "run"]
