"""mmattn.integrations.torchvision: Swin's window attention on mmattn's kernel, held to stock.

The reference is always torchvision itself: its ``SwinTransformer`` (V1 and V2 blocks) with
the stock attention, deep-copied before the swap, so both run the same weights. Run with
``MMATTN_FUSED_ATTN=1`` and ``=0``.
"""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from torch import nn

tv_swin = pytest.importorskip("torchvision.models.swin_transformer")

import mmattn  # noqa: E402
from mmattn.integrations.torchvision import (  # noqa: E402
    ShiftedWindowAttention,
    ShiftedWindowAttentionV2,
    replace_torchvision_attention,
    shift_mask,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}
V2 = {"block": tv_swin.SwinTransformerBlockV2, "downsample_layer": tv_swin.PatchMergingV2}


def _tiny(version: int, device: str = "cpu") -> nn.Module:
    """A 3-stage Swin with 3 x 3 windows: on 22 x 26 images the maps are 5 x 6 (padded to
    6 x 6, shifted), 3 x 3 (one window: no shift) and 2 x 2 (smaller than a window)."""
    torch.manual_seed(0)
    model = tv_swin.SwinTransformer(
        [4, 4], 16, depths=[2, 2, 2], num_heads=[2, 2, 4], window_size=[3, 3],
        stochastic_depth_prob=0.0, num_classes=5, **(V2 if version == 2 else {}),
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the init: biases 0 and norms 1 would hide mistakes
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def _images(device: str, size: tuple[int, int] = (22, 26), batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, 3, *size, generator=gen).to(device)


def _run(model: nn.Module, x: torch.Tensor, mode: str):
    """Logits, input gradient and parameter gradients of ``sum(logits²)``."""
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("version", [1, 2])
def test_swapped_tiny_swin_gives_stock_logits_and_gradients(version, device):
    stock = _tiny(version, device)
    ours = copy.deepcopy(stock)
    assert replace_torchvision_attention(ours) == 6  # every attention module
    cls = ShiftedWindowAttentionV2 if version == 2 else ShiftedWindowAttention
    attns = [m for m in ours.modules() if isinstance(m, tv_swin.ShiftedWindowAttention)]
    assert len(attns) == 6 and all(type(m) is cls for m in attns)
    x = _images(device)
    for mode in ("eval", "train"):
        want, want_x, _ = _run(stock, x, mode)
        got, got_x, _ = _run(ours, x, mode)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_x, want_x, **TOL)
    # Parameter gradients in float64: in float32 stock itself is 4e-5 off its float64 self
    # on the patch embedding of V2 (cosine scores times 10 amplify the rounding).
    stock, ours, x = stock.double(), ours.double(), x.double()
    _, _, want_p = _run(stock, x, "train")
    _, _, got_p = _run(ours, x, "train")
    assert list(got_p) == list(want_p)
    for name in want_p:  # the bias table / cpb_mlp / logit_scale / qkv and proj
        torch.testing.assert_close(got_p[name], want_p[name], atol=1e-10, rtol=1e-10,
                                   msg=name)


@pytest.mark.parametrize("version", [1, 2])
def test_swap_keeps_state_dict_tensors_and_settings(version):
    model = _tiny(version).double().eval()
    model.features[1][0].attn.qkv.weight.requires_grad_(False)
    keys, params = list(model.state_dict()), dict(model.named_parameters())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert mmattn.replace_attention(model) == 6
    assert list(model.state_dict()) == keys  # torchvision keeps the index: persistent
    assert all(p is params[n] for n, p in model.named_parameters())
    attn = model.features[1][1].attn
    assert attn.shift_size == [1, 1] and attn.window_size == [3, 3] and not attn.training
    assert attn.qkv.weight.dtype == torch.float64
    assert model.features[1][0].attn.qkv.weight.requires_grad is False
    model.load_state_dict(saved, strict=True)
    assert mmattn.replace_attention(model) == 0  # already ours


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["swin_t", "swin_v2_t"])
def test_swin_t_and_swin_v2_t_give_stock_logits_and_gradients(builder):
    """fp32 logits within 1e-5; gradients in float64. In fp32 swin_v2_t's input gradient is
    rounding-bound: stock itself is 7e-5 off its float64 self there (ours 6e-5)."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    stock = getattr(models, builder)()
    for module in stock.modules():  # stochastic depth draws per call: off in train mode
        if type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    model = copy.deepcopy(stock)
    assert mmattn.replace_attention(model) == 12  # 2 + 2 + 6 + 2 blocks
    x = _images("cpu", size=(32, 32), batch=1)  # 8 x 8 maps: padded to 14 x 14, shifted
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), stock.eval()(x), **TOL)
    stock, model, x = stock.double(), model.double(), x.double()
    for mode in ("eval", "train"):
        want, want_x, _ = _run(stock, x, mode)
        got, got_x, _ = _run(model, x, mode)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(got_x, want_x, atol=1e-10, rtol=1e-10)


def test_shift_mask_is_torchvisions():
    """torchvision builds the mask inside its function: read it back from the scores."""
    padded, window, shift = (6, 9), (3, 3), (1, 2)
    ours = shift_mask(padded, window, shift)
    regions = torch.zeros(padded)
    count = 0
    for h in ((0, -3), (-3, -1), (-1, None)):
        for w in ((0, -3), (-3, -2), (-2, None)):
            regions[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    regions = regions.view(2, 3, 3, 3).permute(0, 2, 1, 3).reshape(6, 9)
    want = regions[:, None, :] - regions[:, :, None]
    want = want.masked_fill(want != 0, -100.0)
    torch.testing.assert_close(ours, want, atol=0, rtol=0)


def test_module_built_directly_matches_torchvisions_class():
    torch.manual_seed(4)
    theirs = tv_swin.ShiftedWindowAttentionV2(8, [3, 3], [1, 1], 2)
    torch.manual_seed(4)
    ours = ShiftedWindowAttentionV2(8, [3, 3], [1, 1], 2)
    assert isinstance(ours, tv_swin.ShiftedWindowAttentionV2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 5, 7, 8)
    torch.testing.assert_close(ours(x), theirs(x), **TOL)


def test_ties_hooks_subclasses_and_bad_arguments():
    model = _tiny(1).eval()
    blocks = model.features[1]
    blocks[1].attn = blocks[0].attn  # one module, two parents
    blocks[0].attn.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match=r"hooks registered on features\.1\.0\.attn"):
        assert mmattn.replace_attention(model) == 5
    assert blocks[0].attn is blocks[1].attn and type(blocks[0].attn) is ShiftedWindowAttention

    class Custom(tv_swin.ShiftedWindowAttention):
        def forward(self, x):
            return super().forward(x) * 2

    holder = nn.Sequential(Custom(8, [3, 3], [0, 0], 2))
    with pytest.warns(UserWarning, match=r"skipped 0: Custom overrides torchvision's "
                                         r"ShiftedWindowAttention\.forward"):
        assert mmattn.replace_attention(holder) == 0
    with pytest.raises(ValueError, match="from_torchvision"):
        mmattn.replace_attention(tv_swin.ShiftedWindowAttention(8, [3, 3], [0, 0], 2))
    with pytest.raises(TypeError, match="module must be a torchvision ShiftedWindowAttentionV2"):
        ShiftedWindowAttentionV2.from_torchvision(tv_swin.ShiftedWindowAttention(8, [3, 3],
                                                                                 [0, 0], 2))
    with pytest.raises(ValueError, match="x must have last dimension dim=8"):
        ShiftedWindowAttention(8, [3, 3], [0, 0], 2)(torch.randn(1, 3, 3, 4))
    with pytest.raises(ValueError, match="x must be a 4-D tensor"):
        ShiftedWindowAttention(8, [3, 3], [0, 0], 2)(torch.randn(9, 8))


def test_old_module_is_left_as_it_was():
    old = tv_swin.ShiftedWindowAttention(8, [3, 3], [1, 1], 2)
    new = ShiftedWindowAttention.from_torchvision(old)
    new.extra = nn.Linear(2, 2)
    new.register_buffer("other", torch.zeros(1))
    assert not hasattr(old, "extra") and "other" not in dict(old.named_buffers())
    assert new.qkv is old.qkv and new.relative_position_bias_table is (
        old.relative_position_bias_table)


def test_fx_traced_swapped_swin_equals_eager():
    feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
    model = _tiny(2).eval()
    mmattn.replace_attention(model)
    x = _images("cpu")
    extractor = feature_extraction.create_feature_extractor(model, ["flatten", "head"])
    with torch.no_grad():
        torch.testing.assert_close(extractor(x)["head"], model(x), **TOL)


@pytest.mark.slow
def test_compiled_and_exported_swapped_window_attention_equal_eager():
    attn = ShiftedWindowAttentionV2(8, [3, 3], [1, 1], 2)
    x = torch.randn(2, 5, 7, 8, requires_grad=True)
    want = attn(x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    with torch.no_grad():
        exported = torch.export.export(attn, (x.detach(),)).module()
        torch.testing.assert_close(exported(x.detach()), want.detach(), **TOL)


def test_import_without_torchvision_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    monkeypatch.delitem(sys.modules, "mmattn.integrations.torchvision")
    with pytest.raises(ImportError, match=r'pip install "mmattn\[vision\]"'):
        importlib.import_module("mmattn.integrations.torchvision")
    monkeypatch.undo()
    importlib.import_module("mmattn.integrations.torchvision")
