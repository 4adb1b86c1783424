#!/usr/bin/env bash
# One command for the CUDA paths that run without Ray (FSDP2 on NCCL bf16 vs fp32, the fsdp and megatron contract
# suites on CUDA, the lean forward vs HF, megatron-core without the CPU shim, peak CUDA memory); see docs/guide/gpu.md.
#
#   scripts/gpu_check.sh OUT_DIR [--wheelhouse DIR] [--allow-cpu] [--checks a,b]
#       runs scripts/gpu_check.py (stopped at 7 minutes; installing from a wheelhouse comes before, well under one
#       more) and writes OUT_DIR/gpu_check.{json,md}. Needs torch with CUDA;
#       hybridflow's other dependencies are installed from --wheelhouse (no index, no internet) into a throwaway
#       venv that sees the system torch when they are not importable. Without CUDA every check is skipped with a
#       message, unless --allow-cpu (a dry run of the same code on the CPU).
#   scripts/gpu_check.sh --make-wheelhouse DIR [PYTHON_VERSION]
#       on a machine with internet: download those dependencies (binary wheels for CPython PYTHON_VERSION, default
#       this python's, manylinux x86_64; never torch) into DIR, to carry to the GPU machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# hybridflow's runtime dependencies besides torch (pinned to the versions its CI runs; pip adds theirs), and
# megatron-core, whose only other requirements (numpy, packaging) are among them: it is fetched without its torch pin
NEEDS=(transformers==5.24.0 safetensors==0.8.0 pydantic==2.14.4 pluggy==1.7.0 PyYAML==6.0.4 psutil numpy packaging)
MEGATRON=megatron-core==0.16.1

if [[ "${1:-}" == "--make-wheelhouse" ]]; then
  dir="${2:?usage: $0 --make-wheelhouse DIR [PYTHON_VERSION]}"
  version="${3:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
  mkdir -p "$dir"
  platforms=(--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux_2_28_x86_64 --python-version "$version" -d "$dir")
  "$PYTHON" -m pip download "${platforms[@]}" "${NEEDS[@]}"
  "$PYTHON" -m pip download "${platforms[@]}" --no-deps "$MEGATRON"
  du -sh "$dir"
  exit 0
fi

out="${1:?usage: $0 OUT_DIR [--wheelhouse DIR] [--allow-cpu] [--checks a,b]}"
shift
wheelhouse="" passthrough=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheelhouse) wheelhouse="$2"; shift 2 ;;
    *) passthrough+=("$1"); shift ;;
  esac
done
mkdir -p "$out"

"$PYTHON" -c 'import torch' 2>/dev/null || { echo "gpu_check: torch is not importable by $PYTHON; install torch first" >&2; exit 2; }
if ! "$PYTHON" -c 'import transformers, safetensors, pydantic, pluggy, yaml' 2>/dev/null; then
  if [[ -n "$wheelhouse" ]]; then
    venv="$(mktemp -d)/venv"
    "$PYTHON" -m venv --system-site-packages "$venv"
    # each top-level need with its dependencies from the wheelhouse (what the system already has, torch and numpy
    # included, satisfies pip as is); one that cannot be installed is reported and the checks needing it skip
    for need in "${NEEDS[@]}"; do
      "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheelhouse" "$need" \
        || echo "gpu_check: could not install $need from $wheelhouse (the checks needing it will skip)" >&2
    done
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps --find-links "$wheelhouse" "$MEGATRON" \
      || echo "gpu_check: could not install $MEGATRON from $wheelhouse (the megatron check will skip)" >&2
    PYTHON="$venv/bin/python"
  else
    echo "gpu_check: transformers/safetensors/pydantic/pluggy/pyyaml are not importable and no --wheelhouse was" \
         "given; the checks that need them will skip (see docs/guide/gpu.md)" >&2
  fi
fi

export PYTHONPATH="$ROOT/core:$ROOT/plugins/fsdp:$ROOT/plugins/megatron${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
exec timeout 420 "$PYTHON" "$ROOT/scripts/gpu_check.py" --out "$out" ${passthrough[@]+"${passthrough[@]}"}
