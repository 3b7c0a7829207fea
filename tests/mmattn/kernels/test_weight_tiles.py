"""Each kernel's ``weight_tiles``: the tiles a kernel gives for its own report, put back
together, are the weights the same kernel returns with ``need_weights=True`` (an
independent path: the whole (L, L) weights of its explicit twin)."""

from __future__ import annotations

import pytest
import torch

from mmattn.kernels import dense as _dense
from mmattn.kernels._report_tiles import weight_tiles
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.modifiers import Modifiers
from mmattn.kernels.neighborhood import neighborhood_attend
from mmattn.kernels.segment import edge_attend

B, H, E = 2, 2, 8
MODS = {
    "none": lambda: None,
    "all": lambda: Modifiers(sinks=torch.randn(H), slopes=torch.tensor([0.5, 0.25]),
                             softcap=2.0),
}


def reported(run) -> list[dict]:
    """The kernel reports of ``run()`` (a call without weights)."""
    found: list[dict] = []
    remove = _dense.add_listener(found.append)
    try:
        run()
    finally:
        remove()
    return found


def assembled(records: list[dict], rows: int, heads: int, cols: int) -> torch.Tensor:
    """(rows, heads, cols) weights from the tiles of every report, by the call's rows."""
    out = torch.zeros(rows, heads, cols, dtype=torch.float64)
    for record in records:
        for q_ids, k_ids, w in weight_tiles(record, block=5, elements=300):
            if w.dim() == 2:  # edges: (E, h)
                out.permute(0, 2, 1).index_put_((q_ids, k_ids), w.double(), accumulate=True)
                continue
            n, h, r, j = w.shape
            qi = q_ids[:, None, :, None].expand(n, h, r, j)
            ki = k_ids[:, None, None, :].expand(n, h, r, j)
            hi = torch.arange(h)[None, :, None, None].expand(n, h, r, j)
            ok = (qi >= 0) & (ki >= 0)
            out.index_put_((qi[ok], hi[ok], ki[ok]), w[ok].double(), accumulate=True)
    return out


def flat(w: torch.Tensor) -> torch.Tensor:
    """(b, h, l, l) -> (b l, h, b l): item b's block on the diagonal."""
    b, h, length, _ = w.shape
    out = torch.zeros(b * length, h, b * length, dtype=torch.float64)
    for i in range(b):
        part = slice(i * length, (i + 1) * length)
        out[part, :, part] = w[i].transpose(0, 1).double()
    return out


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("causal, glob", [(False, 0), (True, 2), (False, 3)])
def test_local_band(mods, causal, glob):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, 13, E) for _ in range(3))
    key_mask = torch.ones(B, 13, dtype=torch.bool)
    key_mask[1, 10:] = False
    kwargs = dict(causal=causal, key_mask=key_mask, num_global_tokens=glob, block_size=4,
                  modifiers=MODS[mods]())
    records = reported(lambda: local_attend(q, k, v, 2, **kwargs))
    _, w = local_attend(q, k, v, 2, need_weights=True, **kwargs)
    torch.testing.assert_close(assembled(records, B * 13, H, B * 13), flat(w), atol=1e-6,
                               rtol=1e-6)  # weights lie in [0, 1]


@pytest.mark.parametrize("mods", list(MODS))
def test_dense_with_a_float_mask(mods):
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, 9, E) for _ in range(3))
    mask = torch.randn(B, 1, 9, 9)
    mask[0, :, 3] = float("-inf")  # a dead row
    kwargs = dict(modifiers=MODS[mods]())
    records = reported(lambda: _dense.attend(q, k, v, mask, **kwargs))
    _, w = _dense.attend(q, k, v, mask, need_weights=True, report_path=False, **kwargs)
    torch.testing.assert_close(assembled(records, B * 9, H, B * 9), flat(w), atol=1e-6,
                               rtol=1e-6)


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("float_keys", [False, True])
def test_neighborhood_with_global_rows(mods, float_keys):
    torch.manual_seed(2)
    length = 2 + 5 * 6
    q, k, v = (torch.randn(B, H, length, E) for _ in range(3))
    key_mask = torch.ones(B, length, dtype=torch.bool)
    key_mask[1, [0, 5, 17]] = False
    if float_keys:
        key_mask = torch.where(key_mask, torch.randn(B, length), float("-inf"))
    kwargs = dict(num_global_tokens=2, key_mask=key_mask, modifiers=MODS[mods]())
    records = reported(lambda: neighborhood_attend(q, k, v, (5, 6), 3, **kwargs))
    _, w = neighborhood_attend(q, k, v, (5, 6), 3, need_weights=True, **kwargs)
    torch.testing.assert_close(assembled(records, B * length, H, B * length), flat(w),
                               atol=1e-6, rtol=1e-6)


def test_edges():
    torch.manual_seed(3)
    q, k, v = (torch.randn(7, H, E) for _ in range(3))
    src, dst = torch.tensor([0, 2, 3, 6, 1, 1]), torch.tensor([0, 0, 1, 1, 4, 6])
    records = reported(lambda: edge_attend(q, k, v, src, dst))
    _, w = edge_attend(q, k, v, src, dst, need_weights=True)
    expected = torch.zeros(7, H, 7, dtype=torch.float64)
    expected.permute(0, 2, 1).index_put_((dst, src), w.double(), accumulate=True)
    torch.testing.assert_close(assembled(records, 7, H, 7), expected, atol=1e-6, rtol=1e-6)


def test_a_path_without_weight_tiles_says_so():
    from mmattn.kernels._tiles import Unsupported

    with pytest.raises(Unsupported, match="'nope' kernel path has no weight tiles"):
        next(weight_tiles({"path": "nope"}))
