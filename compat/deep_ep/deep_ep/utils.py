"""``deep_ep.utils``: the event helpers engines import (``from deep_ep.utils import EventHandle, EventOverlap``)."""
from epcomm.compat.deep_ep import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
