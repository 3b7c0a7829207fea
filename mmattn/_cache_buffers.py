"""The protocol every cache shares: preallocated ``k``/``v`` buffers and a token counter.

The decoding caches (:mod:`mmattn.cache`) and the streaming chunk cache
(:mod:`mmattn._chunk_cache`) hold different buffers and rules, but a caller reads them the
same way: ``len(cache)`` tokens seen, ``cache.offset`` (the position of the next token, a 0-D
tensor so compiled code does not specialise on it), ``cache.device`` and ``cache.nbytes``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class BufferCache:
    """Reads of a cache that keeps its tensors as attributes: ``k``, ``size`` and others."""

    k: Tensor
    size: Tensor

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def offset(self) -> Tensor:
        """Position of the next token: the number of tokens already seen (0-D tensor)."""
        return self.size

    def __len__(self) -> int:
        return int(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (constant while the cache is used)."""
        return sum(t.numel() * t.element_size() for t in vars(self).values()
                   if isinstance(t, Tensor))
