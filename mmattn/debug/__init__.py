"""Debugging aids: print shapes, trace a model's shapes, record attention maps and Q/K/V
gradient norms.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length.

All of them work through PyTorch hooks and remove their hooks on exit, so the model is left
exactly as it was:

- :func:`debug_shape` — print a tensor's shape with a name and return the tensor unchanged
  (the tutorial's ``Q = debug_shape(Q, "Q")``);
- :func:`explain` — run one forward and report, for every attention call inside, which kernel
  ran (fused SDPA and its backend, explicit, blocked local, ...) and, when not the fused one,
  why;
- :func:`trace_shapes` — forward hooks on every module record input and output shapes, and
  print them as an indented module tree;
- :func:`record_attention` — every module whose ``forward`` takes ``need_weights`` (ours and
  ``torch.nn.MultiheadAttention``) is called with ``need_weights=True`` and its weights are
  kept, while its caller still gets what it asked for;
- :func:`record_qkv_grad_norms` — tensor hooks on the outputs of every ``q_proj`` / ``k_proj``
  / ``v_proj`` record the norm of their gradient in the backward pass;
- :func:`grad_norm_hook` — the same for a single tensor (the tutorial's ``Q.register_hook``);
- :func:`attention_mass` — for every attention call, how much the queries of each modality
  (or segment) attend to the keys of each, computed tile by tile on every kernel;
- :func:`top_keys` — the k keys each query attends most, with their weights, without an
  (L, L) map.
"""

from mmattn.debug.explain import AttentionCall, Explanation, explain
from mmattn.debug.hooks import (
    ShapeRecord,
    debug_shape,
    grad_norm_hook,
    record_attention,
    record_qkv_grad_norms,
    trace_shapes,
)
from mmattn.debug.mass import AttentionMass, TopKeys, attention_mass, top_keys

__all__ = [
    "AttentionCall",
    "AttentionMass",
    "Explanation",
    "ShapeRecord",
    "TopKeys",
    "attention_mass",
    "debug_shape",
    "explain",
    "grad_norm_hook",
    "record_attention",
    "record_qkv_grad_norms",
    "top_keys",
    "trace_shapes",
]
