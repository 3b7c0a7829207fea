"""attention_mass and top_keys against the dense weights (``need_weights=True``) of the same
modules, on every kernel, padded and packed; dead and padded rows; segments; ties; the model
left as it was; no (L, L) tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmattn import (
    AdditiveAttention,
    CrossAttentionBlock,
    EdgeAttention,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
)
from mmattn.debug import attention_mass, record_attention, top_keys
from mmattn.kernels import dense as _kernel
from tests._features import needs

D, H = 16, 4
EDGES = torch.tensor([[0, 1, 2, 3, 7, 8, 9, 15, 16, 20, 24],
                      [1, 2, 3, 4, 8, 9, 10, 16, 17, 25, 24]])

LAYERS = {
    "mha": lambda: MultiHeadAttention(D, H),
    "gqa": lambda: MultiHeadAttention(D, H, num_kv_heads=2),
    "appended": lambda: MultiHeadAttention(D, H, add_bias_kv=True, add_zero_attn=True),
    "local": lambda: LocalAttention(D, H, window_size=2),
    "local-global-causal": lambda: LocalAttention(D, H, window_size=3, num_global_tokens=2,
                                                  causal=True, block_size=4),
    "neighborhood": lambda: NeighborhoodAttention(D, H, kernel_size=3, num_global_tokens=1),
    "edge": lambda: EdgeAttention(D, H),
    "additive": lambda: AdditiveAttention(D, H),
}


def fused(lengths=((6, 4), (9, 9))) -> Tokens:
    """text (padded in item 1) then a 3x3 image, fused by Tokens.cat (padded)."""
    (text, real), (image, _) = lengths
    mask = torch.ones(2, text, dtype=torch.bool)
    mask[1, real:] = False
    parts = {"text": Tokens(torch.randn(2, text, D), mask),
             "image": Tokens(torch.randn(2, image, D), meta={"grid": (3, 3)})}
    return Tokens.cat(parts)


def geometry(layer, tokens: Tokens, kwargs: dict) -> dict:
    return {k: v for k, v in layer.geometry({**tokens.meta, **kwargs}).items() if k not in kwargs}


def dense_weights(layer, tokens: Tokens, **kwargs) -> torch.Tensor:
    """(B, H, L, S) weights of the explicit path, the reference."""
    _, w = layer(tokens.x, key_padding_mask=tokens.key_padding_mask, need_weights=True,
                 average_attn_weights=False, **geometry(layer, tokens, kwargs), **kwargs)
    return w.to_dense() if w.is_sparse else w


def span_groups(tokens: Tokens) -> torch.Tensor:
    group = torch.full((tokens.batch_size, tokens.length), -1)
    for index, (start, stop) in enumerate(tokens.meta["spans"].values()):
        pos = torch.arange(tokens.length)
        inside = (pos >= torch.as_tensor(start).reshape(-1, 1)) & (
            pos < torch.as_tensor(stop).reshape(-1, 1))
        group = torch.where(inside, index, group)
    return group


def reference(w: torch.Tensor, group: torch.Tensor, real: torch.Tensor, count: int):
    """Mean over the real queries of group m of the weight on the keys of group n (float64)."""
    keys = F.pad(torch.where(group >= 0, group, count), (0, w.shape[-1] - group.shape[1]),
                 value=count)
    per_row = torch.einsum("bhij,bjn->bhin", w.double(), F.one_hot(keys, count + 1).double())
    table = torch.zeros(w.shape[1], count, count, dtype=torch.float64)
    for m in range(count):
        rows = (group == m) & real
        table[:, m] = per_row.permute(1, 0, 2, 3)[:, rows][..., :count].mean(1)
    return table


def real_of(tokens: Tokens) -> torch.Tensor:
    return tokens.full_mask()


@pytest.mark.parametrize("name", list(LAYERS))
def test_table_equals_the_dense_weights_summed_over_modalities(name):
    layer, tokens = LAYERS[name]().eval(), fused()
    kwargs = {"edge_index": EDGES} if name == "edge" else {}
    mass = attention_mass(layer, tokens, **kwargs)
    assert mass.modalities == ["text", "image"] and mass.modules == [""]
    w = dense_weights(layer, tokens, **kwargs)
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert mass.counts.tolist() == [[10, 18]]  # real text queries: 6 + 4; image: 9 + 9
    rows = mass.table[0].sum(-1)
    if name == "appended":  # bias_k and the zero key take their share: rows sum below 1
        assert (rows < 0.999).all()
    else:
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=1e-5)


def packed_pair(grids: bool = False) -> tuple[Tokens, Tokens]:
    """Packed text + image Tokens and the same tokens padded (meta with per-item spans)."""
    text, image = [3, 5, 4], ([4, 6, 9] if grids else [4, 6, 2])
    parts = {}
    for name, lens in (("text", text), ("image", image)):
        offsets = torch.tensor([0, *lens]).cumsum(0)
        parts[name] = Tokens.from_packed(torch.randn(sum(lens), D), offsets)
    packed = Tokens.cat(parts)
    padded = packed.unpack()
    padded.meta = packed.meta
    return packed, padded


PACKED = ["mha", "gqa", "local", "local-global-causal", "additive", "neighborhood", "edge"]


@pytest.mark.parametrize("name", PACKED)
def test_packed_table_equals_the_padded_dense_weights(name):
    layer = LAYERS[name]().eval()
    packed, padded = packed_pair(grids=name == "neighborhood")
    kwargs, dense_kwargs = {}, {}
    if name == "neighborhood":
        kwargs = dense_kwargs = {"grid": [(2, 2), (2, 3), (3, 3)], "grid_start": [3, 5, 4]}
    if name == "edge":  # packed rows to the padded flat order b * L + i
        _, offsets = packed.x.values(), packed.x.offsets()
        rows = torch.tensor([[0, 1, 2, 3, 8, 9, 20], [1, 2, 3, 4, 9, 10, 22]])
        item = torch.searchsorted(offsets[1:], rows, right=True)
        kwargs = {"edge_index": rows}
        dense_kwargs = {"edge_index": item * padded.length + rows - offsets[item]}
    mass = attention_mass(layer, packed, **kwargs)
    w = dense_weights(layer, padded, **dense_kwargs)
    expected = reference(w, span_groups(padded), real_of(padded), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    found = top_keys(layer, packed, k=3, **kwargs)
    check_top(found, w, real_of(padded), 3)


def test_blocks_padded_and_packed_match_recorded_weights():
    encoder = Encoder(D, depth=2, num_heads=H, attention="local",
                      attention_kwargs={"window_size": 2}).eval()
    packed, padded = packed_pair()
    mass = attention_mass(encoder, padded)
    with torch.no_grad(), record_attention(encoder, average_attn_weights=False) as maps:
        encoder(padded)
    assert mass.modules == ["blocks.0.attn", "blocks.1.attn"]
    for c, name in enumerate(mass.modules):
        expected = reference(maps[name][0], span_groups(padded), real_of(padded), 2)
        torch.testing.assert_close(mass.table[c].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention_mass(encoder, packed).table, mass.table, atol=1e-5,
                               rtol=1e-5)


def test_dead_rows_add_nothing_and_padded_rows_do_not_count():
    layer, tokens = MultiHeadAttention(D, H).eval(), fused()
    blocked = torch.zeros(tokens.length, tokens.length, dtype=torch.bool)
    blocked[6:] = True  # every image query sees no key: dead rows
    mass = attention_mass(layer, tokens, attn_mask=blocked)
    _, w = layer(tokens.x, key_padding_mask=tokens.key_padding_mask, attn_mask=blocked,
                 need_weights=True, average_attn_weights=False)
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert mass.table[0, :, 1].abs().max() == 0  # dead image rows: exactly zero, never NaN
    assert mass.counts[0].tolist() == [10, 18]  # the 2 padded text rows are not counted


def test_per_segment_groups_of_an_interleaved_sequence():
    # text, image, text, image in item 0; text, image, image in item 1 (then padding)
    ids = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, -1, -1]])
    segments = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3, 3], [0, 1, 1, 1, 2, 2, 2, -1, -1]])
    meta = {"modality_ids": ids, "modalities": ["text", "image"], "segments": segments}
    tokens = Tokens(torch.randn(2, 9, D), ids >= 0, meta)
    layer = MultiHeadAttention(D, H).eval()
    w = dense_weights(layer, tokens)
    by_modality = attention_mass(layer, tokens)
    assert by_modality.modalities == ["text", "image"]
    torch.testing.assert_close(by_modality.table[0].double(),
                               reference(w, ids, ids >= 0, 2), atol=1e-5, rtol=1e-5)
    per_segment = attention_mass(layer, tokens, by="segment")
    assert per_segment.modalities == ["text[0]", "image[0]", "text[1]", "image[1]"]
    group = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3, 3], [0, 1, 1, 1, 3, 3, 3, -1, -1]])
    torch.testing.assert_close(per_segment.table[0].double(),
                               reference(w, group, ids >= 0, 4), atol=1e-5, rtol=1e-5)
    assert per_segment.counts[0].tolist() == [3, 6, 2, 5]


def check_top(found, w: torch.Tensor, real: torch.Tensor, k: int) -> None:
    """Weights equal topk of the dense rows; each index has its weight; ties aside."""
    length = real.shape[1]
    dense = w[..., :length]
    values = dense.topk(k, dim=-1).values
    values = torch.where((values > 0) & real[:, None, :, None], values, 0.0)
    torch.testing.assert_close(found.weights[0, :, :, :length], values, atol=1e-6, rtol=1e-6)
    index = found.indices[0, :, :, :length]
    at = torch.where(index >= 0, dense.gather(-1, index.clamp(min=0)), 0.0)
    torch.testing.assert_close(at, found.weights[0, :, :, :length], atol=1e-6, rtol=1e-6)
    assert ((index >= 0) == (found.weights[0, :, :, :length] > 0)).all()


@pytest.mark.parametrize("name", ["mha", "local-global-causal", "neighborhood", "edge"])
def test_top_keys_equal_topk_of_the_dense_weights(name):
    layer, tokens = LAYERS[name]().eval(), fused()
    kwargs = {"edge_index": EDGES} if name == "edge" else {}
    found = top_keys(layer, tokens, k=4, **kwargs)
    assert found.indices.shape == (1, 2, H, tokens.length, 4)
    check_top(found, dense_weights(layer, tokens, **kwargs), real_of(tokens), 4)
    assert (found.indices[0, 1, :, 4:6] == -1).all()  # padded queries: nothing


@pytest.mark.parametrize("k", [3, 20])  # a few keys, and most of the 25
def test_top_keys_ties_go_to_the_lower_key_index(k):
    layer = MultiHeadAttention(D, H).eval()
    tokens = Tokens(torch.randn(1, 25, D))
    check_top(top_keys(layer, tokens, k=k), dense_weights(layer, tokens), real_of(tokens), k)
    torch.nn.init.zeros_(layer.q_proj.weight)
    torch.nn.init.zeros_(layer.q_proj.bias)  # every score 0: uniform weights, all tied
    found = top_keys(layer, tokens, k=k)
    assert (found.indices == torch.arange(k)).all()
    torch.testing.assert_close(found.weights, torch.full_like(found.weights, 1 / 25))


def test_the_model_runs_as_it_would_without_it():
    encoder = Encoder(D, depth=2, num_heads=H, dropout=0.1)  # training mode: dropout draws
    tokens = fused()
    torch.manual_seed(1)
    plain = encoder(tokens).x
    torch.manual_seed(1)
    mass = attention_mass(encoder, tokens)
    assert torch.equal(mass.output.x, plain)
    assert not encoder.blocks[0].attn._forward_hooks and "attend_rows" not in vars(
        encoder.blocks[0].attn)


def kernel_reports(run) -> tuple[object, list[dict]]:
    """What ``run()`` returns and the kernel reports of its attention calls."""
    seen: list[dict] = []
    remove = _kernel.add_listener(seen.append)
    try:
        return run(), seen
    finally:
        remove()


@pytest.mark.parametrize("name", list(LAYERS))
def test_one_pass_every_step_takes_the_groups_with_the_values(name):
    """Every layer's attention step (its ``_step``: the attention hook, windows, edges) runs
    its kernel once, on [v | groups] (e + M value columns); the output is the layer's alone
    within float rounding (a matrix product of another width may round otherwise)."""
    layer, tokens = LAYERS[name]().eval(), fused()
    kwargs = {"edge_index": EDGES} if name == "edge" else {}
    extra = {**geometry(layer, tokens, kwargs), **kwargs}
    with torch.no_grad():
        plain, alone = kernel_reports(
            lambda: layer(tokens.x, key_padding_mask=tokens.key_padding_mask, **extra)[0])
        mass, seen = kernel_reports(lambda: attention_mass(layer, tokens, **kwargs))
    torch.testing.assert_close(mass.output[0], plain, rtol=1e-6,
                               atol=1e-6 * plain.abs().max().item())
    assert len(seen) == len(alone) and alone
    assert {record["v"].shape[-1] for record in seen} == {layer.head_dim + 2}
    w = dense_weights(layer, tokens, **kwargs)
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_one_pass_leaves_the_gradients_of_the_model():
    """Training mode without dropout takes the one pass; the backward through the call's
    first e value columns gives the parameters the gradients of a plain run."""
    layer, tokens = LocalAttention(D, H, window_size=2), fused()
    grads = []
    for run in (lambda: layer(tokens.x, key_padding_mask=tokens.key_padding_mask)[0],
                lambda: attention_mass(layer, tokens).output[0]):
        layer.zero_grad()
        out, seen = kernel_reports(run)
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    assert len(seen) == 1 and "_attention" not in vars(layer)
    # k_proj.bias's gradient is a sum that cancels (the softmax ignores it): the tolerance
    # follows the gradients' size, not that sum's
    scale = max(g.abs().max().item() for g in grads[0])
    for plain, mass in zip(*grads):
        torch.testing.assert_close(mass, plain, rtol=1e-5, atol=1e-6 * scale)


def test_dropout_runs_the_step_again_on_the_groups_and_packed_calls_take_one_pass():
    """Training with dropout runs each step as it was (the model's outputs bit for bit the
    layer's own) and once more on the groups alone without dropout (the mass of the weights
    before dropout); packed Tokens take the one pass, bucket by bucket."""
    layer, tokens = LocalAttention(D, H, window_size=2, dropout=0.5), fused()
    torch.manual_seed(3)
    plain, alone = kernel_reports(
        lambda: layer(tokens.x, key_padding_mask=tokens.key_padding_mask)[0])
    torch.manual_seed(3)
    mass, seen = kernel_reports(lambda: attention_mass(layer, tokens))
    assert torch.equal(mass.output[0], plain) and len(seen) == 2 * len(alone)
    assert [record["dropout_p"] for record in seen] == [0.5, 0.0]
    layer.eval()
    expected = reference(dense_weights(layer, tokens), span_groups(tokens), real_of(tokens), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    packed, padded = packed_pair()
    mass, seen = kernel_reports(lambda: attention_mass(layer, packed))
    w = dense_weights(layer, padded)
    expected = reference(w, span_groups(padded), real_of(padded), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert {record["v"].shape[-1] for record in seen} == {layer.head_dim + 2}


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_l_by_l_elements_on_a_long_local_sequence():
    length = 1024
    parts = {"a": Tokens(torch.randn(1, 512, 8)), "b": Tokens(torch.randn(1, 512, 8))}
    layer = LocalAttention(8, 2, window_size=8).eval()
    with torch.no_grad(), LargestTensor() as seen:
        mass = attention_mass(layer, Tokens.cat(parts))
        top_keys(layer, Tokens.cat(parts), k=4)
    assert mass.table.shape == (1, 2, 2, 2)
    assert seen.largest < length * length // 8, seen.largest


def test_calls_it_cannot_measure_are_listed_and_nothing_left_raises():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder(D, depth=1, num_heads=H)
            self.cross = CrossAttentionBlock(D, H)
            self.linformer = LinformerAttention(D, H, seq_len=20, proj_len=4)

        def forward(self, tokens):
            out = self.encoder(tokens)
            self.linformer(out.x)
            return self.cross(out, Tokens(torch.randn(2, 3, D)))

    mass = attention_mass(Model().eval(), fused())
    assert mass.modules == ["encoder.blocks.0.attn"]
    reasons = dict(mass.skipped)
    assert "Linformer" in reasons["linformer"] and "cross-attention" in reasons["cross.attn"]
    with pytest.raises(ValueError, match=r"no modality facts \(meta\['spans'\]"):
        attention_mass(MultiHeadAttention(D, H), Tokens(torch.randn(1, 4, D)))


@pytest.mark.parametrize("call, error, message", [
    (lambda m, t: attention_mass(m, t, by="pixel"), ValueError, "by must be one of"),
    (lambda m, t: attention_mass(m, t, block_size=0), ValueError, "block_size must be >= 1"),
    (lambda m, t: top_keys(m, t, k=0), ValueError, "k must be >= 1"),
    (lambda m, t: top_keys(m, t, k=2.0), TypeError, "k must be an int"),
    (lambda m, t: attention_mass(object(), t), TypeError, "model must be a torch.nn.Module"),
])
def test_bad_arguments_name_themselves(call, error, message):
    with pytest.raises(error, match=message):
        call(MultiHeadAttention(D, H), fused())


def test_more_groups_than_the_head_width_and_a_sequence_first_layer():
    """Seven segments on heads of width 4: the values take 7 columns more (e + M = 11); a
    batch_first=False layer inside a model is read sequence first."""
    ids = (torch.arange(20) // 3 % 2)[None].repeat(2, 1)
    segments = torch.arange(20)[None].repeat(2, 1) // 3
    meta = {"modality_ids": ids, "modalities": ["text", "image"], "segments": segments}
    tokens = Tokens(torch.randn(2, 20, D), meta=meta)
    layer = MultiHeadAttention(D, H, num_kv_heads=2, batch_first=False).eval()

    class SequenceFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = layer

        def forward(self, tokens):
            return self.attn(tokens.x.transpose(0, 1))

    mass = attention_mass(SequenceFirst(), tokens, by="segment")
    assert len(mass.modalities) == 7 and layer.head_dim == 4
    _, w = layer(tokens.x.transpose(0, 1), need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(mass.table[0].double(),
                               reference(w, segments, ids >= 0, 7), atol=1e-5, rtol=0)


@pytest.mark.pins_path
@pytest.mark.usefixtures("fused_only")  # MMATTN_FUSED_ATTN=0 keeps the engines off
@needs("flex_cpu")
@pytest.mark.parametrize("name", ["local-global-causal", "neighborhood"])
def test_the_mass_runs_on_the_engine_the_layer_uses(name):
    """With the flex engine forced (its CPU forward), every step of the call runs on flex,
    the groups joined to the values there too: debug/ holds no engine code. top_keys runs
    the calls on mmattn's kernels, whose reports give the tiles."""
    import warnings

    from mmattn.kernels import engines

    layer = {"local-global-causal": lambda: LocalAttention(D, H, window_size=3,
                                                           num_global_tokens=2, causal=True),
             "neighborhood": LAYERS["neighborhood"]}[name]().eval()
    tokens = fused()
    with torch.no_grad(), warnings.catch_warnings(), engines.use("flex"):
        warnings.simplefilter("ignore")
        mass, seen = kernel_reports(lambda: attention_mass(layer, tokens))
    assert {record["path"] for record in seen} == {"flex"}
    assert {record["v"].shape[-1] for record in seen} == {layer.head_dim + 2}
    expected = reference(dense_weights(layer, tokens), span_groups(tokens), real_of(tokens), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    # top_keys needs tiles, which no engine reports: it runs the calls on mmattn's kernels
    with torch.no_grad(), warnings.catch_warnings(), engines.use("flex"):
        warnings.simplefilter("ignore")
        found, seen = kernel_reports(lambda: top_keys(layer, tokens, k=3))
    assert "flex" not in {record["path"] for record in seen} and not found.skipped
    check_top(found, dense_weights(layer, tokens), real_of(tokens), 3)


CUDA_LAYERS = {  # head width 32: varlen (flash) and flex's CUDA kernel take it
    "local-varlen": lambda: LocalAttention(128, 4, window_size=2),
    "local-flex": lambda: LocalAttention(128, 4, window_size=3, num_global_tokens=2,
                                         causal=True),
    "neighborhood-flex": lambda: NeighborhoodAttention(128, 4, kernel_size=3,
                                                       num_global_tokens=1),
}


@pytest.mark.pins_path
@pytest.mark.usefixtures("fused_only")
@pytest.mark.parametrize("name", list(CUDA_LAYERS))
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_mass_runs_on_the_cuda_engine_the_layer_uses(device, name):
    """On CUDA (bf16, no padding: varlen takes no key mask) the mass runs on the engine
    the plain forward runs on, and equals the dense weights summed over modalities."""
    layer = CUDA_LAYERS[name]().to(device, torch.bfloat16).eval()
    parts = {"text": Tokens(torch.randn(2, 6, 128)),
             "image": Tokens(torch.randn(2, 9, 128), meta={"grid": (3, 3)})}
    tokens = Tokens.cat(parts).to(device, torch.bfloat16)
    extra = geometry(layer, tokens, {})
    with torch.no_grad():
        _, alone = kernel_reports(lambda: layer(tokens.x, **extra))
        mass, seen = kernel_reports(lambda: attention_mass(layer, tokens))
        w = dense_weights(layer, tokens).float().cpu()
    engines_used = {record.get("engine") for record in alone}
    assert engines_used & {"varlen", "flex"}, engines_used
    assert {record.get("engine") for record in seen} == engines_used
    expected = reference(w, span_groups(tokens).cpu(), real_of(tokens).cpu(), 2)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=2e-2, rtol=2e-2)
