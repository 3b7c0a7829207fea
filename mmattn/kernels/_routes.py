"""Each structured kernel's hand-over to an engine (:mod:`mmattn.kernels.engines`).

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length, ``e`` head
width.

A kernel calls its route first; the route asks :func:`~mmattn.kernels.engines.select` and
either runs the engine and returns the output, or returns None (the kernel runs as before).
On the CPU, with no engine forced, a route costs one check (:func:`engines.considered`).
Every route reports the engine that ran (path "varlen" / "flex") or, when it declines on a
device it was asked about, the fallback's reason (:func:`fallback_facts`), for ``explain``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmattn._helpers import ceil_div, exporting
from mmattn._masks_grid import axis_window
from mmattn.kernels import _block_sparse_plan as _plan
from mmattn.kernels import dense as _kernel
from mmattn.kernels import engines
from mmattn.kernels._neighborhood_plan import ByteCache
from mmattn.kernels.modifiers import Modifiers

#: geometry → BlockMask (the key mask is a score term): the kernels' byte-bounded,
#: thread-safe LRU cache (:class:`~mmattn.kernels._neighborhood_plan.ByteCache`), 64 MiB.
_MASKS = ByteCache(64 * 2**20)


def facts(kind: str, q: Tensor, k: Tensor, v: Tensor, *, groups: int, need_weights: bool,
          dropout_p: float, key_mask: Tensor | None, modifiers: Modifiers | None,
          global_tokens: bool = False, banded: bool = False) -> engines.Call:
    """The :class:`~mmattn.kernels.engines.Call` of a kernel's arguments."""
    mods = modifiers if modifiers else None
    params = [q, k, v] + ([] if mods is None else [mods.sinks, mods.slopes])
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in params)
    names = () if mods is None else tuple(
        n for n, on in (("sinks", mods.sinks is not None), ("softcap", mods.softcap is not None),
                        ("alibi", mods.slopes is not None)) if on)
    traced = exporting() or torch.compiler.is_compiling() or not isinstance(q.shape[2], int)
    return engines.Call(
        kind=kind, device=q.device.type, dtype=q.dtype, head_dim=int(q.shape[-1]),
        groups=groups, need_weights=need_weights, dropout=dropout_p > 0,
        fused=_kernel.use_fused_attn(), key_mask=key_mask is not None, modifiers=names,
        grad=grad, traced=traced, global_tokens=global_tokens, banded=banded,
    )


def report(choice: engines.Choice, path: str, **facts_: Any) -> None:
    """Tell explain that an engine ran (path = the engine) and why it was chosen."""
    if _kernel.reporting():
        _kernel.report(choice.engine, [], engine=choice.engine, engine_reason=choice.reason,
                       kernel=path, **facts_)


def fallback(choice: engines.Choice | None) -> dict[str, str]:
    """The report facts of a fallback kernel: the engine "fallback" and why (none when no
    engine was considered)."""
    return {} if choice is None else {"engine": "fallback", "engine_reason": choice.reason}


def fallback_facts(choice: engines.Choice | None) -> contextlib.AbstractContextManager:
    """Inside: every report of the fallback kernel carries :func:`fallback`'s facts."""
    if choice is None or not _kernel.reporting():
        return contextlib.nullcontext()
    return _kernel.report_facts(**fallback(choice))


def block_mask(key: tuple, make_mod: Callable[[], Callable], length: int,
               device: torch.device, block: int):
    """The BlockMask of the geometry-only mask_mod ``make_mod()`` (one for every batch and
    head), cached by ``key`` (the geometry); compiled mask creation on CUDA, no (L, L)
    tensor there."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (key, length, str(device), block)
    mask = _MASKS.get(key)
    if mask is not None:
        return mask
    mask = create_block_mask(make_mod(), None, None, length, length, device=device,
                             BLOCK_SIZE=block, _compile=torch.device(device).type == "cuda")
    nbytes = sum(t.nbytes for t in mask.as_tuple() if isinstance(t, Tensor))
    return _MASKS.put(key, mask, nbytes)


def flex_block(device: torch.device) -> int:
    """Flex's tile on this device (128 on CUDA; 16 on a forced CPU run, whose test shapes
    are small)."""
    return 128 if device.type == "cuda" else 16


def band_mask_mod(window: int, causal: bool, num_global_tokens: int,
                  device: torch.device) -> Callable:
    """LocalAttention's rule as a mask_mod (|i − j| ≤ w, j ≤ i when causal, the first g
    tokens global); the numbers are tensors, so every window shares one compiled graph."""
    w = torch.tensor(window, device=device)
    g = torch.tensor(num_global_tokens, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (q_idx - kv_idx).abs() <= w
        if num_global_tokens:
            ok = ok | (q_idx < g) | (kv_idx < g)
        if causal:
            ok = ok & (kv_idx <= q_idx)
        return ok

    return mask_mod


def local(q: Tensor, k: Tensor, v: Tensor, window: int, *, causal: bool,
          key_mask: Tensor | None, num_global_tokens: int, dropout_p: float,
          need_weights: bool, groups: int, modifiers: Modifiers | None,
          scale: float) -> tuple[Tensor | None, engines.Choice | None]:
    """LocalAttention's route: varlen ``window_size`` without global tokens, else flex.

    Returns:
        (output or None, the choice or None when the device was not considered).
    """
    if not engines.considered(q.device):
        return None, None
    call = facts("window", q, k, v, groups=groups, need_weights=need_weights,
                 dropout_p=dropout_p, key_mask=key_mask, modifiers=modifiers,
                 global_tokens=num_global_tokens > 0)
    choice = engines.select(call)
    batch, _, length, _ = q.shape
    info = {"q": q, "k": k, "v": v, "mask": key_mask, "is_causal": causal, "scale": scale,
            "groups": groups, "modifiers": modifiers or None, "window_size": window}
    if choice.engine == "varlen":
        from mmattn.kernels.varlen import row_offsets, varlen_attend, window_size

        out = varlen_attend(q, k, v, row_offsets(batch, length, q.device), length,
                            window=window_size(min(window, length), causal), scale=scale,
                            groups=groups)
        report(choice, "local", **info)
        return out, choice
    if choice.engine == "flex":
        from mmattn.kernels.flex import flex_attend

        mask = block_mask(
            ("band", window, causal, num_global_tokens),
            lambda: band_mask_mod(window, causal, num_global_tokens, q.device), length,
            q.device, flex_block(q.device))
        out = flex_attend(q, k, v, mask, key_mask=key_mask, scale=scale, groups=groups,
                          modifiers=modifiers)
        report(choice, "local", **info)
        return out, choice
    return None, choice


def packed(q: Tensor, k: Tensor, v: Tensor, q_off: Tensor, k_off: Tensor, max_q: int,
           max_k: int, *, is_causal: bool, dropout_p: float,
           groups: int) -> tuple[Tensor | None, engines.Choice | None]:
    """Packed Tokens' route: the jagged offsets are varlen's cu_seqlens (no other engine).

    Shape:
        - q: (t_q, h, e); k, v: (t_k, k, e); offsets (b + 1,); returns (t_q, h, e) or None
    """
    if not engines.considered(q.device):
        return None, None
    call = facts("segments", q, k, v, groups=groups, need_weights=False, dropout_p=dropout_p,
                 key_mask=None, modifiers=None, banded=is_causal)
    choice = engines.select(call, allowed=tuple(
        e for e in (engines.forced() or engines.ENGINES) if e != "flex"))
    if choice.engine != "varlen":
        return None, choice
    from mmattn.kernels.varlen import packed_attend

    out = packed_attend(q, k, v, q_off, k_off, max_q, max_k,
                        window=(-1, 0) if is_causal else (-1, -1), groups=groups)
    report(choice, "packed", q=q, k=k, v=v, mask=None, is_causal=is_causal, groups=groups)
    return out, choice


def seen_keys(mask: Any) -> Tensor | None:
    """(b, l) bool: the keys some query of the SparseMask may attend (the block-sparse plan's
    :func:`~mmattn.kernels._block_sparse_plan.seen_keys`, cached on the mask); None when
    that is every key (nothing to clear)."""
    def build() -> Tensor | None:
        batch, length = mask.batch, mask.length
        seen, every = _plan.seen_keys(batch, length, mask.block_size, mask.full_tiles,
                                      mask.mixed_tiles, mask.mixed_masks)
        padded = ceil_div(length, mask.block_size) * mask.block_size
        return None if every else seen.view(batch, padded)[:, :length]

    return mask.cached("seen-keys", build)


def sparse(q: Tensor, k: Tensor, v: Tensor, mask: Any, *, key_mask: Tensor | None,
           is_causal: bool, dropout_p: float, need_weights: bool, groups: int,
           modifiers: Modifiers | None, scale: float | None = None,
           ) -> tuple[Tensor | None, engines.Choice | None]:
    """A SparseMask's route: varlen over the runs of a segment-wise pattern
    (patterns/_segments.py), else flex with ``mask.block_mask()`` (its tiles as a BlockMask).

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); returns (b, h, l, e) or None
    """
    if not engines.considered(q.device):
        return None, None
    source = getattr(mask, "segment_source", None)
    # a bool key mask may be the tokens' own padding, which the runs hold: compared (a host
    # read) only when varlen would take the call without it
    own = source is not None and key_mask is not None and key_mask.dtype == torch.bool
    banded = source is not None and (is_causal or source.window != (-1, -1))
    call = facts("segments" if source is not None else "blocks", q, k, v, groups=groups,
                 need_weights=need_weights, dropout_p=dropout_p,
                 key_mask=None if own else key_mask, modifiers=modifiers, banded=banded)
    choice = engines.select(call)
    if own and choice.engine == "varlen" and not torch.equal(key_mask, source.real):
        choice = engines.select(dataclasses.replace(call, key_mask=True))
    if choice.engine == "varlen":
        from mmattn.kernels.varlen import segment_runs

        found = segment_runs(mask)
        if found is not None:
            from mmattn.kernels.varlen import varlen_attend

            runs, (left, right) = found
            out = varlen_attend(q, k, v, runs.cu_seqlens, runs.max_len,
                                window=(left, 0 if is_causal else right), scale=scale,
                                groups=groups, dead=runs.dead)
            report(choice, "block-sparse", q=q, k=k, v=v, mask=None, is_causal=is_causal,
                   scale=scale, groups=groups, density=mask.density, block=mask.block_size)
            return out, choice
        # the segments are not contiguous runs
        choice = engines.select(dataclasses.replace(
            call, kind="blocks", key_mask=key_mask is not None, banded=False))
    if choice.engine != "flex":
        return None, choice
    try:
        blocks = mask.block_mask()
    except ValueError as error:  # a block size flex does not run exactly
        return None, engines.Choice("fallback", f"no BlockMask: {error}")
    from mmattn.kernels.flex import flex_attend

    out = flex_attend(q, k, v, blocks, key_mask=key_mask, scale=scale, groups=groups,
                      modifiers=modifiers, causal=is_causal, seen=seen_keys(mask))
    report(choice, "block-sparse", q=q, k=k, v=v, mask=None, is_causal=is_causal, scale=scale,
           groups=groups, modifiers=modifiers or None, density=mask.density,
           block=mask.block_size)
    return out, choice


def window_mask_mod(grid: tuple[int, ...], kernel: tuple[int, ...], dilation: tuple[int, ...],
                    first: int, device: torch.device,
                    causal: tuple[bool, ...] | None = None) -> Callable:
    """NeighborhoodAttention's rule as a mask_mod: the grid's tokens are ``first ..
    first + prod(grid) − 1`` (row-major, 1 to 3 axes; ``causal`` per axis, None: none),
    every other token is global. Pure indexing into per-axis tables built here
    (:func:`~mmattn._masks_grid.axis_window`)."""
    axes = []
    causal = causal or (False,) * len(grid)
    for a, (n, k, d, c) in enumerate(zip(grid, kernel, dilation, causal)):
        stride = torch.tensor(math.prod(grid[a + 1:]), device=device)
        side = torch.tensor(n, device=device)
        axes.append((stride, side, *axis_window(torch.arange(n, device=device), n, k, d, c)))
    lo = torch.tensor(first, device=device)
    hi = torch.tensor(first + math.prod(grid), device=device)
    last = torch.tensor(math.prod(grid) - 1, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        tq = torch.minimum((q_idx - lo).clamp(min=0), last)  # (a tensor bound: no .item())
        tk = torch.minimum((kv_idx - lo).clamp(min=0), last)
        ok = (q_idx < lo) | (q_idx >= hi) | (kv_idx < lo) | (kv_idx >= hi)  # global
        inside = None
        for stride, side, sub, idx, start, stop in axes:
            pq, pk = tq // stride % side, tk // stride % side
            axis = (sub[pq] == sub[pk]) & (idx[pk] >= start[pq]) & (idx[pk] < stop[pq])
            inside = axis if inside is None else inside & axis
        return ok | inside

    return mask_mod


def neighborhood(q: Tensor, k: Tensor, v: Tensor, grid: Any, kernel: tuple[int, ...],
                 dilation: tuple[int, ...], causal: tuple[bool, ...], *, first: Any,
                 key_mask: Tensor | None,
                 dropout_p: float, need_weights: bool, modifiers: Modifiers | None,
                 table: Tensor | None,
                 scale: float | None) -> tuple[Tensor | None, engines.Choice | None]:
    """NeighborhoodAttention's route: flex with a BlockMask of its window (one grid shared
    by the batch; per-item grids and a relative-position table run the tiled kernel).

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); returns (b, h, l, e) or None
    """
    if not engines.considered(q.device):
        return None, None
    groups = q.shape[1] // k.shape[1]
    call = facts("blocks", q, k, v, groups=groups, need_weights=need_weights,
                 dropout_p=dropout_p, key_mask=key_mask, modifiers=modifiers)
    choice = engines.select(call)
    if choice.engine != "flex":
        return None, choice
    shared = isinstance(grid, tuple) and all(isinstance(n, int) for n in grid)
    if not shared or not isinstance(first, int):
        return None, engines.Choice("fallback", "flex route: one grid for the whole batch only")
    if table is not None:
        return None, engines.Choice("fallback", "flex route: no relative-position table")
    if modifiers is not None and modifiers.slopes is not None and len(grid) != 2:
        return None, engines.Choice("fallback", "flex route: ALiBi on a 2-D grid only")
    from mmattn.kernels.flex import flex_attend

    length = q.shape[2]
    mask = block_mask(("window", grid, kernel, dilation, causal, first),
                      lambda: window_mask_mod(grid, kernel, dilation, first, q.device, causal),
                      length, q.device, flex_block(q.device))
    rows = cols = flat = None
    if modifiers is not None and modifiers.slopes is not None:
        t = torch.arange(length, device=q.device) - first
        flat = (t < 0) | (t >= grid[0] * grid[1])
        rows, cols = (t // grid[1]).float(), (t % grid[1]).float()
    out = flex_attend(q, k, v, mask, key_mask=key_mask, scale=scale, groups=groups,
                      modifiers=modifiers, rows=rows, cols=cols, flat=flat)
    report(choice, "neighborhood", q=q, k=k, v=v, mask=key_mask, scale=scale, groups=groups,
           modifiers=modifiers or None, kernel_size=kernel, dilation=dilation, causal=causal,
           grid=grid)
    return out, choice
