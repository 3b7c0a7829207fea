"""Streaming: per-chunk time and memory stay flat over a long stream, and streaming a clip
costs about one offline call.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/streaming.py`` (``--quick`` for a smoke
run; ``--write-docs`` writes docs/performance.md).

The model is a streaming speech encoder: ``AudioFrameEmbedder`` (16 kHz, 80 log-mel bins,
25 ms windows, 10 ms hop, no absolute positions) and an ``Encoder(256, depth=4,
num_heads=4)`` with rotary positions, trained (here: initialised) with the pattern
``P.chunked(16, left=4)``: 160 ms chunks that each see the 640 ms before them. fp32, CPU, one
torch thread, eval mode under ``torch.inference_mode``, a batch of 8 streams. One *chunk
step* is the live loop's work for 160 ms of audio: the adapter's stream on a 2,560-sample
piece, then the encoder on the 16 frames with its ``EncoderCache``.

Three measurements (medians of CPU time, ``time.process_time``, over interleaved repeats —
benchmarks/_harness.py):

- **latency at chunk 1,000 vs chunk 10**: two streams, one advanced to chunk 10 and one to
  chunk 1,000, timed alternately one chunk step at a time (target <= 1.1x);
- **memory after 1,000 chunks vs after 10**: the peak RSS growth (VmHWM, reset through
  /proc/self/clear_refs once the model is built) of a fresh child process that streams 10,
  or 1,000, chunks and keeps nothing but the state (target <= 1.05x); also the bytes the
  stream state holds (cache and audio stream), exactly;
- **streaming a whole clip vs one offline call**: the clip (``--clip-chunks`` chunks, 32 s
  by default) streamed chunk step by chunk step against ``audio(wave)`` + ``encoder(tokens)``
  on the whole clip with the same pattern (block-sparse), interleaved (target <= 1.5x). The
  outputs are checked equal first. A second table repeats it for 1, 4, 8 and 16 streams:
  every call reads all the weights, so calls of few tokens cost more per token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import (  # noqa: E402
    add_docs_argument,
    child_peak_memory,
    interleaved_samples,
    markdown_table,
    peak_rss_growth,
    print_child_peak,
    write_docs,
)

from adapters import AudioFrameEmbedder  # noqa: E402
from mmattn import Encoder, Tokens  # noqa: E402
from mmattn import patterns as P  # noqa: E402

RATE, HOP, N_FFT, MELS = 16000, 160, 400, 80
DIM, DEPTH, HEADS, CHUNK, LEFT, BATCH = 256, 4, 4, 16, 4, 8
PIECE = CHUNK * HOP  # samples per chunk step: 160 ms


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.audio = AudioFrameEmbedder(DIM, RATE, MELS, N_FFT, HOP, positional=None)
        self.encoder = Encoder(DIM, DEPTH, HEADS, pattern=P.chunked(CHUNK, left=LEFT),
                               attention_kwargs={"position": "rotary"})

    def offline(self, wave: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.audio(wave)).x


class Live:
    """One batch of live streams: the adapter's stream, the encoder's cache, frames waiting
    for a full chunk."""

    def __init__(self, model: Model, batch: int = BATCH) -> None:
        self.model = model
        self.stream = model.audio.make_stream(batch)
        self.cache = model.encoder.make_cache(batch)
        self.ready = torch.zeros(batch, 0, DIM)

    def step(self, piece: torch.Tensor, final: bool = False) -> list[torch.Tensor]:
        """One piece of audio in, the outputs of the chunks it completes out."""
        frames = self.model.audio(piece, stream=self.stream, final=final).x
        ready = torch.cat([self.ready, frames], dim=1)
        outs = []
        while ready.shape[1] >= CHUNK or (final and ready.shape[1]):
            outs.append(self.model.encoder(Tokens(ready[:, :CHUNK]), cache=self.cache).x)
            ready = ready[:, CHUNK:]
        self.ready = ready
        return outs

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.stream.nbytes + self.ready.numel() * 4


def stream_clip(model: Model, wave: torch.Tensor) -> torch.Tensor:
    live = Live(model, len(wave))
    outs = []
    for start in range(0, wave.shape[-1], PIECE):
        outs += live.step(wave[:, start:start + PIECE], final=start + PIECE >= wave.shape[-1])
    return torch.cat(outs, dim=1)


def advanced(model: Model, chunks: int) -> Live:
    live = Live(model)
    piece = torch.randn(BATCH, PIECE)
    for _ in range(chunks):
        live.step(piece)
    return live


def clip_times(model: Model, wave: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of one offline call and of streaming ``wave``, interleaved."""
    _, cpu = interleaved_samples(
        {"offline": lambda: model.offline(wave), "streamed": lambda: stream_clip(model, wave)},
        repeats=repeats, warmup=1,
    )
    return statistics.median(cpu["offline"]), statistics.median(cpu["streamed"])


def child(chunks: int) -> None:
    """Peak RSS growth over streaming ``chunks`` chunk steps (nothing kept but the state)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Model().eval()
    piece = torch.randn(BATCH, PIECE)
    with torch.inference_mode():
        def run() -> None:
            live = Live(model)
            for _ in range(chunks):
                live.step(piece)

        print_child_peak(peak_rss_growth(run))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short streams, few repeats")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--clip-chunks", type=int, default=200)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    far, repeats, clip_chunks, sweep_chunks = (
        (100, 5, 20, 10) if args.quick else (1000, args.repeats, args.clip_chunks, 50))
    model = Model().eval()
    rows, notes = [], []
    with torch.inference_mode():
        near_live, far_live = advanced(model, 10), advanced(model, far)
        piece = torch.randn(BATCH, PIECE)
        _, cpu = interleaved_samples(
            {"near": lambda: near_live.step(piece), "far": lambda: far_live.step(piece)},
            repeats=repeats, warmup=1,
        )
        near, far_ms = (1e3 * statistics.median(cpu[k]) for k in ("near", "far"))
        rows.append([f"latency per chunk step (ms), chunk {far:,} vs chunk 10",
                     f"{near:.2f}", f"{far_ms:.2f}", f"{far_ms / near:.3f}x", "<= 1.1x"])
        state_near, state_far = advanced(model, 10).nbytes, advanced(model, far).nbytes

        wave = torch.randn(BATCH, clip_chunks * PIECE)
        diff = float((stream_clip(model, wave) - model.offline(wave)).abs().max())
        one, many = clip_times(model, wave, max(3, repeats // 4))
        sweep = [(batch, *clip_times(model, torch.randn(batch, sweep_chunks * PIECE), 3))
                 for batch in (1, 4, 8, 16)]
    growth = {n: child_peak_memory(__file__, [str(n)], f"{n} chunks") for n in (10, far)}
    if None not in growth.values():
        mib = {n: g / 2**20 for n, g in growth.items()}
        rows.append([f"peak RSS growth (MiB), after {far:,} chunks vs after 10",
                     f"{mib[10]:.1f}", f"{mib[far]:.1f}", f"{mib[far] / mib[10]:.3f}x",
                     "<= 1.05x"])
    rows.append([f"stream state (bytes), after {far:,} chunks vs after 10", f"{state_near:,}",
                 f"{state_far:,}", f"{state_far / state_near:.3f}x", "-"])
    seconds = clip_chunks * PIECE / RATE
    rows.append([f"{seconds:.0f} s clip, {BATCH} streams (s): streamed vs one offline call",
                 f"{one:.2f}", f"{many:.2f}", f"{many / one:.2f}x", "<= 1.5x"])
    table = markdown_table(
        ["measure", "at chunk 10 / offline", f"at chunk {far:,} / streamed", "ratio", "target"],
        rows)
    sweep_table = markdown_table(
        [f"streams (x {CHUNK} frames per call)", "offline (s)", "streamed (s)", "ratio"],
        [[batch, f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}x"] for batch, a, b in sweep])
    table += (f"\n\nStreaming vs one offline call by the number of streams in a batch "
              f"({sweep_chunks * PIECE / RATE:.0f} s clips):\n\n{sweep_table}")
    notes.append(f"max |streamed - offline| = {diff:.1e}; one chunk step is "
                 f"{1e3 * PIECE / RATE:.0f} ms of audio for {BATCH} streams, so the live loop "
                 f"runs at {near / (1e3 * PIECE / RATE):.3f}x real time")
    print(table)
    print("\n".join(notes))
    if args.write_docs:
        write_docs("streaming", table + "\n\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
