"""compile=True (DeepSpeed's engine.compile()): the compiled trainer computes what the eager one does, a
resumed compiled run repeats the straight one, bad input is refused before the engine; the GPU script
is ready to run and skips cleanly here."""
import pytest

from helpers.data import SyntheticTextDataset
from tests.trainers import make_trainer
from tests.rank_programs import resume


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


def trainer(data, tmp_path, **kw):
    return make_trainer(data, micro_batch=8, warmup_steps=2, total_steps=40, output_dir=tmp_path, **kw)


def test_compile_must_be_a_bool(data, tmp_path):
    with pytest.raises(ValueError, match="compile='yes'"):
        trainer(data, tmp_path, compile="yes")


@pytest.mark.parametrize("stage", [0, 3])   # ZeRO 3: the model compiled in pieces between DeepSpeed's gather hooks
def test_compiled_losses_follow_the_eager_ones(data, tmp_path, stage):
    """inductor fuses the elementwise ops (other rounding), so equal within float tolerance, not bitwise."""
    eager = trainer(data, tmp_path / "eager", zero_stage=stage).train(4, progress=False)
    compiled = trainer(data, tmp_path / "compiled", zero_stage=stage, compile=True)
    steps = compiled.train(4, progress=False)
    for e, c in zip(eager, steps):
        assert c["loss"] == pytest.approx(e["loss"], rel=2e-3), (e, c)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-2), (e, c)
    assert compiled.engine.is_compiled
    assert isinstance(compiled.evaluate(data, max_batches=2), float)   # eval runs eagerly beside the compiled graph


@pytest.mark.precision
def test_a_resumed_compiled_run_repeats_the_straight_one(tmp_path):
    rows = resume.compare(resume.run(1, stages=(0, 2), steps=4, out_dir=tmp_path, grad_accum=1, compile=True))
    assert [row["stage"] for row in rows] == [0, 2]
    for row in rows:
        assert row["steps compared"] == 2 and row["same steps"] and row["same lr"] and row["same data"], row
        assert row["max |loss difference|"] == 0.0, row
