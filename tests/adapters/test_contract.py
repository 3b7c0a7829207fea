"""One contract for every adapter, built-in or user-written: the same checks for all.

Each case builds an adapter by name with ``adapters.create`` and feeds it a small input;
the test checks the token shape (B, L, embed_dim), the mask (None or bool (B, L) on the
same device), that the tokens follow the module's dtype and device, and that a loss on the
real tokens sends a finite, non-zero gradient to every parameter; on CPU and CUDA, in
float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adapters
from mmattn.tokens import Tokens

D = 16


class SensorAdapter(adapters.ModalityAdapter):
    """A custom adapter written as a user would: (B, L, C) sensor readings with a NaN gap."""

    modality = "contract_sensor"

    def __init__(self, embed_dim: int, channels: int = 3) -> None:
        super().__init__(embed_dim)
        self.channels = channels
        self.proj = nn.Linear(channels, embed_dim)
        self.scale = nn.Parameter(torch.ones(embed_dim))

    def forward(self, readings: torch.Tensor) -> Tokens:
        dtype, device = self._param_dtype_device()
        mask = ~readings.isnan().any(dim=-1)
        readings = readings.nan_to_num(0.0).to(device=device, dtype=dtype)
        return Tokens(self.proj(readings) * self.scale, mask.to(device), {"modality": "sensor"})


def _graph_input():
    pyg_data = pytest.importorskip("torch_geometric.data")
    graphs = [
        pyg_data.Data(x=torch.randn(n, 5), edge_index=torch.randint(0, n, (2, 2 * n)))
        for n in (4, 2, 6)
    ]
    return pyg_data.Batch.from_data_list(graphs)


def _sensor_input():
    readings = torch.randn(2, 6, 3)
    readings[1, 4:] = float("nan")
    return readings


# name, constructor kwargs, input factory, extra call kwargs, expected (B, L)
CASES = {
    "text": (
        dict(vocab_size=259, embed_dim=D, positional="learned", max_len=32),
        lambda: (adapters.ByteTokenizer().encode(["I love AI", "我爱AI"]),),
        (2, 9),
    ),
    "image": (
        dict(embed_dim=D, patch_size=4, img_size=12),
        lambda: (torch.rand(2, 3, 12, 12),),
        (2, 9),
    ),
    "image_uint8": (
        dict(embed_dim=D, patch_size=4, stride=2, img_size=10, positional="sincos"),
        lambda: (torch.randint(0, 256, (2, 3, 10, 10), dtype=torch.uint8),),
        (2, 16),
    ),
    "audio": (
        dict(
            embed_dim=D,
            sample_rate=8000,
            n_mels=8,
            n_fft=64,
            hop_length=32,
            positional="learned",
            max_frames=64,
        ),
        lambda: (torch.randn(2, 320), torch.tensor([320, 100])),
        (2, 11),
    ),
    "audio_raw": (
        dict(embed_dim=D, sample_rate=8000, n_fft=64, hop_length=32, frontend="raw"),
        lambda: (torch.randn(2, 2, 320), torch.tensor([200, 320])),
        (2, 11),
    ),
    "graph": (
        dict(in_channels=5, embed_dim=D, structural=("degree", "laplacian"), num_eigenvectors=3),
        lambda: (_graph_input(),),
        (3, 6),
    ),
    "contract_sensor": (dict(embed_dim=D), lambda: (_sensor_input(),), (2, 6)),
}
NEEDS = {"audio": "torchaudio", "graph": "torch_geometric"}


def _build(case: str):
    kwargs, make_input, shape = CASES[case]
    name = case.split("_")[0] if case.startswith(("image", "audio")) else case
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return adapters.create(name, **kwargs), make_input(), shape


def _to(value, device):
    return value.to(device) if hasattr(value, "to") else value


def test_every_registered_builtin_is_covered():
    builtin = {"text", "image", "audio", "graph"}
    assert builtin <= set(adapters.available())
    assert "contract_sensor" in adapters.available()
    assert builtin <= {case.split("_")[0] for case in CASES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_contract(case, dtype, device):
    adapter, inputs, (batch, length) = _build(case)
    adapter = adapter.to(device=device, dtype=dtype)
    inputs = tuple(_to(value, device) for value in inputs)
    out = adapter(*inputs)

    assert isinstance(out, Tokens)
    assert out.x.shape == (batch, length, adapter.embed_dim)
    assert out.x.dtype == dtype and out.x.device.type == device
    if out.mask is not None:
        assert out.mask.dtype == torch.bool and out.mask.shape == (batch, length)
        assert out.mask.device == out.x.device
        assert out.mask.any(dim=1).all()  # every sample keeps at least one real token
    assert torch.isfinite(out.x[out.full_mask()]).all()

    loss = out.x[out.full_mask()].float().pow(2).sum()
    loss.backward()
    for name, param in adapter.named_parameters():
        assert param.grad is not None, f"{case}: no gradient reached {name}"
        assert torch.isfinite(param.grad).all(), f"{case}: non-finite gradient in {name}"
        assert param.grad.abs().sum() > 0, f"{case}: zero gradient in {name}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_repr_and_reset(case):
    adapter, inputs, _ = _build(case)
    if hasattr(adapter, "reset_parameters"):
        before = [p.detach().clone() for p in adapter.parameters()]
        torch.manual_seed(123)
        adapter.reset_parameters()
        after = list(adapter.parameters())
        assert any(not torch.equal(b, a) for b, a in zip(before, after))
    assert f"embed_dim={D}" in repr(adapter) or case == "contract_sensor"
