#!/usr/bin/env bash
# Quick start 2: set up if needed, then run the test suite (GPU tests skip themselves without CUDA).
# The run ends with one line per reason tests skipped (tests/skip_reasons.py) and its count.
source "$(dirname "$0")/env.sh"
cd "$EPCOMM_ROOT"
export PYTHONPATH="$EPCOMM_ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"  # (the plugin below lives there)
exec "$PY" -m pytest -q -p skip_reasons "$@" tests
