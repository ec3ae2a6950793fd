#!/usr/bin/env bash
# Quick start 1: set up if needed, then run the MoE demo (all GPUs, else 4 CPU ranks).
source "$(dirname "$0")/env.sh"
exec "$PY" -m epcomm demo "$@"
