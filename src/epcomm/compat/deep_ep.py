"""``import epcomm.compat.deep_ep as deep_ep``: DeepEP's V1 names, backed by epcomm."""
from .. import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
