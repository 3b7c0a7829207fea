"""Values of a head width of their own (e_v != e) through the fused kernels: the result of a
softmax over q kᵀ written out by hand (float64), and torch's flash kernel still runs (zero
columns bring q, k and v to one width: kernels.dense.one_width)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmattn._features import features
from mmattn.kernels import dense
from mmattn.kernels.blocked import local_attend
from tests._features import reason


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def reference(q, k, v, allowed, groups=1):
    """softmax(q kᵀ / sqrt(e)) v in float64, rows without an allowed key 0."""
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("value_width", [3, 8, 10, 24])
def test_sdpa_takes_a_value_width_of_its_own_on_the_flash_kernel(value_width):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 9, 8)
    v = torch.randn(2, 2, 9, value_width)
    allowed = torch.rand(2, 1, 7, 9) > 0.3
    allowed[0, 0, 2] = False  # a dead row gives 0
    with Ops() as seen:
        out = dense.sdpa(q, k, v, allowed, groups=2)
    assert out.shape == (2, 4, 7, value_width)
    expected = reference(q, k, v, allowed, groups=2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
    assert (out[0, :, 2] == 0).all()
    if not features().cpu_flash_gqa:  # torch sends grouped heads to its math kernel
        pytest.skip(reason("cpu_flash_gqa"))
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in seen.names


def test_wider_values_leave_the_first_columns_of_a_band_as_they_were():
    """local_attend on [v | extra]: the first e columns are the call on v (within float
    rounding), the rest are the same weights on the extra columns."""
    torch.manual_seed(1)
    length, window = 50, 4
    q, k, v = (torch.randn(1, 2, length, 16) for _ in range(3))
    extra = torch.randn(1, 2, length, 3)
    narrow, _ = local_attend(q, k, v, window, block_size=8)
    wide, _ = local_attend(q, k, torch.cat([v, extra], dim=-1), window, block_size=8)
    scale = narrow.abs().max().item()
    torch.testing.assert_close(wide[..., :16], narrow, rtol=1e-6, atol=1e-6 * scale)
    position = torch.arange(length)
    allowed = (position[:, None] - position[None, :]).abs() <= window
    expected = reference(q, k, extra, allowed)
    torch.testing.assert_close(wide[..., 16:].double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
