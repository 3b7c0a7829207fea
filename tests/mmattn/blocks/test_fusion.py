"""mmattn/blocks/fusion.py: MultiModalEncoder, concat and latent fusion, masks end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmattn import Tokens
from mmattn.blocks.fusion import MultiModalEncoder
from mmattn.masks import padding_mask

D = 16


class Padded(nn.Module):
    """A test adapter: (B, L, F) features and lengths -> Tokens with a padding mask."""

    def __init__(self, in_features: int, embed_dim: int = D) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.proj = nn.Linear(in_features, embed_dim)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> Tokens:
        mask = None if lengths is None else padding_mask(lengths, x.shape[1])
        return Tokens(self.proj(x), mask, {"width": x.shape[-1]})


def _encoder(fusion: str, **kw) -> MultiModalEncoder:
    adapters = {"a": Padded(3), "b": Padded(5)}
    return MultiModalEncoder(adapters, D, 2, 4, fusion, **kw)


def _inputs(la=(4, 2, 1), lb=(6, 3, 6), len_a=4, len_b=6):
    a = torch.randn(len(la), len_a, 3)
    b = torch.randn(len(lb), len_b, 5)
    return {"a": (a, torch.tensor(la)), "b": (b, torch.tensor(lb))}


def _scramble(inputs):
    out = {}
    for name, (x, lengths) in inputs.items():
        keep = padding_mask(lengths, x.shape[1])[..., None]
        out[name] = (torch.where(keep, x, 50 * torch.randn_like(x)), lengths)
    return out


def _alone(inputs, b):
    """Sample ``b`` alone, every modality cut to its real length."""
    return {
        name: (x[b : b + 1, : int(n[b])], n[b : b + 1]) for name, (x, n) in inputs.items()
    }


# ---------------------------------------------------------------- construction and embed


def test_embed_adds_modality_embedding_and_records_spans():
    enc = _encoder("concat")
    inputs = _inputs()
    fused = enc.embed(inputs)
    a = enc.adapters["a"](*inputs["a"])
    b = enc.adapters["b"](*inputs["b"])
    expected = torch.cat(
        [a.x + enc.modality_embedding["a"], b.x + enc.modality_embedding["b"]], dim=1
    )
    expected = expected * torch.cat([a.mask, b.mask], 1)[..., None]
    torch.testing.assert_close(fused.x, expected)
    assert torch.equal(fused.mask, torch.cat([a.mask, b.mask], dim=1))
    assert fused.meta["spans"] == {"a": (0, 4), "b": (4, 10)}
    assert fused.meta["a"] == {"width": 3} and fused.meta["modalities"] == ["a", "b"]


def test_concat_equals_encoder_over_fused_tokens():
    enc = _encoder("concat")
    inputs = _inputs()
    out = enc(inputs)
    ref = enc.encoder(enc.embed(inputs))
    torch.testing.assert_close(out.x, ref.x)
    assert out.x.shape == (3, 10, D)
    assert out.meta["fusion"] == "concat" and out.meta["spans"]["b"] == (4, 10)


def _ln(x, norm):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def _naive_attention(attn, x, c, real=None):
    """softmax(q kᵀ/√e) v per head with plain tensor ops, from the module's weights only."""
    heads = attn.num_heads
    q, k, v = (
        (t @ p.weight.T + p.bias).unflatten(-1, (heads, -1)).transpose(1, 2)
        for t, p in ((x, attn.q_proj), (c, attn.k_proj), (c, attn.v_proj))
    )
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if real is not None:
        scores = scores.masked_fill(~real[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return out @ attn.out_proj.weight.T + attn.out_proj.bias


def _mlp(mlp, x):
    hidden = torch.nn.functional.gelu(x @ mlp[0].weight.T + mlp[0].bias)
    return hidden @ mlp[3].weight.T + mlp[3].bias


def test_latent_equals_perceiver_reference():
    """Perceiver written out with tensor ops (no block or attention module is called)."""
    enc = _encoder("latent", num_latents=5).eval()
    inputs = _inputs()
    out = enc(inputs)
    # The fused input, built by hand from the adapters and the modality embeddings.
    names = ("a", "b")
    parts = [enc.adapters[name](*inputs[name]) for name in names]
    context = torch.cat(
        [t.x + enc.modality_embedding[name] for name, t in zip(names, parts)], dim=1
    )
    real = torch.cat([t.mask for t in parts], dim=1)
    context = context * real[..., None]
    x = enc.latents.expand(3, 5, D)
    for cross, block in zip(enc.cross_blocks, enc.self_blocks):
        c = _ln(context, cross.norm_context)
        x = x + _naive_attention(cross.attn, _ln(x, cross.norm_query), c, real)
        x = x + _mlp(cross.mlp, _ln(x, cross.norm2))
        h = _ln(x, block.norm1)
        x = x + _naive_attention(block.attn, h, h)
        x = x + _mlp(block.mlp, _ln(x, block.norm2))
    torch.testing.assert_close(out.x, _ln(x, enc.norm), atol=1e-5, rtol=1e-5)
    assert out.x.shape == (3, 5, D) and out.mask is None
    assert out.meta["fusion"] == "latent" and out.meta["spans"] == {"a": (0, 4), "b": (4, 10)}
    torch.testing.assert_close(out.meta["context"].x, context)


def test_latent_size_does_not_depend_on_input_length():
    enc = _encoder("latent", num_latents=3)
    short = enc(_inputs(len_a=4, len_b=6))
    long = enc(_inputs(la=(9, 2, 1), lb=(6, 3, 20), len_a=9, len_b=20))
    assert short.x.shape == long.x.shape == (3, 3, D)


def test_concat_and_latent_differ_but_share_the_embedding_stage():
    concat, latent = _encoder("concat"), _encoder("latent")
    latent.adapters.load_state_dict(concat.adapters.state_dict())
    with torch.no_grad():
        latent.modality_embedding.load_state_dict(concat.modality_embedding.state_dict())
    inputs = _inputs()
    torch.testing.assert_close(concat.embed(inputs).x, latent.embed(inputs).x)
    assert concat(inputs).x.shape[1] == 10 and latent(inputs).x.shape[1] == 16


# ---------------------------------------------------------------- masks end to end


@pytest.mark.parametrize("fusion", ["concat", "latent"])
def test_padding_invariance_through_whole_encoder(fusion):
    enc = _encoder(fusion)
    inputs = _inputs()
    a, b = enc(inputs).x, enc(_scramble(inputs)).x
    assert torch.equal(a, b)


@pytest.mark.parametrize("fusion", ["concat", "latent"])
def test_padded_batch_equals_each_sample_alone(fusion):
    enc = _encoder(fusion)
    inputs = _inputs()
    out = enc(inputs)
    for b in range(3):
        alone = enc(_alone(inputs, b))
        if fusion == "latent":
            torch.testing.assert_close(out.x[b : b + 1], alone.x, atol=1e-5, rtol=1e-4)
            continue
        real = out.x[b][out.mask[b]]  # real tokens in order, padding dropped
        torch.testing.assert_close(real, alone.x[0], atol=1e-5, rtol=1e-4)


def test_concat_padded_outputs_are_zero():
    enc = _encoder("concat")
    out = enc(_inputs())
    assert out.x[~out.mask].abs().sum().item() == 0.0


def test_modalities_may_be_left_out():
    enc = _encoder("concat")
    inputs = _inputs()
    out = enc({"b": inputs["b"]})
    assert out.meta["spans"] == {"b": (0, 6)} and out.meta["modalities"] == ["b"]
    ref = enc.encoder(Tokens.cat({"b": enc.adapters["b"](*inputs["b"])}).replace(
        enc.adapters["b"](*inputs["b"]).x + enc.modality_embedding["b"]
    ))
    torch.testing.assert_close(out.x, ref.x)


def test_kwargs_inputs_are_passed_by_name():
    enc = _encoder("concat")
    (xa, la), (xb, lb) = _inputs().values()
    by_tuple = enc({"a": (xa, la), "b": (xb, lb)}).x
    by_name = enc({"a": {"x": xa, "lengths": la}, "b": {"x": xb, "lengths": lb}}).x
    torch.testing.assert_close(by_tuple, by_name)


# ---------------------------------------------------------------- gradients reach every adapter


@pytest.mark.parametrize("fusion", ["concat", "latent"])
def test_gradients_reach_every_parameter_of_real_adapters(fusion):
    adapters = pytest.importorskip("adapters")
    pytest.importorskip("torchaudio")
    mods = {
        "text": adapters.TextTokenEmbedder(259, D, positional="learned", max_len=16),
        "image": adapters.ImagePatcher(D, patch_size=4, in_channels=1, img_size=8),
        "audio": adapters.AudioFrameEmbedder(D, sample_rate=8000, n_mels=16, n_fft=64,
                                             hop_length=32),
    }
    enc = MultiModalEncoder(mods, D, 1, 2, fusion, num_latents=4)
    ids = adapters.ByteTokenizer().encode(["I love AI", "hi"])
    inputs = {
        "text": ids,
        "image": torch.rand(2, 1, 8, 8),
        "audio": (torch.randn(2, 800), torch.tensor([800, 500])),
    }
    out = enc(inputs)
    (out.x.square().mean()).backward()
    for name, param in enc.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


# ---------------------------------------------------------------- errors


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="adapters must be a mapping"):
        MultiModalEncoder([Padded(3)], D, 1, 2)
    with pytest.raises(ValueError, match="adapters must hold at least one"):
        MultiModalEncoder({}, D, 1, 2)
    with pytest.raises(TypeError, match=r"adapters\['a'\] must be an nn.Module"):
        MultiModalEncoder({"a": lambda x: x}, D, 1, 2)
    with pytest.raises(ValueError, match=r"adapters\['a'\] has embed_dim=8"):
        MultiModalEncoder({"a": Padded(3, embed_dim=8)}, D, 1, 2)
    with pytest.raises(ValueError, match="fusion must be one of"):
        MultiModalEncoder({"a": Padded(3)}, D, 1, 2, fusion="sum")
    with pytest.raises(ValueError, match="num_latents must be >= 1"):
        MultiModalEncoder({"a": Padded(3)}, D, 1, 2, fusion="latent", num_latents=0)
    enc = _encoder("concat")
    inputs = _inputs()
    with pytest.raises(TypeError, match="inputs must be a mapping"):
        enc([inputs["a"]])
    with pytest.raises(ValueError, match=r"inputs has unknown modalities \['c'\]"):
        enc({"c": inputs["a"]})
    with pytest.raises(ValueError, match="inputs must hold at least one"):
        enc({})
    with pytest.raises(ValueError, match="inputs must share one batch size"):
        enc({"a": inputs["a"], "b": (inputs["b"][0][:2], inputs["b"][1][:2])})

    class Bad(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match=r"adapters\['bad'\] must return mmattn.Tokens"):
        MultiModalEncoder({"bad": Bad()}, D, 1, 2)({"bad": torch.randn(1, 2, D)})


def test_repr_and_reset():
    enc = _encoder("latent", num_latents=7)
    text = repr(enc)
    assert "modalities=['a', 'b']" in text and "fusion='latent'" in text
    assert "num_latents=7" in text
    with torch.no_grad():
        enc.latents.zero_()
    enc.reset_parameters()
    assert enc.latents.abs().sum() > 0
