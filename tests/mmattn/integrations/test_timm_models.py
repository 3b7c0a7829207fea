"""replace_attention on timm's biased attention: Swin, EVA-02, vit_relpos, MaxViT, ConViT.

The reference is always the stock timm model, deep-copied before the swap (same weights),
in eval and train mode (every dropout at 0, drop path off). Models are timm's own builders
with small sizes (or, for MaxViT, its config class with small widths). Run with
``MMATTN_FUSED_ATTN=1`` and ``=0``.
"""

from __future__ import annotations

import copy
import warnings
from functools import partial

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")

from timm.layers import RelPosBias  # noqa: E402
from timm.models import convit, eva, maxxvit, swin_transformer, vision_transformer_relpos  # noqa: E402

import mmattn  # noqa: E402
from mmattn.integrations import timm as ours_timm  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _maxvit(**kwargs) -> nn.Module:
    cfg = maxxvit.MaxxVitCfg(
        embed_dim=(16,), depths=(1,), block_type=("M",), stem_width=(8, 16),
        **maxxvit._rw_max_cfg(dim_head=8, window_size=(4, 4)),  # maxvit_tiny_rw's recipe
    )
    return maxxvit.MaxxVit(cfg, img_size=32, num_classes=5, **kwargs)


TINY = dict(pretrained=False, num_classes=5, drop_path_rate=0.0)
MODELS = {  # name: (builder, image side, stock attention class, how many)
    "swin_tiny_patch4_window7_224": (
        lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=32, embed_dim=16,
                                  depths=(2, 2), num_heads=(2, 4), window_size=4, **TINY),
        32, swin_transformer.WindowAttention, 4),
    "eva02_tiny_patch14_224": (
        lambda: timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=2, embed_dim=48,
                                  **TINY),
        28, eva.EvaAttention, 2),
    "vit_relpos_base_patch16_224": (
        lambda: timm.create_model("vit_relpos_base_patch16_224", img_size=32, patch_size=8,
                                  embed_dim=24, depth=2, num_heads=3, **TINY),
        32, vision_transformer_relpos.RelPosAttention, 2),
    "vit_relpos_shared_bias_cls": (
        lambda: timm.create_model("vit_relpos_base_patch16_224", img_size=32, patch_size=8,
                                  embed_dim=24, depth=2, num_heads=3, class_token=True,
                                  global_pool="token", rel_pos_type="bias",
                                  shared_rel_pos=True, **TINY),
        32, vision_transformer_relpos.RelPosAttention, 2),
    "maxvit_rw_small_widths": (
        lambda: _maxvit(drop_path_rate=0.0), 32, maxxvit.AttentionCl, 2),
}


def _jitter(model: nn.Module, scale: float = 0.1) -> nn.Module:
    """Off the init (zero biases, unit norms would hide mistakes); every dropout at 0."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _run(model: nn.Module, x: torch.Tensor, mode: str):
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_model_gives_stock_logits_and_gradients(name, device):
    build, side, stock_cls, count = MODELS[name]
    torch.manual_seed(0)
    stock = _jitter(build()).to(device)
    model = copy.deepcopy(stock)
    assert sum(type(m) is stock_cls for m in stock.modules()) == count
    assert mmattn.replace_attention(model) == count  # every attention module
    assert not any(type(m) is stock_cls for m in model.modules())
    assert list(model.state_dict()) == list(stock.state_dict())
    model.load_state_dict(stock.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, side, side, generator=gen).to(device)
    for mode in ("eval", "train"):
        want, want_x, want_p = _run(stock, x, mode)
        got, got_x, got_p = _run(model, x, mode)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_x, want_x, **TOL)
        for key, grad in want_p.items():  # tables, rel-pos MLPs, q/v biases, projections
            torch.testing.assert_close(got_p[key], grad, **TOL, msg=key)


def test_convit_swaps_mhsa_and_skips_gpsa_naming_the_reason():
    torch.manual_seed(0)
    stock = _jitter(timm.create_model("convit_tiny", img_size=32, patch_size=8, embed_dim=32,
                                      depth=3, num_heads=4, local_up_to_layer=2, **TINY))
    model = copy.deepcopy(stock)
    with pytest.warns(UserWarning, match=r"skipped blocks\.[01]\.attn: ConViT's GPSA mixes "
                                         r"two softmax maps") as record:
        assert mmattn.replace_attention(model) == 1  # the one MHSA block
    assert sum("GPSA" in str(w.message) for w in record) == 2
    assert type(model.blocks[2].attn) is ours_timm.MHSA
    assert type(model.blocks[0].attn) is convit.GPSA
    x = torch.randn(2, 3, 32, 32)
    for mode in ("eval", "train"):
        want, want_x, _ = _run(stock, x, mode)
        got, got_x, _ = _run(model, x, mode)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_x, want_x, **TOL)


def test_window_attention_masks_match_stock_and_dead_rows_give_zeros():
    stock = _jitter(swin_transformer.WindowAttention(12, num_heads=3, window_size=(2, 3)))
    ours = ours_timm.WindowAttention.from_timm(stock)
    x = torch.randn(4, 6, 12)
    shift = torch.zeros(2, 6, 6).masked_fill(torch.rand(2, 6, 6) > 0.6, -100.0)
    shift = shift.masked_fill(torch.eye(6, dtype=torch.bool), 0.0)
    for mask in (None, shift, shift.masked_fill(shift < 0, float("-inf"))):
        for fused in (True, False):
            stock.fused_attn = ours.fused_attn = fused
            torch.testing.assert_close(ours(x, mask=mask), stock(x, mask=mask), **TOL)
    dead = torch.zeros(2, 6, 6)
    dead[1, 4] = float("-inf")  # window 1's query 4 may attend nothing
    x.requires_grad_(True)
    out = ours(x, mask=dead)
    assert torch.equal(out[1::2, 4], ours.proj.bias.expand(2, 12))  # zero attention, + bias
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_eva_attention_masks_and_rope_match_stock(kind):
    stock = _jitter(eva.EvaAttention(12, num_heads=3, norm_layer=nn.LayerNorm, qk_norm=True))
    ours = ours_timm.EvaAttention.from_timm(stock)
    x, rope = torch.randn(2, 5, 12), torch.randn(4, 8)  # one prefix token
    mask = None
    if kind == "bool":
        mask = (torch.rand(2, 1, 5, 5) > 0.5) | torch.eye(5, dtype=torch.bool)
    elif kind == "float":
        mask = torch.randn(5, 5)
    for fused in (True, False):
        stock.fused_attn = ours.fused_attn = fused
        got = ours(x, rope=rope, attn_mask=mask, is_causal=kind == "causal")
        want = stock(x, rope=rope, attn_mask=mask, is_causal=kind == "causal")
        torch.testing.assert_close(got, want, **TOL)


def test_unknown_rel_pos_is_skipped_and_bare_modules_refused():
    class Scaled(RelPosBias):
        def forward(self, attn, shared_rel_pos=None):
            return attn + 2 * self.get_bias()

    holder = nn.Sequential(
        vision_transformer_relpos.RelPosAttention(
            12, num_heads=3, rel_pos_cls=partial(Scaled, window_size=(2, 2))),
        vision_transformer_relpos.RelPosAttention(
            12, num_heads=3, rel_pos_cls=partial(RelPosBias, window_size=(2, 2))),
    )
    with pytest.warns(UserWarning, match=r"skipped 0: its rel_pos is a Scaled, not one of "
                                         r"timm's RelPosBias, RelPosMlp, RelPosBiasTf"):
        assert mmattn.replace_attention(holder) == 1
    assert type(holder[1]) is ours_timm.RelPosAttention
    with pytest.warns(UserWarning, match="skipped 0") as record:
        assert mmattn.replace_attention(holder) == 0  # ours kept, the other skipped again
    assert len(record) == 1
    with pytest.raises(ValueError, match=r"use mmattn\.integrations\.timm\.EvaAttention"
                                         r"\.from_timm"):
        mmattn.replace_attention(eva.EvaAttention(12, num_heads=3, norm_layer=nn.LayerNorm))
    with pytest.raises(TypeError, match="module must be a timm WindowAttention"):
        ours_timm.WindowAttention.from_timm(nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["maxvit_tiny_rw_224", "convit_tiny"])
def test_full_size_models_give_stock_logits(name):
    """The two whose fast tests above use other sizes than the builder's (Swin's and EVA's
    run their builders)."""
    torch.manual_seed(0)
    stock = timm.create_model(name, pretrained=False).eval()
    model = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConViT's GPSA blocks
        count = mmattn.replace_attention(model)
    assert count == {"maxvit_tiny_rw_224": 22, "convit_tiny": 2}[name]
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x), **TOL)
