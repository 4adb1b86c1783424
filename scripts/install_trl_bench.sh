#!/usr/bin/env bash
# Install TRL (default 1.16.0) for bench/e2e_grpo.py into its own directory (default /work/trl-bench/site), leaving
# the project venv untouched: the bench puts that directory on PYTHONPATH of the TRL subprocess only, so TRL runs
# with the venv's own torch and transformers (the comparison needs the same ones on both sides).
#
# First `pip install --dry-run` against the venv lists what TRL needs; if any package the venv already has would
# change version (torch, transformers, ...), this refuses and says how to use a separate venv instead. Otherwise the
# missing packages (TRL 1.16 on this venv: trl, accelerate, datasets, multiprocess, xxhash) go in with --no-deps at
# exactly the versions pip resolved. Idempotent. About 15 MB, under a minute.
# Usage: scripts/install_trl_bench.sh [TARGET_DIR]     env: VENV (default .venv of this repo), TRL_VERSION
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="$VENV/bin/python"
TARGET="${1:-/work/trl-bench/site}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"
TORCH_VERSION="2.13.0"

if [[ ! -x "$PYTHON" ]]; then
    echo "expected a venv at $VENV (with bin/python); got none. Set VENV=... or create it (scripts/setup.sh)." >&2
    exit 2
fi
if PYTHONPATH="$TARGET" "$PYTHON" -c "import trl, sys; sys.exit(trl.__version__ != '$TRL_VERSION')" 2>/dev/null; then
    echo "trl $TRL_VERSION already importable from $TARGET"
    exit 0
fi

report="$(mktemp)"
trap 'rm -f "$report"' EXIT
# torch pinned on the same line: nothing may pull a different (CUDA) torch
"$PYTHON" -m pip install --quiet --dry-run --report "$report" "torch==$TORCH_VERSION" "trl==$TRL_VERSION"
plan="$("$PYTHON" - "$report" <<'EOF'
import importlib.metadata as metadata
import json
import sys

report = json.load(open(sys.argv[1]))
new, changed = [], []
for item in report.get("install", []):
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        new.append(f"{name}=={version}")
        continue
    if have != version:
        changed.append(f"{name} {have} -> {version}")
if changed:
    print("CHANGED " + "; ".join(changed))
else:
    print(" ".join(new))
EOF
)"
if [[ "$plan" == CHANGED* ]]; then
    echo "installing trl $TRL_VERSION next to $VENV would change: ${plan#CHANGED }." >&2
    echo "Use a separate venv instead: python3 -m venv /work/trl-bench/venv && /work/trl-bench/venv/bin/pip install" \
         "torch==$TORCH_VERSION transformers==\$(same as $VENV) trl==$TRL_VERSION, then run the bench with" \
         "--trl-python /work/trl-bench/venv/bin/python --trl-path '' (and hybridflow importable there)." >&2
    exit 3
fi
if [[ -z "$plan" ]]; then
    echo "pip reports nothing to install; trl $TRL_VERSION is already in $VENV"
    exit 0
fi
echo "installing into $TARGET (not into $VENV): $plan"
mkdir -p "$TARGET"
# shellcheck disable=SC2086  # the plan is a space-separated list of name==version
"$PYTHON" -m pip install --quiet --no-deps --target "$TARGET" $plan
PYTHONPATH="$TARGET" "$PYTHON" -W ignore -c "import trl; from trl import GRPOTrainer; print('trl', trl.__version__, 'ok')"
