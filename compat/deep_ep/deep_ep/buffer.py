"""``deep_ep.buffer``: where DeepEP defines ``Buffer`` (some code imports it from here)."""
from epcomm.compat.deep_ep import Buffer

__all__ = ["Buffer"]
