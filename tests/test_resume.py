"""Exact resume (issue 8): at ZeRO 0-3, with gradient accumulation and the LR schedule, on 1 and 2
ranks, a new process that loads the halfway checkpoint continues exactly as the straight run did:
bitwise-identical losses (on a CPU), the same learning rates, the same data."""
import pytest

from tests.rank_programs import resume

pytestmark = pytest.mark.precision   # follows the precision rule: run again with the other one forced


@pytest.mark.parametrize("n_ranks", [1, 2])
def test_resumed_run_continues_bitwise(n_ranks, tmp_path):
    rows = resume.compare(resume.run(n_ranks, stages=(0, 1, 2, 3), steps=6, out_dir=tmp_path, grad_accum=2))
    assert len(rows) == 4 * n_ranks
    for row in rows:
        assert row["world size"] == n_ranks and row["steps compared"] == 3 and row["same steps"], row
        assert row["max |loss difference|"] == 0.0 and row["same lr"] and row["same data"], row
