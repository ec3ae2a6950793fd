# Sourced by the other scripts: find or make a Python with torch, and put epcomm on its path.
# GPU machine (torch with CUDA already installed): use that Python as it is.
# Otherwise: a local .venv with the CPU build of torch 2.13.0 (never a multi-GB CUDA build).
set -euo pipefail
EPCOMM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$EPCOMM_ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=python3
else
  if [ ! -x "$EPCOMM_ROOT/.venv/bin/python" ]; then
    echo "epcomm: creating $EPCOMM_ROOT/.venv with torch==2.13.0 (CPU build)" >&2
    python3 -m venv "$EPCOMM_ROOT/.venv"
  fi
  PY="$EPCOMM_ROOT/.venv/bin/python"
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    # The CPU build from PyTorch's CPU index first: a plain `pip install torch` resolves the
    # multi-GB CUDA build (and its nvidia-* packages) on most machines. Only where that index
    # cannot be reached, the plain name (which some machines serve as a local CPU wheel).
    if "$PY" -m pip install -q --timeout 15 --retries 1 --index-url https://download.pytorch.org/whl/cpu \
         torch==2.13.0 2>/dev/null; then
      echo "epcomm: installed torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
           "(asked PyTorch's CPU index: https://download.pytorch.org/whl/cpu)" >&2
    else
      echo "epcomm: PyTorch's CPU index could not be reached; installing torch==2.13.0 from the default index" >&2
      "$PY" -m pip install -q torch==2.13.0
    fi
  fi
  if ! "$PY" -c 'import pytest, numpy' 2>/dev/null; then
    # numpy < 2.3: Triton 3.6's interpreter (the CPU tests of kernels' device functions) turns
    # one-element arrays into Python ints, which numpy 2.3 refuses.
    "$PY" -m pip install -q 'pytest>=7' 'numpy<2.3'
  fi
  # The `epcomm` command (.venv/bin/epcomm), as an editable install of this checkout.
  if [ ! -x "$EPCOMM_ROOT/.venv/bin/epcomm" ]; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$EPCOMM_ROOT" >/dev/null 2>&1 \
      || echo "epcomm: could not install the epcomm command into .venv; use: $PY -m epcomm" >&2
  fi
fi
export PY
