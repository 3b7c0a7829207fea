"""pattern= on TransformerBlock, Encoder and MultiModalEncoder.

Each equals the same module (same weights) run with ``attn_mask=~pattern.dense(tokens)``;
the Encoder compiles once per forward and hands one SparseMask to every block; packed
Tokens give the padded run's real rows; the fused MultiModalEncoder reads spans, grids and
edges without any other argument.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Encoder, MultiModalEncoder, Tokens, TransformerBlock
from mmattn import patterns as P
from mmattn.debug import explain
from mmattn.patterns import SparseMask

D, H = 16, 2


def tokens(batch=2, length=70):
    mask = torch.arange(length)[None] < torch.tensor([[length], [51]])[:batch]
    docs = (torch.arange(length) // 23)[None].repeat(batch, 1)
    return Tokens(torch.randn(batch, length, D), mask, meta={"documents": docs})


PATTERN = P.same("documents") & P.window(9)


def grads(module):
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("causal", [False, True])
def test_encoder_and_block_equal_dense_mask(causal):
    t = tokens()
    dense = (PATTERN & P.causal() if causal else PATTERN).dense(t)
    for cls, kwargs in ((Encoder, {"depth": 2}), (TransformerBlock, {})):
        model = cls(D, num_heads=H, causal=causal, pattern=PATTERN, **kwargs)
        ref = cls(D, num_heads=H, causal=causal, **kwargs)
        ref.load_state_dict(model.state_dict())
        out, expected = model(t).x, ref(t, attn_mask=~dense).x
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        expected.square().sum().backward()
        for a, b in zip(grads(model), grads(ref)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_encoder_compiles_once_and_shares_the_mask():
    compiled = []

    class Counting(P.Pattern):
        def rule(self, ctx, b, q, k):
            return PATTERN.rule(ctx, b, q, k)

        def bound(self, ctx, tiles):
            return PATTERN.bound(ctx, tiles)

        def compile(self, tokens, block_size=64):
            compiled.append(block_size)
            return super().compile(tokens, block_size)

    encoder = Encoder(D, 3, H, pattern=Counting())
    masks = []
    for block in encoder.blocks:
        block.attn.register_forward_pre_hook(
            lambda mod, args, kwargs: masks.append(kwargs["attn_mask"]), with_kwargs=True)
    encoder(tokens())
    assert compiled == [64]
    assert len(masks) == 3 and all(m is masks[0] for m in masks)
    assert isinstance(masks[0], SparseMask)
    report = explain(encoder, tokens())
    assert [c.path for c in report] == ["block-sparse"] * 3
    assert report[0].density == pytest.approx(masks[0].density)
    assert "density" in str(report)


def test_packed_tokens_run_padded():
    t = tokens()
    encoder = Encoder(D, 2, H, pattern=PATTERN)
    packed = encoder(t.pack())
    assert packed.is_packed
    torch.testing.assert_close(packed.x.values(), encoder(t).x[t.mask], atol=1e-6, rtol=1e-6)
    block = TransformerBlock(D, H, pattern=P.causal())
    torch.testing.assert_close(block(t.pack()).x.values(), block(t).x[t.mask])


def test_sparse_mask_as_attn_mask_adds_the_tokens_padding():
    t = tokens()
    block = TransformerBlock(D, H, causal=True)
    mask = P.full().compile(Tokens(t.x))  # compiled without the padding
    expected = block(t, attn_mask=~P.full().dense(Tokens(t.x))).x
    torch.testing.assert_close(block(t, attn_mask=mask).x, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(Encoder(D, 1, H)(t, attn_mask=mask).x.shape, t.x.shape)


def test_multimodal_encoder_pattern_with_no_other_argument():
    adapters = pytest.importorskip("adapters")
    pytest.importorskip("torchaudio")
    geometric = pytest.importorskip("torch_geometric.data")
    graphs = geometric.Batch.from_data_list([
        geometric.Data(x=torch.randn(5, 3), edge_index=torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])),
        geometric.Data(x=torch.randn(3, 3), edge_index=torch.tensor([[0, 2], [1, 1]])),
    ])
    mods = {
        "text": adapters.TextTokenEmbedder(259, D, max_len=16),
        "image": adapters.ImagePatcher(D, patch_size=4, in_channels=1),
        "audio": adapters.AudioFrameEmbedder(D, sample_rate=8000, n_mels=16, n_fft=64,
                                             hop_length=32),
        "graph": adapters.GraphNodeSequencer(3, D),
    }
    pattern = P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(7), "audio": P.window(16),
                "graph": P.edges()},
        across=P.full(),
    )
    encoder = MultiModalEncoder(mods, D, 2, H, pattern=pattern)
    inputs = {
        "text": adapters.ByteTokenizer().encode(["patterns", "hi"]),
        "image": torch.rand(2, 1, 32, 40),  # an 8 x 10 grid
        "audio": (torch.randn(2, 800), torch.tensor([800, 500])),
        "graph": graphs,
    }
    out = encoder(inputs)
    fused = encoder.embed(inputs)
    ref = Encoder(D, 2, H)
    ref.load_state_dict(encoder.encoder.state_dict())
    dense = pattern.dense(fused)
    expected = ref(fused, attn_mask=~dense).x
    torch.testing.assert_close(out.x, expected, atol=1e-5, rtol=1e-5)
    # each modality kept its structure, and the modalities still meet
    spans = fused.meta["spans"]
    (t0, t1), (i0, i1), (g0, _) = spans["text"], spans["image"], spans["graph"]
    assert not dense[0, t0:t1, t0:t1].triu(1).any()  # causal text
    assert dense[0, i0:i1, i0:i1].sum(-1).max() == 49  # 7 x 7 image windows, not global
    graph = dense[0, g0:g0 + 5, g0:g0 + 5]
    assert graph.int().tolist()[2] == [0, 1, 1, 0, 0]  # node 2: itself and its source, 1
    assert dense[0, t0, i0] and dense[0, i0, g0]  # across: full
    (out.x.square().mean()).backward()
    assert all(torch.isfinite(p.grad).all() for p in encoder.parameters() if p.grad is not None)


def test_bad_input():
    with pytest.raises(TypeError, match="pattern must be a mmattn.patterns.Pattern"):
        Encoder(D, 1, H, pattern="causal")
    with pytest.raises(ValueError, match='pattern= needs fusion="concat"'):
        MultiModalEncoder({"a": TransformerBlock(D, H)}, D, 1, H, "latent", pattern=P.causal())
    t = tokens()
    with pytest.raises(ValueError, match="attn_mask and pattern= were both given"):
        Encoder(D, 1, H, pattern=P.causal())(t, attn_mask=torch.zeros(70, 70, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask: LocalAttention does not take a SparseMask"):
        TransformerBlock(D, H, attention="local", window_size=2, pattern=P.causal())(t)
