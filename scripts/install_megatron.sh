#!/usr/bin/env bash
# Install megatron-core 0.16.1 into a venv (default /work/main/.venv) without touching its torch 2.13.0.
# Idempotent: a fast no-op when megatron-core 0.16.1 is already importable. Usage: scripts/install_megatron.sh [VENV]
set -euo pipefail

VENV="${1:-/work/main/.venv}"
PYTHON="$VENV/bin/python"
MEGATRON_VERSION="0.16.1"
TORCH_VERSION="2.13.0"

if [[ ! -x "$PYTHON" ]]; then
    echo "expected a venv at $VENV (with bin/python); got none. Create it or pass its path." >&2
    exit 2
fi

# pip, or uv with pip's configuration where scripts/setup.sh set it up beside the venv ($VENV/.uv/pip-install)
if [[ -x "$VENV/.uv/pip-install" ]]; then
    pip_install=("$VENV/.uv/pip-install")
else
    pip_install=("$PYTHON" -m pip install)
fi

installed="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)"
if [[ "$installed" == "$MEGATRON_VERSION" ]] && "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec(\"megatron.core\") is None)" 2>/dev/null; then
    echo "megatron-core $MEGATRON_VERSION already installed in $VENV"
    exit 0
fi

# torch stays on the same pip line, pinned, so pip never swaps in a multi-GB CUDA build.
# 0.16.1 is the newest release whose metadata allows Python 3.11; it needs only numpy and packaging besides torch.
"${pip_install[@]}" "megatron-core==$MEGATRON_VERSION" "torch==$TORCH_VERSION"
"$PYTHON" -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
