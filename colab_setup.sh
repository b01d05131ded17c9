#!/usr/bin/env bash
# Google Colab set-up: install only what Colab lacks, once (re-running installs nothing new).
# Colab's own torch (a CUDA build), transformers and ipywidgets are never replaced: every install
# below is constrained to the versions already present.
set -euo pipefail
PY=${PYTHON:-python3}

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
has transformers || missing+=("transformers")
has datasets || missing+=("datasets")
has tensorboard || missing+=("tensorboard")
has tokenizers || missing+=("tokenizers")
has ipywidgets || missing+=("ipywidgets>=7.7,<9")
has tqdm || missing+=("tqdm")
has accelerate || missing+=("accelerate")   # HF Trainer(deepspeed=...)

if ((${#missing[@]})); then
    echo "colab_setup: installing ${missing[*]}"
    "$PY" -m pip install -q -c "$constraints" "${missing[@]}"
else
    echo "colab_setup: nothing to install"
fi
"$PY" -c "import torch, deepspeed; print(f'colab_setup: torch {torch.__version__} (kept), deepspeed {deepspeed.__version__}')"
