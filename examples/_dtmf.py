"""DTMF key presses synthesised with the ITU-T Q.23 frequencies (shared by the audio and the
multimodal examples).

Each key is the sum of one low-group and one high-group sine (Q.23):

========  ======  ======  ======  ======
Hz        1209    1336    1477    1633
========  ======  ======  ======  ======
697       1       2       3       A
770       4       5       6       B
852       7       8       9       C
941       \\*      0       #       D
========  ======  ======  ======  ======

A clip is silence, the tone for a random duration, silence again, plus white noise at a
random signal-to-noise ratio, with random amplitude, phases and a small frequency error
(Q.24 tolerates ±1.5 %). Clips differ in length, so a batch is padded and ``lengths``
matter.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KEYS = "123A456B789C*0#D"
LOW_HZ = (697.0, 770.0, 852.0, 941.0)
HIGH_HZ = (1209.0, 1336.0, 1477.0, 1633.0)
SAMPLE_RATE = 8000


def key_frequencies(key: str) -> tuple[float, float]:
    """The (low, high) frequencies of a key in Hz.

    Examples:
        >>> key_frequencies("5")
        (770.0, 1336.0)
    """
    if key not in KEYS:
        raise ValueError(f"key must be one of {KEYS!r}, got {key!r}")
    index = KEYS.index(key)
    return LOW_HZ[index // 4], HIGH_HZ[index % 4]


def synthesize(
    keys: list[str],
    generator: torch.Generator,
    *,
    sample_rate: int = SAMPLE_RATE,
    tone_s: tuple[float, float] = (0.05, 0.2),
    silence_s: tuple[float, float] = (0.0, 0.1),
    snr_db: tuple[float, float] = (0.0, 20.0),
    freq_error: float = 0.015,
) -> tuple[Tensor, Tensor]:
    """Synthesise one noisy clip per key, padded with zeros at the end.

    Args:
        keys: the keys, from ``KEYS``.
        generator: the random source (durations, phases, noise).
        sample_rate: samples per second.
        tone_s: range of the tone's duration in seconds.
        silence_s: range of the silence before and after the tone.
        snr_db: range of the signal-to-noise ratio in dB (noise over the whole clip).
        freq_error: relative frequency error, uniform in ±freq_error.

    Returns:
        ``(waves, lengths)``: (B, T_max) float32 clips and (B,) long sample counts.
    """

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    clips = []
    for key in keys:
        low, high = key_frequencies(key)
        n_tone = int(uniform(*tone_s) * sample_rate)
        n_pre, n_post = (int(uniform(*silence_s) * sample_rate) for _ in range(2))
        t = torch.arange(n_tone) / sample_rate
        tone = torch.zeros(n_tone)
        for freq in (low, high):
            freq *= 1 + uniform(-freq_error, freq_error)
            tone += torch.sin(2 * math.pi * freq * t + uniform(0, 2 * math.pi))
        tone *= uniform(0.2, 1.0) / 2
        clip = torch.cat([torch.zeros(n_pre), tone, torch.zeros(n_post)])
        power = tone.square().mean()
        noise_std = math.sqrt(float(power) / 10 ** (uniform(*snr_db) / 10))
        clip += noise_std * torch.randn(clip.shape, generator=generator)
        clips.append(clip)
    lengths = torch.tensor([len(c) for c in clips])
    waves = torch.zeros(len(clips), int(lengths.max()))
    for i, clip in enumerate(clips):
        waves[i, : len(clip)] = clip
    return waves, lengths
