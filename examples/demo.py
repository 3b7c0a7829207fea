"""``make demo``: run every example at demo settings on the CPU and print one results table.

Examples run in parallel worker processes (one torch thread each; ``--jobs`` of them, by
default as many as there are CPU cores, at most 4). The table (example, task, metric,
value, baseline, seconds) is printed, ``<out>/results.json`` holds
``{example: {"metric", "value", "baseline", "seconds"}}`` and the pictures land in
``<out>/`` (default ``out/demo``).

Run: ``python -m examples.demo [--quick] [--out DIR] [--jobs N] [--only NAME ...]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from examples._common import Result

#: Every example, longest first so that the workers finish together.
EXAMPLES = (
    "interleaved_digits",
    "video_digits",
    "multimodal_match",
    "audio_dtmf",
    "caption_decoder",
    "audio_stream",
    "graph_edges",
    "graph_sbm",
    "graph_packed",
    "text_recall",
    "image_canvas",
    "image_digits",
    "custom_adapter",
    "qkv_walkthrough",
)


def _init_worker() -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    # torch_geometric's import triggers torch's torch.jit deprecation notice: not ours to fix
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")


def run_example(name: str, out_dir: str, quick: bool, seed: int) -> tuple[list[Result], str]:
    """Import and run one example in this process; return its results and printed output."""
    import contextlib
    import io

    module = importlib.import_module(f"examples.{name}")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        results = module.run(device="cpu", seed=seed, quick=quick, out_dir=Path(out_dir),
                             show_progress=False)
    return results, buffer.getvalue()


def table(results: Sequence[Result]) -> str:
    """The results as a Markdown table."""
    rows = [("example", "task", "metric", "value", "baseline", "target", "seconds")]
    for r in results:
        target = "-" if r.target is None else f">= {r.target:g} " + ("✓" if r.met else "✗")
        rows.append((r.example, r.task, r.metric, f"{r.value:.4g}",
                     f"{r.baseline:.4g} ({r.baseline_name})", target, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long smoke runs")
    p.add_argument("--out", default="out/demo", help="output folder (default out/demo)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="parallel worker processes (default: CPU cores, at most 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=EXAMPLES, help="run only these examples")
    args = p.parse_args(argv)
    names = [n for n in EXAMPLES if not args.only or n in args.only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"running {len(names)} examples on the CPU with {args.jobs} worker(s) -> {out}/",
          flush=True)
    done: dict[str, list[Result]] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_init_worker) as pool:
        futures = {pool.submit(run_example, n, str(out), args.quick, args.seed): n
                   for n in names}
        for future in as_completed(futures):
            name = futures[future]
            results, printed = future.result()
            (out / f"{name}.log").write_text(printed)
            done[name] = results
            for r in results:
                print(f"  {r.line()}", flush=True)
    total = time.perf_counter() - start
    ordered = [r for n in names for r in done[n]]
    print()
    print(table(ordered))
    missed = [r.example for r in ordered if r.met is False]
    summary = {r.example: r.summary() for r in ordered}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ntotal {total:.1f} s wall time; results in {out / 'results.json'}")
    if missed:
        print(f"targets NOT met: {', '.join(missed)}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
