#!/usr/bin/env bash
# Google Colab set-up: install only what Colab lacks, once (re-running installs nothing new).
# Colab's own torch (a CUDA build), transformers and ipywidgets are never replaced: every install
# below is constrained to the versions already present.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")"   # the repository root: helpers.preflight runs from here at the end

has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# Pin what is installed so pip cannot swap it out while resolving DeepSpeed's dependencies.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'PY'
from importlib.metadata import version, PackageNotFoundError
for name in ("torch", "transformers", "ipywidgets", "tokenizers", "numpy"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
PY

missing=()
has deepspeed || missing+=("deepspeed==0.19.8")
has transformers || missing+=("transformers>=4.56")
has datasets || missing+=("datasets>=3.0")
has tensorboard || missing+=("tensorboard")
has tokenizers || missing+=("tokenizers")
has ipywidgets || missing+=("ipywidgets>=7.7,<9")
has tqdm || missing+=("tqdm")
has accelerate || missing+=("accelerate>=1.1")   # HF Trainer(deepspeed=...)

if ((${#missing[@]})); then
    echo "colab_setup: installing ${missing[*]}"
    "$PY" -m pip install -q -c "$constraints" "${missing[@]}"
else
    echo "colab_setup: nothing to install"
fi
"$PY" -c "import torch, deepspeed; print(f'colab_setup: torch {torch.__version__} (kept), deepspeed {deepspeed.__version__}')"
# libaio: DeepSpeed's async_io op builds against it (ZeRO-Infinity's NVMe offload, notebook 08). Colab runs as root.
if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; } ||
        echo "colab_setup: libaio-dev not installed: notebook 08's NVMe section will be skipped"
fi
# Versions of what Colab keeps, nvcc against torch's CUDA, and on a GPU one real FusedAdam build and step
# (DeepSpeed's JIT build does not check nvcc's version itself: a mismatch would fail later, unclearly).
if ! "$PY" -m helpers.preflight; then
    echo "colab_setup: a check above failed (NO): its line says what to install or change" >&2
    exit 1
fi
