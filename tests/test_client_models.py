"""replace_attention inside real client code: PyTorch's Transformer stacks, torchvision's
VisionTransformer, torchaudio's Conformer and PyG's GPSConv.

Each model is copied, one copy swapped with ``mmattn.replace_attention``, and both copies run
the same inputs, with padding wherever the model takes it, in train mode (dropout 0) and eval
mode: outputs on real positions and the gradients of the inputs agree within 1e-5 (fp32).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mmattn import LocalAttention, MultiHeadAttention, replace_attention
from tests._tolerance import assert_close_scaled

ATOL = 1e-5

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")


def _run(model, inputs, real):
    """Outputs on real positions and the gradients of the float inputs (for a fixed random
    weighting of the real outputs)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    gen = torch.Generator().manual_seed(0)
    grad_out = torch.randn(out.shape, generator=gen).to(out.device)
    loss = (out * grad_out)[real].sum()
    grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
    return out[real], grads


def _assert_same(ref, swapped, inputs, real, modes=("train", "eval")):
    """Both models agree in each mode: outputs (real positions) and input gradients."""
    for mode in modes:
        ref.train(mode == "train")
        swapped.train(mode == "train")
        ref_out, ref_grads = _run(ref, inputs, real)
        out, grads = _run(swapped, inputs, real)
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=ATOL, msg=f"outputs ({mode})")
        assert len(grads) == len(ref_grads) > 0
        for g, r in zip(grads, ref_grads):
            assert_close_scaled(g, r, atol=ATOL, msg=f"input grads ({mode})")


def _swapped(model, expected):
    swapped = copy.deepcopy(model)
    assert replace_attention(swapped) == expected
    kinds = {type(m) for m in swapped.modules() if isinstance(m, nn.MultiheadAttention)}
    assert kinds == {MultiHeadAttention}
    return swapped


def _padding(lengths, length, device):
    """Module-direction (B, L) key padding: True at padding."""
    positions = torch.arange(length, device=device)
    return positions[None] >= torch.tensor(lengths, device=device)[:, None]


# ---------------------------------------------------------------------- PyTorch


def _encoder(device, **kwargs):
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, **kwargs).to(device)


def test_transformer_encoder_default_flags(device):
    model = _encoder(device)  # enable_nested_tensor=True, the default
    assert model.use_nested_tensor
    swapped = _swapped(model, 2)
    assert not swapped.use_nested_tensor  # replace_attention turns the nested path off
    src = torch.randn(3, 7, 32, device=device)
    kpm = _padding([7, 4, 1], 7, device)
    ref = _Call(model, src_key_padding_mask=kpm)
    new = _Call(swapped, src_key_padding_mask=kpm)
    _assert_same(ref, new, [src], ~kpm)


def test_transformer_encoder_inference_fast_path(device):
    """eval + no_grad + padding: torch runs its nested-tensor fast path; the swapped model
    gives the same real-token outputs, with replace_attention and with a hand-swapped layer
    (which then receives the NestedTensor itself)."""
    model = _encoder(device).eval()
    by_hand = copy.deepcopy(model)
    for layer in by_hand.layers:
        layer.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    assert by_hand.use_nested_tensor  # the encoder decided at construction
    swapped = _swapped(model, 2)
    src = torch.randn(3, 7, 32, device=device)
    kpm = _padding([7, 4, 1], 7, device)
    calls = []
    by_hand.layers[0].self_attn.register_forward_pre_hook(
        lambda m, args: calls.append(args[0].is_nested)
    )
    with torch.no_grad():
        ref = model(src, src_key_padding_mask=kpm)
        for other in (swapped, by_hand):
            out = other(src, src_key_padding_mask=kpm)
            torch.testing.assert_close(out[~kpm], ref[~kpm], atol=ATOL, rtol=ATOL)
    assert calls == [True]  # the hand-swapped module really got the NestedTensor


def test_transformer_decoder(device):
    layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerDecoder(layer, num_layers=2).to(device)
    swapped = _swapped(model, 4)  # self- and cross-attention in each layer
    tgt = torch.randn(3, 6, 32, device=device)
    memory = torch.randn(3, 9, 32, device=device)
    tgt_kpm = _padding([6, 3, 1], 6, device)
    mem_kpm = _padding([9, 5, 2], 9, device)
    causal = nn.Transformer.generate_square_subsequent_mask(6, device=device)
    kwargs = {"tgt_mask": causal, "tgt_is_causal": True, "tgt_key_padding_mask": tgt_kpm,
              "memory_key_padding_mask": mem_kpm}
    _assert_same(_Call(model, **kwargs), _Call(swapped, **kwargs), [tgt, memory], ~tgt_kpm)


class _Call:
    """A model with fixed keyword arguments, callable like the model (train/eval pass on)."""

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args):
        return self.model(*args, **self.kwargs)

    def train(self, mode=True):
        self.model.train(mode)
        return self


# ---------------------------------------------------------------------- torchvision


def _vit(device):
    models = pytest.importorskip("torchvision.models")
    model = models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
        num_classes=10,
    )
    nn.init.normal_(model.heads.head.weight, std=0.1)  # torchvision starts it at zero
    return model.to(device)


def test_torchvision_vision_transformer(device):
    model = _vit(device)
    swapped = _swapped(model, 2)
    images = torch.randn(2, 3, 32, 32, device=device)
    real = torch.ones(2, dtype=torch.bool, device=device)
    _assert_same(model, swapped, [images], real)


def test_torchvision_checkpoint_loads_into_the_swapped_model(device, tmp_path):
    """A checkpoint saved before the swap loads with strict=True and gives the same logits."""
    torch.manual_seed(1)
    pretrained = _vit(device).eval()
    path = tmp_path / "vit.pt"
    torch.save(pretrained.state_dict(), path)
    assert any(k.endswith("self_attention.in_proj_weight") for k in pretrained.state_dict())
    torch.manual_seed(2)
    fresh = _vit(device).eval()  # other random weights
    replace_attention(fresh)
    result = fresh.load_state_dict(torch.load(path, weights_only=True), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    images = torch.randn(4, 3, 32, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(fresh(images), pretrained(images), atol=ATOL, rtol=ATOL)


def test_local_attention_factory_with_a_huge_window_equals_the_original(device):
    """factory: a LocalAttention carrying the pretrained projections. With a window wider
    than the sequence the band covers everything, so the model is unchanged."""
    model = _vit(device)
    swapped = copy.deepcopy(model)
    count = replace_attention(
        swapped, lambda m: LocalAttention.from_torch(m, window_size=64)
    )
    assert count == 2
    assert all(type(b.self_attention) is LocalAttention for b in swapped.encoder.layers)
    images = torch.randn(2, 3, 32, 32, device=device)
    _assert_same(model, swapped, [images], torch.ones(2, dtype=torch.bool, device=device))
    narrow = copy.deepcopy(model)
    replace_attention(narrow, lambda m: LocalAttention.from_torch(m, window_size=1))
    with torch.no_grad():
        assert not torch.allclose(narrow.eval()(images), model.eval()(images), atol=1e-3)


# ---------------------------------------------------------------------- torchaudio


def test_torchaudio_conformer(device):
    models = pytest.importorskip("torchaudio.models")
    model = models.Conformer(
        input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, depthwise_conv_kernel_size=3,
        dropout=0.0,
    ).to(device)
    swapped = _swapped(model, 2)
    assert not swapped.conformer_layers[0].self_attn.batch_first  # Conformer is time-first
    frames = torch.randn(3, 10, 32, device=device)
    lengths = torch.tensor([10, 7, 3], device=device)
    real = ~_padding(lengths.tolist(), 10, device)

    class WithLengths(_Call):
        def __call__(self, x):
            return self.model(x, lengths)

    _assert_same(WithLengths(model), WithLengths(swapped), [frames], real)


# ---------------------------------------------------------------------- PyG


def test_pyg_gps_conv_calls_our_attention(device):
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    from torch_geometric.utils import to_undirected

    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model = pyg_nn.GPSConv(16, pyg_nn.GINConv(mlp), heads=4, attn_type="multihead").to(device)
    swapped = _swapped(model, 1)
    assert isinstance(swapped.attn, nn.MultiheadAttention)  # GPSConv's dispatch test
    swapped.reset_parameters()  # calls attn._reset_parameters(), torch's private name
    swapped.load_state_dict(model.state_dict())
    sizes = [5, 2, 4]
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)).to(device)
    starts = [0, 5, 7]
    edges = [(s + i, s + (i + 1) % n) for s, n in zip(starts, sizes) for i in range(n)]
    edge_index = to_undirected(torch.tensor(edges).t()).to(device)
    x = torch.randn(sum(sizes), 16, device=device)
    calls = []
    swapped.attn.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))

    class Graph(_Call):
        def __call__(self, nodes):
            return self.model(nodes, edge_index, batch)

    real = torch.ones(sum(sizes), dtype=torch.bool, device=device)
    _assert_same(Graph(model), Graph(swapped), [x], real)
    assert calls and calls[0] == (3, 5, 16)  # ran on the padded (graphs, nodes, dim) batch


# ---------------------------------------------------------------------- the last mile
# TorchScript, FX, code that reads in_proj_weight, and seeded construction (issue 21).

_JIT_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")


def _encoder_cpu():
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _conformer():
    models = pytest.importorskip("torchaudio.models")
    return models.Conformer(
        input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, depthwise_conv_kernel_size=3,
        dropout=0.0,
    )


def _wavlm():
    """torchaudio's WavLM at a tiny size (wavlm_base's architecture: 95M parameters would
    take seconds to build; this one builds in milliseconds)."""
    models = pytest.importorskip("torchaudio.models")
    return models.wavlm_model(
        extractor_mode="group_norm", extractor_conv_layer_config=[(8, 10, 5), (8, 3, 2)],
        extractor_conv_bias=False, encoder_embed_dim=16, encoder_projection_dropout=0.0,
        encoder_pos_conv_kernel=4, encoder_pos_conv_groups=2, encoder_num_layers=2,
        encoder_num_heads=4, encoder_num_buckets=8, encoder_max_distance=16,
        encoder_attention_dropout=0.0, encoder_ff_interm_features=32,
        encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=False,
        encoder_layer_drop=0.0, aux_num_out=None,
    )


def _vit_cpu():
    return _vit("cpu")


def _inputs_of(name):
    """(callable inputs, real-position selector of the output) for each client model."""
    if name == "vit":
        return (torch.randn(2, 3, 32, 32),), slice(None)
    if name == "encoder":
        kpm = _padding([7, 4], 7, "cpu")
        return (torch.randn(2, 7, 32), None, kpm), ~kpm
    if name == "conformer":
        lengths = torch.tensor([10, 6])
        return (torch.randn(2, 10, 32), lengths), ~_padding([10, 6], 10, "cpu")
    return (torch.randn(2, 400),), slice(None)  # wavlm: WavLM takes no lengths with padding


CLIENTS = {"vit": _vit_cpu, "encoder": _encoder_cpu, "conformer": _conformer, "wavlm": _wavlm}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_wavlm_reads_in_proj_and_equals_itself_before_the_swap():
    """WavLMSelfAttention never calls forward: F.linear(query, in_proj_weight, in_proj_bias)
    and out_proj. Our views give the same numbers and train our projections."""
    model = _wavlm()
    swapped = _swapped(model, 2)
    (wave,), _ = _inputs_of("wavlm")
    _assert_same(model, swapped, [wave], slice(None))
    swapped.train()
    _first(swapped(wave)).sum().backward()
    attn = swapped.encoder.transformer.layers[0].attention.attention
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))


def test_wavlm_refuses_a_factory_it_would_bypass():
    model = _wavlm()
    with pytest.warns(UserWarning, match="WavLMSelfAttention reads its in_proj_weight"):
        count = replace_attention(model, lambda m: LocalAttention.from_torch(m, window_size=4))
    assert count == 0
    assert type(model.encoder.transformer.layers[0].attention.attention) is nn.MultiheadAttention


@_JIT_DEPRECATED
@pytest.mark.parametrize("name", list(CLIENTS))
def test_jit_script_of_the_swapped_model_equals_eager(name):
    """Scripting compiles torch's twin of each of our modules (and puts it into the model
    passed in; torchaudio's WavLM does not script a deep copy twice even with torch's
    module, so each model is scripted once)."""
    inputs, real = _inputs_of(name)
    model = CLIENTS[name]().eval()
    swapped = _swapped(model, 2)
    with torch.no_grad():
        want = _first(swapped(*inputs))
        torch.testing.assert_close(want[real], _first(model(*inputs))[real], atol=ATOL, rtol=ATOL)
        scripted = torch.jit.script(swapped)
        assert not any(isinstance(m, MultiHeadAttention) for m in swapped.modules())
        torch.testing.assert_close(_first(scripted(*inputs))[real], want[real], atol=ATOL,
                                   rtol=ATOL)


def _fx_layer(name):
    """What torch.fx traces of each client with torch's own module (the encoder layer does
    not trace even so: F._canonical_mask; Conformer and WavLM use lengths / sizes in Python
    control flow), with its inputs."""
    if name == "vit":
        return _vit_cpu(), (torch.randn(2, 3, 32, 32),), 2
    if name == "encoder":
        layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        return layer, (torch.randn(2, 6, 32), torch.randn(2, 9, 32)), 2
    if name == "conformer":
        kpm = _padding([10, 6], 10, "cpu")
        return _conformer().conformer_layers[0], (torch.randn(10, 2, 32), kpm), 1
    return None


@pytest.mark.parametrize("name", list(CLIENTS))
def test_fx_symbolic_trace_of_the_swapped_model_equals_eager(name):
    """The whole model traces wherever it does with torch's module, and fails with torch's
    own error where it does not; the largest traceable part is traced and compared."""
    model = CLIENTS[name]()
    swapped = _swapped(model, 2)
    try:
        torch.fx.symbolic_trace(model)
    except Exception as error:  # torch's own model does not trace: neither does ours
        with pytest.raises(type(error)) as ours:
            torch.fx.symbolic_trace(swapped)
        assert str(ours.value) == str(error)
    if name == "wavlm":  # WavLM's attention layer branches on sizes too: nothing to trace
        return
    part, inputs, count = _fx_layer(name)
    swapped = _swapped(part, count)
    traced = torch.fx.symbolic_trace(swapped)
    leaves = [n for n in traced.graph.nodes if n.op == "call_module"
              and isinstance(traced.get_submodule(n.target), MultiHeadAttention)]
    assert len(leaves) == count
    for mode in (True, False):  # one call each per mode: Conformer's BatchNorm counts them
        traced.train(mode)
        part.train(mode)
        torch.testing.assert_close(_first(traced(*inputs)), _first(part(*inputs)),
                                   atol=ATOL, rtol=ATOL)
    swapped.eval()  # the graph module calls the swapped model's own submodules
    torch.testing.assert_close(_first(traced(*inputs)), _first(swapped(*inputs)), atol=0, rtol=0)


def test_torchvision_feature_extractor_on_a_swapped_vit():
    feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
    model = _vit_cpu().eval()
    swapped = _swapped(model, 2)
    names = feature_extraction.get_graph_node_names(model)
    assert feature_extraction.get_graph_node_names(swapped) == names
    nodes = {"encoder.layers.encoder_layer_1.self_attention": "attn", "encoder.ln": "features"}
    ref = feature_extraction.create_feature_extractor(model, return_nodes=nodes)
    ours = feature_extraction.create_feature_extractor(swapped, return_nodes=nodes)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got, want = ours(images), ref(images)
    torch.testing.assert_close(got["features"], want["features"], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got["attn"][0], want["attn"][0], atol=ATOL, rtol=ATOL)


class _TorchDefaults(MultiHeadAttention):
    """Ours with nn.MultiheadAttention's defaults, built where client code says
    ``nn.MultiheadAttention(...)``."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
                         vdim, batch_first, device, dtype)


@pytest.mark.parametrize("name", list(CLIENTS))
def test_seeded_construction_with_ours_equals_torchs(name, monkeypatch):
    """A seeded client model built with our class in place of nn.MultiheadAttention has
    torch's weights, and every later draw is the same (the generator state matches)."""
    torch.manual_seed(7)
    model = CLIENTS[name]()
    rng = torch.get_rng_state()
    monkeypatch.setattr(nn, "MultiheadAttention", _TorchDefaults)
    monkeypatch.setattr(nn.modules.transformer, "MultiheadAttention", _TorchDefaults)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TransformerEncoder: no nested-tensor fast path
        ours = CLIENTS[name]()
    monkeypatch.undo()
    assert torch.equal(torch.get_rng_state(), rng)
    assert sum(isinstance(m, MultiHeadAttention) for m in ours.modules()) == 2
    expected = _swapped(model, 2).state_dict()
    state = ours.state_dict()
    assert state.keys() == expected.keys()
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key
