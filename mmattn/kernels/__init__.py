"""Parameter-free attention kernels on (b, h, i, e) tensors; no module, no parameters.

- :mod:`~mmattn.kernels.dense` — SDPA and its explicit softmax twin, the fused switch
  (``MMATTN_FUSED_ATTN``) and the one dead-row policy every path uses;
- :mod:`~mmattn.kernels.blocked` — the 1-D band (sliding window) kernel, O(L·w);
- :mod:`~mmattn.kernels.packed` — the bucket plan and runner for jagged (packed) batches;
- :mod:`~mmattn.kernels.segment` — attention along edge lists (segment softmax), O(E);
- :mod:`~mmattn.kernels.neighborhood` — tiled 2-D neighbourhood attention, O(L·k²).

Nothing here imports a layer: the layers in :mod:`mmattn.attention` call these. Every name
without a leading ``_`` is public; the entry points (``dense.attend``,
``blocked.local_attend``, ``packed.jagged_sdpa``, ``segment.edge_attend`` /
``edge_attend_explicit`` / ``edge_set``, ``neighborhood.neighborhood_attend`` /
``neighborhood_rows`` / ``build_plan``) check their input cheaply (O(1) shapes, O(E) ids)
and raise a ``ValueError`` / ``TypeError`` naming the argument, so no kernel reads outside
its tensors. The unchecked bodies live in ``_``-prefixed modules. The checked public face
of the dense and blocked kernels, with full shape checks, is :mod:`mmattn.functional`
(docs/decisions.md, "Kernels").
"""
