"""User tools built on the library, kept apart from it: the ``epcomm`` command (cli.py), the MoE
demo (demo.py, with the reference MoE layer in moe.py), randomized checks (check.py) and the
benchmarks (bench.py)."""
