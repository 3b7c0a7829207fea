"""Scale out: sequence parallelism over a ``torch.distributed`` process group.

- :class:`SequenceParallel` shards a :class:`~mmattn.LocalAttention`'s sequence (halo
  exchange) or a full :class:`~mmattn.MultiHeadAttention`'s heads (all-to-all, Ulysses);
- :func:`all_reduce_grads` averages gradients across ranks.

The halo and all-to-all exchanges live in :mod:`mmattn.distributed._halo`.
"""

from mmattn.distributed.sequence_parallel import SequenceParallel, all_reduce_grads

__all__ = ["SequenceParallel", "all_reduce_grads"]
