"""Parameter-free attention kernels on (b, h, i, e) tensors; no module, no parameters.

- :mod:`~mmattn.kernels.dense` — SDPA and its explicit softmax twin, the fused switch
  (``MMATTN_FUSED_ATTN``) and the one dead-row policy every path uses;
- :mod:`~mmattn.kernels.blocked` — the 1-D band (sliding window) kernel, O(L·w);
- :mod:`~mmattn.kernels.packed` — the bucket plan and runner for jagged (packed) batches;
- :mod:`~mmattn.kernels.segment` — attention along edge lists (segment softmax), O(E).

Nothing here imports a layer: the layers in :mod:`mmattn.attention` call these. The checked
public face of the dense and blocked kernels is :mod:`mmattn.functional`.
"""
