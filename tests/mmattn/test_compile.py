"""torch.compile(fullgraph=True) on every public module: outputs and gradients equal eager.

The reference is always the same module run eagerly. Inductor compiles C++ on the CPU and is
slow on a small shared machine, so shapes are tiny and each inductor test compiles ONE module
(dynamic shapes) that it then reuses for every length; the wide sweep over all modules uses
the ``aot_eager`` backend, which runs the same Dynamo capture and AOTAutograd (forward and
backward graphs, functionalisation) but executes the captured ops eagerly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import adapters
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
    MultiModalEncoder,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)

D, H = 8, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _padding(batch: int, length: int, seed: int) -> torch.Tensor:
    """(batch, length) bool, True = real; row 0 full, the others a seed-dependent length."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    return torch.arange(length) < lengths[:, None]


def _leaves(out) -> list[torch.Tensor]:
    """Floating tensors of any output: a tensor, an (out, weights) tuple or Tokens (pytree)."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            and t.is_floating_point()]


def _run(module: nn.Module, fn, args: tuple) -> tuple[list, list]:
    """Outputs and gradients (inputs that require grad, then parameters) of one call."""
    out = _leaves(fn(*args))
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in out)
    inputs = [t for t in pytree.tree_leaves(args)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, inputs + params, allow_unused=True)
    return [o.detach() for o in out], list(grads)


def _assert_same(compiled: tuple[list, list], eager: tuple[list, list], atol=2e-5) -> None:
    out_c, grad_c = compiled
    out_e, grad_e = eager
    assert len(out_c) == len(out_e) and len(grad_c) == len(grad_e)
    for got, want in zip(out_c, out_e):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    for got, want in zip(grad_c, grad_e):
        if want is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def _check(module: nn.Module, make_args, lengths, backend: str, dynamic: bool | None = None):
    """Compile ``module`` once, run every length, compare with eager; return the counter."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=dynamic)
    frames = []
    for seed, length in enumerate(lengths):
        args = make_args(length, seed)
        _assert_same(_run(module, compiled, args), _run(module, module, args))
        frames.append(counter.frame_count)
    return frames


def _check_with_breaks(module: nn.Module, make_args) -> None:
    compiled = torch.compile(module, backend="aot_eager")
    args = make_args(6, 0)
    _assert_same(_run(module, compiled, args), _run(module, module, args))


def _x(length: int, seed: int, batch: int = 2, dim: int = D) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(batch, length, dim, generator=gen).requires_grad_()


def _tokens(length: int, seed: int) -> tuple[Tokens]:
    return (Tokens(_x(length, seed), _padding(2, length, seed)),)


# --- recompilation: four lengths, four padding patterns --------------------------------
#
# Under real inductor the Encoder is compiled as users do by default (``dynamic=None``):
# the first call compiles for its static shapes and the first new length recompiles once
# with L dynamic ("automatic dynamic"); the last two lengths must reuse that graph. This is
# also the cheapest way through inductor on the CPU (``dynamic=True`` from the start makes
# every size symbolic and took 2-3x longer to compile here). With ``dynamic=True`` the
# capture itself must never recompile: checked with the aot_eager backend (Dynamo's guards,
# which decide recompilation, do not depend on the backend).

#: Four lengths with a different padding pattern each (seeds differ). LocalAttention's
#: lengths span more than one query block (32); test_compile_dynamic.py also takes
#: shorter ones (docs/performance.md, "Compile").
LENGTHS = (5, 7, 9, 12)
LOCAL_LENGTHS = (33, 40, 47, 58)


class _KeyPadding(nn.Module):
    """Calls an attention module with ``key_padding_mask`` from a (B, L) real-token mask."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x, real, context=None, need_weights=False):
        if context is None:
            return self.attn(x, key_padding_mask=~real, need_weights=need_weights)
        return self.attn(x, context, key_padding_mask=~real, need_weights=need_weights)


class _OnGrid(nn.Module):
    """Calls NeighborhoodAttention on ``1 + 2 * 3`` tokens (one global token, a 2 x 3 grid)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x, real, context=None, need_weights=False):
        return self.attn(x, key_padding_mask=~real, need_weights=need_weights, grid=(2, 3))


def _grid_case(batches=(2,)):
    """NeighborhoodAttention's case: the length is the grid's (7); ``lengths`` are batch
    sizes (each with its own padding)."""
    def make(batch, seed):
        return _x(7, seed, batch=batch), _padding(batch, 7, seed), None, False

    return _OnGrid(NeighborhoodAttention(D, H, 3, num_global_tokens=1)), make, batches


# --- aot_eager sweep: every public module compiles with fullgraph and matches eager ---


def _attention_case(module, need_weights=False, cross=False, lengths=(6,)):
    def make(length, seed):
        x = _x(length, seed)
        if cross:
            context = _x(length + 3, seed + 50)
            return x, _padding(2, length + 3, seed), context, need_weights
        return x, _padding(2, length, seed), None, need_weights

    return _KeyPadding(module), make, lengths


def _cases():
    yield "mha", _attention_case(MultiHeadAttention(D, H))
    yield "mha_weights", _attention_case(MultiHeadAttention(D, H), need_weights=True)
    yield "cross", _attention_case(CrossAttention(D, H, kdim=D, vdim=D), cross=True)
    yield "local_causal_global", _attention_case(
        LocalAttention(D, H, window_size=2, causal=True, num_global_tokens=1), lengths=(40,)
    )
    yield "additive", _attention_case(AdditiveAttention(D, H))
    yield "linformer", _attention_case(LinformerAttention(D, H, seq_len=8, proj_len=3))
    yield "neighborhood", _grid_case()
    yield "block_full", (TransformerBlock(D, H), _tokens, (6,))
    yield "block_local", (TransformerBlock(D, H, attention="local", window_size=2), _tokens,
                          (40,))

    def cross_tokens(length, seed):
        return Tokens(_x(length, seed), _padding(2, length, seed)), _tokens(length + 2, seed)[0]

    yield "cross_block", (CrossAttentionBlock(D, H), cross_tokens, (5,))
    yield "encoder", (Encoder(D, depth=2, num_heads=H), _tokens, (6,))
    for mode in ("mean", "max", "first"):
        yield f"pool_{mode}", (MaskedPool(mode), _tokens, (6,))
    yield "attention_pool", (AttentionPool(D, H), _tokens, (6,))
    for fusion in ("concat", "latent"):
        encoder = MultiModalEncoder(
            {"text": adapters.TextTokenEmbedder(50, D), "image": _image_adapter()},
            D, depth=1, num_heads=H, fusion=fusion, num_latents=3,
        )
        yield f"multimodal_{fusion}", (encoder, _multimodal_inputs, (6,))


def _image_adapter() -> nn.Module:
    return adapters.ImagePatcher(D, patch_size=4, in_channels=1, img_size=8)


def _ids(length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(200 + seed)
    ids = torch.randint(1, 50, (2, length), generator=gen)
    return ids.masked_fill(~_padding(2, length, seed), 0)  # 0 = pad_id


def _image(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(300 + seed)
    return torch.randn(2, 1, 8, 8, generator=gen).requires_grad_()


def _multimodal_inputs(length: int, seed: int) -> tuple[dict]:
    return ({"text": _ids(length, seed), "image": _image(seed)},)


def _adapter_cases():
    yield "text", (adapters.TextTokenEmbedder(50, D), lambda n, s: (_ids(n, s),))
    yield "image", (_image_adapter(), lambda n, s: (_image(s),))
    if importlib.util.find_spec("torchaudio") is not None:
        def audio(length, seed):
            gen = torch.Generator().manual_seed(400 + seed)
            return torch.randn(2, 800, generator=gen), torch.tensor([800, 500])

        yield "audio", (adapters.AudioFrameEmbedder(D, n_mels=8, n_fft=64, hop_length=32),
                        audio)
    if importlib.util.find_spec("torch_geometric") is not None:
        def graph(length, seed):
            from torch_geometric.data import Batch, Data

            gen = torch.Generator().manual_seed(500 + seed)
            graphs = [Data(x=torch.randn(n, 3, generator=gen),
                           edge_index=torch.tensor([[0, 1], [1, 0]])) for n in (3, length)]
            return (Batch.from_data_list(graphs),)

        yield "graph", (adapters.GraphNodeSequencer(3, D), graph)


#: Adapters that cannot compile with fullgraph=True, and why (docs/performance.md, "Compile").
NO_FULLGRAPH = {
    "audio": "AudioFrameEmbedder.forward imports torchaudio lazily (importlib) on every call",
    "graph": "torch_geometric's to_dense_batch reads the node count per graph (.item())",
}


@pytest.mark.parametrize(("name", "case"), list(_adapter_cases()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_adapters_fullgraph_match_eager(name, case):
    adapter, make = case
    if name in NO_FULLGRAPH:
        with pytest.raises(torch._dynamo.exc.Unsupported):
            _check(adapter, make, (6,), "aot_eager")
        # ... but they compile with graph breaks, and still match eager
        torch._dynamo.reset()
        _check_with_breaks(adapter, make)
        return
    _check(adapter, make, (6,), "aot_eager")


@pytest.mark.parametrize(("name", "case"), list(_cases()), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_aot_eager_fullgraph_matches_eager(name, case):
    module, make, lengths = case
    _check(module, make, lengths, "aot_eager")


# --- EdgeAttention: graph breaks around its data-dependent edge set, equal to eager ------


class _OnEdges(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x, real, edge_index):
        return self.attn(x, key_padding_mask=~real, edge_index=edge_index)


def _edges(length: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(600 + seed)
    edge_index = torch.randint(0, length, (2, 3 * length), generator=gen)
    edge_index[:, length:] += length  # the second item's edges
    return _x(length, seed), _padding(2, length, seed), edge_index


@pytest.mark.slow  # one capture with breaks: ~10 s here; the explicit twin runs eagerly too
def test_edge_attention_compiles_and_matches_eager():
    # dynamo failed inside kernels/segment.py (IndexError at the per-head torch.stack); the
    # edge set (ids read, duplicates merged, padding dropped) and the sparse kernel now run
    # eagerly between compiled graphs (torch.compiler.disable): breaks, not a fullgraph
    module = _OnEdges(EdgeAttention(D, H))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter)
    args = _edges(6, 0)
    _assert_same(_run(module, compiled, args), _run(module, module, args))
    assert counter.frame_count >= 1  # the projections did compile
