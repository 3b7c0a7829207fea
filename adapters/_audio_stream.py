"""Streaming front end of ``AudioFrameEmbedder``: frames from pieces of a waveform.

Axis key: ``b`` batch, ``t`` samples of one piece, ``n`` samples held, ``l`` frames, ``f``
features (mel bins or ``n_fft`` samples).

The offline front end frames a clip as a centred STFT: frame ``l`` covers samples
``l * hop - n_fft/2 ... l * hop + n_fft/2 - 1``, the clip padded by ``n_fft/2`` samples at
both ends (reflected for the mel front end, zeros for the raw one). The stream keeps the
samples that the next frames still need, in the same padded coordinates: the start padding
is added as soon as ``n_fft/2 + 1`` samples have arrived (reflection needs them), a frame is
emitted once its window is complete, and ``final=True`` adds the end padding and emits the
last frames. So every frame is computed from the same samples as offline and agrees within
float rounding; without ``final`` the last ``ceil(n_fft / 2 / hop)`` frames (whose windows
reach past the end) are never emitted.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from adapters._imports import require
from mmattn._checks import check_floating, check_integer_dtype, check_positive_int, check_rank

__all__ = ["AudioStream"]


class AudioStream:
    """The state of one batch of audio streams: the samples the next frames still need.

    Made by :meth:`AudioFrameEmbedder.make_stream`; pass it as ``embedder(piece,
    stream=state)`` for every piece of waveform, in order, and with ``final=True`` for the
    last one.

    Args:
        batch_size: streams in the batch.
        lengths: samples of each clip when known (a padded batch streamed from files):
            samples past them are zeroed and their frames are padding in the mask, as
            offline with ``lengths``; None = every stream is real throughout.
        owner: the embedder that made it.

    Attributes:
        samples: samples received so far (per stream).
        frames: frames emitted so far (the next frame's index).
        ended: ``final=True`` was passed; the stream takes no more pieces until :meth:`reset`.
    """

    def __init__(self, batch_size: int, lengths: Tensor | None = None,
                 owner: nn.Module | None = None) -> None:
        self.batch_size = check_positive_int("batch_size", batch_size, minimum=0)
        if lengths is not None:
            check_integer_dtype("lengths", lengths, "samples per clip")
            if tuple(lengths.shape) != (batch_size,):
                raise ValueError(
                    f"lengths must have shape (batch_size,)=({batch_size},), got "
                    f"{tuple(lengths.shape)}"
                )
            if lengths.numel() and int(lengths.min()) < 1:
                raise ValueError(f"lengths must be >= 1, got {int(lengths.min())}")
            lengths = lengths.to(torch.long)
        self.lengths = lengths
        self._owner = None if owner is None else weakref.ref(owner)
        self.reset()

    def reset(self) -> None:
        """Forget every sample: the next piece starts new streams."""
        self.samples = 0
        self.frames = 0
        self.ended = False
        self._held: Tensor | None = None  # (b, n) samples, padded coordinates
        self._start = 0  # padded position of _held[:, 0]
        self._padded_front = False

    @property
    def nbytes(self) -> int:
        """Bytes of the samples held (at most about ``n_fft + hop`` per stream plus a piece)."""
        held = self._held
        return 0 if held is None else held.numel() * held.element_size()

    def __repr__(self) -> str:
        return (f"AudioStream(batch_size={self.batch_size}, samples={self.samples}, "
                f"frames={self.frames}, ended={self.ended})")

    # ------------------------------------------------------------------ one piece
    def check_piece(self, embedder: nn.Module, waveform: Tensor, input_rate: int | None,
                    lengths: Tensor | None, packed: bool) -> None:
        """Raise unless ``waveform`` can be the next piece of these streams."""
        if self._owner is not None and self._owner() is not embedder:
            raise ValueError(
                "stream was made by another AudioFrameEmbedder (make_stream of this one)"
            )
        if self.ended:
            raise ValueError(
                "stream has ended (its last piece came with final=True); reset() it or make "
                "a new one with make_stream(batch_size)"
            )
        check_rank("waveform", waveform, (2, 3), "(batch, time) or (batch, channels, time)")
        check_floating("waveform", waveform)
        if waveform.shape[0] != self.batch_size:
            raise ValueError(
                f"stream was made for batch_size={self.batch_size}, got waveform with batch "
                f"size {waveform.shape[0]}"
            )
        if waveform.dim() == 3 and waveform.shape[1] == 0:
            raise ValueError(
                f"waveform must have at least 1 channel, got shape {tuple(waveform.shape)}"
            )
        if input_rate is not None and input_rate != embedder.sample_rate:
            raise ValueError(
                f"input_rate={input_rate} with stream=: resampling is not streamed; feed "
                f"pieces at sample_rate={embedder.sample_rate}"
            )
        if lengths is not None:
            raise ValueError(
                "lengths does not apply with stream=: give the clips' lengths once, to "
                "make_stream(batch_size, lengths=...)"
            )
        if packed:
            raise ValueError("packed=True does not apply with stream=: pieces are padded")

    def push(self, embedder: nn.Module, wave: Tensor, final: bool) -> tuple[Tensor, int]:
        """Take mono float32 samples (b, t); return the features of the frames they complete
        (b, l, f) and the index of the first of them."""
        half, hop, n_fft = embedder.n_fft // 2, embedder.hop_length, embedder.n_fft
        mel = embedder.frontend == "mel"
        if self.lengths is not None:  # nothing past a clip's end may leak into its frames
            index = self.samples + torch.arange(wave.shape[-1], device=wave.device)
            wave = torch.where(index < self.lengths.to(wave.device)[:, None], wave, 0.0)
        total = self.samples + wave.shape[-1]
        if final and mel and total < half + 1:  # as offline: a short clip gets zeros first
            wave = F.pad(wave, (0, half + 1 - total))
        held = wave if self._held is None else torch.cat([self._held, wave], dim=-1)
        if not self._padded_front and (not mel or held.shape[-1] >= half + 1):
            front = held[:, 1:half + 1].flip(-1) if mel else held.new_zeros(len(held), half)
            held, self._padded_front = torch.cat([front, held], dim=-1), True
        limit = None
        if final:
            back = (held[:, -half - 1:-1].flip(-1) if mel
                    else held.new_zeros(len(held), half))
            held = torch.cat([held, back], dim=-1)
            limit = 1 + total // hop  # the offline frame count
        self.samples, self.ended = total, final
        first = self.frames
        ready = 0
        if self._padded_front:
            ready = max(0, (self._start + held.shape[-1] - n_fft) // hop + 1 - first)
        if limit is not None:
            ready = min(ready, limit - first)
        lo = first * hop - self._start
        segment = held[:, lo:lo + (ready - 1) * hop + n_fft] if ready else held[:, :0]
        feats = _frame_features(embedder, segment, ready)
        self.frames = first + ready
        # keep what the next frames need, and (mel) the n_fft/2 + 1 samples a final end
        # reflection reads
        keep = min(self.frames * hop - self._start, max(0, held.shape[-1] - half - 1))
        if not self._padded_front:
            keep = 0
        self._held, self._start = held[:, keep:], self._start + keep
        return feats, first


def _frame_features(embedder: nn.Module, segment: Tensor, frames: int) -> Tensor:
    """Features of the ``frames`` uncentred windows of ``segment`` (b, n): (b, l, f)."""
    hop, n_fft = embedder.hop_length, embedder.n_fft
    if embedder.frontend == "raw":
        if not frames:
            return segment.new_zeros(len(segment), 0, n_fft)
        return segment.unfold(-1, n_fft, hop)[:, :frames]
    if not frames or not len(segment):  # (an empty batch: the FFT takes no 0-row input)
        return segment.new_zeros(len(segment), frames, embedder.n_mels)
    taf = require("torchaudio.functional", "AudioFrameEmbedder")
    window, fbanks = embedder._mel_tables(segment.device)
    power = taf.spectrogram(
        segment, pad=0, window=window, n_fft=n_fft, hop_length=hop, win_length=n_fft,
        power=2.0, normalized=False, center=False,
    )[..., :frames]  # (b, freq, l)
    mel = rearrange(power, "b f l -> b l f") @ fbanks  # (b, l, m)
    return taf.amplitude_to_DB(mel, 10.0, 1e-10, 0.0, None)
