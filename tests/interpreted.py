"""Run a tests/*_cases.py script under Triton's interpreter on the CPU, in its own process (the
interpreter must be chosen before Triton is imported), and return what it printed. Skips the
calling test where the interpreter cannot run (numpy >= 2.3)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cases(script: str, stdin: str = None) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src")] + sys.path))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", script)], env=env, input=stdin,
                          capture_output=True, text=True, timeout=600)
    if "only 0-dimensional arrays can be converted" in done.stderr:
        pytest.skip("Triton's interpreter needs numpy < 2.3 (scripts/env.sh installs it)")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
