"""ONNX Runtime vs eager PyTorch: inference latency of an exported Encoder on the CPU.

An ``Encoder(256, depth=4, num_heads=8)`` on a padded batch (B=8, L=512, a quarter of each
sequence padding on average) is exported once with ``torch.export`` (batch and length
dynamic) and converted with ``torch.onnx.export(..., dynamo=True)`` at the default opset and
at opset 23 (ONNX ``Attention``). Contenders, one thread each (``torch.set_num_threads(1)``,
ORT ``intra_op_num_threads=1``, denormals flushed to zero), timed as interleaved repeats
(benchmarks/_harness.py):

- eager: ``encoder(tokens)`` under ``torch.inference_mode()``;
- the exported program: ``program.module()(tokens)``;
- ONNX Runtime (CPU) at each opset, fed the same arrays.

The ratio is ORT's median CPU time over eager's (the target is <= 1.0x). Every ORT output is
first checked against eager (within 1e-4).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/export.py`` (about 2 minutes); ``--quick``
for a smoke run (L=128, fewer repeats); ``--write-docs`` writes docs/performance.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_samples,
    markdown_table,
    write_docs,
)

from mmattn import Encoder, Tokens  # noqa: E402
from mmattn.integrations.export import tokens_dynamic_shapes  # noqa: E402


def inputs(batch: int, length: int, dim: int) -> Tokens:
    lengths = torch.randint(length // 2, length + 1, (batch,))
    lengths[0] = length
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return Tokens(torch.randn(batch, length, dim), mask)


def ort_session(program, opset: int | None):
    import onnxruntime as ort

    kwargs = {} if opset is None else {"opset_version": opset}
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False, **kwargs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    # ORT's exp writes denormals (not zeros) for masked scores, and the matmul that follows
    # slows down on them: flushing them to zero took its Attention kernel from about 95 to
    # 60 ms per call here. The numbers move by less than 1e-30.
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    ops = sorted({node.op_type for node in onnx_program.model_proto.graph.node})
    sess = ort.InferenceSession(
        onnx_program.model_proto.SerializeToString(), options,
        providers=["CPUExecutionProvider"],
    )
    return sess, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=128, 5 repeats")
    parser.add_argument("--repeats", type=int, default=15)
    add_docs_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, length, dim, depth, heads = 8, (128 if args.quick else 512), 256, 4, 8
    repeats = 5 if args.quick else args.repeats

    encoder = Encoder(dim, depth, heads).eval()
    example = inputs(3, 64, dim)
    shapes = (tokens_dynamic_shapes(example),)
    program = torch.export.export(encoder, (example,), dynamic_shapes=shapes)
    exported = program.module()
    tokens = inputs(batch, length, dim)
    feeds_arrays = [tokens.x.numpy(), tokens.mask.numpy()]
    with torch.inference_mode():
        want = encoder(tokens).x

    contenders = {
        "eager": lambda: encoder(tokens),
        "torch.export program": lambda: exported(tokens),
    }
    opset_ops = {}
    for opset in (None, 23):
        sess, ops = ort_session(program, opset)
        feeds = dict(zip([i.name for i in sess.get_inputs()], feeds_arrays))
        got = torch.from_numpy(sess.run(None, feeds)[0])
        err = (got - want).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"ONNX Runtime (opset {opset}) differs from eager by {err:.2e}")
        name = f"ONNX Runtime, opset {opset or 'default'}"
        contenders[name] = lambda sess=sess, feeds=feeds: sess.run(None, feeds)
        opset_ops[name] = "Attention" in ops

    with torch.inference_mode():
        wall, cpu = interleaved_samples(contenders, repeats, warmup=2)
    base_cpu = statistics.median(cpu["eager"])
    rows = []
    for name in contenders:
        med_cpu, med_wall = statistics.median(cpu[name]), statistics.median(wall[name])
        kernel = "ONNX Attention" if opset_ops.get(name) else ""
        rows.append([name, kernel, f"{med_cpu * 1e3:.0f}", f"{med_wall * 1e3:.0f}",
                     f"{med_cpu / base_cpu:.2f}x"])
    table = markdown_table(
        ["contender", "kernel", "CPU ms (median)", "wall ms (median)", "vs eager (CPU)"], rows
    )
    summary = (
        f"Encoder(D={dim}, depth={depth}, heads={heads}), B={batch}, L={length} (padded, "
        f"dynamic batch and length), fp32, 1 thread each, {repeats} interleaved repeats. "
        "Target: ONNX Runtime <= 1.0x eager."
    )
    print(table)
    print(summary)
    if args.write_docs and not args.quick:
        write_docs("export", f"{table}\n\n{summary}")


if __name__ == "__main__":
    main()
