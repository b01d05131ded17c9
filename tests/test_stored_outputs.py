"""What a reader sees on GitHub: the outputs stored in every notebook hold no path of the machine that
ran it, nothing on stderr (warnings, compiler noise), no progress bar stuck before its end, no log
lines with timestamps and no object reprs where a widget or an HTML display stood."""
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|home|root|usr|opt|var|content|mnt)/|site-packages|\.venv/")
BAR = re.compile(r"(\d{1,3})%\|")
TIMESTAMPED_LOG = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\]")
COMPILER = re.compile(r"collect2|cannot find -l|built successfully|Loading extension module")
OBJECT_REPR = re.compile(r"<IPython\.core\.display\.\w+ object>|\w+\(children=\(")


def stored_texts(path: Path):
    """(cell index, "stdout" | "stderr" | "data" | "error", text) for every stored output; a cell's
    stream messages joined per stream, as Jupyter shows them (one redraw of a bar per message)."""
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        streams = {}
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                streams[output.name] = streams.get(output.name, "") + output.text
            elif output.output_type in ("execute_result", "display_data"):
                yield index, "data", str(output.data.get("text/plain", ""))
            elif output.output_type == "error":
                yield index, "error", f"{output.ename}: {output.evalue}"
        for name, text in streams.items():
            yield index, name, text


def last_frames(text: str) -> list[str]:
    """What a terminal or Jupyter shows of each line: the part after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def problems(kind: str, text: str) -> list[str]:
    found = []
    if kind in ("stderr", "error"):
        found.append(f"{kind}: {text[:120]!r}")
    if MACHINE_PATH.search(text):
        found.append(f"machine path: {MACHINE_PATH.search(text).group(0)!r} in {text[:120]!r}")
    for pattern, what in ((TIMESTAMPED_LOG, "timestamped log line"), (COMPILER, "compiler noise"),
                          (OBJECT_REPR, "object repr")):
        if pattern.search(text):
            found.append(f"{what}: {text[:120]!r}")
    # A stream's bar is fine once its last frame reached 100%; a display's text is a first frame.
    frames = last_frames(text) if kind == "stdout" else [text]
    for frame in frames:
        stuck = [int(p) for p in BAR.findall(frame) if int(p) < 100]
        if stuck:
            found.append(f"progress bar stuck at {stuck[0]}%: {frame[:120]!r}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_are_clean(path):
    found = [f"cell {index}: {p}" for index, kind, text in stored_texts(path) for p in problems(kind, text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kind, text, expected", [
    ("stdout", "saved to /tmp/pytest-of-root/x.pt", "machine path"),
    ("stdout", "from /work/main/.venv/lib/python3.11", "machine path"),
    ("stderr", "UserWarning: something", "stderr"),
    ("stdout", "[2026-12-01 02:54:09,329] [WARNING] [real_accelerator.py:213:get_accelerator] Setting", "timestamped"),
    ("stdout", "/usr/bin/ld: cannot find -laio: No such file or directory\ncollect2: error", "compiler noise"),
    ("data", "run (ZeRO 0):   0%|          | 0/150 [00:00<?, ?it/s]", "stuck at 0%"),
    ("stdout", "run:  10%|#         | 15/150\rrun:  40%|####      | 60/150", "stuck at 40%"),
    ("data", "<IPython.core.display.HTML object>", "object repr"),
    ("data", "Explorer(children=(HBox(children=(VBox(", "object repr"),
])
def test_each_kind_of_noise_is_caught(kind, text, expected):
    assert any(expected in p for p in problems(kind, text)), problems(kind, text)


@pytest.mark.parametrize("kind, text", [
    ("stdout", "run:  50%|#####     | 75/150\rrun: 100%|##########| 150/150 [00:03<00:00]"),
    ("stdout", "exported step300 to <run dir>/hf_model"),
    ("data", "<Figure size 800x420 with 2 Axes>"),
    ("stdout", "largest difference 2.21e-02 (bf16: tolerance 0.0625) at 1/2 of the steps"),
])
def test_clean_outputs_pass(kind, text):
    assert problems(kind, text) == []


CPU_NAME = re.compile(r"[A-Z][\w() -]*? \(\d+ cores\)")   # helpers.runtime's device name on a CPU


def test_every_stored_notebook_ran_on_one_machine():
    """The stored outputs are one `python -m helpers.run_notebooks --in-place` on one machine: their numbers
    compare across notebooks only then."""
    names = {path.stem: {m.group(0) for _, _, text in stored_texts(path) for m in CPU_NAME.finditer(text)}
             for path in NOTEBOOKS}
    assert names["01_setup"], "notebook 01 stores no machine name"
    assert len(set().union(*names.values())) == 1, names
