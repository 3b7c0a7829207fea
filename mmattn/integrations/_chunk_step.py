"""``ChunkStep``: one streaming chunk of an encoder as a function of tensors, for export.

Axis key: ``b`` batch, ``c`` tokens per chunk, ``k`` key/value heads, ``s`` cached slots
(``left * c``), ``e`` head width, ``d`` model width.

A :class:`~mmattn.cache.ChunkCache` is state outside a traced program, as the decoding
caches are (``DecodeStep``). ``ChunkStep`` takes the caches' tensors in and returns them,
``out, state = step(x, state)``, and writes nothing in place, so ``torch.export`` and
``torch.onnx.export`` see a pure function that streams like eager (docs/streaming.md).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from mmattn.attention.mha import MultiHeadAttention
from mmattn.blocks.transformer import Encoder
from mmattn.cache import ChunkCache, EncoderCache
from mmattn.tokens import Tokens

__all__ = ["ChunkStep"]

#: The tensors of one layer's cache, the order of its part of the state.
LAYER_STATE = ("k", "v", "valid", "size")


class ChunkStep(nn.Module):
    r"""One chunk of a streaming encoder (or attention module, or block), on plain tensors.

    ``out, state = step(x, state)`` (or ``step(x, state, mask)``) gives the same numbers as
    ``encoder(Tokens(x, mask), cache=cache).x`` with the caches' buffers passed in and
    returned instead of kept in a cache object. Nothing is written in place, so
    ``torch.export`` and ``torch.onnx.export`` see a pure function and the exported step
    streams like eager.

    The state is a flat tuple, four tensors per layer (block order): ``k`` (b, k, s, e),
    ``v`` (b, k, s, e), ``valid`` (b, s) bool, ``size`` (0-D long, tokens streamed).
    :meth:`init_state` gives the empty state. An exported program has a static chunk
    length: pad the last chunk to ``chunk`` tokens and mark its padding in ``mask``.

    Args:
        module: an :class:`~mmattn.Encoder` built with ``pattern=P.chunked(chunk,
            left=l)``; or a self-attention module or ``TransformerBlock``, with ``chunk``
            and ``left`` given.
        chunk, left: the chunk rule (not for an Encoder, whose pattern holds it).

    Shape:
        - x: (b, c, d); mask: (b, c) bool, True = real token (optional)
        - returns: out (b, c, d) and the new state

    Raises:
        TypeError: ``module`` has no chunk cache.
        ValueError: an Encoder without a ``P.chunked`` pattern, or ``chunk`` given with
            one; no ``chunk`` for another module; a state of the wrong length or of another
            batch size than ``x``.

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> attn = MultiHeadAttention(16, 4).eval()
        >>> step = ChunkStep(attn, chunk=4, left=2)
        >>> state = step.init_state(batch_size=2)
        >>> out, state = step(torch.randn(2, 4, 16), state)
        >>> out.shape, [tuple(t.shape) for t in state]
        (torch.Size([2, 4, 16]), [(2, 4, 8, 4), (2, 4, 8, 4), (2, 8), ()])
    """

    def __init__(self, module: nn.Module, chunk: int | None = None, left: int = 0) -> None:
        super().__init__()
        if isinstance(module, Encoder):
            if chunk is not None:
                raise ValueError(
                    f"chunk={chunk} does not apply to an Encoder: its pattern "
                    "(P.chunked(chunk, left=...)) holds the chunk rule"
                )
            kind = "encoder"
        elif isinstance(module, MultiHeadAttention):
            kind = "attention"
        elif isinstance(getattr(module, "attn", None), MultiHeadAttention):
            kind = "block"
        else:
            raise TypeError(
                "module must be an mmattn Encoder, attention module or block with one as "
                f".attn, got {type(module).__name__}"
            )
        if kind != "encoder" and chunk is None:
            raise ValueError(
                f"chunk must be given for a {type(module).__name__} (tokens per chunk), got "
                "None"
            )
        self.module = module
        self.chunk, self.left = chunk, left
        self._kind = kind
        template = self._make(1)
        self.chunk, self.left = template.layers[0].chunk, template.layers[0].left
        self._template = template
        #: Names of the state's tensors, ``layer{i}.k`` ...
        self.state_names = tuple(
            f"layer{i}.{name}" for i in range(len(template.layers)) for name in LAYER_STATE
        )

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}, left={self.left}, layers={len(self._template.layers)}"

    def _make(self, batch_size: int, **factory: Any) -> EncoderCache:
        if self._kind == "encoder":
            return self.module.make_cache(batch_size, **factory)
        attention = self.module if self._kind == "attention" else self.module.attn
        cache = attention.make_cache(batch_size, chunk=self.chunk, left=self.left, **factory)
        if not isinstance(cache, ChunkCache):
            raise TypeError(f"{type(attention).__name__} has no chunk cache")
        return EncoderCache([cache])

    def init_state(self, batch_size: int, **factory: Any) -> tuple[Tensor, ...]:
        """The state of empty caches for ``batch_size`` streams (``device``, ``dtype``)."""
        cache = self._make(batch_size, **factory)
        return tuple(getattr(layer, name) for layer in cache.layers for name in LAYER_STATE)

    def forward(
        self, x: Tensor, state: tuple[Tensor, ...], mask: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Stream the chunk ``x`` after the tokens in ``state``; return the output and the
        new state."""
        if not isinstance(state, (tuple, list)) or len(state) != len(self.state_names):
            raise ValueError(
                f"state must be the {len(self.state_names)} tensors of "
                f"ChunkStep.init_state ({', '.join(self.state_names[:4])}, ... per layer), "
                f"got {type(state).__name__} of "
                f"{len(state) if isinstance(state, (tuple, list)) else 1}"
            )
        if state[0].shape[0] != x.shape[0]:
            raise ValueError(
                f"state was made for batch_size={state[0].shape[0]} (ChunkStep.init_state), "
                f"got x with batch size {x.shape[0]}"
            )
        layers = []
        for i, template in enumerate(self._template.layers):
            layer = copy.copy(template)
            for name, value in zip(LAYER_STATE, state[4 * i: 4 * i + 4]):
                setattr(layer, name, value.clone())  # the cache writes in place: not the inputs
            layer.batch_size = x.shape[0]
            layer.dtype = layer.k.dtype
            layers.append(layer)
        cache = copy.copy(self._template)
        cache.layers = tuple(layers)
        if self._kind == "encoder":
            out = self.module(Tokens(x, mask), cache=cache).x
        elif self._kind == "block":
            out = self.module(Tokens(x, mask), cache=layers[0]).x
        else:
            padding = None if mask is None else ~mask
            out, _ = self.module(x, key_padding_mask=padding, cache=layers[0])
        return out, tuple(getattr(layer, name) for layer in layers for name in LAYER_STATE)
