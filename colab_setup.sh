#!/usr/bin/env bash
# Google Colab set-up: install what Colab lacks, and replace what it has below the tutorial's floors (the oldest
# versions helpers/preflight.py accepts, tested by .ci/floors) with the versions requirements.txt pins. Colab's
# own torch (a CUDA build) is never replaced: every install runs under a constraints file that pins it (and
# numpy, which Colab's other packages are built against) to the version present. Re-running installs nothing new.
# Each step prints its duration; pip's own output shows as it goes. Only a missing or too old package fails the
# set-up (exit 1): a CUDA toolkit that DeepSpeed could not JIT-build with is a warning (the notebooks build no CUDA op).
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")"   # the repository root: requirements.txt and helpers.preflight are read from here
started=$SECONDS

say() { echo "colab_setup: $*"; }
# `timed LABEL COMMAND...`: run it, then say how long it took.
timed() {
    local label=$1 t=$SECONDS
    shift
    say "$label ..."
    "$@" || { local code=$?; say "[$((SECONDS - t)) s] $label: failed (exit $code)"; return "$code"; }
    say "[$((SECONDS - t)) s] $label"
}

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# One line per package to install: "name==pinned<TAB>why".
plan=$("$PY" - "$constraints" <<'PY'
import re, sys
from importlib.metadata import PackageNotFoundError, version
from helpers.preflight import DEEPSPEED, MINIMUM_VERSIONS, release

def have(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

with open(sys.argv[1], "w") as constraints:   # what pip must not touch
    for name in ("torch", "numpy"):
        if have(name):
            print(f"{name}=={have(name)}", file=constraints)
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", open("requirements.txt").read(), re.M))
why = {}
for name, least in MINIMUM_VERSIONS.items():
    if name == "torch":   # Colab's own: the preflight says so if it is too old
        continue
    now = have(name)
    if now is None:
        why[name] = "missing"
    elif release(now) < release(least):
        why[name] = f"replaces Colab's {now}: the tutorial needs {name} >= {least}"
# A new transformers pulls a new huggingface_hub (and tokenizers), which Colab's datasets, accelerate and peft were
# never tested with: they move with it, to requirements.txt's versions, the combination CI tests.
if "transformers" in why:
    for name in ("datasets", "accelerate", "peft"):
        if name not in why and have(name) != pins[name]:
            why[name] = f"replaces Colab's {have(name)}: moves with transformers to requirements.txt's versions, tested together"
for name, reason in why.items():
    print(f"{name}=={pins[name]}\t{reason}")
if have("deepspeed") != DEEPSPEED:
    print(f"deepspeed=={DEEPSPEED}\t" + (f"replaces {have('deepspeed')}: the notebooks were checked against {DEEPSPEED}"
                                         if have("deepspeed") else "missing"))
for name in ("tensorboard", "tqdm"):   # any version
    if have(name) is None:
        print(f"{name}\tmissing")
PY
)

if [ -n "$plan" ]; then
    while IFS=$'\t' read -r spec why; do say "$spec: $why"; done <<<"$plan"
    specs=$(cut -f1 <<<"$plan" | tr '\n' ' ')
    say "keeping $(tr '\n' ' ' <"$constraints")(constraints: pip may not change them)"
    # shellcheck disable=SC2086  # one word per package
    timed "pip install $specs" "$PY" -m pip install --progress-bar off -c "$constraints" $specs
else
    say "nothing to install: every package is present and new enough"
fi
"$PY" -c "import torch, deepspeed; print(f'colab_setup: torch {torch.__version__} (kept: never replaced), deepspeed {deepspeed.__version__}')"
# libaio: DeepSpeed's async_io op builds against it (ZeRO-Infinity's NVMe offload, notebook 08). Colab runs as root.
if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    install_libaio() { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; }
    timed "apt-get install libaio-dev" install_libaio ||
        say "libaio-dev not installed: notebook 08's NVMe section will be skipped"
fi
# The packages' versions (fatal), DeepSpeedCPUAdam's build and one step (notebook 05; the first build takes a
# minute or two), on a GPU torch's fused AdamW, and whether DeepSpeed could JIT-build a CUDA op (nvcc against
# torch's CUDA, TORCH_CUDA_ARCH_LIST: a warning where not).
status=0
timed "preflight (python -m helpers.preflight)" "$PY" -m helpers.preflight || status=$?
if [ "$status" != 0 ]; then
    say "[$((SECONDS - started)) s in all] a package check above failed (NO): its line says what to install" >&2
    exit 1
fi
say "[$((SECONDS - started)) s in all] ready"
