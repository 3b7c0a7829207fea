"""NeighborhoodAttention against MultiHeadAttention with the same weights and the dense mask.

The reference is ``MultiHeadAttention`` holding the same state dict, called with
``attn_mask=~masks.neighborhood_mask(...)`` (itself held to a naive loop and to natten in
tests/mmattn/kernels/test_neighborhood.py); per-item grids and packed items are compared
with each item run alone. Outputs and the gradients of the input and of every weight agree
within 1e-5, on the fused and the explicit path.
"""

from __future__ import annotations

import threading

import pytest
import torch

from adapters import ImagePatcher
from mmattn import (
    Encoder,
    MultiHeadAttention,
    MultiModalEncoder,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)
from mmattn.functional import fused_attn
from mmattn.masks import neighborhood_mask

D, H = 16, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}


def pair(kernel=3, dtype=torch.float32, device="cpu", **kwargs):
    """A NeighborhoodAttention and a MultiHeadAttention with the same weights."""
    nbhd = NeighborhoodAttention(D, H, kernel, dtype=dtype, device=device, **kwargs)
    dense_kw = {k: kwargs[k] for k in ("num_kv_heads", "position", "bias", "batch_first")
                if k in kwargs}
    dense = MultiHeadAttention(D, H, dtype=dtype, device=device, **dense_kw)
    dense.load_state_dict(nbhd.state_dict())
    return nbhd, dense


def assert_same_grads(out, want, x, a, b):
    """Gradients of the input and of every weight, for one random output gradient."""
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *a.parameters()], grad)
    ref = torch.autograd.grad(want, [x, *b.parameters()], grad)
    for (name, _), g, r in zip([("input", None), *a.named_parameters()], got, ref):
        torch.testing.assert_close(g, r, **TOL, msg=name)


OPTIONS = [
    # (grid, kernel, constructor options, key padding)
    ((5, 6), 3, {}, False),
    ((6, 7), (5, 3), {"dilation": (1, 2)}, True),
    ((3, 4), 7, {"num_global_tokens": 2}, True),  # grid smaller than the kernel
    ((7, 5), 3, {"num_kv_heads": 2}, True),
    ((6, 6), 5, {"position": "rotary", "dilation": 2, "num_global_tokens": 1}, False),
    ((4, 9), 3, {"bias": False, "num_kv_heads": 1}, True),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", OPTIONS, ids=str)
def test_equals_dense_masked_attention(case, fused):
    grid, kernel, options, padded = case
    nbhd, dense = pair(kernel, **options)
    glob = options.get("num_global_tokens", 0)
    length = glob + grid[0] * grid[1]
    x = torch.randn(3, length, D, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(3, length, dtype=torch.bool)
        kpm[1, length // 2:] = True
        kpm[2, 1:] = True
    allowed = neighborhood_mask(
        grid, kernel, dilation=options.get("dilation", 1), num_global_tokens=glob
    )
    with fused_attn(fused):
        out, _ = nbhd(x, key_padding_mask=kpm, grid=grid)
        want, _ = dense(x, key_padding_mask=kpm, attn_mask=~allowed)
    torch.testing.assert_close(out, want, **TOL)
    assert_same_grads(out, want, x, nbhd, dense)
    out_w, weights = nbhd(x, key_padding_mask=kpm, grid=grid, need_weights=True,
                          average_attn_weights=False)
    want_w, dense_w = dense(x, key_padding_mask=kpm, attn_mask=~allowed, need_weights=True,
                            average_attn_weights=False)
    torch.testing.assert_close(out_w, want_w, **TOL)
    torch.testing.assert_close(weights, dense_w, **TOL)


def test_layouts_unbatched_and_sequence_first():
    nbhd, dense = pair(3)
    allowed = neighborhood_mask((4, 5), 3)
    x = torch.randn(20, D)
    torch.testing.assert_close(nbhd(x, grid=(4, 5))[0], dense(x, attn_mask=~allowed)[0], **TOL)
    seq_first, dense_sf = pair(3, batch_first=False)
    xs = torch.randn(20, 2, D)
    torch.testing.assert_close(seq_first(xs, grid=(4, 5))[0],
                               dense_sf(xs, attn_mask=~allowed)[0], **TOL)


def test_extra_attn_mask_takes_the_dense_fallback():
    nbhd, dense = pair(3)
    x = torch.randn(2, 20, D)
    extra = torch.rand(20, 20) < 0.3
    allowed = neighborhood_mask((4, 5), 3)
    got, _ = nbhd(x, grid=(4, 5), attn_mask=extra)
    want, _ = dense(x, attn_mask=extra | ~allowed)
    torch.testing.assert_close(got, want, **TOL)


def _alone(dense, x_item, grid, kernel, glob, **kw):
    allowed = neighborhood_mask(grid, kernel, num_global_tokens=glob, **kw)
    return dense(x_item[None], attn_mask=~allowed)[0][0]


@pytest.mark.parametrize("fused", [True, False])
def test_padded_batch_of_different_grids(fused):
    nbhd, dense = pair(5, num_global_tokens=1, num_kv_heads=2, position="rotary")
    grids = [(5, 6), (3, 4), (6, 2)]
    length = 1 + 30
    x = torch.randn(3, length, D, requires_grad=True)
    kpm = torch.ones(3, length, dtype=torch.bool)
    for m, (r, c) in enumerate(grids):
        kpm[m, : 1 + r * c] = False
    with fused_attn(fused):
        out, _ = nbhd(x, key_padding_mask=kpm, grid=grids)
    wants = [_alone(dense, x[m, : 1 + r * c], (r, c), 5, 1) for m, (r, c) in enumerate(grids)]
    for m, ((r, c), want) in enumerate(zip(grids, wants)):
        torch.testing.assert_close(out[m, : 1 + r * c], want, **TOL)
    # Without a padding mask the tokens after an item's grid are still never attended.
    torch.testing.assert_close(nbhd(x, grid=grids)[0][1, :13], wants[1], **TOL)
    real = ~kpm
    grad_out = torch.randn_like(out) * real[..., None]
    got = torch.autograd.grad(out, [x, *nbhd.parameters()], grad_out)
    ref_out = torch.cat([w for w in wants])
    ref = torch.autograd.grad(ref_out, [x, *dense.parameters()], grad_out[real])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("fused", [True, False])
def test_packed_items_each_as_if_alone(fused):
    nbhd, dense = pair(3, dilation=(2, 1), num_global_tokens=1, position="rotary")
    grids = [(5, 6), (2, 7), (4, 4)]
    items = [torch.randn(1 + r * c, D) for r, c in grids]
    values = torch.cat(items).requires_grad_(True)
    offsets = torch.tensor([0, *[len(t) for t in items]]).cumsum(0)
    packed = torch.nested.nested_tensor_from_jagged(values, offsets)
    with fused_attn(fused):
        out, weights = nbhd(packed, grid=grids, need_weights=True)
        rows = nbhd.attend_rows(values, offsets, values, offsets, values, self_attention=True,
                                grid=grids)
    wants, start = [], 0
    for (r, c), item in zip(grids, items):
        x_item = values[start:start + len(item)]
        want, want_w = dense(x_item[None], need_weights=True, attn_mask=~neighborhood_mask(
            (r, c), 3, dilation=(2, 1), num_global_tokens=1))
        wants.append(want[0])
        torch.testing.assert_close(weights[len(wants) - 1], want_w[0], **TOL)
        start += len(item)
    want = torch.cat(wants)
    torch.testing.assert_close(out.values(), want, **TOL)
    torch.testing.assert_close(rows, want, **TOL)
    assert_same_grads(rows, want, values, nbhd, dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_layer(dtype, device):
    nbhd, _ = pair(3, num_global_tokens=1, device=device)
    x = torch.randn(2, 1 + 42, D, device=device)
    ref, _ = nbhd(x, grid=(6, 7))
    low = nbhd.to(dtype)
    out, _ = low(x.to(dtype), grid=(6, 7))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - ref).norm() / ref.norm() < 0.05


def test_device_equals_dense(device):
    nbhd, dense = pair(5, device=device, dilation=2, num_kv_heads=2)
    x = torch.randn(2, 9 * 8, D, device=device)
    allowed = neighborhood_mask((9, 8), 5, dilation=2, device=device)
    torch.testing.assert_close(nbhd(x, grid=(9, 8))[0], dense(x, attn_mask=~allowed)[0], **TOL)


# ---------------------------------------------------------------------- named errors


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kernel_size": 4}, ValueError, "kernel_size must be odd"),
    ({"kernel_size": (3, 2)}, ValueError, "kernel_size must be odd"),
    ({"kernel_size": 0}, ValueError, r"kernel_size\[0\] must be >= 1"),
    ({"kernel_size": 3, "dilation": 0}, ValueError, r"dilation\[0\] must be >= 1"),
    ({"kernel_size": 3.0}, TypeError, "kernel_size must be an int or a pair"),
    ({"kernel_size": 3, "num_global_tokens": -1}, ValueError, "num_global_tokens must be >= 0"),
])
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        NeighborhoodAttention(D, H, **kwargs)


def test_forward_errors():
    nbhd = NeighborhoodAttention(D, H, 3, num_global_tokens=1)
    x = torch.randn(2, 21, D)
    with pytest.raises(ValueError, match=r"grid \(4, 4\) has rows \* cols = 16 tokens.*"
                                         r"1 global tokens \+ 16 = 17 tokens, got 21"):
        nbhd(x, grid=(4, 4))
    with pytest.raises(ValueError, match="is_causal=True is not supported"):
        nbhd(x, grid=(4, 5), is_causal=True)
    with pytest.raises(ValueError, match="grid must hold one .rows, cols. per item: expected 2"):
        nbhd(x, grid=[(4, 5)] * 3)
    with pytest.raises(ValueError, match="grid must be given"):
        nbhd(x)
    with pytest.raises(TypeError, match=r"grid\[0\] must be an int, got float \(2.5\)"):
        nbhd(torch.randn(2, 17, D), grid=(2.5, 8))  # not rounded to (2, 8)
    with pytest.raises(TypeError, match=r"grid\[1\]\[0\] must be an int, got bool"):
        nbhd(torch.randn(2, 17, D), grid=[(2, 8), (True, 16)])
    with pytest.raises(ValueError, match=r"grid \(5, 5\) of item 1 .* or more, got 21"):
        nbhd(x, grid=[(4, 5), (5, 5)])
    with pytest.raises(ValueError, match="key of the same length"):
        nbhd(x, torch.randn(2, 11, D), grid=(4, 5))
    with pytest.raises(ValueError, match="has no cache"):
        nbhd.make_cache(2, 8)
    with pytest.raises(NotImplementedError, match="no windows"):
        nbhd.to_torch()
    packed = torch.nested.nested_tensor([torch.randn(21, D), torch.randn(13, D)],
                                        layout=torch.jagged)
    with pytest.raises(ValueError, match=r"item 1 has rows \* cols = 20 .* = 21 tokens, got 13"):
        nbhd(packed, grid=[(4, 5), (4, 5)])


def test_geometry_reads_meta_and_names_the_missing_key():
    nbhd = NeighborhoodAttention(D, H, 3)
    assert nbhd.geometry({"grid": (4, 5)}) == {"grid": (4, 5)}
    assert nbhd.geometry({"grids": [(1, 2), (3, 4)]}) == {"grid": [(1, 2), (3, 4)]}
    fused = {"spans": {"text": (0, 6), "image": (6, 26)}, "image": {"grid": (4, 5)},
             "text": {}}
    assert nbhd.geometry(fused) == {"grid": (4, 5), "grid_start": 6}
    with pytest.raises(ValueError, match="no 'grid' .or 'grids'. key .adapters.ImagePatcher"):
        nbhd.geometry({})
    block = TransformerBlock(D, H, attention="neighborhood", attention_kwargs={"kernel_size": 3})
    with pytest.raises(ValueError, match="'grid'"):
        block(Tokens(torch.randn(1, 9, D)))
    assert "kernel_size=(3, 3)" in repr(block.attn)


# ---------------------------------------------------------------------- blocks


def _patcher():
    return ImagePatcher(D, patch_size=2, in_channels=1, positional="sincos")


def test_blocks_take_the_grid_from_image_tokens():
    patcher = _patcher()
    images = torch.randn(2, 1, 10, 12)
    tokens = patcher(images)
    block = TransformerBlock(D, H, attention="neighborhood", attention_kwargs={"kernel_size": 3})
    out = block(tokens)
    h = block.norm1(tokens.x)
    dense = MultiHeadAttention(D, H)
    dense.load_state_dict(block.attn.state_dict())
    attn = dense(h, attn_mask=~neighborhood_mask((5, 6), 3))[0]
    want = tokens.x + attn
    want = want + block.mlp(block.norm2(want))
    torch.testing.assert_close(out.x, want, **TOL)
    encoder = Encoder(D, 2, H, attention="neighborhood", attention_kwargs={"kernel_size": 3})
    assert encoder(tokens).x.shape == tokens.x.shape


def test_packed_images_in_an_encoder_each_as_if_alone():
    patcher = _patcher()
    images = [torch.randn(1, 10, 12), torch.randn(1, 6, 8), torch.randn(1, 14, 4)]
    encoder = Encoder(D, 2, H, attention="neighborhood", attention_kwargs={"kernel_size": 3})
    packed = encoder(patcher(images, packed=True))
    for m, image in enumerate(images):
        alone = encoder(patcher(image[None])).x[0]
        torch.testing.assert_close(packed.x[m], alone, **TOL)
    unpacked = encoder(patcher(images, packed=True).unpack())  # meta["grids"], padded
    for m in range(len(images)):
        torch.testing.assert_close(unpacked.x[m, : packed.x[m].shape[0]], packed.x[m], **TOL)


class Words(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_dim = D
        self.proj = torch.nn.Linear(3, D)

    def forward(self, v):
        return Tokens(self.proj(v))


def test_multimodal_encoder_other_modalities_are_global():
    encoder = MultiModalEncoder(
        {"text": Words(), "image": _patcher()}, D, 1, H, attention="neighborhood",
        attention_kwargs={"kernel_size": 3},
    )
    words, images = torch.randn(2, 4, 3), torch.randn(2, 1, 8, 10)
    out = encoder({"text": words, "image": images})
    fused = encoder.embed({"text": words, "image": images})
    assert out.x.shape == (2, 4 + 20, D)
    block = encoder.encoder.blocks[0]
    allowed = torch.ones(24, 24, dtype=torch.bool)
    allowed[4:, 4:] = neighborhood_mask((4, 5), 3)  # words attend and are attended by all
    dense = MultiHeadAttention(D, H)
    dense.load_state_dict(block.attn.state_dict())
    h = block.norm1(fused.x)
    want = fused.x + dense(h, attn_mask=~allowed)[0]
    want = encoder.encoder.norm(want + block.mlp(block.norm2(want)))
    torch.testing.assert_close(out.x, want, **TOL)


def test_one_module_serves_threads_with_different_grids():
    # the call's grid lived on the module (_call_geometry): a call in another thread
    # replaced it mid-forward ("cannot unpack non-iterable NoneType", "index 16 is out of
    # bounds", or silently the other grid's windows). The first thread pauses inside its
    # forward (in the position hook, between the checks and the kernel) while a second
    # thread runs a whole call with another grid.
    paused, resume = threading.Event(), threading.Event()

    def position(t, offset):
        if threading.current_thread().name == "paused" and not paused.is_set():
            paused.set()
            assert resume.wait(30)
        return t

    nbhd = NeighborhoodAttention(D, H, 3, position=position).eval()
    gen = torch.Generator().manual_seed(0)
    x_a, x_b, x_c = (torch.randn(2, n, D, generator=gen) for n in (16, 16, 15))
    with torch.no_grad():
        paused.set()  # the references: no pause
        want_a, want_b, want_c = (nbhd(x, grid=g)[0] for x, g in
                                  ((x_a, (4, 4)), (x_b, (2, 8)), (x_c, (3, 5))))
        paused.clear()
    results, errors = {}, []

    def first():
        try:
            with torch.no_grad():
                results["a"] = nbhd(x_a, grid=(4, 4))[0]
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=first, name="paused")
    thread.start()
    assert paused.wait(30)
    with torch.no_grad():  # while the first call waits inside its forward
        got_b, got_c = nbhd(x_b, grid=(2, 8))[0], nbhd(x_c, grid=(3, 5))[0]
    resume.set()
    thread.join(30)
    assert not errors, errors
    torch.testing.assert_close(results["a"], want_a)
    torch.testing.assert_close(got_b, want_b)
    torch.testing.assert_close(got_c, want_c)
    assert not [name for name in vars(nbhd) if "geometry" in name or "grid" in name]
