"""ONNX Runtime equals eager for a streaming chunk step, at every chunk for 50 chunks.

The ``torch.export`` program of ``ChunkStep`` (test_export_stream.py) is converted with
``torch.onnx.export(..., dynamo=True)`` at the default opset and at opset 23 (SDPA lowered to
ONNX ``Attention``); ONNX Runtime streams 50 chunks of a batch other than the traced one,
padding in the last chunks, and every chunk's output and the state must match eager within
1e-5. Skipped without the ``onnx`` extra.
"""

from __future__ import annotations

import pytest
import torch

from tests._features import needs
from tests.mmattn.integrations import _export_onnx as onnx_checks

onnx_checks.skip_without_onnx()

from mmattn import Tokens  # noqa: E402
from mmattn.integrations.export import ChunkStep  # noqa: E402
from tests.mmattn.integrations.test_export_stream import (  # noqa: E402
    CHUNK,
    CHUNKS,
    export_step,
    stream_inputs,
    streaming_encoder,
)

# ONNX Runtime round trips: seconds each; the fused pass of `make test` runs them.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"), needs("is_exporting")]



@pytest.fixture(scope="module")
def exported():
    encoder = streaming_encoder()
    step = ChunkStep(encoder)
    return encoder, step, export_step(step)


@pytest.mark.parametrize("opset", [None, 23], ids=lambda o: f"opset{o or 'default'}")
def test_onnx_chunk_step_streams_like_eager(exported, opset):
    encoder, step, program = exported
    sess = onnx_checks.session(onnx_checks.to_onnx(program, opset))
    batch = 2  # not the traced batch
    cache = encoder.make_cache(batch)
    state = list(step.init_state(batch))
    for x, mask in stream_inputs(batch):
        with torch.no_grad():
            want = encoder(Tokens(x, mask), cache=cache).x
        out, *state = onnx_checks.run(sess, [x, *state, mask])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, got, layer in zip(step.state_names[:4], state[:4], [cache.layers[0]] * 4):
        want = getattr(layer, name.split(".")[1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert int(state[3]) == len(cache) == CHUNKS * CHUNK
