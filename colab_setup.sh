#!/usr/bin/env bash
# Google Colab set-up: install what Colab lacks, and replace what it has below the tutorial's floors (the oldest
# versions helpers/preflight.py accepts, tested by .ci/floors) with the versions requirements.txt pins. Colab's
# own torch (a CUDA build) is never replaced: every install runs under a constraints file that pins it (and
# numpy, which Colab's other packages are built against) to the version present. Re-running installs nothing new.
#
#   bash colab_setup.sh [NN] [--imported MODULE,MODULE,...]
#
# NN, the notebook about to run (e.g. 05): only what that notebook needs. Each notebook opened from its Colab badge
# gets a fresh runtime, so this runs once per notebook. DeepSpeedCPUAdam is built ahead (a C++ build, a minute or
# more on Colab's 2 vCPUs) only for the notebooks that step it (01, 05, 08, 10), libaio-dev (for async_io, ZeRO-
# Infinity's NVMe offload) installed only for 08. Without NN: everything, for every notebook.
# --imported: the top-level modules the calling kernel has imported already. Where pip replaced the package of
# one of them, the kernel keeps the old version until it restarts: the set-up says so and exits 3.
#
# Each step prints its duration. pip runs quietly: its full output is shown only when it fails. Only a missing or
# too old package fails the set-up (exit 1): a CUDA toolkit that DeepSpeed could not JIT-build with is a warning
# (the notebooks build no CUDA op).
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

notebook="" imported="" imported_given=0
while [ $# -gt 0 ]; do
    case $1 in
        --imported) [ $# -ge 2 ] || { say "--imported needs a list of modules" >&2; exit 2; }
                    imported=$2; imported_given=1; shift 2 ;;
        --imported=*) imported=${1#--imported=}; imported_given=1; shift ;;
        [0-9] | [0-9][0-9]) notebook=$(printf '%02d' "$((10#$1))"); shift ;;
        *) say "usage: bash colab_setup.sh [NN] [--imported MODULE,MODULE,...] (NN: a notebook's number, e.g. 05)" >&2
           exit 2 ;;
    esac
done
if [ -n "$notebook" ] && ! compgen -G "notebooks/${notebook}_*.ipynb" >/dev/null; then
    say "there is no notebook $notebook in notebooks/" >&2
    exit 2
fi
# What the notebook at hand needs beyond the packages: 01 checks DeepSpeedCPUAdam, 05, 08 and 10 step it
# (ZeRO-Offload); only 08 offloads to NVMe.
case ${notebook:-all} in
    all) cpu_adam=1 libaio=1; say "set-up for every notebook (pass a notebook's number, e.g. 05, for less)" ;;
    01 | 05 | 10) cpu_adam=1 libaio=0; say "set-up for notebook $notebook" ;;
    08) cpu_adam=1 libaio=1; say "set-up for notebook $notebook" ;;
    *) cpu_adam=0 libaio=0; say "set-up for notebook $notebook" ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# One line per package to install: "name==pinned<TAB>why". Also writes what pip must not touch (constraints) and
# every installed distribution's version (before.json), to tell afterwards what pip changed.
plan=$("$PY" - "$work" <<'PY'
import json, re, sys
from importlib.metadata import PackageNotFoundError, distributions, version
from helpers.preflight import DEEPSPEED, MINIMUM_VERSIONS, release

def have(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

versions = {}   # the first of a name on sys.path: the one Python imports
for dist in distributions():
    if dist.metadata["Name"]:
        versions.setdefault(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower(), dist.version)
with open(f"{sys.argv[1]}/before.json", "w") as before:
    json.dump(versions, before)
with open(f"{sys.argv[1]}/constraints.txt", "w") as constraints:   # what pip must not touch
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

# pip, quiet: its log is kept, and shown (its last 60 lines) only when it fails.
pip_install() {
    # shellcheck disable=SC2086  # one word per package
    "$PY" -m pip install -q --progress-bar off -c "$work/constraints.txt" $specs >"$work/pip.log" 2>&1 ||
        { local code=$?; tail -n 60 "$work/pip.log"; return "$code"; }
}
replaced_imported=""
if [ -n "$plan" ]; then
    while IFS=$'\t' read -r spec why; do say "$spec: $why"; done <<<"$plan"
    specs=$(cut -f1 <<<"$plan" | tr '\n' ' ')
    say "keeping $(tr '\n' ' ' <"$work/constraints.txt")(constraints: pip may not change them)"
    grep -q '^deepspeed' <<<"$plan" && say "DeepSpeed ships no wheel: pip builds one from its source (no C++: ops are built on first use)"
    timed "pip install $specs" pip_install
    # What pip changed (the packages asked for and their dependencies), what its resolver complained about, and
    # which module the kernel had imported before its package was replaced (--imported).
    replaced_imported=$("$PY" - "$work" "$imported_given" "$imported" <<'PY'
import json, re, sys
from importlib.metadata import distributions, packages_distributions

work, given, imported = sys.argv[1], sys.argv[2] == "1", set(filter(None, sys.argv[3].split(",")))
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
say = lambda text: print(f"colab_setup: {text}", file=sys.stderr)   # stdout is the modules to restart for
before = json.load(open(f"{work}/before.json"))
after = {}   # the first of a name on sys.path: the one Python imports
for dist in distributions():
    if dist.metadata["Name"]:
        after.setdefault(norm(dist.metadata["Name"]), dist.version)
replaced = {name: (before[name], now) for name, now in after.items() if name in before and before[name] != now}
added = sorted(name for name in after if name not in before)
if replaced:
    say("replaced: " + ", ".join(f"{name} {old} -> {new}" for name, (old, new) in sorted(replaced.items())))
if added:
    say("added: " + ", ".join(f"{name} {after[name]}" for name in added))

# pip's "ERROR: pip's dependency resolver does not currently take into account all the packages ..." block: one
# line per package of Colab's that asked for other versions than pip installed.
ours = {norm(n) for n in re.findall(r"^([A-Za-z0-9_.-]+)==", open("requirements.txt").read(), re.M)}
complaints = list(re.finditer(r"^(\S+) \S+ (?:requires|has requirement) .*$", open(f"{work}/pip.log").read(), re.M))
theirs = sorted({norm(c[1]) for c in complaints} - ours)
for complaint in complaints:
    if norm(complaint[1]) in ours:   # a package the tutorial uses: that one matters
        say(f"warning from pip: {complaint[0]}")
if theirs:
    say(f"pip's resolver listed conflicts for {len(theirs)} of Colab's own packages ({', '.join(theirs)}): they "
        "want other versions of what the tutorial installed, but the tutorial does not use them, so this is harmless "
        "here (import them in this runtime and they may break)")

modules = {module for module, dists in packages_distributions().items() if any(norm(d) in replaced for d in dists)}
if given:
    print(",".join(sorted(modules & imported)))
elif replaced:
    say("a Python kernel that had imported one of the replaced packages keeps its old version until it restarts "
        "(Colab: Runtime > Restart session)")
PY
) || say "could not tell what pip changed (the install itself succeeded)"
else
    say "nothing to install: every package is present and new enough"
fi
timed "import torch, deepspeed" "$PY" -c "import torch, deepspeed; print(f'colab_setup: torch {torch.__version__} (kept: never replaced), deepspeed {deepspeed.__version__}')"
# libaio: DeepSpeed's async_io op builds against it (ZeRO-Infinity's NVMe offload, notebook 08). Colab runs as root.
if [ "$libaio" = 1 ] && [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    install_libaio() { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; }
    timed "apt-get install libaio-dev" install_libaio ||
        say "libaio-dev not installed: notebook 08's NVMe section will be skipped"
fi
# The packages' versions (fatal), DeepSpeedCPUAdam's build and one step (for the notebooks that step it; the first
# build takes a minute or two), on a GPU torch's fused AdamW, and whether DeepSpeed could JIT-build a CUDA op (nvcc
# against torch's CUDA, TORCH_CUDA_ARCH_LIST: a warning where not).
status=0
if [ "$cpu_adam" = 1 ]; then
    timed "preflight (python -m helpers.preflight)" "$PY" -m helpers.preflight || status=$?
else
    timed "preflight (python -m helpers.preflight --no-cpu-adam)" "$PY" -m helpers.preflight --no-cpu-adam || status=$?
fi
if [ "$status" != 0 ]; then
    say "[$((SECONDS - started)) s in all] a package check above failed (NO): its line says what to install" >&2
    exit 1
fi
if [ -n "$replaced_imported" ]; then
    say "[$((SECONDS - started)) s in all] installed; RESTART NEEDED: this kernel had imported ${replaced_imported//,/, } before" \
        "pip replaced it, and keeps the old version until it restarts: Runtime > Restart session, then run the cells from the top"
    exit 3
fi
say "[$((SECONDS - started)) s in all] ready"
