"""One memory unit (helpers/README.md, "Where a thing goes"): what the reader sees counts MB = 10^6 and
GB = 10^9 bytes. A binary unit or a conversion to one (MiB, GiB, / 2**20, / 1024) appears only where something
else defines the size in it: DeepSpeed's 1 MiB swap floor, glibc's malloc settings, the device tool's carry limit."""
import json
import re

from tests.repository import ROOT

BINARY = re.compile(r"\b[MG]iB\b|\b[mg]ib\b|_[mg]ib\b|\b[mg]ib_|2\s*\*\*\s*(20|30)\b|1024\s*\*\*\s*[23]\b|/\s*1024\b")
# A line naming a size someone else defines in binary may say it in that unit: DeepSpeed's swap floor
# (swap_tensor/utils.py: MIN_AIO_BYTES = 1024 ** 2), glibc's malloc settings (mallopt's M_TRIM_THRESHOLD, M_TOP_PAD).
FLOOR = re.compile(r"1 MiB|MIN_AIO_BYTES|M_TRIM_THRESHOLD|M_TOP_PAD")
# Files whose sizes someone else defines in binary units, and who.
DEFINED_ELSEWHERE = {"benchmarks/gpu_wheels.py": "the device tool's carry limit, 64 MiB"}


def sources() -> dict[str, str]:
    """Every shipped .py file's text, and each notebook's cell sources (outputs left out: they are the run's)."""
    found = {str(p.relative_to(ROOT)): p.read_text() for d in ("helpers", "benchmarks")
             for p in (ROOT / d).rglob("*.py")}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        found[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    return found


def binary_units(text: str) -> list[str]:
    """The lines of `text` that count bytes in a binary unit, those naming a size defined elsewhere (FLOOR) left out."""
    return [line.strip() for line in text.splitlines() if BINARY.search(line) and not FLOOR.search(line)]


def test_the_reader_sees_memory_in_decimal_units():
    found = {path: lines for path, text in sources().items()
             if path not in DEFINED_ELSEWHERE and (lines := binary_units(text))}
    assert not found, f"binary units (use MB = 1e6, GB = 1e9 bytes; helpers/README.md): {found}"


def test_the_unit_check_finds_each_binary_form():
    for line in ('print(f"{x / 2**20:.1f}")', 'label="peak MiB"', '"memory_mib": m', "x / 1024", "m = 1024 ** 3",
                 "GiB = 2 ** 30", "mib = lambda op: 0"):
        assert binary_units(line) == [line], line
    for line in ('print(f"{x / 1e6:.1f} MB")', "n_samples=1024", "seq_len=1024, micro_batch=8",
                 "swaps from 1 MiB on", "x >= MIN_AIO_BYTES", "(M_TOP_PAD, 2**28)"):
        assert binary_units(line) == [], line
