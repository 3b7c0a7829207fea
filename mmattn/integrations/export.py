"""Exporting: ``dynamic_shapes`` for Tokens, and a decoding step as a function of tensors.

Axis key: ``b`` batch, ``i`` new tokens of one step, ``k`` key/value heads, ``n`` cache
capacity (``max_len``), ``w`` window, ``e`` head width, ``d`` model width.

Users call torch's exporters themselves (``torch.export.export``, ``torch.onnx.export(...,
dynamo=True)``); this module only fills the two gaps (docs/deploy.md):

- :func:`tokens_dynamic_shapes`: ``Tokens`` is a pytree node, so torch.export wants its
  ``dynamic_shapes`` as the list of its children (``x``, ``mask``, then meta's tensors).
- :class:`DecodeStep`: a stateful cache (:mod:`mmattn.cache`) is state outside the traced
  program, so exporting a call that takes one is refused. ``DecodeStep`` is the functional
  form: the cache goes in and comes out as a tuple of plain tensors, ``out, state =
  step(x, state)``; nothing is written in place, so the exported step is a pure function.
- :class:`ChunkStep` (``_chunk_step.py``): the same for a streaming encoder and its chunk
  caches (docs/streaming.md).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mmattn.attention.mha import MultiHeadAttention
from mmattn.cache import ContextCache
from mmattn.integrations._chunk_step import ChunkStep
from mmattn.tokens import Tokens

__all__ = ["ChunkStep", "DecodeStep", "tokens_dynamic_shapes"]


def tokens_dynamic_shapes(tokens: Tokens, batch: Any = None, length: Any = None) -> list[Any]:
    """The ``dynamic_shapes`` entry of a :class:`~mmattn.Tokens` input of ``torch.export``.

    ``Tokens`` flattens to ``[x, mask, *meta tensors]``; the entry lists one spec per child:
    ``{0: batch, 1: length}`` for ``x`` and for ``mask`` (None when the mask is None), and
    None (static) for the tensors in ``meta``. The program takes Tokens of that structure:
    one exported with a mask needs a mask (all True for none), one without takes none.

    Args:
        tokens: the example input (padded, not packed).
        batch: the batch dimension (a ``torch.export.Dim``, ``Dim.AUTO``, ...); default
            ``Dim("batch")``.
        length: the length dimension; default ``Dim("length")``. Dims of the same name are
            one size, so two Tokens with ``Dim("length")`` must have equal lengths.

    Returns:
        A list to put where ``tokens`` sits in ``dynamic_shapes``.

    Raises:
        TypeError: ``tokens`` is not Tokens.
        ValueError: ``tokens`` is packed (jagged tensors do not export, docs/deploy.md).

    Examples:
        >>> from torch.export import Dim
        >>> from mmattn import Encoder
        >>> tokens = Tokens(torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool))
        >>> spec = tokens_dynamic_shapes(tokens, Dim("batch"), Dim("length", max=64))
        >>> ep = torch.export.export(Encoder(16, 1, 2).eval(), (tokens,), dynamic_shapes=(spec,))
        >>> out = ep.module()(Tokens(torch.randn(3, 9, 16), torch.rand(3, 9) > 0.5))
        >>> out.x.shape
        torch.Size([3, 9, 16])
    """
    from torch.export import Dim

    if not isinstance(tokens, Tokens):
        raise TypeError(f"tokens must be mmattn.Tokens, got {type(tokens).__name__}")
    if tokens.is_packed:
        raise ValueError(
            "tokens is packed (a jagged x): torch.export does not trace jagged nested tensors; "
            "export padded Tokens (tokens.unpack()) instead"
        )
    batch = Dim("batch") if batch is None else batch
    length = Dim("length") if length is None else length
    dims = {0: batch, 1: length}
    n_meta = sum(isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(tokens.meta))
    return [dims, None if tokens.mask is None else dict(dims), *([None] * n_meta)]


class DecodeStep(nn.Module):
    r"""One decoding step of an attention module or a causal block, on plain tensors.

    ``out, state = step(x, state)``: the same numbers as ``module(x, is_causal=True,
    cache=cache)`` (a block: ``module(Tokens(x), cache=cache).x``) with the cache's buffers
    and counter passed in and returned instead of kept inside a cache object. Nothing is
    written in place: the inputs are left as they were, so ``torch.export`` and
    ``torch.onnx.export`` see a pure function and the exported step decodes like eager.

    The state is a tuple of the cache's tensors, in this order:

    - :class:`~mmattn.cache.KVCache` (``MultiHeadAttention``, ``AdditiveAttention``, causal
      blocks): ``k`` (b, k, n, e), ``v`` (b, k, n, e), ``size`` (0-D long);
    - :class:`~mmattn.cache.LocalKVCache` (causal ``LocalAttention``): ``k`` (b, k, w, e),
      ``v`` (b, k, w, e), ``size``, ``positions`` (w,) long.

    :meth:`init_state` gives the empty state. Exported, each step attends all ``n`` slots
    under a mask (static shapes), as under ``torch.compile``; eagerly it attends the filled
    part. A decoder of several layers holds one ``DecodeStep`` per layer, each with its own
    state.

    Args:
        module: an attention module with ``make_cache`` (``MultiHeadAttention`` and its
            self-attention variants), or a block whose ``attn`` has one
            (``TransformerBlock(..., causal=True)``).
        max_len: the most tokens decoded (the cache capacity ``n``).

    Shape:
        - x: (b, i, d); state: as above
        - returns: out (b, i, d) and the new state

    Raises:
        TypeError: ``module`` has no self-attention cache (e.g. ``CrossAttention``, whose
            context is an input of every step instead); a state entry that is not a tensor.
        ValueError: a state of the wrong length, or made for another batch size than
            ``x``'s.

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> attn = MultiHeadAttention(16, 4).eval()
        >>> step = DecodeStep(attn, max_len=8)
        >>> state = step.init_state(batch_size=2)
        >>> out, state = step(torch.randn(2, 1, 16), state)
        >>> out.shape, [tuple(t.shape) for t in state]
        (torch.Size([2, 1, 16]), [(2, 4, 8, 4), (2, 4, 8, 4), ()])
    """

    def __init__(self, module: nn.Module, max_len: int) -> None:
        super().__init__()
        attention = module if isinstance(module, MultiHeadAttention) else getattr(
            module, "attn", None
        )
        if not isinstance(attention, MultiHeadAttention):
            raise TypeError(
                "module must be an mmattn attention module or a block with one as .attn, got "
                f"{type(module).__name__}"
            )
        template = attention.make_cache(1, max_len)
        if isinstance(template, ContextCache):
            raise TypeError(
                f"{type(attention).__name__} caches a context (cross-attention): pass the "
                "context to every exported step instead of a cache"
            )
        self.module = module
        self.max_len = max_len
        self._takes_tokens = attention is not module  # a block: Tokens in, Tokens out
        self._template = template
        #: Names of the cache's tensors, the order of the state.
        self.state_names = tuple(
            name for name, value in vars(template).items() if isinstance(value, Tensor)
        )

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, state={self.state_names}"

    def init_state(self, batch_size: int, **factory: Any) -> tuple[Tensor, ...]:
        """The state of an empty cache for ``batch_size`` sequences (``device``, ``dtype``)."""
        attention = self.module.attn if self._takes_tokens else self.module
        cache = attention.make_cache(batch_size, self.max_len, **factory)
        return tuple(getattr(cache, name) for name in self.state_names)

    def forward(
        self, x: Tensor, state: tuple[Tensor, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Decode ``x`` after the tokens in ``state``; return the output and the new state."""
        if not isinstance(state, (tuple, list)) or len(state) != len(self.state_names):
            raise ValueError(
                f"state must be the {len(self.state_names)} tensors {self.state_names} "
                f"(DecodeStep.init_state), got {type(state).__name__} of "
                f"{len(state) if isinstance(state, (tuple, list)) else 1}"
            )
        self._check_batch(x, state)
        cache = copy.copy(self._template)
        for name, value in zip(self.state_names, state):
            setattr(cache, name, value.clone())  # the cache writes in place: not the inputs
        cache.batch_size = x.shape[0]
        cache.dtype = state[0].dtype
        if self._takes_tokens:
            out = self.module(Tokens(x), cache=cache).x
        else:
            out, _ = self.module(x, is_causal=True, cache=cache)
        return out, tuple(getattr(cache, name) for name in self.state_names)

    def _check_batch(self, x: Tensor, state: tuple[Tensor, ...] | list[Tensor]) -> None:
        """The state's (b, ...) buffers (``k``, ``v``) must hold ``x``'s batch."""
        for name, value in zip(self.state_names, state):
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"state {name} must be a tensor (DecodeStep.init_state), got "
                    f"{type(value).__name__}"
                )
        if not isinstance(x, Tensor) or x.dim() == 0:
            return  # the module names x
        for name, value in zip(self.state_names, state):
            if value.dim() >= 2 and value.shape[0] != x.shape[0]:
                raise ValueError(
                    f"state {name} was made for batch size {value.shape[0]}, but x has batch "
                    f"size {x.shape[0]} ({tuple(x.shape)}); make the state with "
                    f"init_state(batch_size={x.shape[0]})"
                )
