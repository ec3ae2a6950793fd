"""Recording stand-ins for the one-node normal mode's kernels and a real HostMailbox in unpinned
memory, no GPU: the host side of NormalMode (gpu/normal/one_node/mode.py) driven on the CPU by
tests/test_one_node_dispatch_host.py (the dispatch's paths, the doorbell, the handle's words) and
tests/test_one_node_launch_grids.py (each launch's programs, when the count exchange goes with
them). Imported only where Triton is installed."""
import types
from collections import defaultdict

import torch

from epcomm.backends.gpu.mailbox import HostMailbox
from epcomm.backends.gpu.normal.one_node import mode as M
from epcomm.backends.gpu.sync import DOORBELL_WORDS

R, RANK, HIDDEN, K, E, NUM_SMS, BLOCK_R, ROUND_TOKENS = 4, 1, 64, 2, 8, 6, 8, 100


class _Kernel:
    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def launch(self, grid, *args):
        self.launches.append((self.name, grid, args))


class _OverlappedFull(dict):
    """ep_dispatch's full-dispatch launchers by key (ALIGNED, L_P2, DOORBELL, NOTIFY): named
    "notify+ep_dispatch" where the count exchange goes in the launch."""

    def __init__(self, launches):
        super().__init__()
        self.launches = launches

    def __missing__(self, key):
        self[key] = _Kernel(self.launches, "notify+ep_dispatch" if key[3] else "ep_dispatch")
        return self[key]


class _Mailbox(HostMailbox):
    """A HostMailbox whose count wait answers at once with ``counts`` (rows here, most tokens any
    rank sends), or raises ``fail``; it records every ring as (tag, words)."""

    def __init__(self, counts, fail=None):
        super().__init__(R, E // R, pinned=False)
        self.counts, self.fail, self.rings = counts, fail, []

    def wait_notify(self, sequence, rank, timeout_s):
        if self.fail is not None:
            raise self.fail
        num_rows, max_tokens = self.counts
        return num_rows, max_tokens, torch.zeros(E // R, dtype=torch.int64).numpy()

    def ring(self, sequence, rank, timeout_s, num_rows=0, addresses=()):
        super().ring(sequence, rank, timeout_s, num_rows, addresses)
        index = self._doorbell
        self.rings.append((int(self.view[index]), self.view[index + 1:index + DOORBELL_WORDS - 1].tolist()))


def _mode(monkeypatch, launches, mailbox, doorbell=True):
    monkeypatch.setattr(M, "current_stream", lambda index: 0)
    monkeypatch.setattr(M, "NOTIFY_BOUND", defaultdict(lambda: _Kernel(launches, "notify")))
    mode = object.__new__(M.NormalMode)
    mode.b = types.SimpleNamespace(mailbox=mailbox, timeout_ns=1, timeout_s=1.0)
    mode.R, mode.R_P2, mode.rank, mode.device, mode.dev_index = R, R, RANK, torch.device("cpu"), 0
    mode.expert_major_programs = 132
    mode.ws = types.SimpleNamespace(normal_half_bytes=0, block_flag_cap=1024, block_flags_offset=0, lists_offset=0,
                                    list_cap=0, counts_offset=0)
    mode.bases = mode.state = mode.fingerprints = mode.trace_address = 0
    mode.seat = types.SimpleNamespace(bases_address=0, tag=lambda capturing=None: 0)
    mode._default_choices()
    vars(mode)["doorbell_dispatch"] = doorbell  # (as the defaults: no plans to drop yet)
    mode._dispatch_plans, mode._combine_plans = {}, {}  # (a choice set drops them)

    def kernels(name):
        return defaultdict(lambda: _Kernel(launches, name))
    plan = M.DispatchPlan(x_words=HIDDEN // 4, num_scales=0, num_topk=K, entry_topk=K, topk_row_bytes=32,
                          offsets=(0, 0, 0), round_tokens=ROUND_TOKENS, block_r=BLOCK_R, rows_aligned=True,
                          expert_major=False, stage_lists=kernels("stage"), stage=kernels("stage"),
                          notify_stage=kernels("notify+stage"),
                          pull_index=_Kernel(launches, "pull"), pull=_Kernel(launches, "pull"),
                          overlapped_full=_OverlappedFull(launches), overlapped_cached=kernels("ep_dispatch"),
                          fingerprint_full=(0, 0), fingerprint_cached=(0, 0),
                          **M.NormalMode._fixed_arguments(mode, (0, 0, 0), 32))
    mode._dispatch_plan_of = lambda args: plan
    return mode


def _args(num_tokens, num_worst_tokens=0):
    return types.SimpleNamespace(
        x=torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16), handle=None, plan=None,
        num_tokens_per_rank=torch.zeros(R, dtype=torch.int32), num_tokens_per_expert=torch.zeros(E, dtype=torch.int32),
        is_token_in_rank=torch.zeros(num_tokens, R, dtype=torch.bool), topk_idx=torch.zeros(num_tokens, K, dtype=torch.int64),
        topk_weights=torch.zeros(num_tokens, K), expert_alignment=1, num_worst_tokens=num_worst_tokens,
        config=types.SimpleNamespace(num_sms=NUM_SMS), expert_major=False, capturing=None)


def _doorbell_arg(args):
    """ep_dispatch's sequence argument (0: no doorbell): after the 5 identity words and the trace address."""
    return args[-7]


class _OrderedMailbox(_Mailbox):
    """A _Mailbox that records its count wait among the launches."""

    def __init__(self, counts, launches):
        super().__init__(counts)
        self.launches = launches

    def wait_notify(self, sequence, rank, timeout_s):
        self.launches.append(("wait", 0, ()))
        return super().wait_notify(sequence, rank, timeout_s)
