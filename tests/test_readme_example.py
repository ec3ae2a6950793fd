"""README's runnable examples (examples/*.py) keep working, and the code the README shows is the
example that runs."""
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run_example(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True,
                         text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_two_ranks_cpu_example_runs():
    assert "combine matches: OK" in _run_example("two_ranks_cpu.py")


def test_the_readme_shows_the_example_that_runs():
    """The README's first Python block is examples/two_ranks_cpu.py after its docstring, line for line."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    shown = re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)
    example = open(os.path.join(ROOT, "examples", "two_ranks_cpu.py")).read()
    body = example.split('"""', 2)[2].lstrip("\n")
    assert shown == body, "README.md's example differs from examples/two_ranks_cpu.py: copy the file's code"


def test_skipped_call_example_shows_errors_at_once_and_the_ranks_pairing_again():
    """The recovery rule's example: rank 1 skips a combine; its peers raise EPInputError('call')
    naming the ranks and calls, every rank drops that step, and the later steps are right."""
    out = _run_example("skipped_call_cpu.py")
    assert "EPInputError(call): step dropped" in out and "ranks are in different calls" in out, out
    assert "no step returned wrong data: OK" in out, out
