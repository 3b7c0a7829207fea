"""Named cases of the third hardening pass (issue 29: items 4-7, 10 and 11's entry points)
that no generic rule of the matrix reaches; ``tests/test_bad_input_items.py`` runs them.

Each asserts one of the matrix's three outcomes: a named error (the message it must carry),
or a result checked against a reference (a float64 softmax written out here, torch's own
module, or the proof computed afresh).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import mmattn
from mmattn import functional as MF
from mmattn.integrations import _hf_patterns
from mmattn.integrations import huggingface as hf
from mmattn.integrations.export import DecodeStep
from tests._matrix import MATCHES, NAN, RAISES


def _raises(error: type, *names: str) -> Callable[[Callable[[], Any]], Callable[[], None]]:
    def wrap(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(error) as info:
                call()
            assert any(n in str(info.value) for n in names), f"{info.value} names none of {names}"

        return run

    return wrap


def naive(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """softmax(q kᵀ · scale) v in float64 over the allowed keys; a row with none gives 0.

    Shape: q (b, h, i, e); k, v (b, k, j, e) with k dividing h; allowed broadcastable to
    (b, h, i, j), True = may attend.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def _causal(i: int, j: int) -> Tensor:
    return torch.ones(i, j, dtype=torch.bool).tril()


# --------------------------------------------------------------------------- 4. scale <= 0


def _sdpa_scale_zero_and_negative() -> None:
    torch.manual_seed(0)
    q, (k, v) = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 2, 5, 8).unbind(0)
    pad = torch.ones(5, 5, dtype=torch.bool)
    pad[:, -1] = False
    for scale in (0.0, -0.7, 0.3):
        for causal, mask in ((True, None), (False, None), (True, pad), (False, pad)):
            allowed = _causal(5, 5) if causal else None
            if mask is not None:
                allowed = mask if allowed is None else allowed & mask
            want = naive(q, k, v, allowed, scale)
            for fused in (True, False):
                with MF.fused_attn(fused):
                    out = MF.scaled_dot_product_attention(
                        q, k, v, mask, is_causal=causal, scale=scale
                    )
                torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
            _, weights = MF.scaled_dot_product_attention(
                q, k, v, mask, is_causal=causal, scale=scale, need_weights=True
            )
            if scale == 0.0:  # uniform over the allowed keys: 1 / their count
                counts = (allowed if allowed is not None else torch.ones(5, 5, dtype=torch.bool))
                uniform = counts.double() / counts.sum(-1, keepdim=True)
                torch.testing.assert_close(weights.double(), uniform.expand_as(weights))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    MF.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.0).sum().backward()
    assert all(t.grad.isfinite().all() for t in leaves)


def _hf_scale_zero_and_negative() -> None:
    torch.manual_seed(0)
    q, (k, v) = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 2, 6, 8).unbind(0)
    layer = nn.Module()
    layer.is_causal = True
    for scale in (0.0, -1.5):
        want = naive(q, k, v, _causal(6, 6), scale).transpose(1, 2)
        for fused in (True, False):
            with MF.fused_attn(fused):
                out, _ = hf.attention_forward(layer, q, k, v, None, scaling=scale)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 5. HF entry


def _hf(mask: Any = None, **kwargs: Any) -> Callable[[], Any]:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    tensors = {"query": q, "key": k, "value": v}
    tensors.update({n: kwargs.pop(n) for n in ("query", "key", "value") if n in kwargs})
    layer = nn.Module()
    layer.is_causal = False
    return lambda: hf.attention_forward(layer, *tensors.values(), mask, **kwargs)


def _hf_integer_mask() -> None:
    """A 0/1 integer mask was added as +1/0 (explicit path) or hit torch's dtype error."""
    keep = torch.ones(2, 1, 5, 5, dtype=torch.long)
    keep[..., -2:] = 0
    for fused in (True, False):
        with MF.fused_attn(fused), pytest.raises(
            TypeError, match=r"attention_mask must be bool .* got torch.int64.*mask.bool\(\)"
        ):
            _hf(keep)()


def _hf_dropout_outside_unit_interval() -> None:
    for bad in (-0.1, 1.0, NAN):
        with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got"):
            _hf(dropout=bad)()
    with pytest.raises(TypeError, match="dropout must be a float in"):
        _hf(dropout="0.1")()


def _hf_valid_unusual_inputs() -> None:
    """Valid inputs the checks must let through: a value head width other than the query's
    (DeepSeek's MLA), a float32 bias with bf16 queries, a (b, 1, 1, j) padding mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 6)
    keys = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keys[0, ..., -2:] = False
    layer = nn.Module()
    layer.is_causal = False
    for fused in (True, False):
        with MF.fused_attn(fused):
            out, _ = hf.attention_forward(layer, q, k, v, keys)
        want = naive(q, k, v, keys, 8**-0.5).transpose(1, 2)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    bias = torch.randn(1, 4, 5, 5)
    out, _ = hf.attention_forward(layer, q.bfloat16(), k.bfloat16(), k.bfloat16(), bias)
    assert out.dtype == torch.bfloat16


# --------------------------------------------------------------------------- 6. DecodeStep


def _decode_step_other_batch() -> Any:
    step = DecodeStep(mmattn.MultiHeadAttention(16, 4), max_len=8)
    return step(torch.randn(3, 1, 16), step.init_state(2))


# --------------------------------------------------------------------------- 7. in_proj


def _in_proj_assign_and_write_like_torch() -> None:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mmattn.MultiHeadAttention.from_torch(ref)
    weight = torch.randn(24, 8)
    for module in (ref, ours):
        # ours raised KeyError: attribute already exists (torch's module then holds the
        # Parameter itself, ours a copy: hence one Parameter each)
        module.in_proj_weight = nn.Parameter(weight.clone())
        with torch.no_grad():
            module.in_proj_bias.zero_()  # ours wrote into a copy: lost
        module.in_proj_weight.data[:8].mul_(2)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ours(x)[0], ref(x, x, x)[0])
    torch.testing.assert_close(ours.in_proj_weight, ref.in_proj_weight)


# --------------------------------------------------------------------------- 10. HF caches


def _packed_mask(lengths: list[int]) -> Tensor:
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        mask[start:start + n, start:start + n] = _causal(n, n)
        start += n
    return mask[None, None]


def _packed_proof_survives_id_reuse() -> None:
    """Keyed on id(position_ids), a proof outlived its tensor: a new position_ids that got the
    freed id was handed the old lengths."""
    mask = _packed_mask([3, 5])
    first = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert _hf_patterns.packed_lengths(mask, first) == [3, 5]
    old = id(first)
    del first
    gc.collect()
    kept = []
    for _ in range(100):  # the freed object's memory is reused at once, in practice
        other = torch.zeros(1, 8, dtype=torch.long)  # no sequence boundary pattern
        if id(other) == old:
            break
        kept.append(other)
    assert _hf_patterns.packed_lengths(mask, other) is None
    assert _hf_patterns.packed_lengths(mask, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])) == [3, 5]
    same = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert _hf_patterns.packed_lengths(mask, same) == [3, 5]
    same[0, 3] = 3  # written in place: one sequence now, proved again
    assert _hf_patterns.packed_lengths(mask, same) is None


def _band_cache_is_bounded_in_bytes() -> None:
    bands = _hf_patterns._BANDS
    limit = bands.limit
    try:
        bands.limit = 3000
        bands.clear()
        for length in (20, 30, 40, 50, 60):  # 400 ... 3600 bytes each
            mask = _hf_patterns._band(length, 2, True, torch.device("cpu"))[None, None]
            assert _hf_patterns.window_pattern(mask, 3) == (2, True, None)
            assert bands.nbytes <= 3000, bands.nbytes
        assert bands.get((60, 2, True, torch.device("cpu"))) is None  # over the bound
        assert bands.get((50, 2, True, torch.device("cpu"))) is not None
    finally:
        bands.limit = limit
        bands.clear()


ITEMS_ENTRY = [
    # 4. scale 0 or negative
    pytest.param(MATCHES, _sdpa_scale_zero_and_negative, id="sdpa-causal-scale-0-and-negative"),
    pytest.param(MATCHES, _hf_scale_zero_and_negative, id="hf-causal-scaling-0-and-negative"),
    # 5. the transformers entry
    pytest.param(RAISES, _hf_integer_mask, id="hf-integer-mask"),
    pytest.param(RAISES, _raises(ValueError, "attention_mask must broadcast")(
        _hf(torch.ones(2, 1, 5, 6, dtype=torch.bool))), id="hf-mask-key-length"),
    pytest.param(RAISES, _raises(ValueError, "attention_mask must broadcast")(
        _hf(torch.ones(3, 1, 5, 5, dtype=torch.bool))), id="hf-mask-batch"),
    pytest.param(RAISES, _raises(TypeError, "share a dtype, got query torch.float16")(
        _hf(query=torch.randn(2, 4, 5, 8).half())), id="hf-fp16-query-fp32-keys"),
    pytest.param(RAISES, _raises(ValueError, "key must have the head width of query (8)")(
        _hf(key=torch.randn(2, 2, 5, 4))), id="hf-head-widths"),
    pytest.param(RAISES, _raises(ValueError, "share the batch size")(
        _hf(key=torch.randn(1, 2, 5, 8), value=torch.randn(1, 2, 5, 8))), id="hf-kv-batch"),
    pytest.param(RAISES, _hf_dropout_outside_unit_interval, id="hf-dropout-outside-0-1"),
    pytest.param(RAISES, _raises(ValueError, "scaling must be a finite number")(
        _hf(scaling=NAN)), id="hf-scaling-nan"),
    pytest.param(RAISES, _raises(ValueError, "softcap must be a finite number > 0")(
        _hf(softcap=0.0)), id="hf-softcap-0"),
    pytest.param(RAISES, _raises(ValueError, "position_bias must broadcast")(
        _hf(position_bias=torch.zeros(1, 4, 5, 7))), id="hf-position-bias-shape"),
    pytest.param(MATCHES, _hf_valid_unusual_inputs, id="hf-valid-value-width-and-masks"),
    # 6. DecodeStep
    pytest.param(RAISES, _raises(ValueError, "made for batch size 2, but x has batch size 3")(
        _decode_step_other_batch), id="DecodeStep-state-of-another-batch"),
    # 7. in_proj
    pytest.param(MATCHES, _in_proj_assign_and_write_like_torch, id="in_proj-assign-and-write"),
    # 10. caches of the transformers entry
    pytest.param(MATCHES, _packed_proof_survives_id_reuse, id="hf-packed-proof-id-reuse"),
    pytest.param(MATCHES, _band_cache_is_bounded_in_bytes, id="hf-band-cache-bytes"),
]
