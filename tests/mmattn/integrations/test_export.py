"""torch.export of every layer, block, encoder and adapter with dynamic batch and length.

Each case (tests/mmattn/integrations/_export_cases.py) is exported once per module; the
program must keep batch and length symbolic (no specialisation to the example) and give the
eager module's outputs at two other sizes, fully masked rows included. The ONNX Runtime half
is test_export_onnx.py. Decoding: ``DecodeStep`` exports and reproduces eager decoding with
the stateful caches for 16 steps; exporting a stateful cache raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock
from mmattn.integrations.export import DecodeStep, tokens_dynamic_shapes
from tests._features import needs
from tests.mmattn.integrations._export_cases import (
    CASES,
    SIZES,
    build,
    dead_rows,
    export,
    leaves,
)

STEPS = 16

#: torch.export of mmattn's layers is tested where torch tells an export from a compile
#: (torch.compiler.is_exporting); torch 2.5 and 2.6 specialize what the tests keep dynamic
pytestmark = needs("is_exporting")


@pytest.fixture(scope="module", params=CASES, ids=repr)
def exported(request):
    case = request.param
    module = build(case)
    return case, module, export(case, module)


def _input_symbols(program: torch.export.ExportedProgram) -> set:
    symbols = set()
    for node in program.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            for d in node.meta["val"].shape:
                if isinstance(d, torch.SymInt):
                    symbols |= d.node.expr.free_symbols
    return symbols


def test_every_marked_dim_stays_symbolic(exported):
    case, _, program = exported
    args, kwargs = case.inputs(2, 5)
    marked = {
        d.__name__ for d in pytree.tree_leaves(case.dynamic_shapes(args, kwargs))
        if isinstance(d, Dim)
    }
    # batch and each length (a cross-attention context, an image's height and width) are
    # free symbols of the inputs: nothing was specialised to the example's sizes
    # (NeighborhoodAttention: the batch alone, its length is the grid's)
    assert len(_input_symbols(program)) == len(marked) >= (1 if case.length else 2)


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_exported_program_equals_eager(exported, size):
    case, module, program = exported
    args, kwargs = case.inputs(*size)
    with torch.no_grad():
        want = module(*args, **kwargs)
        got = program.module()(*args, **kwargs)  # guards: a specialised size would raise
    got_leaves, want_leaves = leaves(got), leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    if isinstance(want, Tokens):  # meta sizes (image grid, spans) are the run's, not traced
        assert got.meta == want.meta and (got.mask is None) == (want.mask is None)
    if case.attention:  # the fully padded sample: zero attention, out_proj.bias alone
        torch.testing.assert_close(
            dead_rows(case, module, args, kwargs, got[0]), torch.zeros(case.length or size[1], 16),
            atol=1e-6, rtol=0,
        )


# ---------------------------------------------------------------------- tokens_dynamic_shapes


def test_tokens_dynamic_shapes_lists_the_children():
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    batch, length = Dim("b"), Dim("l")
    spec = tokens_dynamic_shapes(Tokens(x, mask, {"lengths": torch.ones(2), "n": 3}), batch, length)
    assert spec == [{0: batch, 1: length}, {0: batch, 1: length}, None]
    assert tokens_dynamic_shapes(Tokens(x))[1] is None


def test_tokens_dynamic_shapes_refuses_packed_and_non_tokens():
    packed = Tokens(torch.randn(2, 5, 8), torch.rand(2, 5) > 0.5).pack()
    with pytest.raises(ValueError, match="packed"):
        tokens_dynamic_shapes(packed)
    with pytest.raises(TypeError, match="must be mmattn.Tokens"):
        tokens_dynamic_shapes(torch.randn(2, 5, 8))


# ---------------------------------------------------------------------- decoding


def _decoders():
    torch.manual_seed(0)
    modified = [  # ALiBi at the step's positions, sinks in every step's softmax
        MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, alibi=True),
        LocalAttention(16, 4, window_size=3, causal=True, sinks=True, alibi=True),
    ]
    for module in modified:
        torch.nn.init.normal_(module.sinks)
    return [
        MultiHeadAttention(16, 4, num_kv_heads=2, position="rotary"),
        TransformerBlock(16, 2, causal=True),
        LocalAttention(16, 4, window_size=3, causal=True),
        *modified,
    ]


def _eager_step(module, x, cache):
    if isinstance(module, MultiHeadAttention):
        return module(x, is_causal=True, cache=cache)[0]
    return module(Tokens(x), cache=cache).x


def _state_shapes(step: DecodeStep):
    batch = Dim("batch", max=64)
    return ({0: batch}, tuple({0: batch} if n in ("k", "v") else None for n in step.state_names))


@pytest.mark.parametrize("module", _decoders(), ids=lambda m: type(m).__name__)
def test_exported_decode_step_reproduces_eager_decoding(module):
    module.eval()
    step = DecodeStep(module, max_len=STEPS + 4)
    program = torch.export.export(
        step, (torch.randn(3, 1, 16), step.init_state(3)), dynamic_shapes=_state_shapes(step)
    )
    run = program.module()
    for batch in (2, 5):  # other batch sizes than the traced one
        attention = module if isinstance(module, MultiHeadAttention) else module.attn
        cache = attention.make_cache(batch, STEPS + 4)
        state = step.init_state(batch)
        before = [t.clone() for t in state]
        for t in range(STEPS):
            x = torch.randn(batch, 1, 16)
            with torch.no_grad():
                want = _eager_step(module, x, cache)
                got, new_state = run(x, state)
                eager_got, _ = step(x, state)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(eager_got, want, atol=1e-5, rtol=1e-5)
            if t == 0:  # the step writes nothing in place: the caller's state is untouched
                assert all(torch.equal(a, b) for a, b in zip(state, before))
            state = new_state
        assert int(state[step.state_names.index("size")]) == len(cache) == STEPS


def test_decode_step_refuses_cross_attention_and_wrong_state():
    from mmattn import CrossAttention

    with pytest.raises(TypeError, match="caches a context"):
        DecodeStep(CrossAttention(16, 4), max_len=8)
    with pytest.raises(TypeError, match="attention module"):
        DecodeStep(torch.nn.Linear(4, 4), max_len=8)
    step = DecodeStep(MultiHeadAttention(16, 4), max_len=8)
    with pytest.raises(ValueError, match="state must be the 3 tensors"):
        step(torch.randn(2, 1, 16), step.init_state(2)[:2])


class _StatefulStep(torch.nn.Module):
    """A decoding step that keeps its cache object outside the inputs (the wrong way)."""

    def __init__(self, attention, cache):
        super().__init__()
        self.attention, self.cache = attention, cache

    def forward(self, x):
        return self.attention(x, is_causal=True, cache=self.cache)[0]


def test_exporting_a_stateful_cache_raises_and_leaves_it_alone():
    attention = MultiHeadAttention(16, 4).eval()
    cache = attention.make_cache(2, 8)
    attention(torch.randn(2, 1, 16), is_causal=True, cache=cache)
    k = cache.k.clone()
    with pytest.raises(TypeError, match="stateful KVCache.*DecodeStep"):
        torch.export.export(_StatefulStep(attention, cache), (torch.randn(2, 1, 16),))
    assert len(cache) == 1 and torch.equal(cache.k, k)


def test_edge_attention_refuses_to_export_clearly():
    from mmattn import EdgeAttention

    edge_index = torch.tensor([[0, 1, 5], [1, 2, 6]])
    with pytest.raises(NotImplementedError, match="EdgeAttention does not export.*attn_mask"):
        torch.export.export(
            EdgeAttention(16, 4).eval(), (torch.randn(2, 5, 16),), {"edge_index": edge_index}
        )


# ---------------------------------------------------------------------- NeighborhoodAttention


def _neighborhood_export(kwargs, shapes):
    from mmattn import NeighborhoodAttention

    torch.manual_seed(0)
    module = NeighborhoodAttention(16, 2, 3).eval()
    program = torch.export.export(module, (torch.randn(3, 30, 16),), kwargs, dynamic_shapes=shapes)
    return module, program


@pytest.mark.parametrize(
    "kwargs, shapes, match",
    [
        ({"grid": (5, 6)}, {"query": {0: Dim("b"), 1: Dim("l")}, "grid": (None, None)},
         "dynamic batch only: the length is fixed by the grid"),
        ({"grid": [(5, 6)] * 3}, {"query": {0: Dim("b")}, "grid": [(None, None)] * 3},
         "per-item grids do not export"),
        ({"grid": [(5, 6)] * 3}, None, "per-item grids do not export"),
        ({"grid": (5, 6), "need_weights": True}, None, "does not export need_weights=True"),
    ],
    ids=["dynamic_length", "grid_list", "grid_list_static", "need_weights"],
)
def test_neighborhood_refuses_what_it_cannot_export(kwargs, shapes, match):
    with pytest.raises(NotImplementedError, match=match):
        _neighborhood_export(kwargs, shapes)


def test_neighborhood_attn_mask_exports_with_dynamic_batch():
    mask = torch.rand(30, 30) > 0.3
    module, program = _neighborhood_export(
        {"grid": (5, 6), "attn_mask": mask},
        {"query": {0: Dim("b")}, "grid": (None, None), "attn_mask": None},
    )
    x = torch.randn(5, 30, 16)
    with torch.no_grad():
        want = module(x, grid=(5, 6), attn_mask=mask)[0]
        got = program.module()(x, grid=(5, 6), attn_mask=mask)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
