"""mmattn.integrations.timm: timm's Attention on mmattn's kernel, checked against stock timm.

The reference is always timm itself: its ``Attention`` (fused and unfused paths) and its
``VisionTransformer`` with the stock attention, loaded with the same state_dict. Maps
recorded by ``record_attention`` are held to a naive softmax(q kᵀ · scale) computed from the
stock model's own q/k. Run with ``MMATTN_FUSED_ATTN=1`` and ``=0``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")

from timm.layers import Attention as TimmAttention  # noqa: E402
from timm.layers import LayerNorm  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

import mmattn  # noqa: E402
from mmattn.debug import record_attention  # noqa: E402
from mmattn.functional import fused_attn  # noqa: E402
from mmattn.integrations.timm import Attention, replace_timm_attention  # noqa: E402
from mmattn.kernels.dense import add_listener  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}
TINY = dict(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5)
CONFIGS = {
    "tiny": TINY,
    "qk_norm": {**TINY, "qk_norm": True},
    "no_bias_scale_norm_registers": {
        **TINY, "qkv_bias": False, "proj_bias": False, "scale_attn_norm": True,
        "class_token": False, "reg_tokens": 2, "global_pool": "avg",
    },
}


def _jitter(model: nn.Module, scale: float = 0.2, seed: int = 1) -> nn.Module:
    """Move every parameter off its init (biases 0, norms 1 would hide mistakes).

    ``scale`` 0.2 on the tiny widths; vit_tiny's width 192 takes 0.02 (timm's init std), so
    activations stay at a trained model's scale and fp32 rounding stays below 1e-5.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p))
    return model


def _stock(device: str, **config) -> VisionTransformer:
    return _jitter(VisionTransformer(**config)).to(device)


def _images(model: VisionTransformer, batch: int = 2, seed: int = 3) -> torch.Tensor:
    size = model.patch_embed.img_size
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    return torch.randn(batch, 3, *size, generator=gen).to(device)


def _logits_and_grad(model: nn.Module, x: torch.Tensor, mode: str, **kwargs):
    model.train(mode == "train")
    x = x.clone().requires_grad_(True)
    out = model(x, **kwargs)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    return out.detach(), grad


# ---------------------------------------------------------------------- the class itself


def test_constructor_mirrors_timm_signature():
    ours = inspect.signature(Attention.__init__).parameters
    theirs = inspect.signature(TimmAttention.__init__).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


MODULE_KWARGS = [
    {},
    {"qkv_bias": True, "qk_norm": True, "norm_layer": LayerNorm},
    {"scale_norm": True, "norm_layer": nn.LayerNorm, "gated": True, "qkv_bias": True,
     "attn_head_dim": 5, "dim_out": 7, "proj_bias": False},
]


@pytest.mark.parametrize("kwargs", MODULE_KWARGS, ids=["plain", "qk_norm", "gated_scale_norm"])
def test_seeded_build_has_timms_state_dict_and_weights(kwargs):
    torch.manual_seed(5)
    theirs = TimmAttention(12, num_heads=3, **kwargs)
    torch.manual_seed(5)
    ours = Attention(12, num_heads=3, **kwargs)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert (ours.num_heads, ours.head_dim, ours.attn_dim, ours.scale) == (
        theirs.num_heads, theirs.head_dim, theirs.attn_dim, theirs.scale)


def _masks(kind: str, batch: int, heads: int, n: int, device: str):
    """(attn_mask, is_causal) in timm's convention; no row without an allowed key."""
    gen = torch.Generator().manual_seed(7)
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool":  # (b, 1, i, j), the diagonal always allowed
        mask = torch.rand(batch, 1, n, n, generator=gen) > 0.5
        return (mask | torch.eye(n, dtype=torch.bool)).to(device), False
    if kind == "bool_per_head":
        mask = torch.rand(batch, heads, n, n, generator=gen) > 0.3
        return (mask | torch.eye(n, dtype=torch.bool)).to(device), False
    if kind == "float":  # (i, j) additive, some -inf off the diagonal
        mask = torch.randn(n, n, generator=gen)
        mask = mask.masked_fill((torch.rand(n, n, generator=gen) > 0.6)
                                & ~torch.eye(n, dtype=torch.bool), float("-inf"))
        return mask.to(device), False
    raise AssertionError(kind)


@pytest.mark.parametrize("kwargs", MODULE_KWARGS, ids=["plain", "qk_norm", "gated_scale_norm"])
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "bool_per_head", "float"])
@pytest.mark.parametrize("timm_fused", [True, False], ids=["timm_fused", "timm_unfused"])
def test_module_matches_timm_attention(kwargs, kind, timm_fused, device):
    theirs = _jitter(TimmAttention(12, num_heads=3, **kwargs)).to(device)
    theirs.fused_attn = timm_fused
    ours = Attention(12, num_heads=3, **kwargs).to(device)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 6, 12, device=device)
    mask, causal = _masks(kind, 2, 3, 6, device)
    for mode in (True, False):  # train (dropout 0), then eval
        theirs.train(mode), ours.train(mode)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a = theirs(xa, attn_mask=mask, is_causal=causal)
        b = ours(xb, attn_mask=mask, is_causal=causal)
        torch.testing.assert_close(b, a, **TOL)
        a.square().sum().backward()
        b.square().sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, **TOL)


def test_weights_are_the_softmax_and_average_over_heads(device):
    ours = _jitter(Attention(8, num_heads=2, qkv_bias=True)).to(device)
    x = torch.randn(2, 5, 8, device=device)
    out, weights = ours(x, need_weights=True)
    q, k, _ = ours.qkv(x).reshape(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    naive = torch.softmax(q @ k.transpose(-1, -2) * 4**-0.5, dim=-1)
    torch.testing.assert_close(weights, naive, **TOL)
    torch.testing.assert_close(out, ours(x), **TOL)
    _, mean = ours(x, need_weights=True, average_attn_weights=True)
    torch.testing.assert_close(mean, naive.mean(dim=1), **TOL)


def test_rows_without_keys_give_zeros_not_nan(device):
    ours = _jitter(Attention(8, num_heads=2, proj_bias=False)).to(device)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=device)
    mask[..., 2, :] = False  # query 2 may attend nothing
    x = torch.randn(1, 4, 8, device=device, requires_grad=True)
    out = ours(x, attn_mask=mask)
    assert torch.equal(out[0, 2], torch.zeros(8, device=device))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_fused_attn_flag_follows_timm_and_forces_the_explicit_path(monkeypatch):
    import mmattn.integrations.timm as integration

    assert Attention(8, num_heads=2).fused_attn == timm.layers.use_fused_attn()
    monkeypatch.setattr(integration, "_timm_use_fused_attn", lambda: False)
    assert Attention(8, num_heads=2).fused_attn is False
    monkeypatch.undo()

    ours = _jitter(Attention(8, num_heads=2))
    x = torch.randn(2, 5, 8)
    paths: list[tuple[str, list[str]]] = []
    remove = add_listener(lambda record: paths.append((record["path"], record["reasons"])))
    try:
        with fused_attn(True):
            fused = ours(x)
            ours.fused_attn = False
            explicit = ours(x)
        ours.fused_attn = True
        with fused_attn(False):
            switched_off = ours(x)
    finally:
        remove()
    assert [p for p, _ in paths] == ["fused", "explicit", "explicit"]
    assert any("fused_attn flag" in r for r in paths[1][1])
    torch.testing.assert_close(explicit, fused, **TOL)
    torch.testing.assert_close(switched_off, fused, **TOL)


def test_from_timm_takes_over_the_submodules():
    old = _jitter(TimmAttention(12, num_heads=3, qk_norm=True, norm_layer=LayerNorm,
                                gated=True)).double().eval()
    old.fused_attn = False
    old.qkv.weight.requires_grad_(False)
    new = Attention.from_timm(old)
    assert all(a is b for a, b in zip(new.parameters(), old.parameters()))
    assert new.qkv.weight.requires_grad is False and new.fused_attn is False
    assert not new.training and new.qkv.weight.dtype == torch.float64
    x = torch.randn(2, 4, 12, dtype=torch.float64)
    torch.testing.assert_close(new(x), old(x), **TOL)


# ---------------------------------------------------------------------- whole timm models


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_attn_layer_model_loads_stock_weights_and_gives_stock_logits(config, mode, device):
    stock = _stock(device, **CONFIGS[config])
    ours = VisionTransformer(**CONFIGS[config], attn_layer=Attention).to(device)
    assert isinstance(ours.blocks[0].attn, Attention)
    ours.load_state_dict(stock.state_dict(), strict=True)
    x = _images(stock)
    want, want_grad = _logits_and_grad(stock, x, mode)
    got, got_grad = _logits_and_grad(ours, x, mode)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_create_model_vit_tiny_full_size_gives_stock_logits(device):
    stock = _jitter(timm.create_model("vit_tiny_patch16_224", pretrained=False), 0.02).to(device)
    ours = timm.create_model("vit_tiny_patch16_224", pretrained=False, attn_layer=Attention)
    ours.to(device).load_state_dict(stock.state_dict(), strict=True)
    x = _images(stock, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), stock.eval()(x), **TOL)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_replace_attention_on_vit_tiny_keeps_weights_and_logits(mode, device):
    model = _jitter(
        timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2), 0.02
    )
    model = model.to(device).train(mode == "train")
    model.blocks[0].requires_grad_(False)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    x = _images(model, batch=1)
    want, want_grad = _logits_and_grad(model, x, mode)

    assert mmattn.replace_attention(model) == 2
    assert all(isinstance(b.attn, Attention) for b in model.blocks)
    assert model.training == (mode == "train") and model.blocks[1].attn.training == model.training
    assert all(p is params[n] for n, p in model.named_parameters())  # the very same tensors
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        n for n, p in params.items() if not p.requires_grad] != []
    model.load_state_dict(saved, strict=True)
    got, got_grad = _logits_and_grad(model, x, mode)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    assert mmattn.replace_attention(model) == 0  # already ours


def test_replace_attention_keeps_dtype_sharing_and_counts_torch_modules_too():
    vit = _stock("cpu", **TINY).double().eval()
    vit.blocks[1].attn = vit.blocks[0].attn  # one module, two parents
    torch_layer = nn.TransformerEncoderLayer(8, 2, batch_first=True)
    model = nn.ModuleDict({"vit": vit, "text": torch_layer}).eval()
    x = _images(vit).double()
    with torch.no_grad():
        want = vit(x)
    assert mmattn.replace_attention(model) == 2  # the shared timm one once, torch's one
    assert isinstance(model["text"].self_attn, mmattn.MultiHeadAttention)
    assert vit.blocks[0].attn is vit.blocks[1].attn
    assert vit.blocks[0].attn.qkv.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(vit(x), want, **TOL)


def test_replace_skips_subclass_that_overrides_forward_and_refuses_a_bare_module():
    class Custom(TimmAttention):
        def forward(self, x, attn_mask=None, is_causal=False):
            return super().forward(x, attn_mask, is_causal) * 2

    model = nn.Sequential(Custom(8, num_heads=2), TimmAttention(8, num_heads=2))
    with pytest.warns(UserWarning, match=r"skipped 0: Custom overrides"):
        assert replace_timm_attention(model) == 1
    assert type(model[0]) is Custom and isinstance(model[1], Attention)
    with pytest.raises(ValueError, match="from_timm"):
        mmattn.replace_attention(TimmAttention(8, num_heads=2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        replace_timm_attention("vit")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_model_level_attn_mask_matches_stock(kind, device):
    stock = _stock(device, **TINY).eval()
    ours = VisionTransformer(**TINY, attn_layer=Attention).to(device).eval()
    ours.load_state_dict(stock.state_dict(), strict=True)
    x = _images(stock)
    tokens = stock.patch_embed.num_patches + 1
    mask, _ = _masks(kind, 2, 3, tokens, device)
    for fused in (True, False):
        for block in stock.blocks:
            block.attn.fused_attn = fused
        with torch.no_grad():
            torch.testing.assert_close(ours(x, attn_mask=mask), stock(x, attn_mask=mask), **TOL)


# ---------------------------------------------------------------------- record_attention


def _naive_maps(stock: VisionTransformer, x: torch.Tensor) -> list[torch.Tensor]:
    """softmax(q_norm(q) k_norm(k)ᵀ · scale) of every block, from the stock model's q and k."""
    maps = []

    def hook(module, args):
        (tokens,) = args[:1]
        b, n, _ = tokens.shape
        qkv = module.qkv(tokens).reshape(b, n, 3, module.num_heads, module.head_dim)
        q, k, _ = qkv.permute(2, 0, 3, 1, 4)
        q, k = module.q_norm(q), module.k_norm(k)
        maps.append(torch.softmax(q @ k.transpose(-1, -2) * module.scale, dim=-1))

    handles = [blk.attn.register_forward_pre_hook(hook) for blk in stock.blocks]
    try:
        with torch.no_grad():
            stock(x)
    finally:
        for handle in handles:
            handle.remove()
    return maps


@pytest.mark.parametrize("how", ["attn_layer", "replace_attention"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_record_attention_sees_the_maps_inside_timm_models(how, fused, device):
    stock = _stock(device, **CONFIGS["qk_norm"]).eval()
    if how == "attn_layer":
        model = VisionTransformer(**CONFIGS["qk_norm"], attn_layer=Attention).to(device).eval()
        model.load_state_dict(stock.state_dict(), strict=True)
    else:
        model = copy.deepcopy(stock)
        assert mmattn.replace_attention(model) == 2
    x = _images(stock)
    naive = _naive_maps(stock, x)
    with fused_attn(fused), torch.no_grad():
        outside = model(x)
        with record_attention(model) as maps:
            inside = model(x)  # the blocks get tensors back, not (out, weights) pairs
        with record_attention(model, average_attn_weights=True) as averaged:
            model(x)
    assert sorted(maps) == ["blocks.0.attn", "blocks.1.attn"]
    for n, want in enumerate(naive):
        (got,) = maps[f"blocks.{n}.attn"]
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(averaged[f"blocks.{n}.attn"][0], want.mean(1), **TOL)
    torch.testing.assert_close(inside, outside, **TOL)


def test_record_attention_keeps_a_callers_request_for_weights():
    ours = _jitter(Attention(8, num_heads=2))
    x = torch.randn(1, 3, 8)
    with record_attention(ours) as maps:
        out, weights = ours(x, need_weights=True)
        bare = ours(x)
    assert isinstance(bare, torch.Tensor) and weights.shape == (1, 2, 3, 3)
    assert len(maps[""]) == 2


# ---------------------------------------------------------------------- compile


def test_compiled_swapped_vit_equals_eager(device):
    torch._dynamo.reset()
    model = _stock(device, **TINY).eval()
    mmattn.replace_attention(model)
    x = _images(model)
    want, want_grad = _logits_and_grad(model, x, "eval")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, got_grad = _logits_and_grad(compiled, x, "eval")
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_swapped_vit_equals_eager(device):
    torch._dynamo.reset()
    model = _stock(device, **TINY).eval()
    mmattn.replace_attention(model)
    x = _images(model)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, want, **TOL)
    torch._dynamo.reset()


# ---------------------------------------------------------------------- errors and imports


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dim": 10, "num_heads": 3}, ValueError, "dim must be divisible by num_heads"),
    ({"dim": 12, "num_heads": 3, "qk_norm": True}, ValueError, "norm_layer must be given"),
    ({"dim": 12, "num_heads": 3, "scale_norm": True}, ValueError, "norm_layer must be given"),
    ({"dim": 12, "attn_drop": 1.0}, ValueError, r"attn_drop must be in \[0, 1\)"),
    ({"dim": 12, "qkv_bias": "yes"}, TypeError, "qkv_bias must be a bool"),
    ({"dim": 0}, ValueError, "dim must be >= 1"),
])
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        Attention(**kwargs)


def test_forward_errors_name_the_argument():
    ours = Attention(12, num_heads=3)
    x = torch.randn(2, 4, 12)
    with pytest.raises(ValueError, match="x must have last dimension dim=12"):
        ours(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="x must be a 3-D tensor"):
        ours(torch.randn(4, 12))
    with pytest.raises(ValueError, match="attn_mask must be None when is_causal=True"):
        ours(x, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask must broadcast to .* \(2, 3, 4, 4\)"):
        ours(x, attn_mask=torch.ones(2, 2, 4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must have dtype"):
        ours(x, attn_mask=torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="module must be a timm.layers.Attention"):
        Attention.from_timm(nn.Linear(2, 2))


def test_import_without_timm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    monkeypatch.setitem(sys.modules, "timm.layers", None)
    monkeypatch.delitem(sys.modules, "mmattn.integrations.timm")
    with pytest.raises(ImportError, match=r'pip install "mmattn\[timm\]"'):
        importlib.import_module("mmattn.integrations.timm")
    monkeypatch.undo()
    importlib.import_module("mmattn.integrations.timm")


def test_mmattn_and_replace_attention_do_not_import_timm_or_torchvision():
    code = (
        "import sys, torch, mmattn\n"
        "layer = torch.nn.TransformerEncoderLayer(8, 2, batch_first=True)\n"
        "print(mmattn.replace_attention(layer), *(name in sys.modules for name in (\n"
        "    'timm', 'mmattn.integrations.timm', 'torchvision',\n"
        "    'mmattn.integrations.torchvision')))\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["1", "False", "False", "False", "False"]
