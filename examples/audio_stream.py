"""Streaming: a live DTMF recogniser that names each key while the number is still dialled.

A clip is a dialled number: 3–6 keys of the ITU-T Q.23 frequencies (examples/_dtmf.py),
each 60–150 ms, between 40–150 ms of silence, in white noise at 5–25 dB SNR. Every 10 ms
frame is labelled with the key sounding at its centre, or silence. ``AudioFrameEmbedder``
(log-mel frames, no absolute positions) feeds an ``Encoder`` trained on whole clips with the
chunked pattern ``P.chunked(8, left=2)`` (each frame sees its 80 ms chunk and the 160 ms
before it, rotary positions inside attention) and a per-frame linear head.

Live, the same model runs chunk by chunk: the audio arrives in 80 ms pieces,
``embedder(piece, stream=state)`` returns the frames they complete, every 8 frames go
through ``encoder(chunk, cache=cache)`` (one ``ChunkCache`` per block) and a small decoder
emits a key as soon as 3 frames in a row agree on it. The run reports the numbers decoded
right when streamed, beside the same model run offline on whole clips, checks that the
streamed logits equal the offline ones, and times each chunk against its 80 ms of audio.

Baseline: the offline model (whole clips) for accuracy; the chunk's duration for latency.

Run: ``python -m examples.audio_stream``
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters import AudioFrameEmbedder
from examples._common import Result, Timer, main_for, seed_everything, train_classifier
from examples._dtmf import KEYS, SAMPLE_RATE, key_frequencies
from mmattn import Encoder, Tokens
from mmattn import patterns as P

EXAMPLE = "audio_stream"
HOP, N_FFT = 80, 256  # 10 ms frames, 32 ms windows at 8 kHz
CHUNK, LEFT = 8, 2  # 80 ms chunks, 160 ms of left context
SILENCE = 0  # label 0; key i is label i + 1
MIN_RUN = 3  # frames in a row that emit a key


def dialled_numbers(
    n: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, list[str], list[list[int]]]:
    """``n`` noisy clips of 3–6 keys: waves (n, T_max), lengths (n,), the numbers and each
    clip's part sizes in samples (silence, tone, silence, ..., tone, silence)."""

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    clips, numbers, sizes = [], [], []
    for _ in range(n):
        count = int(torch.randint(3, 7, (), generator=generator))
        number = "".join(KEYS[int(i)] for i in torch.randint(len(KEYS), (count,),
                                                              generator=generator))
        parts, power = [], []
        for key in number:
            parts.append(torch.zeros(int(uniform(0.04, 0.15) * SAMPLE_RATE)))
            t = torch.arange(int(uniform(0.06, 0.15) * SAMPLE_RATE)) / SAMPLE_RATE
            tone = sum(torch.sin(2 * math.pi * f * (1 + uniform(-0.015, 0.015)) * t
                                 + uniform(0, 2 * math.pi)) for f in key_frequencies(key))
            tone = tone * uniform(0.2, 1.0) / 2
            parts.append(tone)
            power.append(float(tone.square().mean()))
        parts.append(torch.zeros(int(0.1 * SAMPLE_RATE)))
        clip = torch.cat(parts)
        noise = math.sqrt(statistics.mean(power) / 10 ** (uniform(5, 25) / 10))
        clips.append(clip + noise * torch.randn(clip.shape, generator=generator))
        numbers.append(number)
        sizes.append([len(part) for part in parts])
    lengths = torch.tensor([len(c) for c in clips])
    waves = torch.zeros(n, int(lengths.max()))
    for i, clip in enumerate(clips):
        waves[i, : len(clip)] = clip
    return waves, lengths, numbers, sizes


def frame_labels(sizes: list[list[int]], numbers: list[str], frames: int) -> Tensor:
    """(n, frames) long: the key sounding at each frame's centre (label key + 1), else 0."""
    labels = torch.zeros(len(sizes), frames, dtype=torch.long)
    centres = torch.arange(frames) * HOP
    for i, (parts, number) in enumerate(zip(sizes, numbers)):
        start = 0
        for j, size in enumerate(parts):
            if j % 2:  # odd parts are the tones
                inside = (centres >= start) & (centres < start + size)
                labels[i, inside] = KEYS.index(number[j // 2]) + 1
            start += size
    return labels


class LiveKeys(nn.Module):
    """Log-mel frames -> chunked-attention Encoder -> a key (or silence) per frame."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.audio = AudioFrameEmbedder(dim, sample_rate=SAMPLE_RATE, n_mels=32, n_fft=N_FFT,
                                        hop_length=HOP, positional=None)
        self.norm_in = nn.LayerNorm(dim)
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0,
                               pattern=P.chunked(CHUNK, left=LEFT),
                               attention_kwargs={"position": "rotary"})
        self.head = nn.Linear(dim, len(KEYS) + 1)

    def frames(self, tokens: Tokens, cache=None) -> Tensor:
        tokens = tokens.replace(self.norm_in(tokens.x))
        return self.head(self.encoder(tokens, cache=cache).x)  # (b, l, keys + 1)

    def forward(self, waves: Tensor, lengths: Tensor) -> Tensor:
        return self.frames(self.audio(waves, lengths))


class KeyDecoder:
    """Frame labels in, keys out: a key is emitted once ``MIN_RUN`` frames in a row show it,
    and again only after a frame of something else."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, int]] = []  # (key, frame at which it was emitted)
        self.run_label, self.run, self.frame = SILENCE, 0, 0

    def push(self, labels: list[int]) -> None:
        for label in labels:
            self.run = self.run + 1 if label == self.run_label else 1
            self.run_label = label
            if label != SILENCE and self.run == MIN_RUN:
                self.keys.append((KEYS[label - 1], self.frame))
            self.frame += 1

    @property
    def number(self) -> str:
        return "".join(key for key, _ in self.keys)


@torch.no_grad()
def stream_clip(model: LiveKeys, wave: Tensor, length: int) -> tuple[Tensor, KeyDecoder, list]:
    """Stream one clip in chunk-sized pieces; return its logits, decoder and chunk times."""
    piece = CHUNK * HOP  # 80 ms of audio per piece
    stream, cache, decoder = model.audio.make_stream(1), model.encoder.make_cache(1), KeyDecoder()
    pending, logits, times = [], [], []
    wave = wave[None, :length]
    for start in range(0, length, piece):
        begin = time.perf_counter()
        frames = model.audio(wave[:, start:start + piece], stream=stream,
                             final=start + piece >= length)
        pending.append(frames.x)
        ready = torch.cat(pending, dim=1)
        while ready.shape[1] >= CHUNK or (stream.ended and ready.shape[1]):
            out = model.frames(Tokens(ready[:, :CHUNK]), cache=cache)
            logits.append(out)
            decoder.push(out[0].argmax(-1).tolist())
            ready = ready[:, CHUNK:]
        pending = [ready]
        times.append(time.perf_counter() - begin)
    return torch.cat(logits, dim=1)[0], decoder, times


def run(
    device: torch.device | str = "cpu",
    seed: int = 0,
    quick: bool = False,
    out_dir: Path | None = None,
    show_progress: bool = True,
) -> list[Result]:
    timer = Timer()
    seed_everything(seed)
    device = torch.device(device)  # the data is made on the CPU (same draws), then moved
    generator = torch.Generator().manual_seed(seed)
    n_train, n_test, epochs = (48, 8, 2) if quick else (600, 100, 8)
    waves, lengths, numbers, parts = dialled_numbers(n_train + n_test, generator)
    labels = frame_labels(parts, numbers, 1 + waves.shape[1] // HOP)
    real = torch.arange(labels.shape[1]) < (1 + lengths // HOP)[:, None]
    waves, lengths, labels, real = (t.to(device) for t in (waves, lengths, labels, real))
    print(f"{n_train + n_test} dialled numbers of {lengths.min() / SAMPLE_RATE:.2f}–"
          f"{lengths.max() / SAMPLE_RATE:.2f} s")
    model = LiveKeys().to(device)
    train = torch.arange(n_train)

    def forward(idx: Tensor) -> Tensor:
        longest = int(lengths[idx].max())
        return model(waves[idx, :longest], lengths[idx])

    def frame_loss(logits: Tensor, target_idx: Tensor) -> Tensor:
        target = labels[target_idx, : logits.shape[1]].masked_fill(
            ~real[target_idx, : logits.shape[1]], -100)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    train_classifier(model, forward, torch.arange(len(numbers)), train, epochs=epochs,
                     batch_size=32, lr=3e-3, desc="audio: live DTMF", show=show_progress,
                     loss_fn=lambda logits, idx: frame_loss(logits, idx))
    model.eval()
    offline_right = streamed_right = 0
    worst, chunk_times = 0.0, []
    for i in range(n_train, n_train + n_test):
        n = int(lengths[i])
        with torch.no_grad():
            offline = model(waves[i:i + 1, :n], lengths[i:i + 1])[0]
        whole = KeyDecoder()
        whole.push(offline.argmax(-1).tolist())
        logits, live, times = stream_clip(model, waves[i], n)
        # relative to the logits' size: other CPUs round float32 sums otherwise
        scale = offline.abs().max().clamp(min=1)
        worst = max(worst, float((logits - offline).abs().max() / scale))
        chunk_times += times[1:]  # the first chunk also warms up
        offline_right += whole.number == numbers[i]
        streamed_right += live.number == numbers[i]
        if i == n_train:
            heard = ", ".join(f"{key} at {frame * HOP / SAMPLE_RATE:.2f} s"
                              for key, frame in live.keys)
            print(f"dialled {numbers[i]} ({n / SAMPLE_RATE:.2f} s); streamed: {heard}")
    latency = 1e3 * statistics.median(chunk_times)
    p95 = 1e3 * sorted(chunk_times)[int(0.95 * (len(chunk_times) - 1))]
    chunk_ms = 1e3 * CHUNK * HOP / SAMPLE_RATE
    print(f"numbers right: streamed {streamed_right}/{n_test}, offline {offline_right}/{n_test};"
          f" max |streamed - offline logit| / max(1, max |logit|) = {worst:.2e}")
    print(f"latency per {chunk_ms:.0f} ms chunk: median {latency:.2f} ms, p95 {p95:.2f} ms "
          f"(real-time factor {latency / chunk_ms:.3f}); cache {model.encoder.make_cache(1)}")
    seconds = timer.seconds
    return [
        Result(EXAMPLE, "DTMF numbers keyed live, 80 ms chunks", "numbers right, streamed",
               streamed_right / n_test, offline_right / n_test, "offline, whole clips", 0.9,
               seconds),
        Result(f"{EXAMPLE}/equal", "streamed logits = offline logits",
               "clips within 1e-4 (relative)",
               float(worst <= 1e-4), 0.0, "none", 1.0, seconds),
        Result(f"{EXAMPLE}/latency", "time to process one 80 ms chunk", "median ms",
               latency, chunk_ms, "chunk duration", None, seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
