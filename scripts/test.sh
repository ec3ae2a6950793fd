#!/usr/bin/env bash
# Quick start 2: set up if needed, then run the test suite (GPU tests skip themselves without CUDA).
source "$(dirname "$0")/env.sh"
cd "$EPCOMM_ROOT"
exec "$PY" -m pytest -q "$@" tests
