"""scripts/speed_run.sh's defaults name only what their tools know (VARIANTS: `epcomm bench normal
--variants`; LL_ORDER: scripts/ll_back_to_back.py): a name removed from a tool (or misspelt in the
script) would otherwise surface only on a multi-GPU lease, as a failed part."""
import pathlib
import re

from epcomm.tools.bench import normal_variants

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "speed_run.sh"


def test_the_speed_runs_default_variants_are_all_bench_variants():
    defaults = re.search(r'\$\{VARIANTS-([^}]*)\}', SCRIPT.read_text()).group(1)
    names = normal_variants(defaults)
    assert names and len(names) == len(defaults.split(","))


def test_the_speed_runs_default_ll_order_names_only_what_ll_back_to_back_knows():
    """The ll-gaps part's LL_ORDER default: each name one scripts/ll_back_to_back.py measures."""
    import importlib.util
    path = SCRIPT.parent / "ll_back_to_back.py"
    spec = importlib.util.spec_from_file_location("ll_back_to_back_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    order = re.search(r'\$\{LL_ORDER:-([^}]*)\}', SCRIPT.read_text()).group(1).split(",")
    assert order and set(order) <= set(script.LIBRARIES), order

