"""mmattn.integrations.torch: replace_attention, isinstance nn.MultiheadAttention, from_torch for
every class, and what torch does to an nn.MultiheadAttention (pickle, deepcopy, save/load,
torch.compile, the Transformer layers' fast-path probes) working on ours."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
    replace_attention,
)
from mmattn.rotary import RotaryEmbedding

CLASSES = [
    lambda: MultiHeadAttention(16, 4),
    lambda: CrossAttention(16, 4, kdim=6),
    lambda: LocalAttention(16, 4, window_size=2),
    lambda: AdditiveAttention(16, 4),
    lambda: LinformerAttention(16, 4, seq_len=8, proj_len=4),
]


def _inputs(device="cpu"):
    x = torch.randn(2, 5, 16, device=device)
    kpm = torch.zeros(2, 5, dtype=torch.bool, device=device)
    kpm[1, 3:] = True
    return x, kpm


def _same_outputs(a, b, x, kpm, atol=1e-6):
    a.eval()
    b.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            a(x, x, x, key_padding_mask=kpm)[0], b(x, x, x, key_padding_mask=kpm)[0],
            atol=atol, rtol=atol,
        )


# ---------------------------------------------------------------------- the class itself


@pytest.mark.parametrize("make", CLASSES)
def test_every_attention_class_is_an_nn_multihead_attention(make):
    module = make()
    assert isinstance(module, nn.MultiheadAttention)
    # What PyTorch's Transformer code probes: nothing packed, so its fast paths decline.
    # in_proj_weight / in_proj_bias are views (tests/mmattn/attention/test_dropin.py).
    assert module._qkv_same_embed_dim is False
    assert module.batch_first is True and module.head_dim == 4 and module.bias_k is None
    assert module.q_proj_weight is module.q_proj.weight  # torch's names for separate weights
    assert "in_proj_weight" not in module.state_dict()


def test_transformer_encoder_built_from_a_swapped_layer_declines_its_fast_path():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    with pytest.warns(UserWarning, match="_qkv_same_embed_dim was not True"):
        encoder = nn.TransformerEncoder(layer, num_layers=2)
    assert not encoder.use_nested_tensor
    assert all(type(lay.self_attn) is MultiHeadAttention for lay in encoder.layers)


@pytest.mark.parametrize("make", CLASSES[:3])
def test_pickle_deepcopy_and_torch_save_keep_it_unpacked(make, tmp_path):
    """torch's __setstate__ would set _qkv_same_embed_dim=True; ours does not."""
    module = make().eval()
    x, kpm = _inputs()
    key = torch.randn(2, 5, module.kdim)
    path = tmp_path / "whole.pt"
    torch.save(module, path)
    copies = [
        pickle.loads(pickle.dumps(module)),
        copy.deepcopy(module),
        torch.load(path, weights_only=False),  # a whole module needs the full unpickler
    ]
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    fresh = make().eval()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    copies.append(fresh)
    with torch.no_grad():
        ref = module(x, key, key_padding_mask=kpm)[0]
        for other in copies:
            assert type(other) is type(module)
            assert other._qkv_same_embed_dim is False
            assert "_qkv_same_embed_dim" not in vars(other)
            torch.testing.assert_close(other(x, key, key_padding_mask=kpm)[0], ref)


def test_unpickled_copy_still_works_inside_a_default_transformer_encoder():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2).eval()
    replace_attention(encoder)
    restored = pickle.loads(pickle.dumps(encoder))
    x, kpm = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            restored(x, src_key_padding_mask=kpm)[~kpm], encoder(x, src_key_padding_mask=kpm)[~kpm]
        )


def test_torch_compile_fullgraph_of_module_and_swapped_encoder():
    x, kpm = _inputs()
    mha = MultiHeadAttention(16, 4)
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")
    for need_weights in (False, True):
        got = compiled(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        ref = mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        torch.testing.assert_close(got[0], ref[0])
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    replace_attention(encoder)
    compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        compiled(x, src_key_padding_mask=kpm)[~kpm], encoder(x, src_key_padding_mask=kpm)[~kpm]
    )


# ---------------------------------------------------------------------- replace_attention


class _Model(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, **kwargs)
        self.blocks = nn.ModuleList([nn.MultiheadAttention(16, 4, kdim=6, vdim=6)])
        self.head = nn.Linear(16, 3)


def test_replace_attention_counts_and_keeps_outputs(device):
    model = _Model(add_bias_kv=True).to(device)
    swapped = copy.deepcopy(model)
    assert replace_attention(swapped) == 2
    assert type(swapped.attn) is type(swapped.blocks[0]) is MultiHeadAttention
    x, kpm = _inputs(device)
    _same_outputs(model.attn, swapped.attn, x, kpm)
    seq, mem = torch.randn(5, 2, 16, device=device), torch.randn(7, 2, 6, device=device)
    torch.testing.assert_close(swapped.blocks[0](seq, mem, mem)[0],
                               model.blocks[0](seq, mem, mem)[0], atol=1e-6, rtol=1e-6)
    assert replace_attention(swapped) == 0  # already ours
    assert replace_attention(nn.Sequential(nn.Linear(2, 2))) == 0


def test_replace_attention_keeps_mode_dtype_sharing_and_frozen_weights():
    shared = nn.MultiheadAttention(8, 2).double()
    shared.in_proj_weight.requires_grad_(False)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)}).eval()
    assert replace_attention(model) == 1  # one module, shared by two parents
    new = model["a"]
    assert model["b"][0] is new and not new.training
    assert new.q_proj.weight.dtype == torch.float64
    assert not new.q_proj.weight.requires_grad and new.q_proj.bias.requires_grad


def test_replace_attention_factory_with_every_variant():
    model = _Model()
    del model.blocks
    x, kpm = _inputs()
    factories = {
        LocalAttention: lambda m: LocalAttention.from_torch(m, window_size=8),
        AdditiveAttention: AdditiveAttention.from_torch,
        LinformerAttention: lambda m: LinformerAttention.from_torch(m, seq_len=8, proj_len=8),
        CrossAttention: CrossAttention.from_torch,
    }
    for cls, factory in factories.items():
        swapped = copy.deepcopy(model)
        assert replace_attention(swapped, factory) == 1
        assert type(swapped.attn) is cls
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            assert torch.equal(getattr(swapped.attn, name).weight,
                               getattr(MultiHeadAttention.from_torch(model.attn), name).weight)
        assert swapped.attn(x, x, x, key_padding_mask=kpm)[0].shape == (2, 5, 16)
    local = copy.deepcopy(model)
    replace_attention(local, factories[LocalAttention])
    _same_outputs(model.attn, local.attn, x, kpm)  # window 8 > length 5: full attention


def test_replace_attention_moves_factory_output_to_the_old_device_dtype_and_mode():
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True).double()).eval()
    replace_attention(model, lambda m: MultiHeadAttention(8, 2))  # fp32, training
    assert model[0].q_proj.weight.dtype == torch.float64 and not model[0].training


@pytest.mark.parametrize(
    ("factory", "error", "match"),
    [
        (lambda m: "nope", TypeError, r"factory must return an nn.Module, got str for 'inner.0'"),
        (lambda m: MultiHeadAttention(8, 2), ValueError,
         r"embed_dim=16 for 'inner.0', got MultiHeadAttention with embed_dim=8"),
        (lambda m: nn.Linear(16, 16), ValueError, r"embed_dim=16 for 'inner.0'.*embed_dim=None"),
        (lambda m: MultiHeadAttention(16, 4, batch_first=False), ValueError,
         r"batch_first=True for 'inner.0'"),
    ],
)
def test_replace_attention_bad_factory_names_the_submodule(factory, error, match):
    model = nn.Module()
    model.inner = nn.Sequential(nn.MultiheadAttention(16, 4, batch_first=True))
    with pytest.raises(error, match=match):
        replace_attention(model, factory)


def test_replace_attention_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        replace_attention({"attn": nn.MultiheadAttention(8, 2)})
    with pytest.raises(TypeError, match="factory must be callable or None, got int"):
        replace_attention(nn.Linear(2, 2), factory=3)
    with pytest.raises(ValueError, match="use MultiHeadAttention.from_torch"):
        replace_attention(nn.MultiheadAttention(8, 2))


def test_replace_attention_skips_subclasses_with_their_own_forward():
    class Custom(nn.MultiheadAttention):
        def forward(self, query, key, value, **kwargs):
            return super().forward(query, key, value, **kwargs)

    model = nn.Sequential(Custom(8, 2), nn.MultiheadAttention(8, 2))
    with pytest.warns(UserWarning, match="skipped 0: Custom overrides"):
        assert replace_attention(model) == 1
    assert type(model[0]) is Custom and type(model[1]) is MultiHeadAttention


# ---------------------------------------------------------------------- from_torch


def test_from_torch_of_variants_takes_the_projections_and_keywords():
    ref = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=False, kdim=6, vdim=6)
    local = LocalAttention.from_torch(ref, window_size=3, causal=True)
    assert (local.window_size, local.causal, local.dropout, local.batch_first) == (3, True, 0.1,
                                                                                   False)
    assert torch.equal(local.k_proj.weight, ref.k_proj_weight)
    assert torch.equal(local.q_proj.bias, ref.in_proj_bias[:16])
    again = MultiHeadAttention.from_torch(local)  # an mmattn source: its projections
    assert torch.equal(again.v_proj.weight, local.v_proj.weight)
    assert torch.equal(again.v_proj.bias, local.v_proj.bias)
    with pytest.raises(NotImplementedError, match="LocalAttention.to_torch is not available"):
        local.to_torch()


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda m: LocalAttention.from_torch(m), TypeError,
         r"LocalAttention.from_torch needs window_size as keyword"),
        (lambda m: LinformerAttention.from_torch(m, seq_len=8), TypeError, r"needs proj_len"),
        (lambda m: LocalAttention.from_torch(m, window_size=2, num_heads=2), TypeError,
         r"takes num_heads from the source module"),
        (lambda m: LocalAttention.from_torch(m, window_sizes=2), TypeError,
         "got window_sizes, which LocalAttention does not take; its own arguments are "
         "window_size, causal"),
        (lambda m: CrossAttention.from_torch(m, window_size=2), TypeError,
         "got window_size, which CrossAttention does not take"),
    ],
)
def test_from_torch_bad_keywords(build, error, match):
    with pytest.raises(error, match=match):
        build(nn.MultiheadAttention(16, 4))


@pytest.mark.parametrize("build", [
    lambda m, **kw: MultiHeadAttention.from_torch(m, **kw),
    lambda m, **kw: CrossAttention.from_torch(m, **kw),
    lambda m, **kw: AdditiveAttention.from_torch(m, **kw),
    lambda m, **kw: LocalAttention.from_torch(m, window_size=2, **kw),
    lambda m, **kw: LinformerAttention.from_torch(m, seq_len=8, proj_len=4, **kw),
], ids=["full", "cross", "additive", "local", "linformer"])
def test_from_torch_refuses_num_kv_heads(build):
    """Grouped heads need smaller key/value weights than the source's: a named error, not
    a shape mismatch inside the copy."""
    for num_kv_heads in (1, 2):
        with pytest.raises(TypeError, match=r"from_torch takes num_kv_heads from the source "
                                            r"module \(num_kv_heads=4\); grouped-query"):
            build(nn.MultiheadAttention(16, 4, batch_first=True), num_kv_heads=num_kv_heads)


def test_from_torch_of_an_mmattn_source_keeps_its_heads_and_positions():
    source = MultiHeadAttention(16, 4, num_kv_heads=2, position="rotary").eval()
    x = torch.randn(2, 5, 16)
    for twin in (MultiHeadAttention.from_torch(source),
                 AdditiveAttention.from_torch(MultiHeadAttention.from_torch(source))):
        assert (twin.num_kv_heads, type(twin.position).__name__) == (2, "RotaryEmbedding")
    twin = MultiHeadAttention.from_torch(source).eval()
    torch.testing.assert_close(twin(x)[0], source(x)[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"takes num_kv_heads, position from the source"):
        MultiHeadAttention.from_torch(source, num_kv_heads=4, position=None)
    # a torch source has no positions: position= is the copy's own argument
    torch_mha = nn.MultiheadAttention(16, 4, batch_first=True)
    rotated = MultiHeadAttention.from_torch(torch_mha, position="rotary").eval()
    rope = RotaryEmbedding(4)
    q, k, v = (rearrange(F.linear(x, w, b), "b l (h e) -> b h l e", h=4) for w, b in zip(
        torch_mha.in_proj_weight.chunk(3), torch_mha.in_proj_bias.chunk(3)))
    heads = F.scaled_dot_product_attention(rope(q), rope(k), v)
    reference = torch_mha.out_proj(rearrange(heads, "b h l e -> b l (h e)"))
    torch.testing.assert_close(rotated(x)[0], reference, rtol=1e-5, atol=1e-6)


def test_from_torch_refuses_settings_a_variant_lacks():
    with pytest.raises(ValueError, match="LocalAttention has no add_bias_kv argument, but the "
                                         "source module has add_bias_kv=True"):
        LocalAttention.from_torch(nn.MultiheadAttention(16, 4, add_bias_kv=True), window_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocalAttention.from_torch(nn.MultiheadAttention(16, 4), window_size=2)  # defaults: fine


def test_replace_attention_skips_what_it_cannot_swap_faithfully():
    """Parametrized modules and tied parameters are skipped with the reason; hooks are
    reported as not carried over."""
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrized = nn.MultiheadAttention(8, 2)
    parametrize.register_parametrization(parametrized.out_proj, "weight", Scale())
    tied = nn.MultiheadAttention(8, 2)
    head = nn.Linear(8, 8)
    head.weight = tied.out_proj.weight
    hooked = nn.MultiheadAttention(8, 2)
    hooked.register_forward_hook(lambda m, args, out: None)
    model = nn.ModuleDict({"p": parametrized, "t": tied, "head": head, "h": hooked})
    with pytest.warns(UserWarning) as record:
        assert replace_attention(model) == 1
    messages = [str(w.message) for w in record]
    assert any("skipped p: it is parametrized" in m for m in messages)
    assert any("skipped t: its parameters are shared with head.weight" in m for m in messages)
    assert any("the hooks registered on h are not carried over" in m for m in messages)
    assert model["p"] is parametrized and model["t"] is tied
    assert type(model["h"]) is MultiHeadAttention
