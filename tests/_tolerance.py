"""Float tolerances that follow the magnitude of what is compared.

float32 rounding differs between machines: AVX2 and AVX-512 kernels, FMA contraction and the
order of a vectorised reduction change the last bits, and a GPU differs again. The error of a
result is a few ulps of the values it was computed from, so it grows with their size: a bare
absolute ``atol`` that holds for values near 1 on one CPU fails for values near 170 on the
next (issue 36: 3.05e-5 against atol 1e-5, a relative 1.8e-7). So a tolerance is stated for
values of unit size and scaled by the reference: ``atol * max(1, max|expected|)`` here, or
``rtol`` equal to ``atol`` where the compared values are O(1). Exact comparisons (masks,
indices, dead rows == 0, results the code guarantees bitwise) stay exact and do not use this.
"""

from __future__ import annotations

import torch


def scaled_atol(expected: torch.Tensor, atol: float) -> float:
    """``atol`` for values of unit size, times the largest finite ``|expected|`` above 1."""
    values = expected.values() if expected.is_nested else expected
    values = values.detach().abs().double()
    values = values[torch.isfinite(values)]
    largest = float(values.max()) if values.numel() else 0.0
    return atol * max(1.0, largest)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, *, atol: float,
                        **kwargs) -> None:
    """``torch.testing.assert_close`` with ``atol`` scaled by the reference's size.

    The relative strength stays the one ``atol`` has on unit values; ``kwargs`` (``msg``,
    ``check_dtype``, ...) pass through.
    """
    torch.testing.assert_close(actual, expected, atol=scaled_atol(expected, atol), rtol=0,
                               **kwargs)
