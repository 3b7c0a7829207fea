"""Autocast like nn.MultiheadAttention: CPU bf16, CUDA fp16/bf16, stacked modules, mixed
input dtypes, need_weights, both paths; the explicit path keeps its softmax in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mmattn import (
    AdditiveAttention,
    EdgeAttention,
    LocalAttention,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
    replace_attention,
)
from mmattn import patterns as P
from mmattn.functional import fused_attn
from mmattn.integrations import huggingface as hf
from mmattn.kernels import dense as _kernel

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=CUDA),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=CUDA),
]
#: Loose: one bf16 rounding of O(1) values is 2**-8; the two implementations round at
#: different points.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


class _SoftmaxDtypes(TorchDispatchMode):
    """Records the input dtype of every softmax the kernels run (below autocast). An empty
    input computes nothing: it is the kernels' probe of softmax's dtype (``weights_dtype``)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._softmax, torch.ops.aten.softmax) and \
                args[0].numel():
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _stack(device, **kwargs):
    refs = [nn.MultiheadAttention(16, 4, batch_first=True, device=device, **kwargs)
            for _ in range(2)]
    return refs, [MultiHeadAttention.from_torch(r) for r in refs]


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("settings", [{}, {"add_zero_attn": True}], ids=["plain", "zero_attn"])
def test_stacked_modules_match_torch_under_autocast(device, dtype, fused, need_weights, settings):
    """The second module gets the first one's low-precision output; the first gets an fp32
    query and a low-precision key/value (mixed input dtypes)."""
    refs, ours = _stack(device, **settings)
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    kv = torch.randn(2, 7, 16, device=device).to(dtype)
    kpm = torch.zeros(2, 7, dtype=torch.bool, device=device)
    kpm[1, 4:] = True
    spy = _SoftmaxDtypes()
    with fused_attn(fused), torch.autocast(device, dtype=dtype):
        r1, rw1 = refs[0](x, kv, kv, key_padding_mask=kpm, need_weights=need_weights)
        r2, _ = refs[1](r1, r1, r1, need_weights=need_weights)
        with spy:
            o1, w1 = ours[0](x, kv, kv, key_padding_mask=kpm, need_weights=need_weights)
            o2, _ = ours[1](o1, o1, o1, need_weights=need_weights)
    tol = TOLERANCE[dtype]
    assert o2.dtype == r2.dtype == dtype
    torch.testing.assert_close(o2.float(), r2.float(), atol=tol, rtol=tol)
    if need_weights:
        assert w1.dtype == rw1.dtype
        torch.testing.assert_close(w1.float(), rw1.float(), atol=tol, rtol=tol)
    if need_weights or not fused:
        assert spy.dtypes and set(spy.dtypes) == {torch.float32}  # explicit: fp32 softmax
    (grad,) = torch.autograd.grad(o2.float().sum(), x)
    (ref_grad,) = torch.autograd.grad(r2.float().sum(), x)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, ref_grad, atol=5 * tol, rtol=5 * tol)


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_swapped_transformer_encoder_under_autocast(device, dtype):
    """Inference of a swapped encoder under autocast. (torch's own encoder crashes here on
    the CPU: its fast-path probe only asks about CUDA autocast; the reference runs with the
    fast path off.)"""
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, num_layers=2).to(device).eval()
    swapped = nn.TransformerEncoder(layer, num_layers=2).to(device).eval()
    swapped.load_state_dict(ref.state_dict())
    assert replace_attention(swapped) == 2
    x = torch.randn(3, 6, 16, device=device)
    kpm = torch.zeros(3, 6, dtype=torch.bool, device=device)
    kpm[0, 4:] = True
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        with torch.no_grad(), torch.autocast(device, dtype=dtype):
            expected = ref(x, src_key_padding_mask=kpm)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    with torch.no_grad(), torch.autocast(device, dtype=dtype):
        got = swapped(x, src_key_padding_mask=kpm)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[~kpm].float(), expected[~kpm].float(), atol=tol, rtol=tol)


def test_add_bias_kv_weights_dtype_under_autocast():
    refs, ours = _stack("cpu", add_bias_kv=True)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = ours[0](x, need_weights=True)
        ref_out, ref_weights = refs[0](x, x, x, need_weights=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    assert weights.dtype == ref_weights.dtype


def test_without_autocast_mixed_dtypes_are_still_errors():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="key has dtype torch.bfloat16 but query has dtype "
                                        "torch.float32"):
        mha(x, x.bfloat16())
    with pytest.raises(TypeError, match="query has dtype torch.bfloat16 but the module's "
                                        "parameters have dtype torch.float32"):
        mha(x.bfloat16())
    # CUDA autocast does not cover CPU tensors: still an error there, as in torch.
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        with pytest.raises(TypeError, match="the module's parameters have dtype"):
            mha(x.bfloat16())


def _weights_cases():
    x = torch.randn(2, 16, 16)
    kpm = torch.zeros(2, 16, dtype=torch.bool)
    kpm[1, 12:] = True
    sparse = P.window(4).compile(Tokens(x, ~kpm), 8)
    packed = torch.nested.nested_tensor([x[0, :5], x[1, :9]], layout=torch.jagged)
    edges = torch.tensor([[0, 1, 2], [1, 2, 3]])
    return {
        "dense": lambda: MultiHeadAttention(16, 4)(x, key_padding_mask=kpm, need_weights=True),
        "gqa+sinks+softcap": lambda: MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True,
                                                        softcap=3.0)(x, need_weights=True),
        "no keys": lambda: MultiHeadAttention(16, 4)(x, x[:, :0], x[:, :0], need_weights=True),
        "block-sparse": lambda: MultiHeadAttention(16, 4)(x, attn_mask=sparse, need_weights=True),
        "packed": lambda: MultiHeadAttention(16, 4)(packed, need_weights=True),
        "local+global": lambda: LocalAttention(16, 4, 3, num_global_tokens=2)(
            x, key_padding_mask=kpm, need_weights=True),
        "neighborhood": lambda: NeighborhoodAttention(16, 4, 3)(
            x, key_padding_mask=kpm, grid=(4, 4), need_weights=True),
        "additive": lambda: AdditiveAttention(16, 4)(x, key_padding_mask=kpm, need_weights=True),
        "edge": lambda: EdgeAttention(16, 4)(x, edge_index=edges, need_weights=True),
    }


@pytest.mark.parametrize("kind", list(_weights_cases()))
def test_every_kernel_returns_float32_weights_where_autocast_softmax_is_float32(
        kind, monkeypatch):
    """CUDA autocast's softmax gives float32 (torch's MHA returns float32 weights there).
    Emulated on the CPU: every kernel's weights take that dtype, its output stays bf16."""
    monkeypatch.setattr(_kernel, "weights_dtype",
                        lambda v: torch.float32 if torch.is_autocast_enabled("cpu") else v.dtype)
    call = _weights_cases()[kind]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = call()
    weights = weights if isinstance(weights, list) else [weights]
    assert out.dtype == torch.bfloat16
    assert {w.dtype for w in weights} == {torch.float32}


def test_hf_backend_weights_keep_the_query_dtype_as_transformers_eager(monkeypatch):
    """transformers' eager backend casts its float32 softmax to the query's dtype; so does
    the backend, also where the kernels' weights are float32 (CUDA autocast, emulated)."""
    monkeypatch.setattr(_kernel, "weights_dtype",
                        lambda v: torch.float32 if torch.is_autocast_enabled("cpu") else v.dtype)
    q, k, v = (torch.randn(2, 4, 6, 8).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = hf.attention_forward(nn.Module(), q, k, v, None, output_attentions=True)
    assert out.dtype == weights.dtype == torch.bfloat16
