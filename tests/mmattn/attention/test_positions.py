"""``forward(..., positions=)``: every attention path rotates each token at its own position.

The reference applies the rotary module by hand to the head-split queries and keys, then
runs dense softmax attention in float64 with the layer's weights (``reference`` below), or,
for a layer with its own geometry, the same layer's dense twin (MultiHeadAttention with the
mask) given the same positions. Packed input is compared with the padded batch, cached
decoding with the whole sequence, block-sparse with the dense mask, blocks with a hand-run
pre-norm block; ``Tokens.meta["positions"]`` reaches the attention through every block.
"""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    EdgeAttention,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
    MultiModalEncoder,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)
from mmattn import patterns as P
from mmattn.functional import fused_attn
from mmattn.masks import neighborhood_mask
from mmattn.rotary import MultiAxisRotary, RotaryEmbedding, mrope_positions

D, H, E = 32, 4, 8
F64 = {"dtype": torch.float64}
TOL = {"atol": 1e-10, "rtol": 1e-10}


def rope3() -> MultiAxisRotary:
    return MultiAxisRotary(E, (1, 1, 2))


def positions3(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length, 3))


def reference(mha, x, positions, *, key_padding=None, causal=False, allowed=None):
    """Rotate by hand, then dense softmax attention; dead rows 0 (mmattn's rule)."""
    heads, kv_heads = mha.num_heads, mha.num_kv_heads
    rope = mha.position
    q = rope(rearrange(mha.q_proj(x), "b l (h e) -> b h l e", h=heads), positions)
    k = rope(rearrange(mha.k_proj(x), "b l (h e) -> b h l e", h=kv_heads), positions)
    v = rearrange(mha.v_proj(x), "b l (h e) -> b h l e", h=kv_heads)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    length = x.shape[1]
    ok = torch.ones(x.shape[0], 1, length, length, dtype=torch.bool)
    if key_padding is not None:
        ok = ok & ~key_padding[:, None, None, :]
    if causal:
        ok = ok & torch.ones(length, length, dtype=torch.bool).tril()
    if allowed is not None:
        ok = ok & allowed
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~ok, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return mha.out_proj(rearrange(weights @ v, "b h l e -> b l (h e)"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mha_with_multi_axis_positions_equals_rotating_by_hand(fused, causal):
    mha = MultiHeadAttention(D, H, num_kv_heads=2, position=rope3(), **F64)
    x = torch.randn(3, 11, D, **F64)
    pos = positions3(3, 11)
    padding = torch.arange(11) >= torch.tensor([11, 7, 4])[:, None]
    with fused_attn(fused):
        out, _ = mha(x, key_padding_mask=padding, is_causal=causal, positions=pos)
    want = reference(mha, x, pos, key_padding=padding, causal=causal)
    real = ~padding
    torch.testing.assert_close(out[real], want[real], **TOL)


def test_1d_rotary_at_per_token_positions_equals_rotating_by_hand():
    mha = MultiHeadAttention(D, H, position="rotary", **F64)
    x = torch.randn(2, 9, D, **F64)
    pos = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(mha(x, positions=pos)[0], reference(mha, x, pos), **TOL)
    # text positions 0, 1, 2, ... are what the module does without positions
    steps = torch.arange(9).expand(2, 9)
    torch.testing.assert_close(mha(x, positions=steps)[0], mha(x)[0], **TOL)


def test_every_layout_takes_batch_first_positions():
    mha = MultiHeadAttention(D, H, position=rope3(), **F64)
    x, pos = torch.randn(2, 6, D, **F64), positions3(2, 6)
    want = mha(x, positions=pos)[0]
    torch.testing.assert_close(mha(x[1], positions=pos[1])[0], want[1], **TOL)  # unbatched
    seq_first = MultiHeadAttention(D, H, position=rope3(), batch_first=False, **F64)
    seq_first.load_state_dict(mha.state_dict())
    out = seq_first(x.transpose(0, 1), positions=pos)[0]
    torch.testing.assert_close(out.transpose(0, 1), want, **TOL)


def test_positions_at_padding_never_reach_real_tokens():
    mha = MultiHeadAttention(D, H, position=rope3())
    x, pos = torch.randn(2, 8, D), positions3(2, 8)
    padding = torch.arange(8) >= torch.tensor([8, 5])[:, None]
    out = mha(x, key_padding_mask=padding, positions=pos)[0]
    moved = pos.masked_fill(padding[..., None], 999)
    again = mha(x, key_padding_mask=padding, positions=moved)[0]
    torch.testing.assert_close(again[~padding], out[~padding], atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_with_positions_equals_the_band(causal):
    local = LocalAttention(D, H, 2, causal=causal, position=rope3(), **F64)
    x, pos = torch.randn(2, 13, D, **F64), positions3(2, 13)
    i = torch.arange(13)
    band = (i[:, None] - i[None, :]).abs() <= 2
    want = reference(local, x, pos, causal=causal, allowed=band)
    torch.testing.assert_close(local(x, positions=pos)[0], want, **TOL)


def test_additive_attention_rotates_before_its_scores():
    additive = AdditiveAttention(D, H, position=rope3(), **F64)
    x, pos = torch.randn(2, 7, D, **F64), positions3(2, 7)
    q = rope3()(rearrange(additive.q_proj(x), "b l (h e) -> b h l e", h=H), pos)
    k = rope3()(rearrange(additive.k_proj(x), "b l (h e) -> b h l e", h=H), pos)
    v = rearrange(additive.v_proj(x), "b l (h e) -> b h l e", h=H)
    out, _ = additive._attention(q, k, v, None, is_causal=False, dropout_p=0.0,
                                 need_weights=False)
    want = additive.out_proj(rearrange(out, "b h l e -> b l (h e)"))
    torch.testing.assert_close(additive(x, positions=pos)[0], want, **TOL)


def _neighborhood_pair():
    nbhd = NeighborhoodAttention(D, H, 3, position=rope3(), **F64)
    dense = MultiHeadAttention(D, H, position=rope3(), **F64)
    dense.load_state_dict(nbhd.state_dict())
    return nbhd, dense


def test_neighborhood_attention_with_positions_equals_its_dense_twin():
    nbhd, dense = _neighborhood_pair()
    x, pos = torch.randn(2, 20, D, **F64), positions3(2, 20)
    allowed = neighborhood_mask((4, 5), 3)
    out = nbhd(x, grid=(4, 5), positions=pos)[0]
    torch.testing.assert_close(out, dense(x, attn_mask=~allowed, positions=pos)[0], **TOL)
    torch.testing.assert_close(out, reference(dense, x, pos, allowed=allowed), **TOL)


def test_packed_neighborhood_items_with_positions_equal_each_alone():
    nbhd, _ = _neighborhood_pair()
    grids = [(3, 4), (2, 2)]
    items = [torch.randn(12, D, **F64), torch.randn(4, D, **F64)]
    pos = [positions3(1, 12)[0], positions3(1, 4)[0]]
    padded_pos = torch.zeros(2, 12, 3, dtype=torch.long)
    padded_pos[0], padded_pos[1, :4] = pos[0], pos[1]
    packed = Tokens.from_packed(torch.cat(items), torch.tensor([0, 12, 16]))
    out = nbhd(packed.x, grid=grids, positions=padded_pos)[0].values()
    for m, (x, p, grid) in enumerate(zip(items, pos, grids)):
        alone = nbhd(x[None], grid=grid, positions=p[None])[0][0]
        torch.testing.assert_close(out[[0, 12][m]:[12, 16][m]], alone, **TOL)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_packed_input_with_positions_equals_the_padded_batch(fused):
    mha = MultiHeadAttention(D, H, num_kv_heads=2, position=rope3(), **F64)
    lengths = [7, 3, 5]
    x = torch.randn(3, 7, D, **F64)
    mask = torch.arange(7) < torch.tensor(lengths)[:, None]
    pos = positions3(3, 7)
    tokens = Tokens(x, mask)
    with fused_attn(fused):
        packed = mha(tokens.pack().x, is_causal=True, positions=pos)[0].values()
        padded = mha(x, key_padding_mask=~mask, is_causal=True, positions=pos)[0]
    torch.testing.assert_close(packed, padded[mask], **TOL)


def test_sparse_mask_with_positions_equals_the_dense_mask():
    mha = MultiHeadAttention(D, H, position=rope3(), **F64)
    tokens = Tokens(torch.randn(2, 70, D, **F64), torch.arange(70) < torch.tensor([[70], [41]]))
    pos = positions3(2, 70)
    sparse = (P.causal() & P.window(9)).compile(tokens, block_size=16)
    out = mha(tokens.x, attn_mask=sparse, positions=pos)[0]
    want = reference(mha, tokens.x, pos, allowed=sparse.dense()[:, None])
    real = tokens.mask
    torch.testing.assert_close(out[real], want[real], **TOL)


def test_decoding_with_the_new_tokens_positions_equals_the_whole_sequence():
    mha = MultiHeadAttention(D, H, num_kv_heads=2, position=rope3(), **F64)
    x, pos = torch.randn(2, 9, D, **F64), positions3(2, 9)
    whole = mha(x, is_causal=True, positions=pos)[0]
    cache = mha.make_cache(2, 9)
    steps = [mha(x[:, a:b], is_causal=True, cache=cache, positions=pos[:, a:b])[0]
             for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, **TOL)


def test_ring_cache_decoding_with_positions_equals_the_causal_band():
    local = LocalAttention(D, H, 3, causal=True, position=rope3(), **F64)
    x, pos = torch.randn(1, 8, D, **F64), positions3(1, 8)
    whole = local(x, positions=pos)[0]
    cache = local.make_cache(1, 8)
    steps = [local(x[:, t:t + 1], cache=cache, positions=pos[:, t:t + 1])[0] for t in range(8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, **TOL)


# --------------------------------------------------------------------------------- blocks


def _by_hand(block: TransformerBlock, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The pre-norm block, written out, with the positions given to its attention."""
    x = x + block.attn(block.norm1(x), positions=pos)[0]
    return x + block.mlp(block.norm2(x))


def test_blocks_pass_meta_positions_to_their_attention():
    encoder = Encoder(D, 2, H, attention_kwargs={"position": rope3()}, final_norm=False, **F64)
    x, pos = torch.randn(2, 10, D, **F64), positions3(2, 10)
    out = encoder(Tokens(x, None, {"positions": pos})).x
    want = x
    for block in encoder.blocks:
        want = _by_hand(block, want, pos)
    torch.testing.assert_close(out, want, **TOL)
    assert not torch.allclose(encoder(Tokens(x)).x, out)  # without positions: 0, 1, 2, ...
    block = encoder.blocks[0]
    torch.testing.assert_close(block(Tokens(x, None, {"positions": pos})).x,
                               _by_hand(block, x, pos), **TOL)


def test_packed_tokens_and_patterns_carry_positions_through_the_encoder():
    encoder = Encoder(D, 2, H, causal=True, attention_kwargs={"position": rope3()}, **F64)
    mask = torch.arange(9) < torch.tensor([9, 4, 6])[:, None]
    tokens = Tokens(torch.randn(3, 9, D, **F64), mask, {"positions": positions3(3, 9)})
    padded = encoder(tokens).x
    packed = encoder(tokens.pack()).x.values()
    torch.testing.assert_close(packed, padded[mask], **TOL)
    patterned = Encoder(D, 2, H, pattern=P.causal(), attention_kwargs={"position": rope3()},
                        **F64)
    patterned.load_state_dict(encoder.state_dict())
    torch.testing.assert_close(patterned(tokens).x[mask], padded[mask], **TOL)


def test_block_decoding_takes_the_step_tokens_positions():
    block = TransformerBlock(D, H, causal=True, attention_kwargs={"position": rope3()}, **F64)
    x, pos = torch.randn(1, 6, D, **F64), positions3(1, 6)
    whole = block(Tokens(x, None, {"positions": pos})).x
    cache = block.attn.make_cache(1, 6)
    steps = [block(Tokens(x[:, t:t + 1], None, {"positions": pos[:, t:t + 1]}), cache=cache).x
             for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, **TOL)


class _Grid(torch.nn.Module):
    """A stand-in adapter: (B, n, 3) features on a grid given at construction."""

    def __init__(self, grid):
        super().__init__()
        self.embed_dim, self.grid = D, grid
        self.proj = torch.nn.Linear(3, D, dtype=torch.float64)

    def forward(self, values):
        meta = {} if self.grid is None else {"grid": self.grid}
        return Tokens(self.proj(values), None, meta)


def test_multimodal_encoder_positions_from_mrope():
    parts = {"text": _Grid(None), "video": _Grid((2, 2, 3))}
    kwargs = dict(attention_kwargs={"position": rope3()}, **F64)
    encoder = MultiModalEncoder(parts, D, 1, H, positions=mrope_positions, **kwargs)
    inputs = {"text": torch.randn(2, 4, 3, **F64), "video": torch.randn(2, 12, 3, **F64)}
    fused = encoder.embed(inputs)
    torch.testing.assert_close(fused.meta["positions"], mrope_positions(fused))
    assert fused.meta["positions"][0, 4:8, 2].tolist() == [4, 5, 6, 4]  # video columns
    out = encoder(inputs).x
    want = encoder.encoder(fused.replace(positions=fused.meta["positions"])).x
    torch.testing.assert_close(out, want, **TOL)
    plain = MultiModalEncoder(parts, D, 1, H, **kwargs)
    plain.load_state_dict(encoder.state_dict())
    assert not torch.allclose(plain(inputs).x, out)
    with pytest.raises(TypeError, match="positions must be a function of the fused Tokens"):
        MultiModalEncoder(parts, D, 1, H, positions="mrope")


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "module, kwargs",
    [
        (MultiHeadAttention(D, H), {}),
        (CrossAttention(D, H), {"key": torch.randn(2, 5, D)}),
        (LinformerAttention(D, H, seq_len=5, proj_len=3), {}),
        (EdgeAttention(D, H), {"edge_index": torch.tensor([[0], [1]])}),
    ],
    ids=["mha", "cross", "linformer", "edge"],
)
def test_positions_without_a_position_module_raise(module, kwargs):
    with pytest.raises(ValueError, match=rf"positions= needs a position module, but this "
                                         rf"{type(module).__name__} has none"):
        module(torch.randn(2, 5, D), positions=positions3(2, 5), **kwargs)


@pytest.mark.parametrize(
    "position, positions, match",
    [
        (rope3(), torch.zeros(2, 5, dtype=torch.long),
         r"positions must have shape \(batch, length, axes\)=\(2, 5, 3\) for "
         r"MultiHeadAttention's MultiAxisRotary with num_axes=3, got \(2, 5\)"),
        ("rotary", torch.zeros(2, 5, 3, dtype=torch.long),
         r"positions must have shape \(batch, length\)=\(2, 5\) for MultiHeadAttention's "
         r"RotaryEmbedding \(one axis\), got \(2, 5, 3\)"),
        (rope3(), torch.zeros(2, 4, 3, dtype=torch.long), r"=\(2, 5, 3\).*got \(2, 4, 3\)"),
        (rope3(), torch.zeros(2, 5, 3, dtype=torch.bool), "positions must hold integers or "
                                                          "floats, got torch.bool"),
        (rope3(), [[0, 1]], "positions must be a torch.Tensor, got list"),
    ],
)
def test_positions_of_the_wrong_shape_or_type_raise(position, positions, match):
    mha = MultiHeadAttention(D, H, position=position)
    error = TypeError if "must be a torch" in match or "integers" in match else ValueError
    with pytest.raises(error, match=match):
        mha(torch.randn(2, 5, D), positions=positions)


def test_positions_need_keys_that_are_the_query_tokens():
    mha = MultiHeadAttention(D, H, position=rope3())
    with pytest.raises(ValueError, match="key must have the query's length 5 with positions=, "
                                         "got key length 7"):
        mha(torch.randn(2, 5, D), torch.randn(2, 7, D), positions=positions3(2, 5))


def test_geometry_hands_positions_only_to_layers_that_read_them():
    pos = positions3(1, 4)
    meta = {"positions": pos, "grid": (2, 2)}
    assert MultiHeadAttention(D, H).geometry(meta) == {}
    assert MultiHeadAttention(D, H, position=rope3()).geometry(meta)["positions"] is pos
    assert set(NeighborhoodAttention(D, H, 3, position=rope3()).geometry(meta)) >= {
        "grid", "positions"
    }
    assert "positions" not in EdgeAttention(D, H).geometry({**meta, "edge_index": pos[0, :2]})


def test_float_positions_and_rotary_embedding_module():
    mha = MultiHeadAttention(D, H, position=RotaryEmbedding(E), **F64)
    x = torch.randn(1, 5, D, **F64)
    pos = torch.tensor([[0.0, 1.5, 2.0, 7.25, 9.0]])
    torch.testing.assert_close(mha(x, positions=pos)[0], reference(mha, x, pos), **TOL)


# ------------------------------------------------------------------------ compile, export


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_and_exported_modules_take_positions():
    mha = MultiHeadAttention(D, H, num_kv_heads=2, position=rope3())
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True, dynamic=True)
    for length in (5, 9):
        x, pos = torch.randn(2, length, D), positions3(2, length)
        torch.testing.assert_close(compiled(x, is_causal=True, positions=pos)[0],
                                   mha(x, is_causal=True, positions=pos)[0])
    x, pos = torch.randn(2, 6, D), positions3(2, 6)
    exported = torch.export.export(mha, (x,), {"positions": pos})
    x2, pos2 = torch.randn(2, 6, D), positions3(2, 6)
    torch.testing.assert_close(exported.module()(x2, positions=pos2)[0],
                               mha(x2, positions=pos2)[0])


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_encoder_reads_meta_positions():
    encoder = Encoder(D, 1, H, causal=True, attention_kwargs={"position": rope3()}).eval()
    compiled = torch.compile(encoder, backend="aot_eager", fullgraph=True, dynamic=True)
    for length in (6, 10):
        tokens = Tokens(torch.randn(2, length, D), None, {"positions": positions3(2, length)})
        torch.testing.assert_close(compiled(tokens).x, encoder(tokens).x)
