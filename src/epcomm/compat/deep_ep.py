"""``import epcomm.compat.deep_ep as deep_ep``: DeepEP's V1 names, backed by epcomm."""
from ..buffer import Buffer
from ..config import Config
from ..events import EventOverlap
from ..types import topk_idx_t

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
