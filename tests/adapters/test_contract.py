"""One contract for every adapter, built-in or user-written: the same checks for all.

The cases are discovered: every name in ``adapters.available()`` — the built-ins, the
sensor adapter below, and ``examples.custom_adapter``'s time-series adapter — is built and
fed from its class's ``example()``; a few extra configurations of the built-ins follow.
The test checks the token shape (B, L, embed_dim), the mask (None or bool (B, L) on the
same device), that the tokens follow the module's dtype and device, and that a loss on the
real tokens sends a finite, non-zero gradient to every parameter; on CPU and CUDA, in
float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adapters
import examples.custom_adapter  # noqa: F401  (registers "timeseries", a user's adapter)
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

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, channels={self.channels}"

    @classmethod
    def example(cls):
        readings = torch.randn(2, 6, 3)
        readings[1, 4:] = float("nan")
        return {"embed_dim": D}, (readings,)

    def forward(self, readings: torch.Tensor) -> Tokens:
        dtype, device = self._param_dtype_device()
        mask = ~readings.isnan().any(dim=-1)
        readings = readings.nan_to_num(0.0).to(device=device, dtype=dtype)
        return Tokens(self.proj(readings) * self.scale, mask.to(device), {"modality": "sensor"})


#: Extra configurations of the built-ins: name -> (adapter name, constructor kwargs, inputs).
VARIANTS = {
    "image_uint8": (
        "image", dict(embed_dim=D, patch_size=4, stride=2, img_size=10, positional="sincos"),
        lambda: (torch.randint(0, 256, (2, 3, 10, 10), dtype=torch.uint8),),
    ),
    "audio_raw": (
        "audio", dict(embed_dim=D, sample_rate=8000, n_fft=64, hop_length=32, frontend="raw"),
        lambda: (torch.randn(2, 2, 320), torch.tensor([200, 320])),
    ),
}
#: Every registered adapter, from its example(), plus the variants.
CASES = sorted([*adapters.available(), *VARIANTS])


def _build(case: str):
    """(adapter, inputs); skipped only when the adapter's optional library is missing."""
    try:
        if case in VARIANTS:
            name, kwargs, make_input = VARIANTS[case]
            return adapters.create(name, **kwargs), make_input()
        kwargs, inputs = adapters.adapter_class(case).example()
        return adapters.create(case, **kwargs), inputs
    except ImportError as err:
        pytest.skip(f"{case}: {err}")


def _to(value, device):
    return value.to(device) if hasattr(value, "to") else value


def test_every_registered_adapter_is_covered():
    assert {"text", "image", "audio", "graph", "contract_sensor", "timeseries"} <= set(CASES)
    for name in adapters.available():
        kwargs, inputs = adapters.adapter_class(name).example()  # each defines one
        assert isinstance(kwargs, dict) and isinstance(inputs, tuple), name


def test_base_class_example_says_what_to_define():
    class NoExample(adapters.ModalityAdapter, register=False):
        modality = "no_example"

    with pytest.raises(NotImplementedError, match=r"NoExample.example\(\) is not defined"):
        NoExample.example()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_contract(case, dtype, device):
    adapter, inputs = _build(case)
    adapter = adapter.to(device=device, dtype=dtype)
    inputs = tuple(_to(value, device) for value in inputs)
    out = adapter(*inputs)

    assert isinstance(out, Tokens)
    assert out.x.dim() == 3 and out.x.shape[-1] == adapter.embed_dim
    batch, length = out.x.shape[:2]
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
    adapter, _ = _build(case)
    if hasattr(adapter, "reset_parameters"):
        before = [p.detach().clone() for p in adapter.parameters()]
        torch.manual_seed(123)
        adapter.reset_parameters()
        after = list(adapter.parameters())
        assert any(not torch.equal(b, a) for b, a in zip(before, after))
    assert f"embed_dim={adapter.embed_dim}" in repr(adapter)
