"""Glue to other people's code: each file one library, imported only when used.

- :mod:`~mmattn.integrations.torch` — :func:`replace_attention` (swap every
  ``nn.MultiheadAttention`` in a model for ours, weights kept).
- :mod:`~mmattn.integrations.timm` — :class:`~mmattn.integrations.timm.Attention`, timm's
  ``Attention`` on mmattn's kernel (``pip install "mmattn[timm]"``; imported only when used).
- :mod:`~mmattn.integrations.huggingface` — :func:`~mmattn.integrations.huggingface.register`
  (mmattn as a transformers attention backend; imports transformers only when called).
- :mod:`~mmattn.integrations.export` — :func:`~mmattn.integrations.export.tokens_dynamic_shapes`
  and :class:`~mmattn.integrations.export.DecodeStep` for torch.export / ONNX (torch only).
"""
