"""Streaming: chunk by chunk through a ChunkCache equals the whole-clip run with the chunked
pattern, at every chunk.

The reference is the same module run once on the whole clip with the chunked rule as a
dense ``attn_mask`` built by a naive loop over (query, key) pairs: q may attend k iff both are
real and ``q // c - left <= k // c <= q // c``. Streaming feeds the clip ``c`` tokens at a
time (the last chunk shorter), with padding in the batch where the case says so, and every
chunk's output must agree within 1e-5 on both kernel paths.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import (
    AdditiveAttention,
    Encoder,
    LocalAttention,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)
from mmattn import patterns as P
from mmattn.cache import ChunkCache, EncoderCache, KVCache
from mmattn.functional import fused_attn

D, H = 16, 4


#: Tiny tensors: one intra-op thread (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


class _Chunked:
    """Stands for ``P.chunked(chunk, left, right)`` (the three fields Encoder reads)."""

    def __init__(self, chunk: int, left: int = 0, right: int = 0) -> None:
        self.chunk, self.left, self.right = chunk, left, right


def chunked_allowed(mask: torch.Tensor, chunk: int, left: int) -> torch.Tensor:
    """(B, L, L) bool, True = may attend: the chunked rule by a naive loop over pairs."""
    real = mask.tolist()
    return torch.tensor([[[row[q] and row[k] and q // chunk - left <= k // chunk <= q // chunk
                           for k in range(len(row))] for q in range(len(row))]
                         for row in real])


def clip(batch: int, length: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, L, D) and a mask (B, L), True = real; sample 1 ends early when ``padded``."""
    x = torch.randn(batch, length, D)
    mask = torch.ones(batch, length, dtype=torch.bool)
    if padded:
        mask[1, length // 2 + 1:] = False
        x[1, length // 2 + 1:] = float("nan")  # padded values must never reach real outputs
    return x, mask


def chunks(length: int, chunk: int) -> list[slice]:
    return [slice(s, s + chunk) for s in range(0, length, chunk)]


# (chunk, left, depth, padded): chunk sizes 4-32 frames, left 0-4 chunks, 1-4 layers
CASES = [(4, 0, 1, False), (4, 4, 2, True), (8, 1, 3, True), (32, 2, 4, False),
         (16, 3, 1, True)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize(("chunk", "left", "depth", "padded"), CASES,
                         ids=[f"c{c}-l{lft}-depth{d}{'-pad' if p else ''}"
                              for c, lft, d, p in CASES])
def test_streamed_encoder_equals_the_whole_clip_at_every_chunk(chunk, left, depth, padded,
                                                                fused):
    encoder = Encoder(D, depth, H, mlp_ratio=2.0, pattern=P.chunked(chunk, left=left),
                      attention_kwargs={"position": "rotary", "num_kv_heads": 2}).eval()
    length = 3 * chunk + chunk // 2 + 1  # the last chunk is shorter
    x, mask = clip(2, length, padded)
    allowed = chunked_allowed(mask, chunk, left)
    with fused_attn(fused), torch.no_grad():
        pattern, encoder.pattern = encoder.pattern, None  # the reference: the naive mask
        want = encoder(Tokens(x, mask), attn_mask=~allowed).x
        encoder.pattern = pattern  # as trained: the pattern, block-sparse, on the whole clip
        torch.testing.assert_close(encoder(Tokens(x, mask)).x, want, atol=1e-5, rtol=1e-5)
        cache = encoder.make_cache(2)
        for piece in chunks(length, chunk):
            got = encoder(Tokens(x[:, piece], mask[:, piece]), cache=cache).x
            torch.testing.assert_close(got, want[:, piece], atol=1e-5, rtol=1e-5)
    assert len(cache) == length and isinstance(cache, EncoderCache)
    assert all(layer.k.shape[2] == left * chunk for layer in cache.layers)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("name", ["gqa-rope", "additive", "block"])
def test_streamed_layers_equal_the_whole_sequence(name, fused):
    """The cache at the layer level (MultiHeadAttention, a variant, a TransformerBlock):
    padded query rows attend nothing, as the pattern's dead rows (out_proj.bias)."""
    chunk, left, length = 5, 2, 23
    x, mask = clip(2, length, padded=True)
    x = x.nan_to_num(0.0)  # a bare layer does not zero padded values (a block does)
    allowed = chunked_allowed(mask, chunk, left)
    module = {
        "gqa-rope": lambda: MultiHeadAttention(D, H, num_kv_heads=1, position="rotary"),
        "additive": lambda: AdditiveAttention(D, H),
        "block": lambda: TransformerBlock(D, H),
    }[name]().eval()
    attn = module.attn if name == "block" else module
    with fused_attn(fused), torch.no_grad():
        cache = attn.make_cache(2, chunk=chunk, left=left)
        if name == "block":
            want = module(Tokens(x, mask), attn_mask=~allowed).x
            got = [module(Tokens(x[:, s], mask[:, s]), cache=cache).x
                   for s in chunks(length, chunk)]
        else:
            attn_mask = (~allowed).repeat_interleave(H, 0)
            want, _ = module(x, attn_mask=attn_mask)
            got = [module(x[:, s], key_padding_mask=~mask[:, s], cache=cache)[0]
                   for s in chunks(length, chunk)]
    for piece, out in zip(chunks(length, chunk), got):
        torch.testing.assert_close(out, want[:, piece], atol=1e-5, rtol=1e-5)


def test_gradients_through_the_stream_equal_the_whole_sequence():
    attn = MultiHeadAttention(D, H, position="rotary")
    chunk, left, length = 4, 1, 13
    x = torch.randn(2, length, D, requires_grad=True)
    allowed = chunked_allowed(torch.ones(2, length, dtype=torch.bool), chunk, left)
    want, _ = attn(x, attn_mask=(~allowed).repeat_interleave(H, 0))
    cache = attn.make_cache(2, chunk=chunk, left=left)
    got = torch.cat([attn(x[:, s], cache=cache)[0] for s in chunks(length, chunk)], dim=1)
    params = [x, attn.q_proj.weight, attn.k_proj.weight]
    for a, b in zip(torch.autograd.grad(want.square().sum(), params),
                    torch.autograd.grad(got.square().sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_memory_is_constant_and_reset_starts_a_new_stream():
    encoder = Encoder(D, 2, H).eval()
    encoder.pattern = _Chunked(4, left=2)
    cache = encoder.make_cache(2)
    buffers = [(layer.k.data_ptr(), layer.k.shape) for layer in cache.layers]
    nbytes = cache.nbytes
    x = torch.randn(2, 40, D)
    with torch.no_grad():
        first = [encoder(Tokens(x[:, s]), cache=cache).x for s in chunks(40, 4)]
        assert cache.nbytes == nbytes and len(cache) == 40
        assert [(layer.k.data_ptr(), layer.k.shape) for layer in cache.layers] == buffers
        cache.reset()
        assert len(cache) == 0
        again = [encoder(Tokens(x[:, s]), cache=cache).x for s in chunks(40, 4)]
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # 2 blocks x (k + v) x (2, 4 heads, 8 slots, 4) fp32 + (2, 8) valid + a counter each
    assert nbytes == 2 * (2 * 2 * 4 * 8 * 4 * 4 + 2 * 8 + 8)


@pytest.mark.slow  # 10 s of dynamo tracing on the loaded 2-core machine
def test_compiled_chunk_step_traces_once():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    attn = MultiHeadAttention(D, H, position="rotary").eval()
    counter = CompileCounter()
    step = torch.compile(attn, backend=counter, fullgraph=True)
    cache, eager = (attn.make_cache(2, chunk=4, left=1) for _ in range(2))
    with torch.no_grad():
        for _ in range(5):
            x, kpm = torch.randn(2, 4, D), torch.rand(2, 4) > 0.7
            torch.testing.assert_close(step(x, key_padding_mask=kpm, cache=cache)[0],
                                       attn(x, key_padding_mask=kpm, cache=eager)[0],
                                       atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------- bad input


def _encoder(chunk=4, left=1, right=0, depth=2):
    encoder = Encoder(D, depth, H).eval()
    encoder.pattern = _Chunked(chunk, left, right)
    return encoder


def test_a_chunk_of_the_wrong_length_raises():
    attn = MultiHeadAttention(D, H).eval()
    cache = attn.make_cache(2, chunk=4, left=1)
    with torch.no_grad():
        with pytest.raises(ValueError, match="holds 5 tokens, more than the cache's chunk=4"):
            attn(torch.randn(2, 5, D), cache=cache)
        attn(torch.randn(2, 4, D), cache=cache)
        attn(torch.randn(2, 3, D), cache=cache)  # a shorter chunk ends the stream
        with pytest.raises(ValueError, match="follows a chunk of 3 < chunk=4 tokens, which "
                                             "ended the stream"):
            attn(torch.randn(2, 4, D), cache=cache)
        cache.reset()
        attn(torch.randn(2, 4, D), cache=cache)


def test_a_cache_from_another_model_or_batch_size_raises():
    encoder, other = _encoder(), _encoder()
    with torch.no_grad():
        with pytest.raises(ValueError, match="cache was made by another module"):
            encoder(Tokens(torch.randn(2, 4, D)), cache=other.make_cache(2))
        with pytest.raises(ValueError, match="cache was made for batch_size=3, got tokens "
                                             "with batch size 2"):
            encoder(Tokens(torch.randn(2, 4, D)), cache=encoder.make_cache(3))
        with pytest.raises(TypeError, match="cache must come from Encoder.make_cache"):
            encoder(Tokens(torch.randn(2, 4, D)), cache=[encoder.blocks[0].attn.make_cache(
                2, chunk=4, left=1)])
        attn, twin = MultiHeadAttention(D, H), MultiHeadAttention(D, H)
        with pytest.raises(ValueError, match="cache was made by another module"):
            attn(torch.randn(2, 4, D), cache=twin.make_cache(2, chunk=4))
        with pytest.raises(ValueError, match="cache was made for batch_size=2"):
            attn(torch.randn(3, 4, D), cache=attn.make_cache(2, chunk=4))
        with pytest.raises(TypeError, match="cache must come from LocalAttention.make_cache"):
            local = LocalAttention(D, H, 2)
            local(torch.randn(2, 4, D), cache=attn.make_cache(2, chunk=4))


def test_looking_ahead_raises_named_errors():
    with pytest.raises(ValueError, match="right=1: a ChunkCache cannot look ahead"):
        MultiHeadAttention(D, H).make_cache(2, chunk=4, left=1, right=1)
    with pytest.raises(ValueError, match="right=2: a ChunkCache cannot look ahead"):
        _encoder(right=2).make_cache(2)


@pytest.mark.parametrize("cls", [LocalAttention, NeighborhoodAttention])
def test_band_and_grid_layers_refuse_chunk(cls):
    module = cls(D, H, 3)
    with pytest.raises(TypeError, match=f"{cls.__name__}.make_cache does not take chunk="):
        module.make_cache(2, 16, chunk=4)


def test_calls_a_chunk_cache_cannot_serve_raise():
    attn = MultiHeadAttention(D, H)
    x = torch.randn(2, 4, D)
    cache = attn.make_cache(2, chunk=4, left=1)
    with pytest.raises(ValueError, match="is_causal=True does not apply with a ChunkCache"):
        attn(x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="attn_mask is not supported with cache="):
        attn(x, attn_mask=torch.zeros(4, 4, dtype=torch.bool), cache=cache)
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool with a "
                                        "ChunkCache"):
        attn(x, key_padding_mask=torch.zeros(2, 4), cache=cache)
    with pytest.raises(ValueError, match="max_len=8 does not apply with chunk="):
        attn.make_cache(2, 8, chunk=4)
    with pytest.raises(TypeError, match="left=2 needs chunk="):
        attn.make_cache(2, left=2)
    with pytest.raises(TypeError, match="needs max_len .decoding. or chunk="):
        attn.make_cache(2)
    with pytest.raises(ValueError, match="needs an Encoder built with pattern=P.chunked"):
        Encoder(D, 1, H).make_cache(2)
    assert isinstance(attn.make_cache(2, 8), KVCache)
    assert isinstance(cache, ChunkCache) and repr(cache).startswith("ChunkCache(batch_size=2")
