"""compile=True (DeepSpeed's engine.compile()): the compiled trainer computes what the eager one does, a
resumed compiled run repeats the straight one, bad input is refused before the engine; the GPU script
is ready to run and skips cleanly here."""
import pytest

from helpers.data import SyntheticTextDataset
from helpers.trainer import AdvancedDeepSpeedTrainer
from tests.rank_programs import resume


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


def trainer(data, tmp_path, **kw):
    return AdvancedDeepSpeedTrainer(data, model_size="tiny", micro_batch=8, warmup_steps=2, total_steps=40,
                                    output_dir=tmp_path, **kw)


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


def test_the_gpu_script_skips_cleanly_without_a_gpu(capsys):
    from benchmarks.gpu import main
    assert main([]) is None
    assert "no CUDA GPU" in capsys.readouterr().out


def test_the_gpu_scripts_commands_are_ones_their_programs_accept(tmp_path):
    """Each part's flags parse in the program it runs (the benchmark's with the device this box has)."""
    from benchmarks import trainer_vs_plain
    from benchmarks.gpu import parts
    from helpers import REPO_ROOT
    from helpers.programs import train
    from helpers.run_notebooks import NOTEBOOKS
    for part in parts(tmp_path):
        name, (module, *args) = part["name"], part["command"]
        if module == "helpers.programs.train":
            assert (REPO_ROOT / train.parse(args).config).is_file(), name
        elif module == "benchmarks.trainer_vs_plain":
            a = trainer_vs_plain.parse([x if x != "cuda" else "cpu" for x in args])
            assert a.compiled_stages and "plain-compiled" in trainer_vs_plain.contender_names(a), name
        else:
            assert module == "helpers.run_notebooks" and list(NOTEBOOKS.glob(args[1] + "*.ipynb")), name


def test_the_gpu_summary_reads_what_the_parts_write(tmp_path):
    """The summary's readers on a real training run's rank0.json and on a stored benchmark result."""
    from benchmarks.gpu import markdown, read_result
    from helpers import REPO_ROOT
    from helpers.programs import train
    train.main(["--config", "configs/zero0.json", "--seq-len", "16", "--n-samples", "64", "--eval-samples", "16",
                "--steps", "2", "--out", str(tmp_path / "run")])
    run = read_result(tmp_path / "run" / "rank0.json")
    assert run["skipped_steps"] == 0 and run["final_loss"] > 0 and run["tokens_per_s"] > 0
    bench = read_result(REPO_ROOT / "benchmarks" / "measured" / "trainer_vs_plain_compiled_cpu_2core.json")
    assert "ds0-compiled" in bench["compiled"] and bench["contenders"]["plain"]["vs_plain"] == 1.0
    parts = [{"name": "bf16", "status": "passed", "seconds": 1.0, "result": run},
             {"name": "benchmark", "status": "passed", "seconds": 2.0, "result": bench}]
    text = markdown({"gpu": "a GPU", "torch": "2.x", "seconds": 3.0, "parts": parts})
    assert "| bf16 | passed | 1 |" in text and "| ds0-compiled |" in text
