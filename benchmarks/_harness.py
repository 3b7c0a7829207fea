"""Side-by-side timing: interleaved contenders, medians of repeats, ratios.

The machine these run on is shared and noisy, so contenders are never timed in separate
blocks: every repeat runs each contender once, in a shuffled order, and we report medians.
Peak memory is measured apart, one contender per fresh child process
(:func:`child_peak_memory`, :func:`peak_rss_growth`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

#: Seconds one sample should last when :func:`interleaved_samples` picks its ``calls``.
SAMPLE_SECONDS = 0.02


def interleaved_samples(
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    seed: int = 0,
    sync: Callable[[], object] | None = None,
    calls: int | None = 1,
    device: str = "cpu",
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds of every run of each zero-argument callable, interleaved.

    Every repeat runs each contender once, in a shuffled order. A sample times ``calls``
    (k) back-to-back calls and records their mean, so a sub-millisecond call's launch and
    sync overhead are spread over k calls instead of landing on every sample (and pulling
    the ratios toward 1); ``calls=None`` picks k per contender from the warm-up so a sample
    lasts about :data:`SAMPLE_SECONDS`. On ``device="cuda"`` the wall times come from CUDA
    events recorded around the k calls (the device's clock, after a synchronisation so the
    previous contender's work does not count); elsewhere from ``perf_counter``, with
    ``sync`` (e.g. ``torch.cuda.synchronize``) run before the clock starts and stops. On a
    shared machine another process's load stretches wall time but hardly this process's CPU
    time, so with one torch thread the CPU-time ratios are the steadier ones.
    """
    sync = sync or (lambda: None)
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    counts = {}
    for name, fn in contenders.items():
        start = time.perf_counter()
        for _ in range(warmup):
            fn()
        sync()
        each = (time.perf_counter() - start) / max(warmup, 1)
        counts[name] = calls or max(1, min(1000, int(SAMPLE_SECONDS / max(each, 1e-6))))
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn, k = contenders[name], counts[name]
            gc.collect()
            sync()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                begin.record()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(k):
                fn()
            if cuda:
                end.record()
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1e3
            else:
                sync()
                seconds = time.perf_counter() - start_wall
            wall[name].append(seconds / k)
            cpu[name].append((time.process_time() - start_cpu) / k)
    return wall, cpu


def interleaved_medians(
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    seed: int = 0,
    sync: Callable[[], object] | None = None,
    calls: int | None = 1,
    device: str = "cpu",
) -> dict[str, float]:
    """Median wall time in seconds of each callable, run interleaved (interleaved_samples)."""
    wall, _ = interleaved_samples(contenders, repeats, warmup, seed, sync, calls, device)
    return {name: statistics.median(ts) for name, ts in wall.items()}


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """Render rows as a GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{c:.3g}" if isinstance(c, float) else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- writing results into the docs --------------------------------------------------------
#
# Each benchmark owns one block of a docs page, between
#     <!-- bench:NAME:start -->  and  <!-- bench:NAME:end -->
# and ``--write-docs`` replaces the block with the new table and a stamp line (date, torch,
# machine, command). Prose around the blocks is never touched, so re-running a benchmark
# changes only numbers. Without ``--write-docs`` (e.g. ``--quick`` runs) nothing is written.

DOCS = Path(__file__).resolve().parents[1] / "docs"


def add_docs_argument(parser: argparse.ArgumentParser) -> None:
    """The shared ``--write-docs`` flag (``make bench`` passes it)."""
    parser.add_argument(
        "--write-docs", action="store_true",
        help="write the result table into its docs page between the bench markers",
    )


def machine(device: str = "cpu") -> str:
    """A short description of where the numbers come from."""
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def command_line() -> str:
    """How this run was started, without ``--write-docs`` (so a re-run's stamp is stable)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(DOCS.parent)
    except ValueError:
        pass
    args = [a for a in sys.argv[1:] if a != "--write-docs"]
    return " ".join([f"python {script}", *args])


def write_docs(name: str, body: str, *, device: str = "cpu", page: str = "performance.md",
               command: str | None = None) -> Path:
    """Replace the ``bench:NAME`` block of ``docs/PAGE`` with ``body`` and a stamp line.

    A page without the block gets it appended under a ``## NAME`` heading.
    """
    import torch

    path = DOCS / page
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    stamp = (f"*Last run {when}; torch {torch.__version__}; {machine(device)}; "
             f"`{command or command_line()}`*")
    block = f"{start}\n{stamp}\n\n{body.strip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    path.write_text(text, encoding="utf-8")
    print(f"wrote the {name} table into {path}")
    return path


def proc_status(field: str) -> int:
    """Bytes of one ``/proc/self/status`` field (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_growth(call: Callable[[], object]) -> int:
    """Bytes the process's peak RSS grows over one ``call()`` (Linux).

    The peak (``VmHWM``) is reset first through ``/proc/self/clear_refs``, so what earlier
    calls held does not count. Run it in a fresh child (:func:`child_peak_memory`): one
    contender per process, its warm-up done before.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = proc_status("VmRSS")
    call()
    return proc_status("VmHWM") - base


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU memory allocated by ``fn()`` (the profiler's allocation trace).

    Each op's *self* allocations count once (a parent op's figure includes its children's).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live, peak = 0, 0
    events = sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start
    )
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple, timeout: float) -> object:
    """Run ``worker(rank, world, port, *args, out)`` in ``world`` spawned processes (a
    ``torch.distributed`` group of them, rendezvous on 127.0.0.1:port) and return what rank
    0 wrote as JSON to ``out``; processes still alive after ``timeout`` seconds are killed.

    Raises:
        RuntimeError: nothing was written (a rank failed or was killed).
    """
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, str(out)))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if not out.exists():
            raise RuntimeError(f"P={world} failed (exit codes {[p.exitcode for p in procs]})")
        return json.loads(out.read_text())


def print_child_peak(peak: int) -> None:
    """The child's answer to :func:`child_peak_memory`: one JSON line on stdout."""
    print(json.dumps({"peak": peak}))


def child_peak_memory(script: str, args: list[str], label: str) -> int | None:
    """Bytes of peak RSS growth reported by ``python script --child *args``; None (and a
    printed reason) where the child failed."""
    result = subprocess.run(
        [sys.executable, script, "--child", *args], capture_output=True, text=True
    )
    if result.returncode != 0:
        print(f"  memory child {label} failed: {result.stderr[-300:]}")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])["peak"]

