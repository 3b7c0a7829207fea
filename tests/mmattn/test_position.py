"""mmattn.position against the formulas written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmattn.position import (
    LearnedPositionalEmbedding,
    LearnedPositionalEmbedding2d,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    apply_rotary,
    resample_2d,
    rotary_cos_sin,
    sinusoidal_1d,
    sinusoidal_2d,
)


def _vaswani(length: int, dim: int, offset: int = 0) -> torch.Tensor:
    table = torch.empty(length, dim, dtype=torch.float64)
    for p in range(length):
        for i in range(0, dim, 2):
            angle = (p + offset) / 10000 ** (i / dim)
            table[p, i] = math.sin(angle)
            table[p, i + 1] = math.cos(angle)
    return table


def test_sinusoidal_1d_matches_the_paper_formula():
    torch.testing.assert_close(sinusoidal_1d(7, 12).double(), _vaswani(7, 12), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        sinusoidal_1d(3, 6, offset=5).double(), _vaswani(3, 6, offset=5), atol=1e-6, rtol=1e-6
    )


def test_sinusoidal_2d_rows_then_columns():
    rows, cols, dim = 3, 4, 8
    table = sinusoidal_2d(rows, cols, dim).double()
    ref_row, ref_col = _vaswani(rows, dim // 2), _vaswani(cols, dim // 2)
    for r in range(rows):
        for c in range(cols):
            ref = torch.cat([ref_row[r], ref_col[c]])
            torch.testing.assert_close(table[r * cols + c], ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sinusoidal_1d(4, 7), "dim must be divisible by 2"),
        (lambda: sinusoidal_2d(2, 2, 6), "dim must be divisible by 4"),
        (lambda: sinusoidal_1d(-1, 8), "length must be >= 0"),
        (lambda: rotary_cos_sin(4, 5), "dim must be divisible by 2"),
        (lambda: resample_2d(torch.zeros(5, 4), (2, 2), (3, 3)), "old_grid rows"),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_sinusoidal_module_adds_table_in_input_dtype():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    out = SinusoidalPositionalEncoding(8)(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out - x, _vaswani(5, 8).expand(2, 5, 8), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="last dimension dim=8"):
        SinusoidalPositionalEncoding(8)(torch.zeros(1, 2, 6))


def test_learned_1d_adds_its_rows_and_refuses_long_inputs():
    pos = LearnedPositionalEmbedding(6, 4)
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(pos(x), x + pos.weight[:5])
    torch.testing.assert_close(pos(x[:, :2], offset=3), x[:, :2] + pos.weight[3:5])
    with pytest.raises(ValueError, match="max_len=6"):
        pos(torch.randn(1, 7, 4))


def test_resample_same_grid_is_identity_and_other_grid_matches_interpolate():
    table = torch.randn(2 * 3, 5)
    assert resample_2d(table, (2, 3), (2, 3)) is table
    out = resample_2d(table, (2, 3), (4, 5))
    image = table.reshape(2, 3, 5).permute(2, 0, 1)[None]  # independent of einops
    ref = F.interpolate(image, size=(4, 5), mode="bicubic", align_corners=False)
    torch.testing.assert_close(out, ref[0].permute(1, 2, 0).reshape(20, 5))
    constant = torch.full((6, 3), 0.25)
    torch.testing.assert_close(resample_2d(constant, (2, 3), (7, 2)), torch.full((14, 3), 0.25))


def test_learned_2d_uses_the_table_on_its_grid_and_resamples_elsewhere():
    pos = LearnedPositionalEmbedding2d((2, 3), 4)
    x = torch.zeros(1, 6, 4)
    assert torch.equal(pos(x), pos.weight[None])
    torch.testing.assert_close(
        pos(torch.zeros(1, 12, 4), grid=(3, 4))[0], resample_2d(pos.weight, (2, 3), (3, 4))
    )
    with pytest.raises(ValueError, match="rows\\*cols=12"):
        pos(torch.zeros(1, 11, 4), grid=(3, 4))


def _rotary_complex(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Reference: pair i is the complex number x_i + j x_{i+e/2}, turned by e^{j p theta_i}."""
    length, dim = x.shape[-2:]
    half = dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    pos = torch.arange(offset, offset + length, dtype=torch.float64)[:, None]
    theta = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    z = z * torch.polar(torch.ones_like(pos * theta), pos * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rotary_matches_complex_rotation_and_keeps_norms():
    x = torch.randn(2, 3, 6, 8)
    out = RotaryEmbedding(8)(x, offset=2)
    torch.testing.assert_close(out.double(), _rotary_complex(x, offset=2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 8), torch.randn(1, 8)
    rope = RotaryEmbedding(8)

    def score(m: int, n: int) -> torch.Tensor:
        return (rope(q[None], offset=m) * rope(k[None], offset=n)).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(3, 1), score(1, 3), atol=1e-3)


def test_apply_rotary_checks_table_shapes():
    cos, sin = rotary_cos_sin(4, 8)
    with pytest.raises(ValueError, match="cos must have shape"):
        apply_rotary(torch.randn(2, 5, 8), cos, sin)
