"""ONNX Runtime equals eager for the exported attention layers, and for a decoding step.

The shared checks are in _export_onnx.py; test_export_onnx_models.py covers the blocks,
encoders and adapters. Skipped without the ``onnx`` extra.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests._features import needs
from tests.mmattn.integrations import _export_onnx as onnx_checks
from tests.mmattn.integrations._export_cases import CASES, SIZES

onnx_checks.skip_without_onnx()

from mmattn import MultiHeadAttention  # noqa: E402
from mmattn._helpers import ceil_div  # noqa: E402
from mmattn.integrations.export import DecodeStep  # noqa: E402

# ONNX Runtime round trips: seconds each, so the explicit pass of `make test`
# (-m "not slow") skips them;
# the fused pass runs them, and each path of theirs is checked with MMATTN_FUSED_ATTN=0 by hand.
pytestmark = [pytest.mark.slow, needs("is_exporting")]

LAYERS = [c for c in CASES if c.attention]
STEPS = 16


@pytest.fixture(scope="module")
def programs():
    return onnx_checks.programs_fixture()


@pytest.fixture(scope="module", params=onnx_checks.params(LAYERS), ids=onnx_checks.param_id)
def converted(request, programs):
    return onnx_checks.convert(request.param, programs)


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_onnx_runtime_equals_eager(converted, size):
    onnx_checks.check_equals_eager(converted, size)


def test_opset_23_runs_onnx_attention(converted):
    onnx_checks.check_attention_op(converted)


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4, num_kv_heads=2, position="rotary").eval()
    step = DecodeStep(attention, max_len=STEPS + 4)
    batch = torch.export.Dim("batch", max=64)
    shapes = ({0: batch}, ({0: batch}, {0: batch}, None))
    program = torch.export.export(
        step, (torch.randn(3, 1, 16), step.init_state(3)), dynamic_shapes=shapes
    )
    return attention, step, program


@pytest.mark.parametrize("opset", [None, 23], ids=lambda o: f"opset{o or 'default'}")
def test_onnx_decode_step_reproduces_eager_decoding(decoder, opset):
    attention, step, program = decoder
    sess = onnx_checks.session(onnx_checks.to_onnx(program, opset))
    batch = 2  # not the traced batch
    cache = attention.make_cache(batch, STEPS + 4)
    state = list(step.init_state(batch))
    for _ in range(STEPS):
        x = torch.randn(batch, 1, 16)
        with torch.no_grad():
            want, _ = attention(x, is_causal=True, cache=cache)
        out, *state = onnx_checks.run(sess, [x, *state])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert int(state[2]) == len(cache) == STEPS


class _Blocks(torch.nn.Module):
    """ceil(L / 4) blocks of a dynamic length, as the blocked kernels count them."""

    def forward(self, x):
        return torch.arange(ceil_div(x.shape[1], 4), dtype=x.dtype) + 0.0 * x.sum()


def test_ceil_div_exports_as_a_ceiling():
    # torch.onnx lowers -(-a // b) to ONNX's truncating Div: ONNX Runtime then gives
    # floor(a / b), e.g. 2 blocks for a length of 9 (the kernels need 3)
    length = torch.export.Dim("length", min=5, max=64)
    program = torch.export.export(_Blocks(), (torch.randn(2, 9),),
                                  dynamic_shapes=({1: length},))
    sess = onnx_checks.session(onnx_checks.to_onnx(program, None))
    for size in (8, 9, 13, 33):  # ceil and floor differ at all but 8
        (out,) = onnx_checks.run(sess, [torch.randn(2, size)])
        assert out.shape == (math.ceil(size / 4),), size


def test_no_negative_floor_division_left():
    pattern = re.compile(r"-\s*\(\s*-[^()]*//|//\s*-")  # -(-a // b), a // -b
    root = Path(__file__).resolve().parents[3]
    found = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("mmattn", "adapters") for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0]) and "``" not in line
    ]
    assert not found, f"use mmattn._helpers.ceil_div instead of a negative floor division: {found}"
