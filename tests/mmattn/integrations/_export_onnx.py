"""The ONNX half of the export tests, shared by test_export_onnx*.py (split for time).

Each case of _export_cases.py is exported once by torch.export and converted with
``torch.onnx.export(..., dynamo=True)`` at the default opset and, where SDPA runs inside
(torch then emits ONNX ``Attention``), at opset 23. ONNX Runtime (CPU, one thread) runs the
model at two sizes other than the traced one, on batches with fully masked rows, and must
match eager within 1e-5: a dead row gives a zero attention result there too (ONNX's own
lowering of a boolean mask would give the mean of V, onnx/onnx#8068).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from mmattn.kernels.dense import use_fused_attn
from tests.mmattn.integrations._export_cases import (
    build,
    dead_rows,
    export,
    input_tensors,
    program_leaves,
)

REASON = "needs the onnx extra: pip install 'mmattn[onnx]'"

#: The cases with SDPA inside: opset 23 lowers it to ONNX Attention. The others (additive
#: scores, adapters) have no attention op to lower; for them opset 23 changes nothing else.
SDPA_CASES = {"mha", "mha_cross_gqa", "local", "local_causal_gqa", "block", "encoder_local",
              "multimodal", "neighborhood", "neighborhood_global", "mha_modifiers"}


def params(cases) -> list:
    """(case, opset) pairs: the default opset (None) for every case, 23 where SDPA runs."""
    return [(c, None) for c in cases] + [(c, 23) for c in cases if c.name in SDPA_CASES]


def param_id(param) -> str:
    case, opset = param
    return f"{case.name}-opset{opset or 'default'}"


def to_onnx(program, opset: int | None):
    kwargs = {} if opset is None else {"opset_version": opset}
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(program, dynamo=True, verbose=False, **kwargs)


def session(onnx_program):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(
        onnx_program.model_proto.SerializeToString(), options,
        providers=["CPUExecutionProvider"],
    )


def run(sess, tensors) -> list[torch.Tensor]:
    names = [i.name for i in sess.get_inputs()]
    assert len(names) == len(tensors)
    feeds = {name: t.numpy() for name, t in zip(names, tensors)}
    return [torch.from_numpy(out) for out in sess.run(None, feeds)]


def programs_fixture():
    """A module-scoped cache: torch.export once per case, shared by both opsets."""
    cache = {}

    def get(case):
        if case.name not in cache:
            module = build(case)
            cache[case.name] = module, export(case, module)
        return cache[case.name]

    return get


def convert(param, programs):
    case, opset = param
    module, program = programs(case)
    onnx_program = to_onnx(program, opset)
    ops = {node.op_type for node in onnx_program.model_proto.graph.node}
    return case, opset, module, session(onnx_program), ops, program.call_spec.out_spec


def check_equals_eager(converted, size) -> None:
    case, _, module, sess, _, out_spec = converted
    args, kwargs = case.inputs(*size)
    with torch.no_grad():
        want = program_leaves(module(*args, **kwargs), out_spec)
    got = run(sess, input_tensors(args, kwargs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        else:  # meta sizes (image grid, modality spans) come out as int64 scalars
            assert g.dim() == 0 and int(g) == w
    if case.attention:  # the fully padded sample: zero attention, out_proj.bias alone
        torch.testing.assert_close(
            dead_rows(case, module, args, kwargs, got[0]), torch.zeros(case.length or size[1], 16),
            atol=1e-6, rtol=0,
        )


def check_attention_op(converted) -> None:
    # Where SDPA runs (the fused path), opset 23 lowers it to ONNX Attention, so ORT's
    # Attention kernel is what check_equals_eager held to eager; the explicit path
    # (MMATTN_FUSED_ATTN=0) has no SDPA to lower.
    case, opset, _, _, ops, _ = converted
    emits = opset == 23 and case.name in SDPA_CASES and use_fused_attn()
    assert ("Attention" in ops) == emits


def skip_without_onnx() -> None:
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name, reason=REASON)
