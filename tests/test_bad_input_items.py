"""The items of the hardening issue that no generic rule of the matrix reaches.

Each case is named after what it checks and asserts one of the matrix's three outcomes
(``tests/_matrix.py``): a named error, a result checked against a reference, or NaN
confined to what it touches. Together with ``tests/test_bad_inputs.py`` every item of the
issue has a case that failed before the hardening.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import adapters
import mmattn
from mmattn import functional as MF
from mmattn import masks, position
from mmattn.tokens import Tokens
from tests._items_second_pass import ITEMS_SECOND_PASS
from tests._items_third_pass_entry import ITEMS_ENTRY
from tests._matrix import (  # noqa: F401 - one_thread is a fixture
    CONFINED,
    INF,
    MATCHES,
    NAN,
    RAISES,
    one_thread,
    pad_mask,
)


def _raises(error: type, *names: str) -> Callable[[Callable[[], Any]], Callable[[], None]]:
    """A case that must raise ``error`` whose message names one of ``names``."""

    def wrap(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(error) as info:
                call()
            assert any(n in str(info.value) for n in names), f"{info.value} names none of {names}"

        return run

    return wrap


def _close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _sdpa_1d_mask() -> None:
    q, (k, v) = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 2, 5, 8).unbind(0)
    keep = torch.tensor([True, False, True, True, False])
    for fused in (True, False):
        with MF.fused_attn(fused):
            _close(MF.scaled_dot_product_attention(q, k, v, keep),
                   MF.scaled_dot_product_attention(q, k, v, keep.expand(4, 5)))
            _close(MF.scaled_dot_product_attention(q, k, v, torch.tensor(True)),
                   MF.scaled_dot_product_attention(q, k, v))


def _sdpa_float_mask_dtype() -> None:
    q = k = v = torch.randn(1, 2, 3, 4)
    for fused in (True, False):
        with MF.fused_attn(fused), pytest.raises(TypeError, match="attn_mask must be bool or"):
            MF.scaled_dot_product_attention(q, k, v, torch.zeros(3, 3, dtype=torch.float64))


def _paths_agree() -> None:
    """Fused and explicit give the same numbers: NaN at padded keys, dead rows, float masks."""
    q, (k, v) = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 2, 6, 8).unbind(0)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[0, ..., -2:] = False
    dead = pad.expand(2, 2, 4, 6).clone()
    dead[1, 0, 2] = False  # a query row with no key
    k_nan = k.clone()
    k_nan[0, :, -2:] = NAN  # padded keys holding NaN
    for mask in (pad, dead, masks.to_additive(dead)):
        with MF.fused_attn(True):
            fused = MF.scaled_dot_product_attention(q, k_nan, v, mask, scale=0.3)
            clean = MF.scaled_dot_product_attention(q, k, v, mask, scale=0.3)
        explicit, _ = MF.scaled_dot_product_attention(
            q, k_nan, v, mask, scale=0.3, need_weights=True
        )
        _close(fused, explicit)
        _close(fused, clean)


def _inf_in_float_mask_confined() -> None:
    """+inf / NaN in a float mask behave as in torch: NaN in the rows they touch, only there."""
    q, (k, v) = torch.randn(1, 2, 4, 8), torch.randn(2, 1, 2, 5, 8).unbind(0)
    for bad in (INF, NAN):
        mask = torch.zeros(4, 5)
        mask[1, 2] = bad
        for need in (False, True):
            out = MF.scaled_dot_product_attention(q, k, v, mask, need_weights=need)
            out = out[0] if need else out
            assert out[:, :, 1].isnan().all()
            rows = [0, 2, 3]
            _close(out[:, :, rows], MF.scaled_dot_product_attention(q, k, v)[:, :, rows])


def _linformer_nan_padding() -> None:
    attn = mmattn.LinformerAttention(8, 2, seq_len=6, proj_len=3).eval()
    x = torch.randn(2, 6, 8)
    pad = pad_mask(2, 6)
    clean, _ = attn(x, key_padding_mask=pad)
    out, _ = attn(x, torch.where(pad[..., None], NAN, x), key_padding_mask=pad)
    _close(out, clean)


def _audio_short_clip() -> None:
    audio = adapters.AudioFrameEmbedder(8, n_mels=8, n_fft=64, hop_length=16).eval()
    clip = torch.randn(1, 20)  # <= n_fft // 2: too short for reflect padding
    alone = audio(clip)
    batch = audio(torch.cat([clip, torch.zeros(1, 60)], 1).expand(2, 80).contiguous(),
                  lengths=torch.tensor([20, 80]))
    assert alone.length == 1 + 20 // 16
    torch.testing.assert_close(alone.x[0], batch.x[0, : alone.length], rtol=1e-3, atol=1e-4)
    assert audio(torch.randn(2, 1)).x.shape == (2, 1, 8)


def _text_small_int_ids() -> None:
    emb = adapters.TextTokenEmbedder(20, 8)
    ids = torch.randint(0, 20, (2, 5))
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        out = emb(ids.to(dtype))
        _close(out.x, emb(ids).x)
        assert torch.equal(out.mask, ids != 0)


def _learned_keeps_dtype() -> None:
    pos = position.LearnedPositionalEmbedding(8, 4)
    x = torch.randn(2, 3, 4, dtype=torch.float16)
    out = pos(x)
    assert out.dtype == torch.float16
    _close(out, x + pos.weight[:3].half())
    pos2d = position.LearnedPositionalEmbedding2d(2, 4)
    assert pos2d(torch.randn(1, 4, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _state_dict_by_name() -> None:
    def encoder(order: tuple[str, ...]) -> mmattn.MultiModalEncoder:
        parts = {"a": nn.Linear(3, 8), "b": nn.Linear(3, 8)}
        wrapped = {n: _TokensOf(parts[n]) for n in order}
        return mmattn.MultiModalEncoder(wrapped, 8, 1, 2)

    first, second = encoder(("a", "b")), encoder(("b", "a"))
    second.load_state_dict(first.state_dict())
    inputs = {"a": torch.randn(2, 3, 3), "b": torch.randn(2, 4, 3)}
    out1, out2 = first(inputs), second(inputs)
    for name in "ab":
        start1, stop1 = out1.meta["spans"][name]
        start2, stop2 = out2.meta["spans"][name]
        _close(first.embed(inputs).x[:, start1:stop1], second.embed(inputs).x[:, start2:stop2])


class _TokensOf(nn.Module):
    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj
        self.embed_dim = 8

    def forward(self, v: Tensor) -> Tokens:
        return Tokens(self.proj(v))


class _NoParams(adapters.ModalityAdapter, register=False):
    def forward(self, values: Tensor) -> Tokens:
        dtype, _ = self._param_dtype_device()
        return Tokens(values.to(dtype))


def _graph(edges: list[list[int]], sizes: tuple[int, ...] = (3, 2)) -> Any:
    from torch_geometric.data import Batch, Data

    graphs = [Data(x=torch.randn(n, 4), edge_index=torch.empty(2, 0, dtype=torch.long))
              for n in sizes]
    batch = Batch.from_data_list(graphs)
    batch.edge_index = torch.tensor(edges, dtype=torch.long).reshape(2, -1)
    return batch


def _zero_node_laplacian() -> None:
    seq = adapters.GraphNodeSequencer(4, 8, structural=("laplacian", "degree"))
    from torch_geometric.data import Data

    out = seq(Data(x=torch.randn(0, 4), edge_index=torch.empty(2, 0, dtype=torch.long)))
    assert out.x.shape == (1, 0, 8)
    empty = torch.empty(2, 0, dtype=torch.long)
    assert adapters.laplacian_eigenvectors(empty, None, 2).shape == (1, 0, 2)
    with_empty = seq(_graph([], (0, 3)))
    assert with_empty.x.shape == (2, 3, 8) and with_empty.lengths.tolist() == [0, 3]


def _tokens_cat_dtype() -> Any:
    return Tokens.cat([Tokens(torch.randn(1, 2, 4)), Tokens(torch.randn(1, 2, 4).double())])


def _empty_pools() -> None:
    for mask in (None, torch.zeros(2, 0, dtype=torch.bool)):
        tokens = Tokens(torch.randn(2, 0, 4), mask)
        for pool in (mmattn.masked_mean, mmattn.masked_max, mmattn.MaskedPool("first"),
                     mmattn.AttentionPool(4)):
            out = pool(tokens)
            assert out.shape == (2, 4) and out.isfinite().all()
    assert mmattn.masked_mean(Tokens(torch.randn(2, 0, 4))).abs().sum() == 0


def _explicit_empty_lengths() -> None:
    mha = mmattn.MultiHeadAttention(8, 2)
    for q_len, k_len in ((0, 4), (4, 0), (0, 0)):
        out, weights = mha(torch.randn(2, q_len, 8), torch.randn(2, k_len, 8),
                           need_weights=True)
        assert out.shape == (2, q_len, 8) and weights.shape == (2, q_len, k_len)
        _close(out, mha.out_proj.bias.expand(2, q_len, 8))


def _record_attention_empty() -> None:
    encoder = mmattn.Encoder(8, 1, 2)
    with mmattn.debug.record_attention(encoder) as maps:
        out = encoder(Tokens(torch.randn(2, 0, 8)))
    assert out.x.shape == (2, 0, 8)
    assert [m.shape for m in maps["blocks.0.attn"]] == [(2, 0, 0)]


def _dropout_names() -> None:
    q = torch.randn(1, 1, 2, 4)
    for bad, error in (("0.1", TypeError), (None, TypeError), (1.5, ValueError),
                       (NAN, ValueError)):
        with pytest.raises(error, match="dropout_p"):
            MF.scaled_dot_product_attention(q, q, q, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout"):
        mmattn.MultiHeadAttention(8, 2, dropout="0.1")


def _factory_dtypes() -> None:
    for build in (
        lambda: mmattn.MultiHeadAttention(8, 2, dtype=torch.long),
        lambda: mmattn.TransformerBlock(8, 2, dtype=torch.int32),
        lambda: mmattn.AttentionPool(8, dtype=torch.long),
        lambda: mmattn.MultiModalEncoder({"a": _TokensOf(nn.Linear(3, 8))}, 8, 1, 2,
                                         dtype=torch.long),
        lambda: position.LearnedPositionalEmbedding(4, 8, dtype=torch.long),
        lambda: adapters.ImagePatcher(8, dtype=torch.uint8),
        lambda: adapters.TextTokenEmbedder(20, 8, dtype=torch.long),
        lambda: adapters.AudioFrameEmbedder(8, frontend="raw", dtype=torch.int16),
    ):
        with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
            build()


ITEMS = [
    # 1. padding never leaks
    pytest.param(MATCHES, _linformer_nan_padding, id="LinformerAttention-nan-keys-past-padding"),
    pytest.param(CONFINED, _inf_in_float_mask_confined, id="sdpa-inf-or-nan-in-float-mask"),
    # 2. empty sizes
    pytest.param(MATCHES, _explicit_empty_lengths, id="MultiHeadAttention-explicit-L0-S0"),
    pytest.param(MATCHES, _empty_pools, id="pools-length-0"),
    pytest.param(MATCHES, _record_attention_empty, id="record_attention-length-0"),
    pytest.param(MATCHES, lambda: adapters.ByteTokenizer().decode(
        torch.zeros(0, 0, dtype=torch.long)) == [], id="ByteTokenizer-decode-0x0"),
    pytest.param(MATCHES, lambda: position.sinusoidal_1d(0, 8).shape == (0, 8),
                 id="sinusoidal_1d-length-0"),
    # 3. adapters' edges
    pytest.param(MATCHES, _audio_short_clip, id="AudioFrameEmbedder-short-clip"),
    pytest.param(RAISES, _raises(ValueError, "waveform")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw")(torch.randn(2, 0, 50))), id="AudioFrameEmbedder-no-channels"),
    pytest.param(RAISES, _raises(ValueError, "waveform")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw")(torch.randn(2, 0))), id="AudioFrameEmbedder-raw-T0"),
    pytest.param(MATCHES, _text_small_int_ids, id="TextTokenEmbedder-small-int-ids"),
    # 4. graphs
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8, structural="degree")(_graph([[0, 7], [1, 0]]))), id="Graph-edge-out-of-range"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8)(_graph([[0, -1], [1, 0]]))), id="Graph-negative-edge"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8).neighbourhood_mask(_graph([[0, 3], [1, 1]]))), id="Graph-edge-between-graphs"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.neighbourhood_mask(
        torch.tensor([[0], [1]], device="meta"), torch.zeros(2, dtype=torch.long))),
        id="neighbourhood_mask-edge-index-on-other-device"),
    pytest.param(MATCHES, _zero_node_laplacian, id="Graph-zero-node-laplacian"),
    # 5. checks that pass and then the kernel fails; paths that disagree
    pytest.param(MATCHES, _sdpa_1d_mask, id="sdpa-1d-and-0d-bool-mask"),
    pytest.param(RAISES, _sdpa_float_mask_dtype, id="sdpa-float-mask-of-other-dtype"),
    pytest.param(RAISES, _raises(ValueError, "scale")(lambda: MF.scaled_dot_product_attention(
        *torch.randn(3, 1, 2, 4), scale=NAN)), id="sdpa-scale-nan"),
    pytest.param(MATCHES, _paths_agree, id="sdpa-fused-equals-explicit"),
    # 6. dtype and state
    pytest.param(RAISES, _raises(TypeError, "dtype")(_tokens_cat_dtype), id="Tokens.cat-dtypes"),
    pytest.param(MATCHES, _learned_keeps_dtype, id="LearnedPositionalEmbedding-keeps-fp16"),
    pytest.param(MATCHES, _state_dict_by_name, id="MultiModalEncoder-state-dict-by-name"),
    pytest.param(RAISES, _raises(TypeError, "tokens")(lambda: mmattn.AttentionPool(4)(
        Tokens(torch.randn(1, 2, 4).double()))), id="AttentionPool-names-tokens"),
    # 7. arguments never validated
    pytest.param(RAISES, _raises(TypeError, "meta")(lambda: Tokens(torch.randn(1, 2, 4),
                                                                   meta=[1])), id="Tokens-meta"),
    pytest.param(RAISES, _raises(TypeError, "parts")(lambda: Tokens.cat(Tokens(
        torch.randn(1, 2, 4)))), id="Tokens.cat-single-Tokens"),
    pytest.param(MATCHES, lambda: _close(masks.to_additive(torch.tensor([True, False]),
                                                         "float16"),
                                         torch.tensor([0.0, -INF], dtype=torch.float16)),
                 id="to_additive-dtype-by-name"),
    pytest.param(RAISES, _raises(TypeError, "dtype")(lambda: masks.to_additive(
        torch.tensor([True]), "nope")), id="to_additive-bad-dtype-name"),
    pytest.param(RAISES, _raises(TypeError, "name")(lambda: adapters.create(["text"])),
                 id="create-list"),
    pytest.param(RAISES, _dropout_names, id="dropout-str-None-nan"),
    pytest.param(RAISES, _factory_dtypes, id="integer-parameter-dtype"),
    pytest.param(RAISES, _raises(ValueError, "offset")(
        lambda: position.LearnedPositionalEmbedding(8, 4)(torch.randn(1, 2, 4), offset=-1)),
        id="learned-negative-offset"),
    pytest.param(RAISES, _raises(ValueError, "offset")(
        lambda: position.SinusoidalPositionalEncoding(4)(torch.randn(1, 2, 4), offset=-3)),
        id="sinusoidal-negative-offset"),
    pytest.param(RAISES, _raises(TypeError, "offset")(lambda: position.sinusoidal_1d(
        2, 4, offset=0.5)), id="sinusoidal-offset-0.5"),
    pytest.param(RAISES, _raises(ValueError, "base")(lambda: position.sinusoidal_1d(
        2, 4, base=0)), id="sinusoidal-base-0"),
    pytest.param(RAISES, _raises(ValueError, "mode")(lambda: position.resample_2d(
        torch.randn(4, 2), (2, 2), (3, 3), mode="cubic")), id="resample_2d-mode"),
    pytest.param(RAISES, _raises(ValueError, "rows")(lambda: position.sinusoidal_2d(-1, 2, 8)),
                 id="sinusoidal_2d-names-rows"),
    pytest.param(RAISES, _raises(ValueError, "max_frames")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw", positional="learned", max_frames=3)(torch.randn(1, 1600))),
        id="audio-learned-names-max_frames"),
    pytest.param(RAISES, _raises(TypeError, "batch_first")(lambda: mmattn.MultiHeadAttention(
        8, 2, batch_first="no")), id="batch_first-no"),
    pytest.param(RAISES, _raises(ValueError, "norm_eps")(lambda: mmattn.TransformerBlock(
        8, 2, norm_eps=-1)), id="norm_eps-negative"),
    # issue 9, item 8
    pytest.param(RAISES, _raises(ValueError, "spans", "context")(lambda: mmattn.MultiModalEncoder(
        {"spans": _TokensOf(nn.Linear(3, 8))}, 8, 1, 2)), id="MultiModalEncoder-reserved-name"),
    pytest.param(MATCHES, lambda: _close(_NoParams(4)(torch.ones(1, 2, 4)).x,
                                         torch.ones(1, 2, 4)), id="adapter-without-parameters"),
]


ITEMS += ITEMS_SECOND_PASS  # issue 22, items 6-8 (tests/_items_second_pass.py)
ITEMS += ITEMS_ENTRY  # issue 29, items 4-7 and 10 (tests/_items_third_pass_entry.py)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("outcome, run", ITEMS)
def test_item(outcome: str, run: Callable[[], Any]) -> None:
    result = run()
    assert result is None or result is True


ATTENTION = [
    lambda: mmattn.MultiHeadAttention(8, 2),
    lambda: mmattn.AdditiveAttention(8, 2),
    lambda: mmattn.LinformerAttention(8, 2, seq_len=6, proj_len=3),
    lambda: mmattn.LocalAttention(8, 2, window_size=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("build", ATTENTION)
def test_padding_and_empty_sizes_on_every_device(device, build, dtype):
    """NaN / Inf at padded keys and empty sizes, on the device's own kernels."""
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("half precision attention is checked on CUDA")
    attn = build().to(device=device, dtype=dtype).eval()
    x = torch.randn(2, 6, 8, device=device, dtype=dtype)
    pad = pad_mask(2, 6).to(device)
    for fused in (True, False):
        with MF.fused_attn(fused), torch.no_grad():
            clean, _ = attn(x, key_padding_mask=pad)
            for fill in (NAN, INF):
                dirty = torch.where(pad[..., None], fill, x)
                out, _ = attn(x, dirty, dirty, key_padding_mask=pad)
                torch.testing.assert_close(out, clean)
            for batch, length in ((0, 6), (2, 0)):
                empty = torch.randn(batch, length, 8, device=device, dtype=dtype)
                out, _ = attn(empty, need_weights=not fused)
                assert out.shape == (batch, length, 8)
