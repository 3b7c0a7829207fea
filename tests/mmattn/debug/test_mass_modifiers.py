"""attention_mass with score modifiers (sinks, softcap, ALiBi) against the dense weights of
the same modules: a sink's share goes to no modality, so rows sum below one."""

from __future__ import annotations

import pytest
import torch

from mmattn import LocalAttention, MultiHeadAttention
from mmattn.debug import attention_mass, top_keys
from tests.mmattn.debug.test_mass import (
    D,
    H,
    check_top,
    dense_weights,
    fused,
    real_of,
    reference,
    span_groups,
)

LAYERS = {
    "mha-sinks": lambda: MultiHeadAttention(D, H, sinks=True),
    "mha-softcap": lambda: MultiHeadAttention(D, H, softcap=2.0),
    "mha-alibi": lambda: MultiHeadAttention(D, H, alibi=True),
    "mha-all": lambda: MultiHeadAttention(D, H, sinks=True, softcap=3.0, alibi=True),
    "local-alibi": lambda: LocalAttention(D, H, window_size=2, alibi=True),
    "local-sinks-softcap": lambda: LocalAttention(D, H, window_size=3, sinks=True,
                                                  softcap=2.0, block_size=4),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_mass_with_modifiers_equals_the_dense_weights(name):
    torch.manual_seed(0)
    layer, tokens = LAYERS[name]().eval(), fused()
    if getattr(layer, "sinks", None) is not None:
        with torch.no_grad():
            layer.sinks.normal_()  # a sink with weight: rows sum below one
    w = dense_weights(layer, tokens)
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    mass = attention_mass(layer, tokens)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=0)
    rows = mass.table[0].sum(-1)
    if "sinks" in name or "all" in name:
        assert (rows < 0.999).all()
    check_top(top_keys(layer, tokens, k=3), w, real_of(tokens), 3)
