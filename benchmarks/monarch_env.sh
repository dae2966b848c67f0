#!/usr/bin/env bash
# Make a Python environment with Monarch 0.7.0 for benchmarks/peers.py.
#
#     bash benchmarks/monarch_env.sh [VENV]      (default: /work/monarch-venv)
#
# torch is pinned and installed first: torchmonarch 0.7.0 is built against
# torch 2.13, and an unpinned torch would pull whatever is newest. Both install
# on CPU without a GPU. Prints the Python to pass as --monarch-python.
set -euo pipefail

VENV="${1:-/work/monarch-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet "torchmonarch==0.7.0"
"$VENV/bin/python" -c "import torch, monarch; print('torch', torch.__version__, 'monarch', monarch.__file__)"
echo "$VENV/bin/python"
