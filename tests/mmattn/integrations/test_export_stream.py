"""torch.export of a streaming chunk step: ``ChunkStep`` equals the stateful eager stream.

A two-block Encoder trained with the chunked rule (rotary positions, grouped-query heads)
streams 50 chunks three ways: eagerly with its ``EncoderCache``, through ``ChunkStep``
eagerly, and through the ``torch.export`` program of ``ChunkStep`` (a dynamic batch, traced
at another batch size). Every chunk's output must agree within 1e-5, padding included. The
ONNX Runtime half is test_export_onnx_stream.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from mmattn import Encoder, LocalAttention, MultiHeadAttention, Tokens
from mmattn.integrations.export import ChunkStep
from tests._features import needs

CHUNK, LEFT, D, CHUNKS = 4, 2, 16, 50


#: Tiny tensors: one intra-op thread (tests/conftest.py).
#: torch.export of mmattn's layers is tested where torch tells an export from a compile
#: (torch.compiler.is_exporting); torch 2.5 and 2.6 specialize what the tests keep dynamic
pytestmark = [pytest.mark.usefixtures("one_thread"), needs("is_exporting")]


class _Chunked:
    """Stands for ``P.chunked(chunk, left)`` (the three fields Encoder reads)."""

    def __init__(self, chunk: int, left: int = 0, right: int = 0) -> None:
        self.chunk, self.left, self.right = chunk, left, right


def streaming_encoder() -> Encoder:
    torch.manual_seed(0)
    encoder = Encoder(D, 2, 4, mlp_ratio=2.0,
                      attention_kwargs={"position": "rotary", "num_kv_heads": 2}).eval()
    encoder.pattern = _Chunked(CHUNK, LEFT)
    return encoder


def export_step(step: ChunkStep) -> torch.export.ExportedProgram:
    """The program of ``step(x, state, mask)`` with a dynamic batch, traced at batch 3."""
    batch = Dim("batch", max=64)
    state = tuple({0: batch} if not name.endswith("size") else None
                  for name in step.state_names)
    example = (torch.randn(3, CHUNK, D), step.init_state(3),
               torch.ones(3, CHUNK, dtype=torch.bool))
    return torch.export.export(step, example, dynamic_shapes=({0: batch}, state, {0: batch}))


def stream_inputs(batch: int, chunks: int = CHUNKS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, mask) per chunk; sample 1 ends in the middle of the last few chunks."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in range(chunks):
        mask = torch.ones(batch, CHUNK, dtype=torch.bool)
        if n >= chunks - 3:
            mask[1, 1 if n == chunks - 3 else 0:] = False
        out.append((torch.randn(batch, CHUNK, D, generator=gen), mask))
    return out


@pytest.fixture(scope="module")
def exported():
    encoder = streaming_encoder()
    step = ChunkStep(encoder)
    return encoder, step, export_step(step)


def test_exported_chunk_step_equals_eager_at_every_chunk(exported):
    encoder, step, program = exported
    run = program.module()
    batch = 2  # not the traced batch
    cache = encoder.make_cache(batch)
    state = exported_state = step.init_state(batch)
    for n, (x, mask) in enumerate(stream_inputs(batch)):
        before = [t.clone() for t in state]
        with torch.no_grad():
            want = encoder(Tokens(x, mask), cache=cache).x
            got, state = step(x, state, mask)
            got_exported, exported_state = run(x, exported_state, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_exported, want, atol=1e-5, rtol=1e-5)
        if n == 0:  # nothing written in place: the caller's state is left as it was
            assert all(torch.equal(a, b) for a, b in zip(step.init_state(batch), before))
    assert int(state[3]) == int(exported_state[3]) == len(cache) == CHUNKS * CHUNK
    assert step.state_names[:4] == ("layer0.k", "layer0.v", "layer0.valid", "layer0.size")


def test_exporting_the_stateful_stream_names_chunk_step():
    encoder = streaming_encoder()

    class Stateful(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.cache = encoder, encoder.make_cache(2)

        def forward(self, x):
            return self.encoder(Tokens(x), cache=self.cache).x

    with pytest.raises(TypeError, match="ChunkStep for a ChunkCache"):
        torch.export.export(Stateful(), (torch.randn(2, CHUNK, D),))


def test_chunk_step_of_a_layer_and_bad_arguments():
    attn = MultiHeadAttention(D, 4).eval()
    step = ChunkStep(attn, chunk=CHUNK, left=1)
    cache = attn.make_cache(2, chunk=CHUNK, left=1)
    state = step.init_state(2)
    for x, mask in stream_inputs(2, chunks=3):
        with torch.no_grad():
            want, _ = attn(x, key_padding_mask=~mask, cache=cache)
            got, state = step(x, state, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk=4 does not apply to an Encoder"):
        ChunkStep(streaming_encoder(), chunk=4)
    with pytest.raises(ValueError, match="chunk must be given for a MultiHeadAttention"):
        ChunkStep(attn)
    with pytest.raises(TypeError, match="LocalAttention.make_cache does not take chunk="):
        ChunkStep(LocalAttention(D, 4, 2), chunk=CHUNK)
    with pytest.raises(TypeError, match="module must be an mmattn Encoder"):
        ChunkStep(torch.nn.Linear(D, D), chunk=CHUNK)
    with pytest.raises(ValueError, match="state must be the 4 tensors of ChunkStep.init_state"):
        step(torch.randn(2, CHUNK, D), state[:3])
    with pytest.raises(ValueError, match="state was made for batch_size=2 .ChunkStep.init_state"
                                         "., got x with batch size 3"):
        step(torch.randn(3, CHUNK, D), state)
