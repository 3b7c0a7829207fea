"""The contenders of benchmarks/gpu_engines.py: the four projections around a kernel, the
baselines (torch's varlen_attn itself; flex_attention compiled apart from mmattn's), and
the comparison of a contender's output with the fallback's.

Axis key: ``b`` batch, ``h`` heads, ``l`` length, ``e`` head width.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class Projected(nn.Module):
    """The four projections of ``ours`` around ``kernel(q, k, v)`` on (b, h, l, e)."""

    def __init__(self, ours: nn.Module, kernel, heads: int) -> None:
        super().__init__()
        self.ours, self.kernel, self.heads = ours, kernel, heads

    def forward(self, x):
        m = self.ours
        q, k, v = (rearrange(p(x), "b l (h e) -> b h l e", h=self.heads)
                   for p in (m.q_proj, m.k_proj, m.v_proj))
        return m.out_proj(rearrange(self.kernel(q, k, v), "b h l e -> b l (h e)"))


def block_mask_of(mask_mod, batch, length, device):
    """The BlockMask of ``mask_mod`` (torch's recommended ``torch.compile(create_block_mask)``
    on CUDA, eager where that fails in this torch)."""
    from torch.nn.attention.flex_attention import create_block_mask

    args = (mask_mod, batch, None, length, length)
    kwargs = dict(device=device, BLOCK_SIZE=128 if device.type == "cuda" else 16)
    if device.type == "cuda":
        try:
            return torch.compile(create_block_mask)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - an older torch: the eager build
            print(f"  compiled create_block_mask failed ({type(error).__name__}): eager")
    return create_block_mask(*args, **kwargs)


def _flex(q, k, v, block_mask, score_mod):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod)


def flex_kernel(mask_mod, batch, length, device, score_mod=None):
    """A baseline: flex_attention with its own compiled copy (separate from mmattn's)."""
    from mmattn.kernels.flex import own_copy

    mask = block_mask_of(mask_mod, batch, length, device)
    name = f"baseline_flex_{next(_BASELINES)}"
    run = torch.compile(own_copy(_flex, name), dynamic=False if device.type == "cpu" else None)
    return lambda q, k, v: run(q, k, v, mask, score_mod)


_BASELINES = itertools.count()


def once(build):
    """A contender built on its first call (outside the timing), then reused."""
    made = []

    def run(x):
        if not made:
            made.append(build())
        return made[0](x)

    return run


def varlen_kernel(cu, max_len, window=(-1, -1)):
    """torch's varlen_attn itself on the runs (the anchor; no mmattn code in between)."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {} if window == (-1, -1) else {"window_size": window}
    cu = cu.to(torch.int32)

    def kernel(q, k, v):
        b, h, length, e = q.shape
        rows = [rearrange(t, "b h l e -> (b l) h e") for t in (q, k, v)]
        out = varlen_attn(*rows, cu, cu, max_len, max_len, **extra)
        return rearrange(out, "(b l) h e -> b h l e", b=b)

    return kernel


def dense_kernel(allowed):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def relative_error(got, want) -> float:
    got, want = got.detach().float().reshape(-1), want.detach().float().reshape(-1)
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def outputs(fn, x, train):
    """The output (and, training, the input's gradient) of one call."""
    x.grad = None
    with torch.set_grad_enabled(train):
        out = fn(x)
        grad = None
        if train:
            out.float().sum().backward()
            grad = x.grad.detach().clone()
    return out.detach(), grad
