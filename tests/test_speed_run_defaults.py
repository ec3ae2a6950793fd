"""scripts/speed_run.sh's default VARIANTS are names `epcomm bench normal --variants` accepts: a name
removed from bench.NORMAL_VARIANTS (or misspelt in the script) would otherwise surface only on a
multi-GPU lease, as a failed part."""
import pathlib
import re

from epcomm.tools.bench import normal_variants

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "speed_run.sh"


def test_the_speed_runs_default_variants_are_all_bench_variants():
    defaults = re.search(r'\$\{VARIANTS-([^}]*)\}', SCRIPT.read_text()).group(1)
    names = normal_variants(defaults)
    assert names and len(names) == len(defaults.split(","))
