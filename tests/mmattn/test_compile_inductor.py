"""torch.compile under the default inductor backend: outputs and gradients equal eager.

The modules and inputs are test_compile.py's; this file holds its inductor tests so that
pytest's two workers share the compile work (they take files whole). Inductor compiles C++
on the CPU and is slow on a small shared machine: every test here is ``slow`` (fused pass
only, see the Makefile).
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Encoder, LocalAttention
from tests.mmattn.test_compile import (  # noqa: F401 (_fresh_dynamo: an autouse fixture)
    LENGTHS,
    LOCAL_LENGTHS,
    NO_FULLGRAPH,
    D,
    H,
    _adapter_cases,
    _cases,
    _check,
    _fresh_dynamo,
    _KeyPadding,
    _leaves,
    _padding,
    _tokens,
    _x,
)


@pytest.mark.slow
def test_inductor_encoder_four_lengths_at_most_one_recompile(device):
    """Encoder -> TransformerBlock -> MultiHeadAttention under inductor, fwd + bwd."""
    model = Encoder(D, depth=1, num_heads=H).to(device)

    def make(length, seed):
        (tokens,) = _tokens(length, seed)
        return (tokens.to(device),)

    frames = _check(model, make, LENGTHS, "inductor")
    assert frames[-1] - frames[0] <= 1, f"recompiled: frames after each length {frames}"


@pytest.mark.slow
def test_inductor_local_attention_matches_eager(device):
    """LocalAttention under inductor, forward at one length. Inductor needs minutes on two CPU
    cores for its dynamic-shape and backward graphs, so those are checked under aot_eager
    below (the same Dynamo capture, hence the same recompilation guards), and
    benchmarks/compile.py runs inductor fwd + bwd and compares it with eager."""
    model = _KeyPadding(LocalAttention(D, H, window_size=3).to(device))
    compiled = torch.compile(model, fullgraph=True)
    x, real = _x(LOCAL_LENGTHS[0], 0).to(device), _padding(2, LOCAL_LENGTHS[0], 0).to(device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, real)[0], model(x, real)[0], atol=2e-5,
                                   rtol=1e-4)


# --- inductor sweep: the same modules under the default backend ------------------------


#: Modules whose every layer another inductor case already compiles: the Encoder and its
#: full TransformerBlock (test_inductor_encoder_four_lengths_at_most_one_recompile),
#: CrossAttention (inside CrossAttentionBlock), the latent MultiModalEncoder (the concat
#: one's layers plus cross-attention). The aot_eager sweep still takes them all.
ELSEWHERE = {"encoder", "block_full", "cross", "multimodal_latent"}


#: Sweep cases whose backward graph inductor also builds. The others are compared forward
#: only, to keep CI under 15 minutes with a cold inductor cache (the inductor file was the
#: suite's longest, 8 minutes of one worker); the aot_eager sweep checks every module's
#: gradients through the same captured graphs and the Encoder test above runs inductor's
#: backward of the fused path. ``mha_weights`` adds the explicit path's backward.
BACKWARD = {"mha_weights"}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "case"), [c for c in _cases() if c[0] not in ELSEWHERE],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_inductor_fullgraph_matches_eager(name, case):
    """Every public module under the default inductor backend at one length: the forward,
    and for :data:`BACKWARD` the gradients too."""
    module, make, lengths = case
    if name in BACKWARD:
        _check(module, make, lengths[:1], "inductor")
        return
    compiled = torch.compile(module, fullgraph=True)
    args = make(lengths[0], 0)
    with torch.no_grad():
        got, want = _leaves(compiled(*args)), _leaves(module(*args))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "case"), [c for c in _adapter_cases()
                                            if c[0] not in NO_FULLGRAPH],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_adapters_inductor_fullgraph_match_eager(name, case):
    adapter, make = case
    _check(adapter, make, (6,), "inductor")
