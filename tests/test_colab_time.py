"""benchmarks/colab_time.py reads the cell timings the stored notebooks keep."""
from benchmarks import colab_time
from helpers.model import MODEL_SIZES, gpt2_param_count


def test_every_stored_notebook_has_its_cell_timings_and_the_estimate_is_a_range():
    rows = colab_time.estimate(cpu_peak_tflops=0.4)
    assert [r["notebook"] for r in rows] == ["01_setup", "02_dataset", "03_trainer", "04_zero_stages",
                                             "05_memory_tricks", "06_advanced_features", "07_tensor_sequence_parallel",
                                             "08_bigger_than_one_device", "09_past_the_notebook",
                                             "10_when_it_breaks"]
    for r in rows:
        assert r["here s"] > 0 and r["here s"] == r["rank programs s"] + r["in the kernel s"], r
        low, high = r["T4 estimate s"]
        assert r["rank programs s"] <= low <= high, r
    assert rows[3]["rank programs s"] > rows[3]["in the kernel s"]   # notebook 04 is its torchrun launches


def test_notebook_03s_model_grows_as_auto_model_size_picks_it_on_a_gpu():
    from helpers.hardware import runtime_for
    from helpers.model import auto_model_size
    assert auto_model_size(runtime_for("T4")) == colab_time.GPU_MODEL_GROWTH["03"][1]
    small, tiny = (gpt2_param_count(130, 64, *MODEL_SIZES[s][:2]) for s in ("small", "tiny"))
    assert colab_time.growth("03") == small / tiny and colab_time.growth("04") == 1.0


def test_the_notebooks_page_holds_the_table_with_a_row_per_stored_notebook():
    """notebooks/README.md shows what `python -m benchmarks.colab_time` prints. Its figures are not compared: they
    follow the timings stored in the notebooks and the CPU peak the page names; its columns and rows are."""
    header = colab_time.markdown([])
    page = colab_time.PAGE.read_text()
    assert header in page, f"{colab_time.PAGE}: no table headed as markdown() writes it"
    rows = page.split(header, 1)[1].strip().splitlines()
    notebooks = [line.split("|")[1].strip() for line in rows[:next((i for i, l in enumerate(rows) if not l.startswith("|")),
                                                                   len(rows))]]
    assert notebooks == [path.stem for path in sorted((colab_time.REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))]
