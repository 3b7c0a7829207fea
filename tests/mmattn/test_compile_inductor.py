"""torch.compile under the default inductor backend: outputs and gradients equal eager.

The modules and inputs are test_compile.py's; this file holds its inductor tests so that
pytest's two workers share the compile work (they take files whole). Inductor compiles C++
on the CPU and is slow on a small shared machine: every test here is ``slow`` (fused pass
only, see the Makefile).
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Encoder
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


#: The inductor sweep's modules: one of each kernel and composition (the dense fused and
#: explicit paths, the blocked local kernel inside a block, additive, Linformer, the
#: multimodal encoder with its adapters, cross-attention inside its block). With a cold
#: inductor cache every compile costs tens of seconds on 2 cores, and compiling the
#: modules made of these same layers again (Encoder, the pools, LocalAttention alone,
#: CrossAttention alone, the latent encoder) kept CI over 15 minutes. The aot_eager sweep
#: still takes every module; the adapters go through inductor inside the multimodal
#: encoder.
SWEEP = {"mha", "mha_weights", "block_local", "additive", "linformer", "multimodal_concat",
         "cross_block"}


#: Sweep cases whose backward graph inductor also builds. The others are compared forward
#: only, to keep CI under 15 minutes with a cold inductor cache (the inductor file was the
#: suite's longest, 9 minutes of one worker); the aot_eager sweep checks every module's
#: gradients through the same captured graphs and the Encoder test above runs inductor's
#: backward of the fused path. ``mha_weights`` adds the explicit path's backward.
BACKWARD = {"mha_weights"}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "case"), [c for c in _cases() if c[0] in SWEEP],
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
