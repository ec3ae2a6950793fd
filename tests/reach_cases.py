"""Loads through NVSHMEM's mapping of a peer's memory see that peer's released stores (run on every
rank of a world; the shared-GPU bed: ranks sharing one GPU under CUDA MPS).

Why: the nvlink backend's kernels pull (a receiver loads the rows a source staged in its own
memory, after acquiring the source's release), where the two-level kernels only store to peers.
On ranks sharing a GPU the nvlink backend read zeros in place of staged rows (docs/notes/
multinode-log.md, finding 14). This case does the pull's hand-off alone, on the same memory and the same sync
helpers, so one device call tells whether the mapping and the acquire are at fault::

    round e (every rank, one stream, no host sync inside the round):
      stage:  my data[:] = value(rank, e)            plain stores, my own memory
              RELEASE e into word `rank` of every peer's flags         (sync.signal_peers)
      pull:   ACQUIRE every peer's word >= e in my flags                (sync.poll_epochs)
              for each peer p: count words of p's data != value(p, e)   plain loads through bases[p]
      host barrier (the next round rewrites the data every peer has just read: a load served by
      a stale cache line would show there)
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from epcomm.backends.gpu import sync

FLAG_WORDS = 64  # flags at the start of each rank's memory (one int64 word per rank), then a spare word
DATA_OFFSET = 1024  # bytes from a rank's base to its data


@triton.jit
def _stage_and_release(data_address, num_words, value, bases_ptr, rank, num_ranks, epoch, spare_address,
                       R_P2: tl.constexpr, BLOCK: tl.constexpr):
    """One program: this rank's data = value, then RELEASE epoch into every peer's flag word ``rank``."""
    data = data_address.to(tl.pointer_type(tl.int64))
    for start in range(0, num_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(data + offs, tl.zeros([BLOCK], tl.int64) + value, mask=offs < num_words)
    tl.debug_barrier()  # every thread's stores precede the release (each thread fences there)
    sync.signal_peers(bases_ptr, 0, rank, num_ranks, epoch, bases_ptr, spare_address, HAS_MASK=False, R_P2=R_P2)


@triton.jit
def _acquire_and_pull(my_flags_address, bases_ptr, data_offset, num_words, epoch, timeout_ns, num_ranks, wrong_ptr,
                      R_P2: tl.constexpr, BLOCK: tl.constexpr):
    """One program per peer: ACQUIRE every peer's release of ``epoch``, then count the words of
    this program's peer that differ from ``peer * 1000003 + epoch`` (-1: the wait timed out)."""
    peer = tl.program_id(0)
    lanes = tl.arange(0, R_P2)
    flags = my_flags_address.to(tl.pointer_type(tl.int64))
    _, _, late = sync.poll_epochs(flags + lanes, lanes < num_ranks, epoch, timeout_ns, EPOCH_SHIFT=0)
    if tl.max(late.to(tl.int32), axis=0) != 0:
        tl.store(wrong_ptr + peer, -1)
    else:
        tl.debug_barrier()  # the acquire (the threads holding the lanes) precedes every thread's loads
        data = (tl.load(bases_ptr + peer) + data_offset).to(tl.pointer_type(tl.int64))
        want = peer.to(tl.int64) * 1000003 + epoch
        wrong = tl.zeros([BLOCK], tl.int64)
        for start in range(0, num_words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            got = tl.load(data + offs, mask=offs < num_words, other=want)
            wrong += (got != want).to(tl.int64)
        tl.store(wrong_ptr + peer, tl.sum(wrong, axis=0))


def peer_loads_see_released_stores(num_words: int = 1 << 18, rounds: int = 20, timeout_s: float = 20.0) -> dict:
    """Rounds of the hand-off above on NVSHMEM symmetric memory (gpu/reach/transport.py). Returns
    ``{"bases": every peer mapped and this rank's base its own buffer, "wrong": words read wrong
    per round and peer (-1: timed out)}``."""
    from epcomm.backends.gpu.reach.transport import NvshmemTransport
    R, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    assert R <= FLAG_WORDS
    memory = NvshmemTransport(dist.group.WORLD, device, DATA_OFFSET + num_words * 8)
    bases = memory.peer_bases
    base_ok = bool((bases != 0).all()) and int(bases[rank]) == memory.buffer.data_ptr()
    local = memory.buffer.data_ptr()
    r_p2 = triton.next_power_of_2(R)
    wrong = []
    for round_ in range(rounds):
        epoch = round_ + 1
        found = torch.full((R,), -2, dtype=torch.int64, device=device)
        _stage_and_release[(1,)](local + DATA_OFFSET, num_words, rank * 1000003 + epoch, bases, rank, R, epoch,
                                 local + FLAG_WORDS * 8, R_P2=r_p2, BLOCK=1024)
        _acquire_and_pull[(R,)](local, bases, DATA_OFFSET, num_words, epoch, int(timeout_s * 1e9), R, found,
                                R_P2=r_p2, BLOCK=1024)
        wrong.append(found.tolist())
        memory.barrier()
    memory.release()
    return {"bases": base_ok, "wrong": wrong}
