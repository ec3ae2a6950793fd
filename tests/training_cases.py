"""Rank bodies for tests/test_autograd.py."""
import torch
import torch.distributed as dist

import epcomm
import epcomm.autograd
from epcomm.testing.sweeps import SCENARIOS, make_routing, world

# Enough for every case here (the nvlink backend stages tokens in it; torch_dist ignores it).
NUM_NVL_BYTES = 64 << 20


def _scale(experts: torch.Tensor) -> torch.Tensor:
    """Stand-in expert e multiplies its input by (e + 1) / 8; 0 where there is no expert."""
    return torch.where(experts >= 0, (experts.double() + 1) / 8, torch.zeros_like(experts, dtype=torch.float64))


def dense_gradients(x, topk, weights, grad_out):
    """The same layer in one process, float64: y_t = Σ_k w_tk · scale(e_tk) · x_t; returns the
    gradients of Σ (y · grad_out) with respect to x and the weights."""
    x = x.detach().double().requires_grad_(True)
    w = weights.detach().double().requires_grad_(True)
    y = ((w * _scale(topk)).sum(1, keepdim=True) * x)
    # The layer's output is bf16, so the gradient reaching it is bf16 too (autograd casts it): a
    # token whose <x, grad> nearly cancels (|x| 178, |grad| 16, <x, grad> 1.9 in the "skewed" case
    # at 16 ranks) moves by 20% between the float32 and the bf16 gradient, in any implementation.
    (y * grad_out.to(torch.bfloat16).double()).sum().backward()
    return x.grad, w.grad


def autograd_against_dense(num_cases: int = 6, hidden: int = 128, device: str = "cpu", side_stream: bool = False):
    """dispatch → weighted stand-in experts → combine, differentiated through epcomm.autograd;
    the gradients of x and topk_weights match the dense computation on every rank. With
    ``side_stream`` (GPU) forward and backward run on a non-default stream: epcomm's calls follow
    the current stream, as the forward calls do."""
    import contextlib
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=NUM_NVL_BYTES)
    worst = 0.0
    for case in range(num_cases):
        num_experts = 4 * R
        xs, topks, weights = make_routing(700 + case, SCENARIOS[case % len(SCENARIOS)], R, num_experts,
                                          min(3, num_experts), 20, hidden)
        x = xs[rank].to(dev).clone().requires_grad_(True)
        w = weights[rank].to(dev).clone().requires_grad_(True)
        grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(900 + case * 31 + rank))
        stream = torch.cuda.Stream(dev) if side_stream else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            recv_x, recv_topk_idx, recv_w, handle = epcomm.autograd.dispatch(buffer, x, topks[rank].to(dev), w,
                                                                             num_experts)
            local = recv_topk_idx
            scale = _scale(torch.where(local >= 0, local + rank * (num_experts // R), local)).float()
            out = ((recv_w * scale).sum(1, keepdim=True) * recv_x.float()).to(torch.bfloat16)
            combined = epcomm.autograd.combine(buffer, out, handle)
            (combined.float() * grad_out.to(dev)).sum().backward()
        if stream is not None:
            torch.cuda.current_stream(dev).wait_stream(stream)
        want_x, want_w = dense_gradients(xs[rank], topks[rank], weights[rank], grad_out)
        for got, want, name in ((x.grad, want_x, "x"), (w.grad, want_w, "topk_weights")):
            assert got is not None and got.shape == want.shape, name
            got = got.cpu()
            error = float((got.double() - want).norm() / want.norm().clamp_min(1e-12)) if want.numel() else 0.0
            if error > 2e-2:  # name the worst entries: which tokens, which experts
                diff = (got.double() - want).abs()
                worst_rows = diff.reshape(diff.shape[0], -1).max(1).values.topk(min(4, diff.shape[0])).indices.tolist()
                detail = [(t, topks[rank][t].tolist(), got[t].tolist()[:4], want[t].tolist()[:4]) for t in worst_rows]
                raise AssertionError(f"case {case} ({SCENARIOS[case % len(SCENARIOS)]}): gradient of {name}: "
                                     f"relative error {error:.2e}; worst (token, experts, got, want): {detail}")
            worst = max(worst, error)
    return worst


def moe_layer_against_dense(hidden: int = 64, ffn: int = 32, experts_per_rank: int = 2, num_topk: int = 2,
                            device: str = "cpu"):
    """epcomm.nn.MoE forward and backward (input, router, this rank's experts) against the dense
    layer in one process, on the same weights and tokens."""
    import epcomm.nn
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=NUM_NVL_BYTES)
    E = experts_per_rank * R
    layer = epcomm.nn.MoE(buffer, hidden, ffn, E, num_topk, seed=5)
    tokens = [10 + 3 * i for i in range(R)]
    xs = [torch.randn(t, hidden, generator=torch.Generator().manual_seed(40 + i)).to(torch.bfloat16)
          for i, t in enumerate(tokens)]
    grads = [torch.randn(t, hidden, generator=torch.Generator().manual_seed(80 + i)) for i, t in enumerate(tokens)]
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    x = xs[rank].to(dev).clone().requires_grad_(True)
    out = layer(x)
    (out.float() * grads[rank].to(dev)).sum().backward()
    # dense: every rank's tokens through all experts; the loss is the sum over ranks, so this
    # rank's expert weights see every rank's tokens, its input and router only its own
    expert_grads = None
    for i in range(R):
        xi = xs[i].float().requires_grad_(True)
        dense_out, (router_i, w_in_i, w_out_i) = epcomm.nn.MoE.dense_reference(xi, hidden, ffn, E, num_topk, seed=5)
        (dense_out * grads[i]).sum().backward()
        if i == rank:
            dense_x, router_grad, want_out = xi.grad, router_i.grad, dense_out.detach()
        step = [w_in_i.grad, w_out_i.grad]
        expert_grads = step if expert_grads is None else [a + b for a, b in zip(expert_grads, step)]
    first = rank * experts_per_rank

    def rel(got, want):
        return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12))

    errors = {"out": rel(out.detach().float().cpu(), want_out), "x": rel(x.grad.float().cpu(), dense_x),
              "router": rel(layer.router.grad.cpu(), router_grad),
              "w_in": rel(layer.w_in.grad.cpu(), expert_grads[0][first:first + experts_per_rank]),
              "w_out": rel(layer.w_out.grad.cpu(), expert_grads[1][first:first + experts_per_rank])}
    assert all(e <= 2e-2 for e in errors.values()), errors
    return errors


def expert_major_against_reference(num_cases: int = 8, hidden: int = 128, device: str = "cpu",
                                   num_nvl_bytes: int = NUM_NVL_BYTES, experts_per_rank: int = 4, num_topk: int = 3,
                                   max_tokens: int = 16, fp8: bool = False):
    """dispatch(expert_major=True): rows grouped by local expert (padded to the alignment, group
    sizes in the returned list), each (token, local expert) entry once, in plain (row, k) order
    inside a group, equal to the torch re-layout of a plain dispatch (expert_major.py) — bf16, or
    also FP8 values and scales; combine of the unweighted expert outputs equals the weighted top-k
    sum at home. A small ``num_nvl_bytes`` makes the nvlink backend take several rounds."""
    from epcomm import expert_major as layout
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.testing import reference_dispatch, reference_low_latency_combine
    from epcomm.testing.sweeps import FUZZ_SCENARIOS, expert_fn
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes)
    for case in range(num_cases):
        num_experts, alignment = experts_per_rank * R, (1, 4, 8)[case % 3]
        xs, topks, weights = make_routing(400 + case, FUZZ_SCENARIOS[case % len(FUZZ_SCENARIOS)], R, num_experts,
                                          min(num_topk, num_experts), max_tokens, hidden)
        x, topk, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=topk, topk_weights=w, expert_alignment=alignment)
        rows, experts, row_weights, sizes, handle, _ = buffer.dispatch(x, expert_major=True, **args)
        assert torch.equal(buffer.dispatch(x, handle=handle)[0], rows), "cached dispatch keeps the layout"
        plain = buffer.dispatch(x, **args)
        relaid = layout.plan(plain[1], plain[2], plain[3])
        assert torch.equal(layout.expand(plain[0], relaid), rows) and torch.equal(relaid.row_experts, experts) and \
            torch.equal(relaid.row_weights, row_weights) and torch.equal(relaid.dest, handle.expert_major.dest), \
            f"case {case}: expert-major rows differ from the re-laid plain dispatch"
        if fp8 and case % 2:  # FP8 rows and scales take the same layout
            x8 = per_token_cast_to_fp8(x)
            rows8, _, _, sizes8, handle8, _ = buffer.dispatch(x8, expert_major=True, **args)
            want8 = layout.expand(buffer.dispatch(x8, **args)[0], relaid)
            assert sizes8 == sizes and torch.equal(rows8[0].view(torch.uint8), want8[0].view(torch.uint8)) and \
                torch.equal(rows8[1], want8[1]), f"case {case}: FP8 expert-major rows"
            cached8 = buffer.dispatch(x8, handle=handle8)[0]
            assert torch.equal(cached8[0].view(torch.uint8), want8[0].view(torch.uint8)), f"case {case}: cached FP8"
        global_expert = torch.where(experts >= 0, experts + rank * experts_per_rank, experts)
        y = expert_fn(global_expert.clamp_min(0), rows.float()).to(torch.bfloat16)  # unweighted outputs
        combined = buffer.combine(y, handle)[0].cpu()
        rows, experts, row_weights = rows.cpu(), experts.cpu(), row_weights.cpu()
        reference = reference_dispatch(xs, topks, weights, num_experts, alignment)[rank]
        assert sizes == reference["num_recv_tokens_per_expert_list"] and rows.shape[0] == sum(sizes)
        start = 0
        for local, size in enumerate(sizes):
            r, k = (reference["recv_topk_idx"] == local).nonzero(as_tuple=True)  # entries in plain row order
            group = slice(start, start + size)
            assert torch.equal(rows[group][:r.numel()], reference["recv_x"][r]), f"case {case} expert {local} rows"
            assert (rows[group][r.numel():] == 0).all() and (experts[group][r.numel():] == -1).all()
            assert (experts[group][:r.numel()] == local).all()
            assert torch.equal(row_weights[group][:r.numel()], reference["recv_topk_weights"][r, k])
            start += size
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, use_fp8=False)
        torch.testing.assert_close(combined, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"case {case}: {m}")
    return num_cases

