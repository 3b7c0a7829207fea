"""Packed (jagged) input end to end, against the same module on padded input with a mask.

The reference is always the padded path: the same real tokens laid out by a Python loop in a
(B, L, D) batch with ``key_padding_mask``. Packed results must equal it on the real tokens
within 1e-5 (fp32), and so must the gradients of the inputs and of every parameter. Lengths
include 0, 1 and one item much longer than the rest.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmattn import (
    AdditiveAttention,
    AttentionPool,
    CrossAttention,
    CrossAttentionBlock,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MaskedPool,
    MultiHeadAttention,
    MultiModalEncoder,
    Tokens,
    TransformerBlock,
    masked_max,
    masked_mean,
)
from mmattn.functional import fused_attn
from mmattn.kernels import dense as _kernel
from mmattn.kernels.packed import plan

E, H = 16, 4
LENS = [5, 0, 1, 37, 3, 8]  # an empty item, a single token, one long item
CTX = [4, 6, 0, 2, 30, 1]  # cross-attention context lengths (an empty context)
TOL = 1e-5


def batch(lens, dim=E, device="cpu"):
    """(packed leaf values, offsets) and an independent padded copy with its leaf and mask."""
    values = torch.randn(sum(lens), dim, device=device, requires_grad=True)
    offsets = torch.tensor([0, *lens], device=device).cumsum(0)
    leaf = values.detach().clone().requires_grad_()
    rows, start = [], 0
    for n in lens:
        rows.append(torch.cat([leaf[start:start + n], leaf.new_zeros(max(lens) - n, dim)]))
        start += n
    padded = torch.stack(rows)
    mask = torch.arange(max(lens), device=device)[None, :] < torch.tensor(lens, device=device)[
        :, None
    ]
    return values, offsets, padded, mask, leaf


def real(padded, lens):
    """The real rows of a padded (B, L, D) result, item after item."""
    return torch.cat([padded[b, :n] for b, n in enumerate(lens)])


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max().item()


def compare_grads(module, pairs, packed_loss, padded_loss):
    """Backward both losses; the input leaves and every parameter get equal gradients."""
    module.zero_grad()
    packed_loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    padded_loss.backward()
    for name, p in module.named_parameters():
        if name in grads:
            close(grads[name], p.grad)
    for packed_leaf, padded_leaf in pairs:
        assert torch.isfinite(packed_leaf.grad).all()
        close(packed_leaf.grad, padded_leaf.grad)


MODULES = {
    "mha": lambda: MultiHeadAttention(E, H),
    "local-narrow": lambda: LocalAttention(E, H, window_size=2),
    "local-wide": lambda: LocalAttention(E, H, window_size=50),
    "local-global": lambda: LocalAttention(E, H, window_size=3, num_global_tokens=2),
    "additive": lambda: AdditiveAttention(E, H),
    "linformer": lambda: LinformerAttention(E, H, seq_len=40, proj_len=6),
    "mha-bias-kv-zero-attn": lambda: MultiHeadAttention(E, H, add_bias_kv=True,
                                                        add_zero_attn=True),
    "mha-gqa-rotary": lambda: MultiHeadAttention(E, H, num_kv_heads=2, position="rotary"),
    "local-gqa-rotary": lambda: LocalAttention(E, H, window_size=3, num_kv_heads=1,
                                               position="rotary"),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_self_attention_packed_equals_padded(name, causal, fused, device):
    if name == "linformer" and causal:
        pytest.skip("Linformer has no causal mode (its error is tested below)")
    module = MODULES[name]().to(device)
    values, offsets, padded, mask, leaf = batch(LENS, device=device)
    nt = Tokens.from_packed(values, offsets).x
    weight = torch.randn(sum(LENS), E, device=device)
    with fused_attn(fused):
        out, _ = module(nt, is_causal=causal)
        ref, _ = module(padded, key_padding_mask=~mask, is_causal=causal)
    assert out.is_nested and torch.equal(out.offsets(), offsets)
    close(out.values(), real(ref, LENS))
    compare_grads(
        module, [(values, leaf)], (out.values() * weight).sum(), (real(ref, LENS) * weight).sum()
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cls", [CrossAttention, AdditiveAttention])
def test_cross_attention_different_lengths(cls, causal, device):
    module = cls(E, H, kdim=12).to(device) if cls is CrossAttention else cls(
        E, H, kdim=12, vdim=12
    ).to(device)
    q_values, q_off, q_pad, _, q_leaf = batch(LENS, device=device)
    c_values, c_off, c_pad, c_mask, c_leaf = batch(CTX, dim=12, device=device)
    query, context = Tokens.from_packed(q_values, q_off).x, Tokens.from_packed(c_values, c_off).x
    out, weights = module(query, context, is_causal=causal, need_weights=True)
    ref, ref_w = module(q_pad, c_pad, key_padding_mask=~c_mask, is_causal=causal,
                        need_weights=True)
    close(out.values(), real(ref, LENS))
    for b, (n, m) in enumerate(zip(LENS, CTX)):
        close(weights[b], ref_w[b, :n, :m])
    # the item with an empty context gets a zero attention result: out_proj's bias
    empty = sum(LENS[:2])
    close(out.values()[empty:empty + LENS[2]], module.out_proj.bias.expand(LENS[2], E))
    weight = torch.randn(sum(LENS), E, device=device)
    compare_grads(
        module, [(q_values, q_leaf), (c_values, c_leaf)], (out.values() * weight).sum(),
        (real(ref, LENS) * weight).sum(),
    )


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("name", ["mha", "local-narrow", "additive", "linformer",
                                  "mha-bias-kv-zero-attn"])
def test_need_weights_gives_one_map_per_item(name, average):
    module = MODULES[name]()
    values, offsets, padded, mask, _ = batch(LENS)
    out, maps = module(Tokens.from_packed(values, offsets).x, need_weights=True,
                       average_attn_weights=average)
    ref, ref_w = module(padded, key_padding_mask=~mask, need_weights=True,
                        average_attn_weights=average)
    assert isinstance(maps, list) and len(maps) == len(LENS)
    extra = 2 if name == "mha-bias-kv-zero-attn" else 0
    longest = max(LENS)
    for b, n in enumerate(LENS):
        expected = ref_w[b][..., :n, :]
        if name != "linformer":  # keys: the item's real keys, then the appended ones
            expected = torch.cat([expected[..., :n], expected[..., longest:longest + extra]], -1)
        close(maps[b], expected)
    close(out.values(), real(ref, LENS))


@pytest.mark.parametrize("kind", ["2d-bool", "3d-float"])
def test_attn_mask_applies_to_each_items_corner(kind):
    module = MultiHeadAttention(E, H)
    values, offsets, padded, mask, _ = batch(LENS)
    longest = max(LENS)
    if kind == "2d-bool":
        attn_mask = torch.rand(longest, longest) > 0.7
    else:
        attn_mask = torch.randn(len(LENS) * H, longest, longest)
    out, _ = module(Tokens.from_packed(values, offsets).x, attn_mask=attn_mask)
    ref, _ = module(padded, key_padding_mask=~mask, attn_mask=attn_mask)
    close(out.values(), real(ref, LENS))


def test_empty_items_give_zeros_not_nan():
    module = MultiHeadAttention(E, H)
    values = torch.zeros(0, E, requires_grad=True)
    out, maps = module(Tokens.from_packed(values, torch.tensor([0, 0, 0])).x, need_weights=True)
    assert out.values().shape == (0, E) and [m.shape for m in maps] == [(0, 0), (0, 0)]
    query = Tokens.from_packed(torch.randn(3, E, requires_grad=True), torch.tensor([0, 3])).x
    context = Tokens.from_packed(torch.randn(0, E, requires_grad=True), torch.tensor([0, 0])).x
    out, _ = module(query, context)
    close(out.values(), module.out_proj.bias.expand(3, E))
    out.values().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


# ---------------------------------------------------------------------- bad input


def test_mixing_packed_and_padded_raises_type_error_naming_both():
    module = CrossAttention(E, H)
    packed = Tokens.from_packed(torch.randn(4, E), torch.tensor([0, 1, 4])).x
    with pytest.raises(TypeError, match="query is packed .* but key and value are padded"):
        module(packed, torch.randn(2, 3, E))
    with pytest.raises(TypeError, match="key and value are packed .* but query is padded"):
        module(torch.randn(2, 3, E), packed)
    block = CrossAttentionBlock(E, H)
    with pytest.raises(TypeError, match="query is packed but context is padded"):
        block(Tokens(packed), Tokens(torch.randn(2, 3, E)))
    with pytest.raises(TypeError, match=r"\['a'\] are packed but parts \['b'\] are padded"):
        Tokens.cat({"a": Tokens(packed), "b": Tokens(torch.randn(2, 3, E))})


def test_packed_bad_width_offsets_and_masks_raise_value_error():
    module = MultiHeadAttention(E, H)
    wrong = Tokens.from_packed(torch.randn(4, E + 1), torch.tensor([0, 1, 4])).x
    with pytest.raises(ValueError, match=r"query must have last dimension embed_dim=16"):
        module(wrong)
    for offsets in ([0, 3, 2, 4], [1, 2, 4], [0, 1, 3]):
        with pytest.raises(ValueError, match="offsets must start at 0, be non-decreasing"):
            Tokens.from_packed(torch.randn(4, E), torch.tensor(offsets))
    with pytest.raises(TypeError, match="offsets must have an integer dtype"):
        Tokens.from_packed(torch.randn(4, E), torch.tensor([0.0, 4.0]))
    packed = Tokens.from_packed(torch.randn(4, E), torch.tensor([0, 1, 4])).x
    with pytest.raises(ValueError, match="Tokens.mask must be None when x is packed"):
        Tokens(packed, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be None for packed"):
        module(packed, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"cannot apply .* \(3, 3\) .*Tokens.unpack\(\)"):
        module(packed, attn_mask=torch.zeros(5, 5, dtype=torch.bool))
    cross = Tokens.from_packed(torch.randn(5, E), torch.tensor([0, 2, 5])).x
    with pytest.raises(ValueError, match="needs key of the same length as query for every"):
        LocalAttention(E, H, window_size=1)(packed, cross, cross)
    linformer = LinformerAttention(E, H, seq_len=2, proj_len=2)
    with pytest.raises(ValueError, match="is_causal=True is not supported"):
        linformer(packed, is_causal=True)
    with pytest.raises(ValueError, match="key length must be <= seq_len=2"):
        linformer(packed)


# ---------------------------------------------------------------------- Tokens


def test_pack_unpack_round_trip_is_lossless():
    _, _, padded, mask, _ = batch(LENS)
    tokens = Tokens(padded.detach(), mask, {"grid": (1, 2)})
    packed = tokens.pack()
    assert packed.is_packed and packed.mask is None and packed.meta == {"grid": (1, 2)}
    assert packed.lengths.tolist() == LENS and packed.length == max(LENS)
    assert packed.batch_size == len(LENS) and packed.dim == E
    assert torch.equal(packed.x.values(), real(padded.detach(), LENS))
    back = packed.unpack()
    assert torch.equal(back.mask, mask) and torch.equal(back.x, padded.detach())
    assert packed.pack() is packed and tokens.unpack() is tokens
    assert Tokens(torch.randn(2, 3, E)).pack().lengths.tolist() == [3, 3]


def test_from_packed_is_zero_copy_like_pyg_x_and_ptr():
    x, ptr = torch.randn(7, E), torch.tensor([0, 3, 3, 7])
    tokens = Tokens.from_packed(x, ptr)
    assert tokens.x.values().data_ptr() == x.data_ptr()
    assert tokens.lengths.tolist() == [3, 0, 4]
    assert "lengths=[3, 0, 4]" in repr(tokens)


def test_cat_packed_concatenates_per_item():
    a_lens, b_lens = [2, 0, 3], [1, 4, 0]
    a = Tokens.from_packed(torch.randn(5, E), torch.tensor([0, *a_lens]).cumsum(0))
    b = Tokens.from_packed(torch.randn(5, E), torch.tensor([0, *b_lens]).cumsum(0))
    both = Tokens.cat({"a": a, "b": b})
    assert both.is_packed and both.lengths.tolist() == [3, 4, 3]
    items_a, items_b, items = a.x.unbind(), b.x.unbind(), both.x.unbind()
    for m in range(3):
        assert torch.equal(items[m], torch.cat([items_a[m], items_b[m]]))
    starts, stops = both.meta["spans"]["b"]
    assert starts.tolist() == a_lens and stops.tolist() == [3, 4, 3]


# ---------------------------------------------------------------------- blocks, pooling


def tokens_pair(lens=LENS, dim=E):
    values, offsets, padded, mask, leaf = batch(lens, dim)
    return Tokens.from_packed(values, offsets), Tokens(padded, mask), values, leaf


@pytest.mark.parametrize(
    "make",
    [
        lambda: TransformerBlock(E, H),
        lambda: TransformerBlock(E, H, causal=True),
        lambda: TransformerBlock(E, H, attention="local", window_size=2),
        lambda: Encoder(E, 2, H),
        lambda: Encoder(E, 2, H, attention="local", window_size=4, causal=True),
        lambda: TransformerBlock(E, H, attention="additive"),
        lambda: Encoder(E, 1, H, attention="full", attention_kwargs={"num_kv_heads": 2}),
    ],
    ids=["block", "block-causal", "block-local", "encoder", "encoder-local-causal",
         "block-additive", "encoder-gqa"],
)
def test_blocks_packed_equal_padded(make):
    module = make()
    packed, padded, values, leaf = tokens_pair()
    out, ref = module(packed), module(padded)
    assert out.is_packed
    close(out.x.values(), real(ref.x, LENS))
    weight = torch.randn(sum(LENS), E)
    compare_grads(module, [(values, leaf)], (out.x.values() * weight).sum(),
                  (real(ref.x, LENS) * weight).sum())


def test_cross_attention_block_packed_equals_padded():
    block = CrossAttentionBlock(E, H, kdim=12)
    query, query_pad, q_values, q_leaf = tokens_pair()
    context, context_pad, c_values, c_leaf = tokens_pair(CTX, 12)
    out, ref = block(query, context), block(query_pad, context_pad)
    close(out.x.values(), real(ref.x, LENS))
    compare_grads(block, [(q_values, q_leaf), (c_values, c_leaf)], out.x.values().sum(),
                  real(ref.x, LENS).sum())


@pytest.mark.parametrize(
    "pool",
    [masked_mean, masked_max, MaskedPool("first"), AttentionPool(E, 2)],
    ids=["mean", "max", "first", "attention"],
)
def test_pooling_packed_equals_padded(pool):
    packed, padded, values, leaf = tokens_pair()
    out, ref = pool(packed), pool(padded)
    close(out, ref)
    assert torch.equal(out[1], torch.zeros(E)) or isinstance(pool, AttentionPool)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    close(values.grad, leaf.grad)


class _Vectors(nn.Module):
    """A toy adapter: (t, 3) rows + offsets -> packed Tokens, or a padded batch + mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_dim = E
        self.proj = nn.Linear(3, E)

    def forward(self, rows, offsets=None, mask=None):
        if offsets is not None:
            return Tokens.from_packed(self.proj(rows), offsets)
        return Tokens(self.proj(rows), mask)


@pytest.mark.parametrize("fusion", ["concat", "latent"])
def test_multimodal_encoder_packed_equals_padded(fusion):
    encoder = MultiModalEncoder({"a": _Vectors(), "b": _Vectors()}, E, 2, H, fusion=fusion,
                                num_latents=3)
    a_lens, b_lens = [2, 0, 5], [3, 1, 0]
    a_vals, a_off, a_pad, a_mask, _ = batch(a_lens, 3)
    b_vals, b_off, b_pad, b_mask, _ = batch(b_lens, 3)
    out = encoder({"a": (a_vals, a_off), "b": (b_vals, b_off)})
    ref = encoder({"a": {"rows": a_pad, "mask": a_mask}, "b": {"rows": b_pad, "mask": b_mask}})
    assert out.is_packed
    if fusion == "latent":
        close(out.x.values(), ref.x.flatten(0, 1))
        return
    # padded concat keeps each modality's padding in between; compare the real rows
    expected = []
    for m in range(3):
        expected += [ref.x[m, : a_lens[m]], ref.x[m, 5:5 + b_lens[m]]]
    close(out.x.values(), torch.cat(expected))


# ---------------------------------------------------------------------- kernel, report, compile


def test_planner_cost_follows_sum_of_squares_not_batch_times_max():
    gen = torch.Generator().manual_seed(1)
    lens = [max(1, int(x)) for x in torch.exp(torch.randn(64, generator=gen) * 0.6) * 160]
    lens[0] = 4 * max(lens)
    buckets = plan(lens, lens)
    assert sorted(m for b in buckets for m in b.items) == list(range(64))
    padded_scores = sum(len(b.items) * b.q_len * b.k_len for b in buckets)
    ideal = sum(n * n for n in lens)
    assert padded_scores <= 1.15 * ideal < 0.3 * len(lens) * max(lens) ** 2


def test_packed_calls_are_reported():
    records = []
    remove = _kernel.add_listener(records.append)
    try:
        values, offsets, *_ = batch(LENS)
        with fused_attn(True):  # switched off, the explicit kernel reports each bucket
            MultiHeadAttention(E, H)(Tokens.from_packed(values, offsets).x)
    finally:
        remove()
    packed = [r for r in records if r["path"] == "packed"]  # one record per bucket call
    assert len(packed) == len(packed[0]["buckets"]) and packed[0]["q_lengths"] == LENS
    assert sum(n for n, _, _ in packed[0]["buckets"]) == sum(1 for n in LENS if n)
    assert [r["bucket"] for r in packed] == list(range(len(packed)))
    assert all(r["q"].shape[0] == n for r, (n, _, _) in zip(packed, packed[0]["buckets"]))


def test_torch_compile_on_the_packed_path():
    block = TransformerBlock(E, H)
    compiled = torch.compile(block, backend="aot_eager")
    packed, _, values, _ = tokens_pair()
    expected = block(packed).x.values()
    out = compiled(packed).x.values()
    close(out, expected)
    out.sum().backward()
    assert torch.isfinite(values.grad).all()


def test_pooling_an_all_empty_packed_batch_gives_zeros():
    empty = Tokens.from_packed(torch.zeros(0, E), torch.tensor([0, 0, 0]))
    for pool in (masked_mean, masked_max, MaskedPool("first")):
        assert torch.equal(pool(empty), torch.zeros(2, E))
    out = AttentionPool(E, 2)(empty)
    assert out.shape == (2, E) and torch.isfinite(out).all()


def test_explain_names_the_packed_path():
    from mmattn.debug import explain

    nt = Tokens.from_packed(torch.randn(9, E), torch.tensor([0, 2, 2, 9])).x
    with fused_attn(True):  # plain SDPA per bucket: one record per bucket, with its backend
        calls = explain(MultiHeadAttention(E, H), nt)
        assert [call.path for call in calls] == ["packed"] and calls[0].fused
        assert calls[0].q == (2, H, 7, E // H) and calls[0].backend == "flash"
    with fused_attn(False):  # the module's kernel per bucket: it reports each bucket call
        calls = explain(MultiHeadAttention(E, H), nt)
        assert [c.path for c in calls] == ["explicit"] and not calls[0].fused
    calls = explain(LocalAttention(E, H, window_size=2), nt)
    assert [c.path for c in calls] == ["local"]
