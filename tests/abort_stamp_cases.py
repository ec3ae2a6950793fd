"""The abort's stamp and a receiver's verdict (gpu/agreement.py: stamp_word, abort_covers,
row_verdict; gpu/sync.py: row_ends_wait, a wait's row check) run by Triton's interpreter on the
CPU: ``TRITON_INTERPRET=1 python tests/abort_stamp_cases.py`` (the interpreter must be chosen
before Triton is imported, hence its own process; test_abort_stamp.py runs it and holds the
scenarios).

Reads a JSON list from stdin, each item ``{"words": [...], "shift": 0 | 32, "rows": [[own0, own1,
own_epoch, other0, other1, other_epoch, signal_word, epoch], ...], "fp": [fp0, fp1]}``, and prints
a list of ``{"stamped_words": [...], "verdicts": [[differ, words0, words1], ...]}``: each word as
the abort stamps it, and for each row case what the receiver makes of it (the signal word's stamp
read as the kernels read it: its epoch field, ``word >> shift``). An item may also hold ``"waits":
[[own0, own1, own_epoch, other_epoch, epoch], ...]``; its result then holds ``"ends"``: whether
each row ends a wait (sync.row_ends_wait)."""
import json
import sys

import torch
import triton
import triton.language as tl

from epcomm.backends.gpu.agreement import abort_covers, row_verdict, stamp_word
from epcomm.backends.gpu.sync import row_ends_wait


@triton.jit
def _stamp(words_ptr, out_ptr, n, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    i = tl.arange(0, BLOCK)
    words = tl.load(words_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, stamp_word(words, SHIFT), mask=i < n)


@triton.jit
def _verdicts(cases_ptr, out_ptr, n, fp0, fp1, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < n
    row = cases_ptr + i * 8
    own0 = tl.load(row, mask=live, other=0)
    own1 = tl.load(row + 1, mask=live, other=0)
    own_epoch = tl.load(row + 2, mask=live, other=0)
    other0 = tl.load(row + 3, mask=live, other=0)
    other1 = tl.load(row + 4, mask=live, other=0)
    other_epoch = tl.load(row + 5, mask=live, other=0)
    signal = tl.load(row + 6, mask=live, other=0)
    epoch = tl.load(row + 7, mask=live, other=0)
    stamped = abort_covers(signal >> SHIFT, epoch)
    differ, words0, words1 = row_verdict(own0, own1, own_epoch, other0, other1, other_epoch, stamped, fp0, fp1,
                                         epoch)
    tl.store(out_ptr + i * 3, differ.to(tl.int64), mask=live)
    tl.store(out_ptr + i * 3 + 1, words0, mask=live)
    tl.store(out_ptr + i * 3 + 2, words1, mask=live)


@triton.jit
def _waits(cases_ptr, out_ptr, n, fp0, fp1, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < n
    row = cases_ptr + i * 5
    ends = row_ends_wait(tl.load(row, mask=live, other=0), tl.load(row + 1, mask=live, other=0),
                         tl.load(row + 2, mask=live, other=0), tl.load(row + 3, mask=live, other=0), fp0, fp1,
                         tl.load(row + 4, mask=live, other=0))
    tl.store(out_ptr + i, ends.to(tl.int64), mask=live)


def run(spec):
    shift = spec["shift"]
    words = torch.tensor(spec["words"] or [0], dtype=torch.int64)
    stamped = torch.zeros_like(words)
    _stamp[(1,)](words, stamped, len(spec["words"]), BLOCK=triton.next_power_of_2(max(len(words), 2)), SHIFT=shift)
    rows = torch.tensor(spec["rows"] or [[0] * 8], dtype=torch.int64)
    out = torch.zeros((rows.shape[0], 3), dtype=torch.int64)
    _verdicts[(1,)](rows, out, len(spec["rows"]), *spec["fp"], BLOCK=triton.next_power_of_2(max(rows.shape[0], 2)),
                    SHIFT=shift)
    done = dict(stamped_words=stamped[:len(spec["words"])].tolist(), verdicts=out[:len(spec["rows"])].tolist())
    if spec.get("waits"):
        waits = torch.tensor(spec["waits"], dtype=torch.int64)
        ends = torch.zeros(waits.shape[0], dtype=torch.int64)
        _waits[(1,)](waits, ends, waits.shape[0], *spec["fp"], BLOCK=triton.next_power_of_2(max(waits.shape[0], 2)))
        done["ends"] = ends.tolist()
    return done


if __name__ == "__main__":
    print(json.dumps([run(spec) for spec in json.load(sys.stdin)]))
    sys.stdout.flush()
