"""README's runnable example (examples/two_ranks_cpu.py) keeps working."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_two_ranks_cpu_example_runs():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "two_ranks_cpu.py")], capture_output=True,
                         text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "combine matches: OK" in run.stdout
