"""mmattn.debug.explain: the path of every attention call, the reasons, a model left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mmattn import (
    AdditiveAttention,
    Encoder,
    LocalAttention,
    MultiHeadAttention,
    Tokens,
)
from mmattn.debug import AttentionCall, explain
from mmattn.kernels import dense as _kernel


class Mixed(nn.Module):
    """Fused, explicit (weights), local, additive, torch's own, and a nested Encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.full = MultiHeadAttention(16, 4)
        self.local = LocalAttention(16, 4, window_size=2)
        self.additive = AdditiveAttention(16, 2)
        self.torch_mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.encoder = Encoder(16, 2, 4, dropout=0.1)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        a, _ = self.full(x, key_padding_mask=pad)
        b, weights = self.full(x, need_weights=True)
        c, _ = self.local(x)
        d, _ = self.additive(x)
        e, _ = self.torch_mha(x, x, x)
        f = self.encoder(Tokens(x)).x
        y = a + b + c + d + e + f + weights.sum()
        return self.norm(y.transpose(1, 2))


@pytest.fixture(autouse=True)
def _fused_on():
    """These tests name the paths taken with the default switch (on); the switch-off case
    is tested explicitly."""
    with _kernel.fused_attn(True):
        yield


def _inputs():
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True  # module direction: True = padding
    return x, pad


def test_mixed_model_every_call_attributed_with_its_path():
    model = Mixed().eval()
    x, pad = _inputs()
    report = explain(model, x, pad)
    assert [(c.module, c.cls, c.path) for c in report] == [
        ("full", "MultiHeadAttention", "fused"),
        ("full", "MultiHeadAttention", "explicit"),
        ("local", "LocalAttention", "local"),
        ("additive", "AdditiveAttention", "chunked"),
        ("torch_mha", "MultiheadAttention", "torch"),
        ("encoder.blocks.0.attn", "MultiHeadAttention", "fused"),
        ("encoder.blocks.1.attn", "MultiHeadAttention", "fused"),
    ]
    fused, explicit, local, additive, theirs = report[:5]
    assert fused.backend == "flash" and fused.fused and fused.reasons == []
    assert fused.q == (2, 4, 6, 4) and fused.dtype == "float32" and fused.device == "cpu"
    assert fused.mask == "bool (2, 1, 1, 6)"  # the merged key padding, SDPA direction
    assert explicit.reasons == ["attention weights were requested (need_weights=True)"]
    assert not explicit.fused and explicit.backend is None
    assert local.fused and local.reasons == []
    assert "no fused kernel" in additive.reasons[0]
    assert "replace_attention" in theirs.reasons[0] and theirs.q == (2, 6, 16)
    with torch.no_grad():
        torch.testing.assert_close(report.output, model(x, pad))
    table = str(report)
    assert table.splitlines()[0].split()[:4] == ["module", "class", "path", "backend"]
    assert "encoder.blocks.1.attn" in table
    assert "[1] full: attention weights were requested" in table


def test_model_unchanged_afterwards():
    model = Mixed().train()
    model.torch_mha.eval()  # mixed training flags must come back as they were
    x, pad = _inputs()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    flags = {k: m.training for k, m in model.named_modules()}
    rng = torch.get_rng_state()
    explain(model, x, pad)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert {k: m.training for k, m in model.named_modules()} == flags
    for k, v in model.named_parameters():
        assert torch.equal(v, params[k]), k
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k  # BatchNorm's running stats were restored
    assert torch.equal(torch.get_rng_state(), rng)  # dropout draws left no trace
    assert not _kernel.reporting()


def test_reasons_match_the_cause():
    x, _ = _inputs()
    mha = MultiHeadAttention(16, 4, dropout=0.2).eval()
    with _kernel.fused_attn(False):
        (call,) = explain(mha, x)
    assert call.path == "explicit"
    assert call.reasons == [
        "the fused path is switched off (MMATTN_FUSED_ATTN=0 / set_fused_attn)"
    ]
    with sdpa_kernel([SDPBackend.MATH]):
        (call,) = explain(mha, x)
    assert (call.path, call.backend) == ("fused", "math") and not call.fused
    assert "backends are disabled" in call.reasons[0]

    mha.train()  # CPU: SDPA's flash kernel takes no dropout
    (call,) = explain(mha, x)
    assert call.backend == "math" and call.dropout_p == 0.2
    assert any("dropout_p=0.2" in r and "rules out" in r for r in call.reasons)
    (call,) = explain(mha, x, need_weights=True)
    assert call.reasons[0].startswith("attention weights were requested")
    assert "dropout is applied to the explicit weights" in call.reasons[1]

    local = LocalAttention(16, 4, window_size=1).eval()
    (call,) = explain(local, x, attn_mask=torch.zeros(6, 6, dtype=torch.bool))
    assert call.path == "fused" and "dense O(L²)" in call.reasons[0]


class _SpySDPA:
    """Records every ``F.scaled_dot_product_attention`` call that really runs, and the backend
    torch picks for exactly those tensors: the reference for what explain reports."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
            index = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal,
                                            scale=scale, enable_gqa=enable_gqa)
            mask = "none" if attn_mask is None else (
                f"{'bool' if attn_mask.dtype == torch.bool else 'float'} "
                f"{tuple(attn_mask.shape)}")
            self.calls.append((tuple(q.shape), tuple(k.shape), mask, SDPBackend(index)))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def assert_reported(self, report) -> None:
        from mmattn.debug.explain import BACKENDS

        assert len(report) == len(self.calls)
        for call, (q, k, mask, backend) in zip(report, self.calls):
            assert (call.q, call.k, call.mask, call.backend) == (q, k, mask, BACKENDS[backend])
            assert call.fused == (BACKENDS[backend] != "math")


def test_local_reports_the_per_block_call_with_its_band_mask(monkeypatch):
    """The blocked kernel runs SDPA on (b·n, h, s, e) blocks with a band mask; explain must
    report that call (on CUDA the whole unmasked q/k/v would say "flash" where the masked
    blocks cannot run flash)."""
    local = LocalAttention(16, 4, window_size=3, num_kv_heads=2).eval()
    spy = _SpySDPA(monkeypatch)
    with torch.no_grad():
        report = explain(local, torch.randn(2, 40, 16))
    assert len(spy.calls) == 1  # one batched call over all blocks
    spy.assert_reported(report)
    (call,) = report
    # block 32 (MIN_BLOCK), 2 blocks per item; slab 32 + 2·3 keys; 2 key heads
    assert call.q == (4, 4, 32, 4) and call.k == (4, 2, 38, 4)
    assert call.mask == "bool (4, 1, 32, 38)" and call.path == "local"


def _packed_tokens() -> Tokens:
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    real = torch.arange(7) < torch.tensor([7, 4, 6])[:, None]
    return Tokens(x, real).pack()


@pytest.mark.parametrize("attention", ["full", "local"])
def test_packed_blocks_report_each_call_attributed_to_the_attention(monkeypatch, attention):
    """Packed blocks call ``attn.attend_rows`` directly (no forward hook of the attention
    runs): every call is still attributed to ``blocks.N.attn``, with its backend."""
    kwargs = {"attention": "local", "window_size": 2} if attention == "local" else {}
    enc = Encoder(16, 2, 4, **kwargs).eval()
    spy = _SpySDPA(monkeypatch)
    with torch.no_grad():
        report = explain(enc, _packed_tokens())
    cls, path = ("LocalAttention", "local") if attention == "local" else (
        "MultiHeadAttention", "packed")
    assert [(c.module, c.cls, c.path) for c in report] == [
        ("blocks.0.attn", cls, path), ("blocks.1.attn", cls, path)]
    spy.assert_reported(report)
    assert all(c.fused and c.backend == "flash" and c.reasons == [] for c in report)
    if attention == "full":  # one bucket of 3 items padded to 7, keys masked
        assert report[0].q == (3, 4, 7, 4) and report[0].mask == "bool (3, 1, 1, 7)"
    with torch.no_grad():
        torch.testing.assert_close(report.output.x.values(), enc(_packed_tokens()).x.values())


def test_packed_weights_report_the_explicit_bucket_call():
    mha = MultiHeadAttention(16, 4).eval()
    packed = _packed_tokens().x
    with torch.no_grad():
        report = explain(mha, packed, need_weights=True)
    assert [(c.module, c.path, c.q) for c in report] == [("", "explicit", (3, 4, 7, 4))]
    assert not report[0].fused and "need_weights=True" in report[0].reasons[0]


def test_packed_tokens_through_a_block():
    enc = Encoder(16, 1, 4).eval()
    tokens = Tokens(torch.randn(2, 5, 16), torch.tensor([[1] * 5, [1] * 3 + [0] * 2]).bool())
    report = explain(enc, tokens.pack())
    assert [c.path for c in report] == ["packed"]
    assert report[0].fused and report[0].module == "blocks.0.attn"
    assert not any("attend_rows" in vars(m) for m in enc.modules())  # unwrapped afterwards


def test_backend_names_per_device(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    mha = MultiHeadAttention(64, 2, device=device, dtype=dtype).eval()
    x = torch.randn(2, 32, 64, device=device, dtype=dtype)
    (call,) = explain(mha, x)
    if device == "cuda":
        assert call.backend in ("flash", "efficient", "cudnn")
    else:
        assert call.backend == "flash"
    assert call.device.startswith(device) and call.fused and call.reasons == []
    if device == "cuda":  # training-mode dropout: still a fused kernel on CUDA
        mha.dropout = 0.1
        (call,) = explain(mha.train(), x)
        assert call.backend in ("flash", "efficient", "cudnn") and call.dropout_p == 0.1


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got function"):
        explain(lambda x: x, torch.zeros(1))
    assert isinstance(AttentionCall("m", "C", "fused").reasons, list)


def test_torch_debug_messages_are_caught_in_words():
    """The capture of torch's own can_use_* reasons (used on CUDA) works: here it explains
    that CPU tensors cannot use the CUDA flash kernel, in torch's words, every time."""
    from mmattn.debug.explain import _torch_debug_messages

    q = torch.randn(1, 2, 4, 8)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    for _ in range(2):
        messages = _torch_debug_messages(torch.backends.cuda.can_use_flash_attention, params)
        assert any("cuda" in m.lower() for m in messages), messages


def test_packed_neighbourhood_calls_are_reported():
    from mmattn import NeighborhoodAttention

    attn = NeighborhoodAttention(16, 4, kernel_size=3).eval()
    tokens = Tokens.from_packed(torch.randn(4 + 9, 16), torch.tensor([0, 4, 13]))
    report = explain(attn, tokens.x, grid=[(2, 2), (3, 3)])
    assert [(call.path, call.q) for call in report] == [("neighborhood", (13, 4, 4))]
