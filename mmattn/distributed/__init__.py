"""Scale out: sequence and context parallelism over a ``torch.distributed`` process group.

- :class:`SequenceParallel` shards a :class:`~mmattn.LocalAttention`'s sequence (halo
  exchange) or a full :class:`~mmattn.MultiHeadAttention`'s heads (all-to-all, Ulysses);
- :class:`ContextParallel` spreads the query tiles of a pattern call (``attn_mask=SparseMask``,
  ``TransformerBlock`` / ``Encoder`` with ``pattern=``) over ranks, balanced by their work,
  by the :class:`ContextPlan` of the mask (:func:`context_plan`);
- :func:`all_reduce_grads` sums gradients across ranks.

The halo and all-to-all exchanges live in :mod:`mmattn.distributed._halo`; the dispatch of
query tiles in :mod:`mmattn.distributed._dispatch`.
"""

from mmattn.distributed.context_parallel import ContextParallel, context_plan
from mmattn.distributed.context_plan import ContextPlan
from mmattn.distributed.sequence_parallel import SequenceParallel, all_reduce_grads

__all__ = ["ContextParallel", "ContextPlan", "SequenceParallel", "all_reduce_grads",
           "context_plan"]
