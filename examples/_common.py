"""Shared plumbing of the examples: command line, seeding, progress bars, results.

Every example module exposes ``run(device, seed, quick, out_dir, progress) -> list[Result]``
and ``main(argv)``; ``main`` parses ``--device``, ``--seed``, ``--quick`` and ``--out``,
calls ``run``, prints one line per result and writes ``<out>/<example>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

os.environ.setdefault("MPLBACKEND", "Agg")


@dataclass
class Result:
    """One line of results: a metric beside a simple baseline.

    Attributes:
        example: the example's name (the key in results.json).
        task: what was learned, in a few words.
        metric: the metric's name, e.g. "test accuracy".
        value: the metric of the attention model.
        baseline: the same metric for the baseline (chance, or a model without attention).
        baseline_name: what the baseline is.
        target: the value the example promises (None: no promise).
        seconds: wall time of the example.
    """

    example: str
    task: str
    metric: str
    value: float
    baseline: float
    baseline_name: str
    target: float | None
    seconds: float

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.value >= self.target

    def line(self) -> str:
        goal = "" if self.target is None else f" (target >= {self.target:g}: "
        goal += "" if self.target is None else ("met)" if self.met else "NOT met)")
        return (
            f"[{self.example}] {self.task}: {self.metric} = {self.value:.4g}{goal}; "
            f"baseline ({self.baseline_name}) = {self.baseline:.4g}; {self.seconds:.1f} s"
        )

    def summary(self) -> dict[str, Any]:
        """The results.json entry: metric, value, baseline, seconds."""
        return {
            "metric": self.metric,
            "value": float(self.value),
            "baseline": float(self.baseline),
            "seconds": round(float(self.seconds), 2),
        }


def parser(description: str) -> argparse.ArgumentParser:
    """The common command line of every example."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... or auto (default)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--out", default=None, help="output folder (default out/<example>)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: the models are tiny)")
    return p


def resolve_device(name: str) -> torch.device:
    """``auto`` is cuda when available, else cpu; anything else is checked and returned."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for CUDA, but CUDA is not available")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def progress(iterable: Iterable, *, desc: str, enabled: bool = True, total: int | None = None):
    """A tqdm progress bar (on stderr), or the bare iterable when disabled."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batches(n: int, batch_size: int, *, shuffle: bool, generator: torch.Generator | None = None):
    """Index tensors covering range(n) in batches (shuffled when asked)."""
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def train_classifier(
    model: nn.Module,
    forward: Callable[[Tensor], Tensor],
    targets: Tensor,
    train_idx: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    desc: str,
    show: bool,
    weight_decay: float = 0.01,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> None:
    """AdamW + one-cycle cosine schedule over ``epochs`` of ``train_idx`` minibatches.

    ``forward(idx)`` returns the logits of the examples ``idx``; ``targets[idx]`` the labels.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = (len(train_idx) + batch_size - 1) // batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, total_steps=max(1, epochs * steps_per_epoch), pct_start=0.15
    )
    model.train()
    bar = progress(range(epochs), desc=desc, enabled=show)
    for _ in bar:
        for idx in batches(len(train_idx), batch_size, shuffle=True):
            idx = train_idx[idx]
            loss = loss_fn(forward(idx), targets[idx.to(targets.device)])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        if show and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


@torch.no_grad()
def accuracy(forward: Callable[[Tensor], Tensor], targets: Tensor, idx: Tensor, bs=512) -> float:
    """Accuracy of ``forward(idx).argmax(-1)`` against ``targets[idx]``."""
    correct = 0
    for part in idx.split(bs):
        pred = forward(part).argmax(-1)
        correct += int((pred == targets[part.to(targets.device)]).sum())
    return correct / max(1, len(idx))


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def out_path(out_dir: str | Path | None, example: str) -> Path:
    path = Path(out_dir) if out_dir is not None else Path("out") / example
    path.mkdir(parents=True, exist_ok=True)
    return path


def main_for(example: str, description: str, run: Callable[..., list[Result]]):
    """Build the ``main(argv)`` of an example around its ``run`` function."""

    def main(argv: Sequence[str] | None = None) -> list[Result]:
        args = parser(description).parse_args(argv)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, args.threads))
        out = out_path(args.out, example)
        try:
            results = run(
                device=resolve_device(args.device),
                seed=args.seed,
                quick=args.quick,
                out_dir=out,
                show_progress=not args.no_progress,
            )
        finally:
            torch.set_num_threads(threads)
        for result in results:
            print(result.line())
        payload = {r.example: {**r.summary(), "task": r.task} for r in results}
        (out / f"{example}.json").write_text(json.dumps(payload, indent=2) + "\n")
        return results

    return main


def as_dict(result: Result) -> dict[str, Any]:
    return asdict(result)
