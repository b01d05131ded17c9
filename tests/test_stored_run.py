"""What the notebooks' openings and notebooks/README.md say about the stored run is what its outputs say
(benchmarks/stored_run.py): a notebook re-stored on another machine, or faster, fails here until
`python -m benchmarks.stored_run --write` is run."""
import nbformat

from benchmarks import stored_run
from benchmarks.colab_time import PAGE


def test_every_opening_states_its_stored_time_and_t4_estimate():
    for path, line in zip(stored_run.NOTEBOOKS, stored_run.opening_lines().values()):
        opening = nbformat.read(path, as_version=4).cells[0].source
        assert stored_run.TIME_LINE.findall(opening) == [line], path.name


def test_the_notebooks_page_holds_the_generated_table_and_provenance():
    page = PAGE.read_text()
    assert stored_run.table() in page
    assert stored_run.PROVENANCE_HEADING + stored_run.provenance() + "\n\n" in page


def test_the_facts_come_from_the_outputs():
    """Notebook 03 prints its machine and precision; 02 trains in fp32 anywhere and prints neither."""
    three, two = (stored_run.facts(p) for p in stored_run.NOTEBOOKS[2:0:-1])
    assert three["machine"] and three["precision"] in ("fp32", "bf16") and three["seconds"] > 0
    assert two["machine"] is None and two["precision"] is None
    precision, peak = stored_run.stored_cpu_peak()
    assert precision == three["precision"] and peak > 0
