"""NeighborhoodAttention on video grids (t, h, w) and 1-D grids, with causal axes.

The reference is ``MultiHeadAttention`` holding the same state dict, called with
``attn_mask=~masks.neighborhood_mask(grid, kernel_size, dilation=..., causal=...)`` (the
mask is held to a pair-by-pair loop and to natten in tests/mmattn/kernels/
test_neighborhood_axes.py). Outputs and the gradients of the input and of every weight agree
in float64, on the fused and the explicit path; padding, per-item grids, packed input,
global tokens, ALiBi, blocks reading ``Tokens.meta``, export and compile carry over.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from mmattn import (
    Encoder,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)
from mmattn.debug import explain
from mmattn.functional import fused_attn
from mmattn.kernels import engines
from mmattn.kernels.modifiers import alibi_slopes
from mmattn.masks import neighborhood_mask
from tests._features import needs
from tests._tolerance import assert_close_scaled

D, H = 16, 4
pytestmark = pytest.mark.usefixtures("one_thread")


def pair(kernel, dtype=torch.float64, **kwargs):
    """A NeighborhoodAttention and a MultiHeadAttention with the same weights."""
    nbhd = NeighborhoodAttention(D, H, kernel, dtype=dtype, **kwargs)
    dense_kw = {k: kwargs[k] for k in ("num_kv_heads", "position", "alibi") if k in kwargs}
    dense = MultiHeadAttention(D, H, dtype=dtype, **dense_kw)
    dense.load_state_dict(nbhd.state_dict())
    return nbhd, dense


OPTIONS = [  # (grid, kernel, constructor options, key padding)
    ((4, 5, 6), (3, 3, 3), {"causal": (True, False, False)}, False),
    ((5, 4, 6), (3, 3, 5), {"causal": (True, False, False), "dilation": (1, 2, 1)}, True),
    ((3, 5, 5), 3, {"causal": True, "num_global_tokens": 2}, True),
    ((6, 3, 4), (5, 3, 3), {"num_kv_heads": 2, "position": "rotary"}, True),
    ((17,), 5, {"causal": True, "dilation": 2}, True),
    ((5, 6), (3, 3), {"causal": (False, True)}, False),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", OPTIONS, ids=str)
def test_equals_dense_masked_attention_with_gradients_float64(case, fused):
    grid, kernel, options, padded = case
    nbhd, dense = pair(kernel, **options)
    glob = options.get("num_global_tokens", 0)
    length = glob + math.prod(grid)
    x = torch.randn(3, length, D, dtype=torch.float64, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(3, length, dtype=torch.bool)
        kpm[1, length // 2:] = True
        kpm[2, 1:] = True  # one real key: rows whose window misses it are dead (zero)
    allowed = neighborhood_mask(grid, kernel, dilation=options.get("dilation", 1),
                                causal=options.get("causal", False), num_global_tokens=glob)
    with fused_attn(fused):
        out, _ = nbhd(x, key_padding_mask=kpm, grid=grid)
        want, _ = dense(x, key_padding_mask=kpm, attn_mask=~allowed)
    torch.testing.assert_close(out, want)  # dead rows: out_proj's bias in both
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *nbhd.parameters()], grad)
    ref = torch.autograd.grad(want, [x, *dense.parameters()], grad)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_padding_never_leaks():
    nbhd, _ = pair((3, 3, 3), causal=(True, False, False))
    grid = (3, 4, 4)
    x = torch.randn(2, 48, D, dtype=torch.float64)
    kpm = torch.zeros(2, 48, dtype=torch.bool)
    kpm[0, 40:] = True
    out, _ = nbhd(x, key_padding_mask=kpm, grid=grid)
    moved = x.clone()
    moved[0, 40:] = float("nan")
    again, _ = nbhd(moved, key_padding_mask=kpm, grid=grid)
    torch.testing.assert_close(again[0, :40], out[0, :40])
    assert torch.isfinite(again[0, :40]).all()


def test_per_item_grids_and_packed_video_each_as_if_alone():
    nbhd, dense = pair((3, 3, 3), causal=(True, False, False))
    grids = [(2, 3, 4), (3, 2, 2)]
    x = torch.randn(2, 24, D, dtype=torch.float64)
    out, _ = nbhd(x, grid=grids)
    packed = Tokens(x, torch.arange(24)[None] < torch.tensor([[24], [12]])).pack()
    rows, _ = nbhd(packed.x, grid=grids)
    for m, grid in enumerate(grids):
        n = math.prod(grid)
        alone, _ = dense(x[m:m + 1, :n],
                         attn_mask=~neighborhood_mask(grid, 3, causal=(True, False, False)))
        torch.testing.assert_close(out[m:m + 1, :n], alone)
        torch.testing.assert_close(rows[m][None], alone)
    assert torch.equal(out[1, 12:], nbhd.out_proj.bias.expand(12, D))  # dead: out_proj's bias


def test_alibi_on_euclidean_video_distances():
    nbhd, dense = pair((3, 3, 3), causal=(True, False, False), alibi=True)
    grid = (3, 3, 4)
    cells = torch.cartesian_prod(*(torch.arange(n) for n in grid)).double()
    dist = torch.cdist(cells, cells)  # Euclidean, in grid cells
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float64)  # Press et al.'s
    bias = -slopes[:, None, None] * dist  # (h, l, l)
    allowed = neighborhood_mask(grid, 3, causal=(True, False, False))
    mask = torch.where(allowed, bias, float("-inf")).repeat(2, 1, 1)  # (b * h, l, l)
    plain = MultiHeadAttention(D, H, dtype=torch.float64)
    plain.load_state_dict(dense.state_dict())
    x = torch.randn(2, 36, D, dtype=torch.float64)
    out, _ = nbhd(x, grid=grid)
    want, _ = plain(x, attn_mask=mask)
    torch.testing.assert_close(out, want)


def test_window_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match=r"kernel_size, dilation and causal must have one "
                                         r"entry per grid axis.*'kernel_size': 3, 'causal': 2"):
        NeighborhoodAttention(D, H, (3, 3, 3), causal=(True, False))
    with pytest.raises(TypeError, match="causal must be a bool or a tuple of bools"):
        NeighborhoodAttention(D, H, 3, causal="time")
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        NeighborhoodAttention(D, H, (3, 4, 3))
    with pytest.raises(ValueError, match=r"relative_position_bias .* needs a 2-D kernel_size"):
        NeighborhoodAttention(D, H, (3, 3, 3), relative_position_bias=True)
    video = NeighborhoodAttention(D, H, (3, 3, 3), causal=(True, False, False))
    with pytest.raises(ValueError, match=r"grid must have one side per axis of the window "
                                         r"\(kernel_size=\(3, 3, 3\), dilation=\(1, 1, 1\), "
                                         r"causal=\(True, False, False\)\): expected 3 sides, "
                                         r"got grid \(4, 6\)"):
        video(torch.randn(1, 24, D), grid=(4, 6))
    with pytest.raises(ValueError, match=r"grid \(2, 3, 4\) has frames \* rows \* cols = 24"):
        video(torch.randn(1, 20, D), grid=(2, 3, 4))
    assert "causal=(True, False, False)" in repr(video)
    with pytest.raises(ValueError, match="is_causal=True is not supported"):
        video(torch.randn(1, 24, D), grid=(2, 3, 4), is_causal=True)
    table = NeighborhoodAttention(D, H, 3, relative_position_bias=True)
    with pytest.raises(ValueError, match="relative_position_bias .* needs a 2-D grid"):
        table(torch.randn(1, 24, D), grid=(2, 3, 4))


def test_a_window_of_more_than_three_axes_is_refused_when_built():
    # found by docs/_tools/fuzz_sixth_wave.py: a 4-axis kernel was accepted by the layer
    # (and P.neighborhood), though no grid can ever have 4 axes
    with pytest.raises(ValueError, match=r"kernel_size must have one entry per grid axis, "
                                         r"1 to 3 .*got 4: kernel_size=\(3, 3, 3, 3\)"):
        NeighborhoodAttention(D, H, (3, 3, 3, 3))
    with pytest.raises(ValueError, match=r"dilation and causal must have one entry per grid "
                                         r"axis, 1 to 3 .*got 0: dilation=\(\), causal=\(\)"):
        NeighborhoodAttention(D, H, 3, dilation=(), causal=())


def test_a_grid_that_misses_a_window_given_by_causal_names_causal():
    # the window's axes came from causal alone: the message names every per-axis argument
    # rather than a kernel_size tuple the user never wrote (fuzz_sixth_wave.py)
    layer = NeighborhoodAttention(D, H, 3, causal=(True, False))
    with pytest.raises(ValueError, match=r"kernel_size=\(3, 3\), dilation=\(1, 1\), "
                                         r"causal=\(True, False\)\): expected 2 sides, got "
                                         r"grid \(2, 2, 2\)"):
        layer(torch.randn(1, 8, D), grid=(2, 2, 2))


def test_a_scalar_kernel_takes_the_grid_it_is_given():
    nbhd, dense = pair(3, causal=True)
    for grid in ((7,), (3, 4), (2, 3, 4)):
        x = torch.randn(1, math.prod(grid), D, dtype=torch.float64)
        out, _ = nbhd(x, grid=grid)
        want, _ = dense(x, attn_mask=~neighborhood_mask(grid, 3, causal=True))
        torch.testing.assert_close(out, want)


def test_blocks_read_a_video_grid_from_meta():
    kwargs = {"kernel_size": (3, 3, 3), "causal": (True, False, False)}
    block = TransformerBlock(D, H, attention="neighborhood", attention_kwargs=kwargs).eval()
    encoder = Encoder(D, 1, H, attention="neighborhood", attention_kwargs=kwargs).eval()
    encoder.blocks[0].load_state_dict(block.state_dict())
    grid = (3, 4, 4)
    tokens = Tokens(torch.randn(2, 48, D), meta={"grid": grid})
    with torch.no_grad():
        out = block(tokens).x
        by_hand = block(tokens, attn_mask=~neighborhood_mask(grid, 3, causal=(True, False,
                                                                              False))).x
        enc = encoder(tokens).x
    assert_close_scaled(out, by_hand, atol=1e-5)
    assert_close_scaled(enc, encoder.norm(out), atol=1e-5)


class _OnGrid(nn.Module):
    def __init__(self, attn: NeighborhoodAttention, grid: tuple[int, ...]) -> None:
        super().__init__()
        self.attn, self.grid = attn, grid

    def forward(self, x: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
        return self.attn(x, key_padding_mask=kpm, grid=self.grid)[0]


def _padded(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    kpm = torch.zeros(batch, length, dtype=torch.bool)
    kpm[0, length - 5:] = True
    return torch.randn(batch, length, D), kpm


@needs("is_exporting")  # torch 2.5/2.6's export specializes what stays dynamic here
def test_export_with_a_dynamic_batch_equals_eager():
    module = _OnGrid(NeighborhoodAttention(D, H, (3, 3, 3), causal=(True, False, False),
                                           alibi=True, num_global_tokens=1), (2, 3, 4)).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(module, _padded(2, 25),
                                  dynamic_shapes=({0: batch}, {0: batch}))
    for size in (1, 3):
        args = _padded(size, 25)
        with torch.no_grad():
            assert_close_scaled(program.module()(*args), module(*args), atol=1e-5)


def test_compiled_dynamic_equals_eager():
    module = _OnGrid(NeighborhoodAttention(D, H, (3, 3, 3), causal=(True, False, False)),
                     (2, 3, 4)).eval()
    compiled = torch.compile(module, dynamic=True, backend="eager")
    for size in (2, 3):
        args = _padded(size, 24)
        with torch.no_grad():
            assert_close_scaled(compiled(*args), module(*args), atol=1e-5)


@pytest.mark.pins_path
@needs("flex_cpu")  # forced flex on the CPU
def test_flex_route_forward_on_the_cpu_equals_the_tiles():
    pytest.importorskip("torch.nn.attention.flex_attention", reason="needs FlexAttention")
    nbhd = NeighborhoodAttention(D, H, (3, 3, 5), causal=(True, False, False),
                                 num_global_tokens=1, dilation=(1, 2, 1)).eval()
    grid = (3, 4, 6)
    x, kpm = _padded(2, 1 + 72)
    with torch.no_grad(), warnings.catch_warnings(), fused_attn(True):
        warnings.simplefilter("ignore")
        tiles, _ = nbhd(x, key_padding_mask=kpm, grid=grid)
        with engines.use("flex"):
            report = explain(nbhd, x, key_padding_mask=kpm, grid=grid)
        with engines.use("flex"):  # ALiBi on a 3-D grid: the tiles, with the reason
            alibi = explain(NeighborhoodAttention(D, H, 3, alibi=True).eval(), x[:, 1:],
                            grid=grid)
    assert report[0].engine == "flex" and report[0].path == "flex"
    assert alibi[0].engine == "fallback" and "ALiBi on a 2-D grid" in alibi[0].engine_reason
    flex = report.output[0]
    assert_close_scaled(flex, tiles, atol=1e-5)


def test_flex_window_mask_mod_is_the_video_window():
    """The flex route's mask_mod of a 3-D window (causal time axis, dilation, a global
    token) allows exactly the dense neighbourhood mask, on every torch."""
    from mmattn.kernels._routes import window_mask_mod

    grid = (3, 4, 6)
    rule = window_mask_mod(grid, (3, 3, 5), (1, 2, 1), 1, torch.device("cpu"),
                           (True, False, False))
    i = torch.arange(73)
    zero = torch.zeros((), dtype=torch.long)
    want = neighborhood_mask(grid, (3, 3, 5), dilation=(1, 2, 1), causal=(True, False, False),
                             num_global_tokens=1)
    assert torch.equal(rule(zero, zero, i[:, None], i[None, :]), want)


def test_debug_tools_read_the_video_window():
    from mmattn.debug import attention_mass, top_keys

    kwargs = {"kernel_size": (3, 3, 3), "causal": (True, False, False)}
    encoder = Encoder(D, 1, H, attention="neighborhood", attention_kwargs=kwargs).eval()
    grid = (3, 3, 3)
    tokens = Tokens(torch.randn(1, 27, D), meta={"grid": grid})
    found = top_keys(encoder, tokens, k=4)
    allowed = neighborhood_mask(grid, 3, causal=(True, False, False))
    rows = torch.arange(27)[:, None].expand(27, 4)
    for head in range(H):
        assert allowed[rows, found.indices[0, 0, head]].all()  # only keys of the window
    text = Tokens(torch.randn(1, 2, D))
    mass = attention_mass(encoder, Tokens.cat({"text": text, "video": tokens}))
    torch.testing.assert_close(mass.table.sum(-1), torch.ones(1, H, 2))
