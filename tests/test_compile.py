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


def test_compiled_losses_follow_the_eager_ones_at_zero_3(data, tmp_path):
    """inductor fuses the elementwise ops (other rounding), so equal within float tolerance, not bitwise.
    ZeRO 3: the model compiled in pieces between DeepSpeed's gather hooks. ZeRO 0 is notebook 03's section 7,
    which compares compiled and eager losses in both precisions (nbval runs it twice)."""
    eager = trainer(data, tmp_path / "eager", zero_stage=3).train(4, progress=False)
    compiled = trainer(data, tmp_path / "compiled", zero_stage=3, compile=True)
    steps = compiled.train(4, progress=False)
    for e, c in zip(eager, steps):
        assert c["loss"] == pytest.approx(e["loss"], rel=2e-3), (e, c)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-2), (e, c)
    assert compiled.engine.is_compiled
    assert isinstance(compiled.evaluate(data, max_batches=2), float)   # eval runs eagerly beside the compiled graph


def test_a_resumed_compiled_run_repeats_the_straight_one(tmp_path):
    """At ZeRO 2 (a partitioned optimizer state to restore); tests/test_resume.py resumes every stage eagerly, in
    both precisions (`make test-other-precision`), and notebook 03 compiles in both: so this runs in the rule's
    precision only (in the other one it cost CI 28 s and added no case).
    What compiling adds does not depend on the stage: DeepSpeed compiles the module in place (nn.Module.compile,
    its state-dict names unchanged), and the resumed process compiles it again before its first step."""
    rows = resume.compare(resume.run(1, stages=(2,), steps=4, out_dir=tmp_path, grad_accum=1, compile=True))
    assert [row["stage"] for row in rows] == [2]
    for row in rows:
        assert row["steps compared"] == 2 and row["same steps"] and row["same lr"] and row["same data"], row
        assert row["max |loss difference|"] == 0.0, row
