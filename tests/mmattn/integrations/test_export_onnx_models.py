"""ONNX Runtime equals eager for the exported blocks, encoders and adapters (Tokens in and
out; meta sizes such as an image grid come out as int64 scalars).

The shared checks are in _export_onnx.py; test_export_onnx.py covers the attention layers.
Skipped without the ``onnx`` extra.
"""

from __future__ import annotations

import pytest

from tests._features import needs
from tests.mmattn.integrations import _export_onnx as onnx_checks
from tests.mmattn.integrations._export_cases import CASES, SIZES

# ONNX Runtime round trips: seconds each, so the explicit pass of `make test`
# (-m "not slow") skips them;
# the fused pass runs them, and each path of theirs is checked with MMATTN_FUSED_ATTN=0 by hand.
pytestmark = [pytest.mark.slow, needs("is_exporting")]

onnx_checks.skip_without_onnx()

MODELS = [c for c in CASES if not c.attention]


@pytest.fixture(scope="module")
def programs():
    return onnx_checks.programs_fixture()


@pytest.fixture(scope="module", params=onnx_checks.params(MODELS), ids=onnx_checks.param_id)
def converted(request, programs):
    return onnx_checks.convert(request.param, programs)


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_onnx_runtime_equals_eager(converted, size):
    onnx_checks.check_equals_eager(converted, size)


def test_opset_23_runs_onnx_attention(converted):
    onnx_checks.check_attention_op(converted)
