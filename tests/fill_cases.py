"""copy.py's fill_value and fill_nan (the NaN rows and -1 index outputs of a call that gave up,
one_node/dispatch.py) run by Triton's interpreter on the CPU. Run as ``TRITON_INTERPRET=1 python
tests/fill_cases.py`` (test_nvlink_host.py runs it). Prints one JSON line per case: whether every
element was written with the value, and nothing past ``count``."""
import json
import math

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.copy import fill_nan, fill_value


@triton.jit
def _fill(ptr, count, NAN: tl.constexpr, BLOCK: tl.constexpr):
    # every program its share, as the kernels' programs take theirs
    if NAN:
        fill_nan(ptr, count, tl.program_id(0), tl.num_programs(0), BLOCK)
    else:
        fill_value(ptr, count, -1, tl.program_id(0), tl.num_programs(0), BLOCK)


# (dtype, count, programs, BLOCK): a count that is not a multiple of BLOCK, more programs than
# blocks, int32 / int64 -1 (recv_src_idx, top-k ids), float32 NaN (weights)
CASES = [("int32", 37, 3, 8), ("int64", 64, 2, 16), ("int64", 5, 4, 8), ("float32", 29, 3, 8)]

for dtype, count, programs, block in CASES:
    out = torch.zeros(count + 7, dtype=getattr(torch, dtype))
    nan = dtype == "float32"
    _fill[(programs,)](out, count, NAN=nan, BLOCK=block)
    head = out[:count].tolist()
    filled = all(math.isnan(v) for v in head) if nan else all(v == -1 for v in head)
    print(json.dumps({"case": [dtype, count, programs, block], "filled": filled,
                      "untouched_after": out[count:].tolist() == [0] * 7}))
