"""The last mile of the drop-in: seeded construction, in_proj views, TorchScript and FX,
each held to ``nn.MultiheadAttention`` (its weights, its RNG state, its numbers)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from mmattn import (
    AdditiveAttention,
    AttentionPool,
    CrossAttention,
    CrossAttentionBlock,
    EdgeAttention,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MaskedPool,
    MultiHeadAttention,
    Tokens,
    TransformerBlock,
)
from mmattn.cache import KVCache

#: torch.jit is deprecated (a FutureWarning at every call) but still what clients test.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")

SETTINGS = {
    "equal widths": {},
    "kdim/vdim": {"kdim": 6, "vdim": 5},
    "add_bias_kv": {"add_bias_kv": True},
    "bias=False": {"bias": False},
    "all": {"kdim": 6, "vdim": 6, "add_bias_kv": True, "add_zero_attn": True, "bias": False},
    "float64, time-first": {"dtype": torch.float64, "batch_first": False},
}


def _rng_states(device):
    states = [torch.get_rng_state()]
    if device == "cuda":
        states.append(torch.cuda.get_rng_state())
    return states


def _expected_state(ref):
    """torch's weights under our names (from_torch copies them exactly)."""
    return MultiHeadAttention.from_torch(ref).state_dict()


def _assert_same_state(ours, expected):
    state = ours.state_dict()
    assert state.keys() == expected.keys()
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key


# ---------------------------------------------------------------------- seeded construction


@pytest.mark.parametrize("kwargs", SETTINGS.values(), ids=list(SETTINGS))
def test_seeded_construction_draws_torchs_weights_and_leaves_its_rng_state(kwargs, device):
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(16, 4, device=device, **kwargs)
    ref_rng = _rng_states(device)
    torch.manual_seed(3)
    ours = MultiHeadAttention(16, 4, device=device, **kwargs)
    for a, b in zip(_rng_states(device), ref_rng, strict=True):
        assert torch.equal(a, b)
    _assert_same_state(ours, _expected_state(ref))


@pytest.mark.parametrize("kwargs", SETTINGS.values(), ids=list(SETTINGS))
def test_reset_parameters_draws_as_torch(kwargs):
    """reset_parameters() redraws as the constructor; _reset_parameters() as torch's private
    one (out_proj.weight kept)."""
    torch.manual_seed(1)
    built = MultiHeadAttention(16, 4, **kwargs).state_dict()
    ours = MultiHeadAttention(16, 4, **kwargs)
    torch.manual_seed(1)
    ours.reset_parameters()
    _assert_same_state(ours, built)
    ref = nn.MultiheadAttention(16, 4, **kwargs)
    ours = MultiHeadAttention.from_torch(ref)
    torch.manual_seed(5)
    ref._reset_parameters()
    ref_rng = torch.get_rng_state()
    torch.manual_seed(5)
    ours._reset_parameters()
    assert torch.equal(torch.get_rng_state(), ref_rng)
    _assert_same_state(ours, _expected_state(ref))


def test_seeded_variants_draw_the_base_first_then_their_own():
    torch.manual_seed(2)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    ref_rng = torch.get_rng_state()
    expected = {k: v for k, v in _expected_state(ref).items() if "proj" in k}
    variants = {
        LocalAttention: {"window_size": 2},
        CrossAttention: {},
        AdditiveAttention: {},
        LinformerAttention: {"seq_len": 8, "proj_len": 3},
    }
    for cls, kwargs in variants.items():
        torch.manual_seed(2)
        module = cls(16, 4, **kwargs)
        state = module.state_dict()
        for key, value in expected.items():
            assert torch.equal(state[key], value), (cls.__name__, key)
        if cls in (LocalAttention, CrossAttention):  # nothing of their own to draw
            assert torch.equal(torch.get_rng_state(), ref_rng)
    torch.set_rng_state(ref_rng)  # AdditiveAttention: score_weight ~ U(±1/√e) afterwards
    score = torch.empty(4, 4).uniform_(-0.5, 0.5)
    torch.manual_seed(2)
    assert torch.equal(AdditiveAttention(16, 4).score_weight.detach(), score)


def test_grouped_query_init_is_one_packed_xavier_draw():
    torch.manual_seed(4)
    ours = MultiHeadAttention(16, 4, num_kv_heads=2)  # k/v project to 8
    torch.manual_seed(4)
    out_proj = nn.Linear(16, 16)
    packed = nn.init.xavier_uniform_(torch.empty(16 + 2 * 8, 16))
    q, k, v = packed.split([16, 8, 8])
    for proj, weight in zip((ours.q_proj, ours.k_proj, ours.v_proj), (q, k, v)):
        assert torch.equal(proj.weight.detach(), weight) and not proj.bias.any()
    assert torch.equal(ours.out_proj.weight.detach(), out_proj.weight.detach())


def test_construction_follows_the_default_device():
    with torch.device("meta"):
        module = MultiHeadAttention(16, 4, add_bias_kv=True)
    assert all(p.is_meta for p in module.parameters())
    assert MultiHeadAttention(16, 4, device="meta").q_proj.weight.is_meta


# ---------------------------------------------------------------------- in_proj views


def _random_pair(**kwargs):
    ref = nn.MultiheadAttention(16, 4, **{"batch_first": True, **kwargs})
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    return ref, MultiHeadAttention.from_torch(ref)


@pytest.mark.parametrize("kwargs", SETTINGS.values(), ids=list(SETTINGS))
def test_in_proj_weight_and_bias_are_torchs_where_torch_has_them(kwargs):
    ref, ours = _random_pair(**kwargs)
    for name in ("in_proj_weight", "in_proj_bias"):
        mine, theirs = getattr(ours, name), getattr(ref, name)
        assert (mine is None) == (theirs is None), name
        if theirs is not None:
            assert torch.equal(mine, theirs), name
    assert ours._qkv_same_embed_dim is False  # torch's fast paths still decline


def test_in_proj_is_none_with_grouped_heads():
    module = MultiHeadAttention(16, 4, num_kv_heads=2)
    assert module.in_proj_weight is None and module.in_proj_bias is None


def test_code_reading_in_proj_computes_and_trains_the_same():
    """torchaudio's WavLMSelfAttention: F.linear(x, in_proj_weight, in_proj_bias)."""
    ref, ours = _random_pair()
    x = torch.randn(2, 5, 16)
    got = F.linear(x, ours.in_proj_weight, ours.in_proj_bias)
    want = F.linear(x, ref.in_proj_weight, ref.in_proj_bias)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        got, torch.cat([ours.q_proj(x), ours.k_proj(x), ours.v_proj(x)], dim=-1)
    )
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    weights = ref.in_proj_weight.grad.chunk(3)
    biases = ref.in_proj_bias.grad.chunk(3)
    for proj, weight, bias in zip((ours.q_proj, ours.k_proj, ours.v_proj), weights, biases):
        torch.testing.assert_close(proj.weight.grad, weight)
        torch.testing.assert_close(proj.bias.grad, bias)


# Writing into and assigning in_proj_weight / in_proj_bias: tests/mmattn/attention/test_in_proj.py


def test_transformer_layer_fast_path_declines_with_the_views():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(layer).eval()
    layer.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    layer.eval()
    calls = []
    layer.self_attn.register_forward_pre_hook(lambda m, args: calls.append(1))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)
    assert calls == [1]  # our forward ran: the fused encoder-layer kernel declined


# ---------------------------------------------------------------------- TorchScript


def _inputs(module, batch_first=True):
    q = torch.randn(2, 7, 16)  # LocalAttention: as long as the keys
    kv = torch.randn(2, 7, module.kdim), torch.randn(2, 7, module.vdim)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    if not batch_first:
        q, kv = q.transpose(0, 1), tuple(t.transpose(0, 1) for t in kv)
    return q, *kv, kpm


@pytest.mark.parametrize("kwargs", SETTINGS.values(), ids=list(SETTINGS))
def test_jit_script_compiles_the_torch_twin(kwargs):
    module = MultiHeadAttention(16, 4, **kwargs).eval()
    scripted = torch.jit.script(module)
    q, k, v, kpm = _inputs(module, module.batch_first)
    q, k, v = (t.to(module.q_proj.weight.dtype) for t in (q, k, v))
    for average in (True, False):
        got = scripted(q, k, v, key_padding_mask=kpm, average_attn_weights=average)
        want = module(q, k, v, key_padding_mask=kpm, need_weights=True,
                      average_attn_weights=average)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("lengths", [(4, 4), (4, 2), (2, 4), (3, 7)], ids=str)
@pytest.mark.pins_path
def test_jit_script_twin_equals_eager_bit_for_bit(lengths, padded, train, fused_only):
    """The scripted twin projects q, k and v separately, as our forward does, and calls the
    same SDPA: the numbers are ours exactly, also where torch's packed layout rounds the
    shared key/value product differently (a few rows, k is v; issue 41). On the fused path:
    the explicit one (MMATTN_FUSED_ATTN=0) computes its softmax itself (docs/migrating.md)."""
    q_len, k_len = lengths
    module = MultiHeadAttention(8, 2, batch_first=True).train(train)
    scripted = torch.jit.script(copy.deepcopy(module))
    for _ in range(5):
        q, kv = torch.randn(2, q_len, 8), torch.randn(2, k_len, 8)
        kpm = torch.zeros(2, k_len, dtype=torch.bool)
        kpm[1, k_len // 2:] = padded
        for key in (kv, q) if q_len == k_len else (kv,):  # cross (k is v), self (q is k is v)
            want = module(q, key, key, key_padding_mask=kpm, need_weights=False)[0]
            got = scripted(q, key, key, key_padding_mask=kpm, need_weights=False)[0]
            assert torch.equal(got, want)


@pytest.mark.pins_path
@pytest.mark.parametrize("block_name", ["SetAttentionBlock", "InducedSetAttentionBlock"])
def test_pyg_set_attention_blocks_script_to_our_numbers(block_name, fused_only):
    """PyG's test/nn/aggr/test_aggr_utils.py with mmattn swapped in: the eager output, then
    ``torch.jit.script(block)`` on unseeded inputs, ``torch.allclose`` at its defaults; 20
    of 20 runs (and bit for bit)."""
    aggr_utils = pytest.importorskip("torch_geometric.nn.aggr.utils")
    from mmattn import replace_attention

    make = {
        "SetAttentionBlock": lambda: aggr_utils.SetAttentionBlock(8, heads=2),
        "InducedSetAttentionBlock": lambda: aggr_utils.InducedSetAttentionBlock(
            8, num_induced_points=2, heads=2),
    }[block_name]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    for _ in range(20):
        x = torch.randn(2, 4, 8)
        block = make()
        assert replace_attention(block)
        out = block(x, mask)
        jit = torch.jit.script(block)
        scripted = jit(x, mask)
        assert torch.allclose(scripted, out) and torch.equal(scripted, out)


class _Holder(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(16, 3)

    def forward(self, x, context, key_padding_mask):
        out, weights = self.attn(
            x, context, context, key_padding_mask=key_padding_mask, need_weights=True
        )
        return self.head(out), weights


def test_jit_script_of_a_model_puts_the_twin_into_the_eager_model_too():
    """torch's __prepare_scriptable__ protocol rewrites the eager model's _modules; a deep
    copy keeps the original. Both give the same numbers, and a saved script loads."""
    model = _Holder(CrossAttention(16, 4, kdim=6)).eval()
    kept = copy.deepcopy(model)
    q, k, _, kpm = _inputs(model.attn)
    want = kept(q, k, kpm)
    scripted = torch.jit.script(model)
    assert type(model.attn) is nn.MultiheadAttention  # the documented side effect
    assert type(torch.jit.script(copy.deepcopy(kept)) and kept.attn) is CrossAttention
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    for other in (scripted, model, loaded):
        for a, b in zip(other(q, k, kpm), want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_jit_script_of_many_dropped_modules_keeps_each_twin():
    """torch.jit.script memoises prepared modules by id(): a module the model drops must
    stay alive, or a later twin's out_proj may reuse its id and be swapped for a twin."""
    for _ in range(2):
        model = nn.ModuleList([MultiHeadAttention(16, 4) for _ in range(6)])
        scripted = torch.jit.script(copy.deepcopy(model))  # the copies are dropped
        assert all(hasattr(layer.out_proj, "weight") for layer in scripted)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: LocalAttention(16, 4, window_size=2), "LocalAttention"),
        (lambda: AdditiveAttention(16, 4), "AdditiveAttention"),
        (lambda: LinformerAttention(16, 4, seq_len=8, proj_len=4), "LinformerAttention"),
        (lambda: MultiHeadAttention(16, 4, num_kv_heads=2), "MultiHeadAttention"),
        (lambda: MultiHeadAttention(16, 4, position="rotary"), "MultiHeadAttention"),
    ],
)
def test_jit_script_without_a_torch_twin_names_the_module(make, name):
    model = _Holder(make())
    with pytest.raises(NotImplementedError, match=rf"torch.jit.script cannot compile {name}\("):
        torch.jit.script(model)
    assert type(model.attn).__name__ == name  # nothing was replaced


# ---------------------------------------------------------------------- FX

MAKERS = {
    "mha": lambda: MultiHeadAttention(16, 4, add_bias_kv=True),
    "cross": lambda: CrossAttention(16, 4, kdim=6),
    "local": lambda: LocalAttention(16, 4, window_size=2),
    "additive": lambda: AdditiveAttention(16, 4, kdim=6, vdim=6),
    "linformer": lambda: LinformerAttention(16, 4, seq_len=7, proj_len=3, kdim=6, vdim=6),
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=list(MAKERS))
def test_fx_traces_a_model_holding_each_class_with_it_as_a_leaf(make):
    model = _Holder(make())
    graph_module = fx.symbolic_trace(model)
    calls = [n.target for n in graph_module.graph.nodes if n.op == "call_module"]
    assert calls == ["attn", "head"]
    q, k, _, kpm = _inputs(model.attn)
    if model.attn.kdim == 16:
        k = torch.randn(2, 7, 16)
    for mode in (True, False):
        model.train(mode)
        graph_module.train(mode)
        for a, b in zip(graph_module(q, k, kpm), model(q, k, kpm)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("make", MAKERS.values(), ids=list(MAKERS))
def test_fx_traces_each_class_as_the_root(make):
    module = make().eval()
    graph_module = fx.symbolic_trace(module)
    q, k, v, kpm = _inputs(module)
    got = graph_module(q, k, v, key_padding_mask=kpm, need_weights=True)
    want = module(q, k, v, key_padding_mask=kpm, need_weights=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the graph module holds the module itself (parameters shared, not copied)
    assert {id(p) for p in graph_module.parameters()} == {id(p) for p in module.parameters()}


def test_fx_traces_edge_attention_in_a_model():
    """(Not as the root: FX writes its required keyword-only edge_index after defaults.)"""
    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = EdgeAttention(16, 4)

        def forward(self, x, edge_index):
            return self.attn(x, edge_index=edge_index, need_weights=False)[0]

    x = torch.randn(2, 3, 16)
    edge_index = torch.tensor([[0, 1, 3], [1, 2, 4]])
    model = Graph()
    traced = fx.symbolic_trace(model)
    torch.testing.assert_close(traced(x, edge_index), model(x, edge_index), atol=0, rtol=0)
    with pytest.raises(NotImplementedError, match="torch.jit.script cannot compile EdgeAttention"):
        torch.jit.script(model)


def test_fx_refuses_a_cache():
    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 4)
            self.cache = KVCache(2, 8, 4, 4)

        def forward(self, x):
            return self.attn(x, is_causal=True, cache=self.cache)[0]

    with pytest.raises(TypeError, match="torch.fx cannot trace MultiHeadAttention with cache="):
        fx.symbolic_trace(Decoder())


def test_fx_traces_blocks_and_models_holding_them():
    """Blocks and pools are leaves too: a model taking Tokens traces, and so does each block
    as the root; the graph modules give eager's numbers."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = TransformerBlock(16, 4, causal=True)
            self.cross = CrossAttentionBlock(16, 4, kdim=8)
            self.pool = AttentionPool(16, 2)

        def forward(self, tokens, context):
            return self.pool(self.cross(self.block(tokens), context))

    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    tokens = Tokens(torch.randn(2, 7, 16), mask)
    context = Tokens(torch.randn(2, 5, 8))
    net = Net().eval()
    traced = fx.symbolic_trace(net)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == [
        "block", "cross", "pool"
    ]
    torch.testing.assert_close(traced(tokens, context), net(tokens, context), atol=0, rtol=0)
    roots = [
        (Encoder(16, depth=2, num_heads=4), (tokens,), lambda out: out.x),
        (CrossAttentionBlock(16, 4, kdim=8), (tokens, context), lambda out: out.x),
        (MaskedPool("mean"), (tokens,), lambda out: out),
    ]
    for module, inputs, value in roots:
        graph_module = fx.symbolic_trace(module.eval())
        torch.testing.assert_close(value(graph_module(*inputs)), value(module(*inputs)),
                                   atol=0, rtol=0)
