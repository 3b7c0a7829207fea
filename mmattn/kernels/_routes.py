"""Each structured kernel's hand-over to an engine (:mod:`mmattn.kernels.engines`).

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length, ``e`` head
width.

A kernel calls its route first; the route asks :func:`~mmattn.kernels.engines.select` and
either runs the engine (through :func:`~mmattn.kernels.engines.attempt`: an engine that
fails or meets dynamo's recompile limit hands the call back) and returns the output, or
returns None (the kernel runs as before). On the CPU, with no engine forced, a route costs
one check (:func:`engines.considered`). No route makes a host sync: everything it derives
from a mask is cached on the mask (or by geometry). Every route reports the engine that ran
(path "varlen" / "flex") or, when it declines on a device it was asked about, the
fallback's reason (:func:`fallback_facts`), for ``explain``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
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
from mmattn.kernels.flex import mod_facts, own_copy
from mmattn.kernels.modifiers import Modifiers

#: geometry → BlockMask (the key mask is a score term): the kernels' byte-bounded,
#: thread-safe LRU cache (:class:`~mmattn.kernels._neighborhood_plan.ByteCache`), 64 MiB.
_MASKS = ByteCache(64 * 2**20)


def facts(kind: str, q: Tensor, k: Tensor, v: Tensor, *, groups: int, need_weights: bool,
          dropout_p: float, key_mask: Tensor | None, modifiers: Modifiers | None,
          global_tokens: bool = False, banded: bool = False, block: int | None = None,
          packed: bool = False) -> engines.Call:
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
        capability=engines.capability(q.device), block=block, packed=packed,
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
    head), cached by ``key`` (the geometry); compiled mask creation on CUDA
    (:func:`build_block_mask`), no (L, L) tensor there."""
    key = (key, length, str(device), block)
    mask = _MASKS.get(key)
    if mask is not None:
        return mask
    mask = build_block_mask(make_mod(), length, torch.device(device), block)
    nbytes = sum(t.nbytes for t in mask.as_tuple() if isinstance(t, Tensor))
    return _MASKS.put(key, mask, nbytes)


def _create(mask_mod: Callable, length: int, device: torch.device, block: int):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, None, None, length, length, device=device,
                             BLOCK_SIZE=block)


#: The compiled mask builders, one per mask_mod (its own dynamo cache and recompile budget);
#: None once this torch failed to compile one (the older spellings then).
_BUILDERS: dict[tuple, Callable | None] = {}


def build_block_mask(mask_mod: Callable, length: int, device: torch.device, block: int):
    """``create_block_mask`` of a (b, h)-free mask_mod: eager on the CPU; on CUDA through
    ``torch.compile`` of a function of mmattn's own, one per mask_mod (torch's newer
    spelling of the deprecated ``_compile=True``), the ``_compile`` flag only where that
    compile fails in this torch (its deprecation warning silenced), eager where neither
    exists."""
    if device.type != "cuda":
        return _create(mask_mod, length, device, block)
    key = mod_facts(mask_mod)
    if key not in _BUILDERS and None not in _BUILDERS.values():
        _BUILDERS[key] = torch.compile(own_copy(_create, f"mmattn_block_mask_{len(_BUILDERS)}"))
    builder = _BUILDERS.get(key)
    if builder is not None:
        try:
            return builder(mask_mod, length, device, block)
        except Exception:  # noqa: BLE001 - this torch does not compile it: older spellings
            _BUILDERS[key] = None
    if engines.available().mask_compile_flag:
        from torch.nn.attention.flex_attention import create_block_mask

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return create_block_mask(mask_mod, None, None, length, length, device=device,
                                     BLOCK_SIZE=block, _compile=True)
    return _create(mask_mod, length, device, block)


def flex_block(device: torch.device) -> int:
    """Flex's tile on this device (128 on CUDA; 16 on a forced CPU run, whose test shapes
    are small)."""
    return 128 if device.type == "cuda" else 16


def band_mask_mod(window: int, causal: bool, num_global_tokens: int,
                  device: torch.device) -> Callable:
    """LocalAttention's rule as a mask_mod (|i − j| ≤ w, j ≤ i when causal, the first g
    tokens global); the numbers are tensors, so every window shares one compiled graph."""
    w = torch.full((), window, device=device)
    g = torch.full((), num_global_tokens, device=device)
    glob = num_global_tokens > 0  # a bool, not the count: no graph per count

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (q_idx - kv_idx).abs() <= w
        if glob:
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

    ALiBi is measured as the blocked kernel measures it: the band by the rows' offset
    ``|i − j|``, a pair with a global token between ``modifiers.q_pos`` (the absolute
    positions sequence parallelism sets), else the index.

    Returns:
        (output or None, the choice or None when the device was not considered).
    """
    if not engines.considered(q.device):
        return None, None
    call = facts("window", q, k, v, groups=groups, need_weights=need_weights,
                 dropout_p=dropout_p, key_mask=key_mask, modifiers=modifiers,
                 global_tokens=num_global_tokens > 0, block=flex_block(q.device))
    choice = engines.select(call)
    batch, _, length, _ = q.shape
    if choice.engine == "varlen":
        from mmattn.kernels.varlen import row_offsets, varlen_attend, window_size

        def run() -> Tensor:
            return varlen_attend(q, k, v, row_offsets(batch, length, q.device), length,
                                 window=window_size(min(window, length), causal), scale=scale,
                                 groups=groups)
    elif choice.engine == "flex":
        from mmattn.kernels.flex import flex_attend

        def run() -> Tensor:
            mask = block_mask(
                ("band", window, causal, num_global_tokens),
                lambda: band_mask_mod(window, causal, num_global_tokens, q.device), length,
                q.device, flex_block(q.device))
            return flex_attend(q, k, v, mask, key_mask=key_mask, scale=scale, groups=groups,
                               modifiers=modifiers, **_band_alibi(modifiers, num_global_tokens,
                                                                 length, q.device))
    else:
        return None, choice
    out, choice = engines.attempt(choice, call, run)
    if out is not None:
        report(choice, "local", q=q, k=k, v=v, mask=key_mask, is_causal=causal, scale=scale,
               groups=groups, modifiers=modifiers or None, window_size=window)
    return out, choice


def _band_alibi(mods: Modifiers | None, glob: int, length: int,
                device: torch.device) -> dict[str, Tensor]:
    """flex_attend's ALiBi tables for the band: the global tokens measured from
    ``mods.q_pos`` (the blocked kernel's rule), the rest by index (none: all by index)."""
    if not mods or mods.slopes is None or not glob or mods.q_pos is None:
        return {}
    return {"flat": torch.arange(length, device=device) < glob,
            "flat_rows": mods.q_pos[:, 0].float()}


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
                 key_mask=None, modifiers=None, banded=is_causal, packed=True)
    choice = engines.select(call)
    if choice.engine != "varlen":
        return None, choice
    from mmattn.kernels.varlen import packed_attend

    out, choice = engines.attempt(choice, call, lambda: packed_attend(
        q, k, v, q_off, k_off, max_q, max_k, window=(-1, 0) if is_causal else (-1, -1),
        groups=groups))
    if out is not None:
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

    A key padding mask sends a segment-wise call to flex: the mask already holds its
    tokens' padding, and whether a key mask says more could only be read from the device.

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); returns (b, h, l, e) or None
    """
    if not engines.considered(q.device) or (modifiers and any(
            t is not None for t in (modifiers.q_pos, modifiers.k_pos, modifiers.bias))):
        return None, None  # (ALiBi positions: the kernel refuses them, engines do too)
    source = getattr(mask, "segment_source", None)
    banded = source is not None and (is_causal or source.window != (-1, -1))
    call = facts("segments" if source is not None else "blocks", q, k, v, groups=groups,
                 need_weights=need_weights, dropout_p=dropout_p, key_mask=key_mask,
                 modifiers=modifiers, banded=banded, block=mask.block_size)
    choice = engines.select(call)
    if choice.engine == "varlen":
        from mmattn.kernels.varlen import segment_runs

        found = segment_runs(mask)
        if found is not None:
            from mmattn.kernels.varlen import varlen_attend

            runs, (left, right) = found
            out, choice = engines.attempt(choice, call, lambda: varlen_attend(
                q, k, v, runs.cu_seqlens, runs.max_len, window=(left, 0 if is_causal else right),
                scale=scale, groups=groups, dead=runs.dead))
            if out is not None:
                report(choice, "block-sparse", q=q, k=k, v=v, mask=None, is_causal=is_causal,
                       scale=scale, groups=groups, density=mask.density, block=mask.block_size)
            return out, choice
        # the segments are not contiguous runs
        call = dataclasses.replace(call, kind="blocks", banded=False)
        choice = engines.select(call)
    if choice.engine != "flex":
        return None, choice
    from mmattn.kernels.flex import flex_attend

    out, choice = engines.attempt(choice, call, lambda: flex_attend(
        q, k, v, mask.block_mask(), key_mask=key_mask, scale=scale, groups=groups,
        modifiers=modifiers, causal=is_causal, seen=seen_keys(mask)))
    if out is not None:
        report(choice, "block-sparse", q=q, k=k, v=v, mask=None, is_causal=is_causal,
               scale=scale, groups=groups, modifiers=modifiers or None, density=mask.density,
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
                 dropout_p=dropout_p, key_mask=key_mask, modifiers=modifiers,
                 block=flex_block(q.device))
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

    def run() -> Tensor:
        mask = block_mask(("window", grid, kernel, dilation, causal, first),
                          lambda: window_mask_mod(grid, kernel, dilation, first, q.device,
                                                  causal),
                          length, q.device, flex_block(q.device))
        rows = cols = flat = None
        if modifiers is not None and modifiers.slopes is not None:
            t = torch.arange(length, device=q.device) - first
            flat = (t < 0) | (t >= grid[0] * grid[1])
            rows, cols = (t // grid[1]).float(), (t % grid[1]).float()
        return flex_attend(q, k, v, mask, key_mask=key_mask, scale=scale, groups=groups,
                           modifiers=modifiers, rows=rows, cols=cols, flat=flat)

    out, choice = engines.attempt(choice, call, run)
    if out is not None:
        report(choice, "neighborhood", q=q, k=k, v=v, mask=key_mask, scale=scale,
               groups=groups, modifiers=modifiers or None, kernel_size=kernel,
               dilation=dilation, causal=causal, grid=grid)
    return out, choice
