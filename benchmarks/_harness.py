"""Side-by-side timing: interleaved contenders, medians of repeats, ratios.

The machine these run on is shared and noisy, so contenders are never timed in separate
blocks: every repeat runs each contender once, in a shuffled order, and we report medians.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians(
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    seed: int = 0,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time in seconds of each zero-argument callable, run interleaved.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock starts and stops, so
    asynchronous devices are timed for their work, not for the launch.
    """
    sync = sync or (lambda: None)
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            gc.collect()
            sync()
            start = time.perf_counter()
            contenders[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """Render rows as a GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{c:.3g}" if isinstance(c, float) else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
