"""Q, K and V step by step for "I love AI" — the tutorial mmattn grew from, runnable.

Three embedded tokens of width 4 go through the query / key / value projections, the scaled
scores, the softmax and the weighted sum, each printed. Then the same numbers come out of
``torch.nn.MultiheadAttention`` with the same weights, two heads are computed once by an
explicit per-head loop and once by einops, the windowed local mask is built by the
tutorial's loop and by ``mmattn.masks.band_mask``, the scores are recomputed with
``torch.baddbmm``, and a gradient hook prints the norm of Q's gradient.

Run: ``python -m examples.qkv_walkthrough``
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange

from examples._common import Result, Timer, main_for, seed_everything
from mmattn import MultiHeadAttention
from mmattn.debug import debug_shape, grad_norm_hook, record_qkv_grad_norms
from mmattn.masks import band_mask

EXAMPLE = "qkv_walkthrough"
TOLERANCE = 1e-6


def _show(title: str, tensor: torch.Tensor) -> None:
    print(f"{title}:\n{tensor.detach()}\n")


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def run(
    device: torch.device | str = "cpu",
    seed: int = 0,
    quick: bool = False,
    out_dir: Path | None = None,
    show_progress: bool = True,
) -> list[Result]:
    """Print every step; return the largest difference to the reference computations."""
    timer = Timer()
    seed_everything(seed)
    device = torch.device(device)
    torch.set_printoptions(precision=4, sci_mode=False)
    words = ["I", "love", "AI"]
    embed_dim = 4

    print("== 1. the input: three embedded tokens", words, f"of width {embed_dim}")
    x = torch.randn(len(words), embed_dim, device=device)  # (l, d)
    _show("embeddings x (3, 4)", x)

    print("== 2. linear projections Q = x W_q + b_q, K = x W_k + b_k, V = x W_v + b_v")
    mha = MultiHeadAttention(embed_dim, num_heads=1).to(device)
    with torch.no_grad():  # non-zero biases, so the comparison checks them too
        for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
            proj.bias.normal_(std=0.1)
    Q = debug_shape(mha.q_proj(x), "Q")
    K, V = mha.k_proj(x), mha.v_proj(x)
    _show("Q", Q)
    _show("K", K)
    _show("V", V)

    print("== 3. scaled dot-product attention: softmax(Q Kᵀ / √d_k) V")
    d_k = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)  # (i, j)
    _show(f"scores Q Kᵀ / √{d_k}", scores)
    weights = F.softmax(scores, dim=-1)
    _show("attention weights (each row sums to 1)", weights)
    heads_out = weights @ V
    _show("attention output (before out_proj)", heads_out)
    output = mha.out_proj(heads_out)
    _show("module output out_proj(weights V)", output)

    print("== 4. the same numbers from torch.nn.MultiheadAttention with copied weights")
    reference = mha.to_torch()
    ref_out, ref_weights = reference(x[None], x[None], x[None])
    ours_out, ours_weights = mha(x[None], need_weights=True)
    diffs = {
        "manual vs nn.MultiheadAttention (output)": _diff(output, ref_out[0]),
        "manual vs nn.MultiheadAttention (weights)": _diff(weights, ref_weights[0]),
        "mmattn.MultiHeadAttention vs nn.MultiheadAttention": _diff(ours_out, ref_out),
        "mmattn weights vs nn.MultiheadAttention weights": _diff(ours_weights, ref_weights),
    }
    for name, value in diffs.items():
        print(f"max |difference| {name}: {value:.3g}")
    print("(the tutorial compared before out_proj; nn.MultiheadAttention always applies it)\n")

    print("== 5. two heads: an explicit per-head loop, then einops")
    mha2 = MultiHeadAttention(embed_dim, num_heads=2).to(device)
    num_heads, head_dim = 2, embed_dim // 2
    Q2, K2, V2 = mha2.q_proj(x), mha2.k_proj(x), mha2.v_proj(x)
    per_head = []
    for h in range(num_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        s = Q2[:, cols] @ K2[:, cols].T / math.sqrt(head_dim)
        per_head.append(F.softmax(s, dim=-1) @ V2[:, cols])
    loop_out = torch.cat(per_head, dim=-1)
    q, k, v = (rearrange(t, "l (h e) -> h l e", h=num_heads) for t in (Q2, K2, V2))
    einops_out = rearrange(
        F.softmax(q @ k.transpose(-2, -1) / math.sqrt(head_dim), dim=-1) @ v, "h l e -> l (h e)"
    )
    _show("two heads, loop", loop_out)
    _show("two heads, einops", einops_out)
    diffs["two heads: loop vs einops"] = _diff(loop_out, einops_out)
    diffs["two heads: einops vs nn.MultiheadAttention"] = _diff(
        mha2.out_proj(einops_out), mha2.to_torch()(x[None], x[None], x[None])[0][0]
    )
    print(f"max |loop - einops| = {diffs['two heads: loop vs einops']:.3g}")
    print(f"max |einops - nn.MultiheadAttention| = "
          f"{diffs['two heads: einops vs nn.MultiheadAttention']:.3g}\n")

    print("== 6. the windowed local mask (window_size = 1: each word sees its neighbours)")
    window_size = 1
    loop_mask = torch.ones_like(scores)
    for i in range(len(words)):  # the tutorial's loop: 0 inside the window, 1 outside
        loop_mask[i, max(0, i - window_size) : i + window_size + 1] = 0
    hidden = loop_mask.bool()  # True = not allowed (the nn.MultiheadAttention direction)
    print("tutorial loop mask (True = hidden):\n", hidden)
    assert torch.equal(hidden, ~band_mask(len(words), window_size, device=device))
    print("equals ~mmattn.masks.band_mask(3, 1)")
    local_weights = F.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    _show("local attention weights ('I' cannot see 'AI')", local_weights)
    local_out = mha.out_proj(local_weights @ V)
    diffs["local mask: manual vs MultiHeadAttention(attn_mask)"] = _diff(
        local_out, mha(x[None], attn_mask=hidden)[0][0]
    )
    try:
        from mmattn.attention.local import LocalAttention

        local = LocalAttention(embed_dim, 1, window_size).to(device)
        local.load_state_dict(mha.state_dict())
        diffs["local mask: manual vs LocalAttention"] = _diff(local_out, local(x[None])[0][0])
    except ImportError:  # pragma: no cover - LocalAttention ships with mmattn
        pass
    print(f"max |manual local - module| = "
          f"{diffs['local mask: manual vs MultiHeadAttention(attn_mask)']:.3g}\n")

    print("== 7. the same scores with torch.baddbmm (scale fused into the matmul)")
    bmm_scores = torch.baddbmm(
        torch.empty(1, 3, 3, device=device), Q[None], K[None].transpose(-2, -1),
        beta=0, alpha=1 / math.sqrt(d_k),
    )[0]
    diffs["baddbmm vs matmul scores"] = _diff(bmm_scores, scores)
    print(f"max |baddbmm - matmul| = {diffs['baddbmm vs matmul scores']:.3g}\n")

    print("== 8. backward: a hook prints the norm of Q's gradient")
    Q = mha.q_proj(x)
    store: list[float] = []
    grad_norm_hook(Q, "Q", store=store)
    w = F.softmax(Q @ mha.k_proj(x).T / math.sqrt(d_k), dim=-1)
    mha.out_proj(w @ mha.v_proj(x)).sum().backward()
    with record_qkv_grad_norms(mha) as norms:
        mha(x[None])[0].sum().backward()
    print(f"the module's own q_proj output, via mmattn.debug.record_qkv_grad_norms: "
          f"{norms['q_proj'][0]:.6g}")
    diffs["Q gradient norm: manual vs module hook"] = abs(store[0] - norms["q_proj"][0])

    worst = max(diffs.values())
    print(f"\nlargest difference of all checks: {worst:.3g} (tolerance {TOLERANCE:g})")
    return [
        Result(
            EXAMPLE, "QKV by hand = nn.MultiheadAttention", "max abs difference", worst,
            TOLERANCE, "tolerance", None, timer.seconds,
        )
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
