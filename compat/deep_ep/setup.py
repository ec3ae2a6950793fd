"""Builds the opt-in ``deep_ep`` package, refusing where a real DeepEP is installed.

Both provide the top-level ``deep_ep`` package; installing this one over DeepEP would overwrite
its files and leave neither working. pip builds in an isolated environment, so the check asks the
installing interpreter (without the build's own path settings) what ``import deep_ep`` finds.
"""
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from install_check import real_deep_ep_in  # noqa: E402

if os.environ.get("EPCOMM_DEEP_EP_FORCE") != "1":
    found = real_deep_ep_in(sys.executable)
    if found:
        sys.exit(f"refusing to install epcomm's deep_ep package: DeepEP itself is installed ({found}). "
                 f"Uninstall it first (pip uninstall deep_ep), or use a separate environment.")

setup()
