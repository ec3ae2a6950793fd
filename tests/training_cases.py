"""Rank bodies for tests/test_autograd.py."""
import torch
import torch.distributed as dist

import epcomm
import epcomm.autograd
from epcomm.testing.sweeps import SCENARIOS, make_routing, world


def _scale(experts: torch.Tensor) -> torch.Tensor:
    """Stand-in expert e multiplies its input by (e + 1) / 8; 0 where there is no expert."""
    return torch.where(experts >= 0, (experts.double() + 1) / 8, torch.zeros_like(experts, dtype=torch.float64))


def dense_gradients(x, topk, weights, grad_out):
    """The same layer in one process, float64: y_t = Σ_k w_tk · scale(e_tk) · x_t; returns the
    gradients of Σ (y · grad_out) with respect to x and the weights."""
    x = x.detach().double().requires_grad_(True)
    w = weights.detach().double().requires_grad_(True)
    y = ((w * _scale(topk)).sum(1, keepdim=True) * x)
    (y * grad_out.double()).sum().backward()
    return x.grad, w.grad


def autograd_against_dense(num_cases: int = 6, hidden: int = 128, device: str = "cpu"):
    """dispatch → weighted stand-in experts → combine, differentiated through epcomm.autograd;
    the gradients of x and topk_weights match the dense computation on every rank."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    buffer = epcomm.Buffer(dist.group.WORLD)
    worst = 0.0
    for case in range(num_cases):
        num_experts = 4 * R
        xs, topks, weights = make_routing(700 + case, SCENARIOS[case % len(SCENARIOS)], R, num_experts,
                                          min(3, num_experts), 20, hidden)
        x = xs[rank].to(dev).clone().requires_grad_(True)
        w = weights[rank].to(dev).clone().requires_grad_(True)
        grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(900 + case * 31 + rank))
        recv_x, recv_topk_idx, recv_w, handle = epcomm.autograd.dispatch(buffer, x, topks[rank].to(dev), w,
                                                                         num_experts)
        local = recv_topk_idx
        scale = _scale(torch.where(local >= 0, local + rank * (num_experts // R), local)).float()
        out = ((recv_w * scale).sum(1, keepdim=True) * recv_x.float()).to(torch.bfloat16)
        combined = epcomm.autograd.combine(buffer, out, handle)
        (combined.float() * grad_out.to(dev)).sum().backward()
        want_x, want_w = dense_gradients(xs[rank], topks[rank], weights[rank], grad_out)
        for got, want, name in ((x.grad, want_x, "x"), (w.grad, want_w, "topk_weights")):
            assert got is not None and got.shape == want.shape, name
            got = got.cpu()
            error = float((got.double() - want).norm() / want.norm().clamp_min(1e-12)) if want.numel() else 0.0
            assert error <= 2e-2, f"case {case}: gradient of {name}: relative error {error:.2e}"
            worst = max(worst, error)
    return worst


def moe_layer_against_dense(hidden: int = 64, ffn: int = 32, experts_per_rank: int = 2, num_topk: int = 2,
                            device: str = "cpu"):
    """epcomm.nn.MoE forward and backward (input, router, this rank's experts) against the dense
    layer in one process, on the same weights and tokens."""
    import epcomm.nn
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
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
