"""torch.compile(dynamic=True, fullgraph=True): one capture serves four lengths.

The modules and inputs are test_compile.py's; this file holds its ``dynamic=True`` tests so
that pytest's two workers share the capture work (they take files whole). The backend is
``aot_eager``: Dynamo's guards, which decide recompilation, do not depend on the backend.
"""

from __future__ import annotations

import pytest
import torch

import adapters
from mmattn import (
    AdditiveAttention,
    CrossAttention,
    CrossAttentionBlock,
    EdgeAttention,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
    MultiModalEncoder,
    Tokens,
    TransformerBlock,
)
from tests.mmattn.test_compile import (  # noqa: F401 (_fresh_dynamo: an autouse fixture)
    LENGTHS,
    LOCAL_LENGTHS,
    D,
    H,
    _assert_same,
    _attention_case,
    _check,
    _edges,
    _fresh_dynamo,
    _grid_case,
    _image_adapter,
    _multimodal_inputs,
    _OnEdges,
    _padding,
    _run,
    _tokens,
    _x,
)


def test_blocks_dynamic_true_never_recompile():
    model = Encoder(D, depth=1, num_heads=H)
    frames = _check(model, _tokens, LENGTHS, "aot_eager", dynamic=True)
    assert frames[-1] == frames[0], f"recompiled: frames after each length {frames}"



# --- dynamic=True on every layer and block: one capture for four lengths --------------


def _dynamic_cases():
    """Every attention layer and block, for ``dynamic=True``: (module, make_args, lengths).

    The layers take grouped-query heads where they have them (SDPA's ``enable_gqa`` must come
    from the configuration, never a SymBool shape comparison)."""
    yield "mha_gqa", _attention_case(MultiHeadAttention(D, H, num_kv_heads=1), lengths=LENGTHS)
    # context lengths 8, 10, 12, 15: the first equals D, which duck sizing would tie to
    # the static width (a test artefact, not a recompile of the layer): start at 6 instead
    yield "cross", _attention_case(CrossAttention(D, H, kdim=D, vdim=D), cross=True,
                                   lengths=(6, 8, 10, 13))
    # short lengths too: a block of min(32, L) made one graph per length below 32
    yield "local_gqa_causal", _attention_case(
        LocalAttention(D, H, window_size=3, causal=True, num_kv_heads=1),
        lengths=(9, 17, 33, 65),
    )
    yield "neighborhood_batches", _grid_case(batches=(2, 3, 5))  # one grid, three batches
    yield "additive", _attention_case(AdditiveAttention(D, H), lengths=LENGTHS)
    yield "linformer", _attention_case(LinformerAttention(D, H, seq_len=16, proj_len=3),
                                       lengths=LENGTHS)
    yield "block_full", (TransformerBlock(D, H), _tokens, LENGTHS)
    yield "block_local", (TransformerBlock(D, H, attention="local", window_size=2,
                                           attention_kwargs={"num_kv_heads": 1,
                                                             "num_global_tokens": 2}),
                          _tokens, LOCAL_LENGTHS)

    def cross_tokens(length, seed):
        return Tokens(_x(length, seed), _padding(2, length, seed)), _tokens(length + 2, seed)[0]

    yield "cross_block", (CrossAttentionBlock(D, H), cross_tokens, LENGTHS)
    encoder = MultiModalEncoder(
        {"text": adapters.TextTokenEmbedder(50, D), "image": _image_adapter()},
        D, depth=1, num_heads=H,
    )
    yield "multimodal", (encoder, _multimodal_inputs, LENGTHS)


#: Captures that take 5-70 s each on 2 shared CPU cores (the blocked and neighbourhood
#: kernels', the multimodal encoder's, the cross-attention and Linformer layers'): they run
#: in the fused pass only. The explicit pass still captures the MultiHeadAttention,
#: AdditiveAttention and TransformerBlock cases here and the Encoder
#: (test_blocks_dynamic_true_never_recompile).
SLOW_DYNAMIC = {"local_gqa_causal", "neighborhood_batches", "block_local",
                "multimodal", "cross", "cross_block", "linformer"}


@pytest.mark.parametrize(("name", "case"), [
    pytest.param(n, c, marks=pytest.mark.slow) if n in SLOW_DYNAMIC else (n, c)
    for n, c in _dynamic_cases()], ids=lambda v: v if isinstance(v, str) else "")
def test_dynamic_true_fullgraph_four_lengths_one_capture(name, case):
    """``dynamic=True, fullgraph=True``: four lengths and padding patterns, forward and
    backward equal to eager, and the capture of the first length serves the other three."""
    module, make, lengths = case
    frames = _check(module, make, lengths, "aot_eager", dynamic=True)
    assert frames[-1] == frames[0], f"recompiled: frames after each length {frames}"


@pytest.mark.slow  # captures with breaks (the edge set and the sparse kernel run eagerly)
def test_edge_attention_dynamic_true_matches_eager():
    # docs/edge_cases.md: EdgeAttention is in the dynamic=True sweep (not fullgraph: its
    # data-dependent edge set breaks the graph); sinks take the modified kernel
    module = _OnEdges(EdgeAttention(D, H, sinks=True))
    compiled = torch.compile(module, backend="aot_eager", dynamic=True)
    for length, seed in ((6, 0), (9, 1)):
        args = _edges(length, seed)
        _assert_same(_run(module, compiled, args), _run(module, module, args))
