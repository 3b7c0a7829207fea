"""The modules the export tests trace: each with inputs at any (batch, length) and its dims.

Every case is exported once (batch and length dynamic) at :data:`TRACE` and run at the two
sizes of :data:`SIZES`, with padding that leaves query rows without any allowed key: the last
sample is all padding, the first is padded at the end, the second (when there is one) at the
front, so local attention has dead rows inside a sample that also has real tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.export import Dim

from adapters import ImagePatcher, TextTokenEmbedder
from mmattn import (
    AdditiveAttention,
    Encoder,
    LocalAttention,
    MultiHeadAttention,
    MultiModalEncoder,
    NeighborhoodAttention,
    Tokens,
    TransformerBlock,
)
from mmattn.integrations.export import tokens_dynamic_shapes

D, H, VOCAB, MAX_LEN = 16, 4, 40, 64
TRACE = (3, 11)
#: Other sizes than the traced one; 45 spans two blocks of local attention.
SIZES = [(2, 5), (5, 45)]

BATCH = Dim("batch", max=64)
LENGTH = Dim("length", max=MAX_LEN)
CONTEXT = Dim("context", max=MAX_LEN + 8)
HEIGHT = Dim("height", min=5, max=128)  # a side needs two patches (4 px): 5 px at least
WIDTH = Dim("width", min=5, max=128)


def padding(batch: int, length: int) -> Tensor:
    """(b, n) bool, True = padding (the module direction), with fully masked query rows."""
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[0, length // 2 + 1:] = True
    if batch > 2:
        pad[1, : 2 * length // 3] = True
    pad[-1] = True
    return pad


def tokens(batch: int, length: int) -> Tokens:
    return Tokens(torch.randn(batch, length, D), ~padding(batch, length))


def ids(batch: int, length: int) -> Tensor:
    out = torch.randint(1, VOCAB, (batch, length))
    return out.masked_fill(padding(batch, length), 0)


def image(batch: int, length: int) -> Tensor:
    return torch.rand(batch, 3, length + 4, 2 * length - 1)


@dataclass(frozen=True)
class Case:
    """One module to export: ``module(*args, **kwargs)`` with ``inputs(b, n) = (args,
    kwargs)`` and ``dynamic_shapes(args, kwargs)`` for the example."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], tuple[tuple, dict]]
    dynamic_shapes: Callable[[tuple, dict], Any]
    #: Where fully masked query rows must give zeros (of the attention result): a function
    #: of (output leaves, module, inputs) returning (got, expected) pairs.
    attention: bool = False
    #: A length fixed by the module (NeighborhoodAttention: the grid's): only the batch is
    #: dynamic and ``inputs(b, n)`` ignores n.
    length: int | None = None

    def __repr__(self) -> str:
        return self.name


def _self_attention(build: Callable[[], nn.Module]) -> Case:
    return Case(
        build.__name__,
        build,
        lambda b, n: ((torch.randn(b, n, D),), {"key_padding_mask": padding(b, n)}),
        lambda args, kwargs: {
            "query": {0: BATCH, 1: LENGTH}, "key_padding_mask": {0: BATCH, 1: LENGTH}
        },
        attention=True,
    )


def mha() -> nn.Module:
    return MultiHeadAttention(D, H)


def local() -> nn.Module:
    return LocalAttention(D, H, window_size=3)


def local_causal_gqa() -> nn.Module:
    return LocalAttention(D, H, window_size=5, causal=True, num_kv_heads=2, num_global_tokens=1)


def additive() -> nn.Module:
    return AdditiveAttention(D, H)


def mha_modifiers() -> nn.Module:
    return MultiHeadAttention(D, H, num_kv_heads=2, sinks=True, alibi=True)


def local_modifiers() -> nn.Module:
    return LocalAttention(D, H, window_size=3, causal=True, sinks=True, alibi=True, softcap=4.0)


def _neighborhood(name: str, global_tokens: int, **modifiers: Any) -> Case:
    """NeighborhoodAttention on a 5 × 6 grid: the length is the grid's, the batch dynamic."""
    length = global_tokens + 5 * 6
    return Case(
        name,
        lambda: NeighborhoodAttention(D, 2, 3, num_global_tokens=global_tokens, **modifiers),
        lambda b, n: (
            (torch.randn(b, length, D),), {"key_padding_mask": padding(b, length), "grid": (5, 6)}
        ),
        lambda args, kwargs: {
            "query": {0: BATCH}, "key_padding_mask": {0: BATCH}, "grid": (None, None)
        },
        attention=True,
        length=length,
    )


def _cross_inputs(b: int, n: int) -> tuple[tuple, dict]:
    s = n + 3
    args = (torch.randn(b, n, D), torch.randn(b, s, 12), torch.randn(b, s, 10))
    return args, {"key_padding_mask": padding(b, s)}


def _tokens_case(name: str, build: Callable[[], nn.Module]) -> Case:
    return Case(
        name, build, lambda b, n: ((tokens(b, n),), {}),
        lambda args, kwargs: (tokens_dynamic_shapes(args[0], BATCH, LENGTH),),
    )


def _mme() -> nn.Module:
    text = TextTokenEmbedder(VOCAB, D, max_len=MAX_LEN, positional="learned")
    return MultiModalEncoder({"text": text, "image": ImagePatcher(D, 4, img_size=8)}, D, 1, 2)


CASES = [
    _self_attention(mha),
    Case(
        "mha_cross_gqa",
        lambda: MultiHeadAttention(D, H, kdim=12, vdim=10, num_kv_heads=2),
        _cross_inputs,
        lambda args, kwargs: {
            "query": {0: BATCH, 1: LENGTH}, "key": {0: BATCH, 1: CONTEXT},
            "value": {0: BATCH, 1: CONTEXT}, "key_padding_mask": {0: BATCH, 1: CONTEXT},
        },
        attention=True,
    ),
    _self_attention(local),
    _self_attention(local_causal_gqa),
    _self_attention(additive),
    _self_attention(mha_modifiers),
    _self_attention(local_modifiers),
    _neighborhood("neighborhood", 0),
    # global tokens with sinks, grid ALiBi and NAT's table (softcap's explicit tiles: no
    # export path of their own; the plain tiles are the case above)
    _neighborhood("neighborhood_global", 1, sinks=True, alibi=True, relative_position_bias=True),
    _tokens_case("block", lambda: TransformerBlock(D, 2)),
    _tokens_case("encoder_local", lambda: Encoder(D, 2, 2, attention="local", window_size=3)),
    Case(
        "multimodal",
        _mme,
        lambda b, n: (({"text": ids(b, n), "image": image(b, n)},), {}),
        lambda args, kwargs: (
            {"text": {0: BATCH, 1: LENGTH}, "image": {0: BATCH, 2: HEIGHT, 3: WIDTH}},
        ),
    ),
    Case(
        "text",
        lambda: TextTokenEmbedder(VOCAB, D, max_len=MAX_LEN),
        lambda b, n: ((ids(b, n),), {}),
        lambda args, kwargs: ({0: BATCH, 1: LENGTH},),
    ),
    Case(
        "text_learned",
        lambda: TextTokenEmbedder(VOCAB, D, max_len=MAX_LEN, positional="learned"),
        lambda b, n: ((ids(b, n),), {}),
        lambda args, kwargs: ({0: BATCH, 1: LENGTH},),
    ),
    Case(
        "image",
        lambda: ImagePatcher(D, 4, img_size=12),
        lambda b, n: ((image(b, n),), {}),
        lambda args, kwargs: ({0: BATCH, 2: HEIGHT, 3: WIDTH},),
    ),
]


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    module = case.build().eval()
    for p in module.parameters():  # biases start at 0: make the dead rows' bias visible
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.1)
    return module


def export(case: Case, module: nn.Module) -> torch.export.ExportedProgram:
    args, kwargs = case.inputs(*TRACE)
    return torch.export.export(
        module, args, kwargs, dynamic_shapes=case.dynamic_shapes(args, kwargs)
    )


def leaves(out: Any) -> list[Any]:
    """The leaves of an output (Tokens, tuples), None dropped, as ONNX lists its outputs."""
    return [leaf for leaf in pytree.tree_leaves(out) if leaf is not None]


def input_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors an exported program takes, in its order (as ONNX lists its inputs); plain
    ints (a static grid) are constants of the program, not inputs."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]


def dead_rows(case: Case, module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor:
    """The output of the fully padded sample minus ``out_proj.bias`` (zero when the attention
    result of every dead row is zero, as eager gives)."""
    assert case.attention
    return out[-1] - module.out_proj.bias


def program_leaves(out: Any, spec: pytree.TreeSpec) -> list[Any]:
    """The leaves of an eager ``out`` in the order of the exported program's outputs.

    ``spec`` is ``program.call_spec.out_spec``. The program also returns the meta sizes that
    were symbolic while tracing (a modality span, an image grid): eagerly they are constant
    context of Tokens, in the program they are children (ONNX outputs). None is dropped.
    """
    if spec.is_leaf():
        return [] if out is None else [out]
    if spec.type is Tokens:
        _, child_at, _ = spec.context
        meta = [leaf for leaf, child in zip(pytree.tree_leaves(out.meta), child_at) if child]
        children = [out.x, out.mask, *meta]
    else:
        children, _ = pytree.SUPPORTED_NODES[spec.type].flatten_fn(out)
    specs = spec.children()
    return [leaf for c, s in zip(children, specs) for leaf in program_leaves(c, s)]
