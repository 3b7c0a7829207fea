"""No layer writes state during forward (issue 29, item 8).

A module shared by threads (or called re-entrantly from a position hook) must keep the facts
of one call in the call: NeighborhoodAttention kept the grid of the current call on the
module (``_call_geometry``), so two threads with different grids got each other's grid.
Every public layer and block runs here with two geometries, and the attributes of each of its
submodules are the same objects after the calls as before.
"""

from __future__ import annotations

import pytest
import torch

import mmattn
from mmattn import Tokens

D, H = 8, 2


def _x(b, n, seed=0):
    return torch.randn(b, n, D, generator=torch.Generator().manual_seed(seed))


def _pad(b, n):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, -1] = False
    return mask


CASES = {
    "mha": (lambda: mmattn.MultiHeadAttention(D, H),
            lambda m, n: m(_x(2, n), key_padding_mask=~_pad(2, n))),
    "additive": (lambda: mmattn.AdditiveAttention(D, H), lambda m, n: m(_x(2, n))),
    "linformer": (lambda: mmattn.LinformerAttention(D, H, seq_len=12, proj_len=3),
                  lambda m, n: m(_x(2, n))),
    "cross": (lambda: mmattn.CrossAttention(D, H),
              lambda m, n: m(_x(2, n), _x(2, n + 1, 1), _x(2, n + 1, 1))),
    "local": (lambda: mmattn.LocalAttention(D, H, 2), lambda m, n: m(_x(2, n))),
    "neighborhood": (lambda: mmattn.NeighborhoodAttention(D, H, 3),
                     lambda m, n: m(_x(2, 12), grid=(3, 4) if n == 6 else (2, 6))),
    "neighborhood_modifiers": (
        lambda: mmattn.NeighborhoodAttention(D, H, 3, num_global_tokens=1, sinks=True,
                                             alibi=True, relative_position_bias=True),
        lambda m, n: m(_x(2, 13), key_padding_mask=~_pad(2, 13),
                       grid=(3, 4) if n == 6 else (2, 6)),
    ),
    "edge_modifiers": (
        lambda: mmattn.EdgeAttention(D, H, sinks=True, softcap=5.0),
        lambda m, n: m(_x(2, n), edge_index=torch.tensor([[0, 1, n], [1, 2, n + 1]])),
    ),
    "edge": (lambda: mmattn.EdgeAttention(D, H),
             lambda m, n: m(_x(2, n), edge_index=torch.tensor([[0, 1, n], [1, 2, n + 1]]))),
    "block": (lambda: mmattn.TransformerBlock(D, H), lambda m, n: m(Tokens(_x(2, n), _pad(2, n)))),
    "block_grid": (lambda: mmattn.TransformerBlock(D, H, attention="neighborhood",
                                                   attention_kwargs={"kernel_size": 3}),
                   lambda m, n: m(Tokens(_x(2, 12), None, {"grid": (3, 4) if n == 6 else (4, 3)}))),
    "encoder": (lambda: mmattn.Encoder(D, 2, H), lambda m, n: m(Tokens(_x(2, n), _pad(2, n)))),
    "cross_block": (lambda: mmattn.CrossAttentionBlock(D, H),
                    lambda m, n: m(Tokens(_x(2, n)), Tokens(_x(2, n + 2, 1), _pad(2, n + 2)))),
    "attention_pool": (lambda: mmattn.AttentionPool(D, H),
                       lambda m, n: m(Tokens(_x(2, n), _pad(2, n)))),
}


def _state(module: torch.nn.Module) -> dict:
    """Every submodule's attributes (parameters and buffers included), by identity; the hook
    dicts are the test's own and the mode is set by it."""
    return {(name, key): id(value) for name, sub in module.named_modules()
            for key, value in vars(sub).items() if "hooks" not in key and key != "training"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_writes_no_state_on_the_module(name):
    build, call = CASES[name]
    module = build()
    before, seen = _state(module), []
    # the state is read inside the call too (from every leaf's forward): a write undone
    # before the call returns (the grid was reset in a finally) is still a race
    for sub in module.modules():
        if not list(sub.children()):
            sub.register_forward_hook(lambda *_: seen.append(_state(module)))
    for n, train in ((6, False), (9, True)):  # two geometries (grids, lengths, edge sets)
        call(module.train(train), n)
    assert seen, "no leaf ran"
    for during in [*seen, _state(module)]:
        added = sorted(set(during) - set(before))
        changed = sorted(k for k in before if k in during and before[k] != during[k])
        assert not added and not changed, f"forward wrote {added + changed}"
