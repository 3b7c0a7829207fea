"""Audio: ``AudioFrameEmbedder``, waveforms -> (log-mel or raw) frames -> Tokens.

Axis key: ``b`` batch, ``c`` channels, ``t`` samples, ``l`` frames, ``m`` mel bins
(or ``n_fft`` samples for the raw front end), ``d`` model width (``embed_dim``).

    wave (b, t) or (b, c, t) ──mean over c──▶ (b, t) ──resample──▶ ──zero past lengths──▶
      ──log-mel (b, l, m) or raw frames (b, l, n_fft)──▶ linear ──+ pos──▶ Tokens(x (b, l, d))

Frames follow a centred STFT: frame ``l`` is centred on sample ``l * hop_length``, so a clip
of ``T`` samples has ``1 + T // hop_length`` frames, and a clip of length ``T_i`` inside a
padded batch has that many real frames (the mask).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from adapters._audio_stream import AudioStream
from adapters._imports import require
from adapters._packing import add_positions, packed_from_mask
from adapters.base import ModalityAdapter
from mmattn._checks import (
    check_choice,
    check_factory_dtype,
    check_floating,
    check_has_data,
    check_lengths,
    check_positive_int,
    check_rank,
)
from mmattn.position import position_1d
from mmattn.tokens import Tokens

__all__ = ["AudioFrameEmbedder", "AudioStream", "num_frames"]

FRONTENDS = ("mel", "raw")


def num_frames(num_samples: int | Tensor, hop_length: int) -> int | Tensor:
    """Frames of a centred STFT over ``num_samples`` samples: ``1 + num_samples // hop``.

    Examples:
        >>> num_frames(16000, 160)
        101
    """
    return 1 + num_samples // hop_length


def _resampled_length(lengths: Tensor, orig: int, new: int) -> Tensor:
    """torchaudio's resampled length, ``ceil(T * new / orig)``, in exact integers."""
    return (lengths * new + orig - 1) // orig


def _zero_past(wave: Tensor, lengths: Tensor) -> Tensor:
    """Samples past each clip's length set to 0 by selection, so a NaN there vanishes too."""
    keep = torch.arange(wave.shape[-1], device=wave.device) < rearrange(lengths, "b -> b 1")
    return torch.where(keep, wave, 0.0)


class AudioFrameEmbedder(ModalityAdapter):
    r"""Waveforms to frame tokens through a torchaudio log-mel (or a raw-frame) front end.

    Front ends, both on ``1 + T // hop_length`` frames centred on samples ``l * hop_length``:

    - ``"mel"``: ``torchaudio.functional.spectrogram`` (Hann window of ``n_fft``, power 2,
      ``center=True``, reflect padding) -> ``melscale_fbanks`` (HTK, ``n_mels`` bins) ->
      ``amplitude_to_DB`` (10 log10, floor 1e-10, no ``top_db`` so that clips never depend on
      each other); features (B, L, n_mels).
    - ``"raw"``: the waveform zero-padded by ``n_fft // 2`` at both ends and cut into windows
      of ``n_fft`` samples every ``hop_length``; features (B, L, n_fft).

    Then a linear projection to ``embed_dim`` and a 1D position encoding. The front end runs
    in float32 whatever the module's dtype (the projection's input is cast to it).

    Clips of any length T >= 1 work: a clip no longer than ``n_fft // 2`` samples (too short
    for the reflect padding of the mel front end) is zero-padded at its end first, exactly as
    it would be inside a longer padded batch. A batch of 0 clips gives 0 token sequences.

    Multi-channel input (B, C, T) is mixed down by the mean over channels. Input at another
    ``input_rate`` is resampled with ``torchaudio.functional.resample`` and its lengths become
    ``ceil(length * sample_rate / input_rate)``. Samples past a clip's length are zeroed
    (before and after resampling), so padding never leaks into a clip's frames.

    Mask: clip ``i`` of ``lengths[i]`` samples has ``1 + lengths[i] // hop_length`` real
    frames. Those frames equal the clip run alone, except for the **edge frames** whose
    window reaches past the clip's end (frames ``l > (lengths[i] - n_fft // 2) // hop``, at
    most ``ceil(n_fft / 2 / hop)`` of them): alone, the mel front end reflects the clip's
    own samples there, in the batch it sees zeros. The raw front end pads with zeros both
    ways, so all its real frames are equal.

    Args:
        embed_dim: token width ``D``.
        sample_rate: the rate the model works at.
        n_mels: mel bins (mel front end).
        n_fft: window and FFT size in samples, even (25 ms at 16 kHz by default).
        hop_length: frame step in samples (10 ms at 16 kHz).
        frontend: "mel" (needs torchaudio) or "raw".
        positional: "sinusoidal", "learned" (up to ``max_frames``) or None.
        max_frames: longest sequence for ``positional="learned"``.
        device: parameter device.
        dtype: parameter dtype; the tokens come out in it.

    Shape:
        - waveform: (B, T) or (B, C, T), floating, with T >= 1 and C >= 1 (B may be 0)
        - lengths: (B,) integer, 1 <= lengths <= T (at ``input_rate``)
        - Output: ``Tokens`` x (B, 1 + T' // hop_length, D), mask (B, L); meta
          ``hop_length``, ``sample_rate``, ``n_fft``

    Raises:
        TypeError: ``waveform`` not floating; ``lengths`` not integer.
        ValueError: wrong rank; no samples (T = 0) or no channels (C = 0); ``lengths`` of
            the wrong shape, below 1 or above T; more frames than ``max_frames`` with
            learned positions.
        ImportError: torchaudio is missing (``pip install "mmattn[audio]"``) for the mel front
            end or for resampling.

    Examples:
        >>> audio = AudioFrameEmbedder(32, sample_rate=16000, n_mels=40)
        >>> out = audio(torch.randn(2, 16000), lengths=torch.tensor([16000, 8000]))
        >>> out.x.shape, out.lengths.tolist()
        (torch.Size([2, 101, 32]), [101, 51])
    """

    modality = "audio"

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Two short clips of different lengths (see :meth:`ModalityAdapter.example`)."""
        kwargs = dict(
            embed_dim=16, sample_rate=8000, n_mels=8, n_fft=64, hop_length=32,
            positional="learned", max_frames=64,
        )
        return kwargs, (torch.randn(2, 320), torch.tensor([320, 100]))

    def __init__(
        self,
        embed_dim: int,
        sample_rate: int = 16000,
        n_mels: int = 80,
        n_fft: int = 400,
        hop_length: int = 160,
        frontend: str = "mel",
        positional: str | None = "sinusoidal",
        max_frames: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embed_dim)
        dtype = check_factory_dtype("dtype", dtype)
        self.sample_rate = check_positive_int("sample_rate", sample_rate)
        self.n_mels = check_positive_int("n_mels", n_mels)
        self.n_fft = check_positive_int("n_fft", n_fft, minimum=2)
        if n_fft % 2:
            raise ValueError(f"n_fft must be even (frames are centred on samples), got {n_fft}")
        self.hop_length = check_positive_int("hop_length", hop_length)
        check_choice("frontend", frontend, FRONTENDS)
        if frontend == "mel":
            require("torchaudio", "AudioFrameEmbedder(frontend='mel')")
        self.frontend = frontend
        self.positional = positional
        if max_frames is not None:
            check_positive_int("max_frames", max_frames)
        self.max_frames = max_frames
        features = n_mels if frontend == "mel" else n_fft
        self.proj = nn.Linear(features, embed_dim, device=device, dtype=dtype)
        self.position = position_1d(
            positional, embed_dim, max_frames, device=device, dtype=dtype, max_len_name="max_frames"
        )
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        if hasattr(self.position, "reset_parameters"):
            self.position.reset_parameters()

    # --------------------------------------------------------------------- front ends
    def _mel_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """Hann window and mel filterbank in float32, built once per device."""
        if device not in self._tables:
            taf = require("torchaudio.functional", "AudioFrameEmbedder")
            window = torch.hann_window(self.n_fft, device=device)
            fbanks = taf.melscale_fbanks(
                self.n_fft // 2 + 1, 0.0, self.sample_rate / 2, self.n_mels, self.sample_rate
            ).to(device)
            self._tables[device] = (window, fbanks)
        return self._tables[device]

    def features(
        self, waveform: Tensor, *, stream: AudioStream | None = None, final: bool = False
    ) -> Tensor:
        """The front end on mono float32 (B, T) audio at ``sample_rate``: (B, L, features).

        With ``stream`` (:meth:`make_stream`), ``waveform`` is the next piece and the result
        holds the frames it completes (``final``: the last piece), equal to the offline ones.
        """
        if stream is not None:
            check_rank("waveform", waveform, (2,), "(batch, time), mono")
            stream.check_piece(self, waveform, None, None, False)
            return stream.push(self, waveform.to(torch.float32), bool(final))[0]
        if self.frontend == "raw":
            half = self.n_fft // 2
            padded = F.pad(waveform, (half, half))
            frames = padded.unfold(-1, self.n_fft, self.hop_length)  # (b, l, n_fft)
            return frames[:, : num_frames(waveform.shape[-1], self.hop_length)]
        taf = require("torchaudio.functional", "AudioFrameEmbedder")
        window, fbanks = self._mel_tables(waveform.device)
        frames = num_frames(waveform.shape[-1], self.hop_length)
        short = self.n_fft // 2 + 1 - waveform.shape[-1]
        if short > 0:  # reflect padding needs more samples than n_fft // 2: pad with zeros,
            waveform = F.pad(waveform, (0, short))  # as a longer batch would
        power = taf.spectrogram(
            waveform,
            pad=0,
            window=window,
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            win_length=self.n_fft,
            power=2.0,
            normalized=False,
            center=True,
            pad_mode="reflect",
        )[..., :frames]  # (b, freq, l)
        mel = rearrange(power, "b f l -> b l f") @ fbanks  # (b, l, m)
        return taf.amplitude_to_DB(mel, 10.0, 1e-10, 0.0, None)

    # ----------------------------------------------------------------------- checks
    def _check(self, waveform: Tensor, lengths: Tensor | None, input_rate: int | None):
        check_rank("waveform", waveform, (2, 3), "(batch, time) or (batch, channels, time)")
        check_floating("waveform", waveform)
        if waveform.shape[-1] == 0:
            raise ValueError(
                f"waveform must hold at least 1 sample per clip (T >= 1), got shape "
                f"{tuple(waveform.shape)}"
            )
        if waveform.dim() == 3 and waveform.shape[1] == 0:
            raise ValueError(
                f"waveform must have at least 1 channel, got shape {tuple(waveform.shape)}"
            )
        if input_rate is not None:
            check_positive_int("input_rate", input_rate)
        if lengths is not None:
            check_lengths(
                "lengths", lengths, waveform.shape[0], waveform.shape[-1], "samples", "waveform"
            )

    def forward(
        self,
        waveform: Tensor,
        lengths: Tensor | None = None,
        input_rate: int | None = None,
        *,
        packed: bool = False,
        stream: AudioStream | None = None,
        final: bool = False,
    ) -> Tokens:
        """Embed a batch of clips, or the next piece of a batch of streams.

        Args:
            waveform: the clips, padded at the end to a common length.
            lengths: samples of each clip (at ``input_rate``); None means all full length.
            input_rate: rate of ``waveform``; None means ``sample_rate``.
            packed: return packed Tokens (jagged x, no mask): only each clip's real frames
                are projected and positioned.
            stream: from :meth:`make_stream`: ``waveform`` (B, t), any t >= 0, is the next
                piece of the streams; the Tokens hold the frames it completes (maybe none),
                positioned from ``meta["frame_offset"]``, the index of the first of them.
            final: with ``stream``, this is the last piece: the end padding is added and
                the last frames are emitted, as offline.
        """
        if stream is not None:
            return self._stream(waveform, stream, final, lengths, input_rate, packed)
        self._check(waveform, lengths, input_rate)
        check_has_data("waveform", waveform)
        dtype, device = self._param_dtype_device()
        wave = waveform.to(device=device, dtype=torch.float32)
        if wave.dim() == 3:
            wave = wave.mean(dim=1)  # mix down: (b, c, t) -> (b, t)
        batch = wave.shape[0]
        if batch == 0:  # no clips: run one silent clip for the shapes, keep none of it
            wave, lengths = wave.new_zeros(1, wave.shape[-1]), None
        if lengths is not None:
            lengths = lengths.to(device=device, dtype=torch.long)
        if lengths is not None:  # nothing past a clip's end may leak into its frames
            wave = _zero_past(wave, lengths)
        rate = self.sample_rate if input_rate is None else input_rate
        if rate != self.sample_rate:
            taf = require("torchaudio.functional", "AudioFrameEmbedder resampling")
            wave = taf.resample(wave, rate, self.sample_rate)
            if lengths is not None:
                lengths = _resampled_length(lengths, rate, self.sample_rate)
                wave = _zero_past(wave, lengths)
        feats = self.features(wave)[:batch]  # (b, l, features), float32
        if self.positional == "learned" and feats.shape[1] > self.max_frames:
            raise ValueError(
                f"waveform gives {feats.shape[1]} frames, more than max_frames="
                f"{self.max_frames} (the learned positions)"
            )
        mask = None
        if lengths is not None:
            frames = num_frames(lengths, self.hop_length)
            mask = torch.arange(feats.shape[1], device=device) < rearrange(frames, "b -> b 1")
        if packed:
            real = mask if mask is not None else torch.ones(
                feats.shape[:2], dtype=torch.bool, device=device
            )
            rows, offsets = packed_from_mask(feats, real)
            x = add_positions(self.position, self.proj(rows.to(dtype)), offsets)
        else:
            x = self.position(self.proj(feats.to(dtype)))
        if packed:
            return Tokens.from_packed(x, offsets, self._meta())
        return Tokens(x, mask, self._meta())

    def _meta(self, **more: Any) -> dict[str, Any]:
        return {"modality": self.modality, "hop_length": self.hop_length, "n_fft": self.n_fft,
                "sample_rate": self.sample_rate, "frame_rate": self.sample_rate / self.hop_length,
                **more}

    def make_stream(self, batch_size: int, lengths: Tensor | None = None) -> AudioStream:
        """The state of ``batch_size`` streams: ``embedder(piece, stream=state)``.

        Each call takes the next piece of waveform (B, t) or (B, C, t) at ``sample_rate``,
        of any length, and returns the Tokens of the frames it completes. Frames equal the
        offline ones (``embedder(whole_waveform, lengths)``) within float rounding: the
        start is reflected as offline once ``n_fft // 2 + 1`` samples have arrived, and the
        piece passed with ``final=True`` adds the end padding and emits the last frames
        (docs/streaming.md).

        Args:
            batch_size: streams in the batch.
            lengths: (B,) samples of each clip, when known: later samples are zeroed and
                later frames are padding in the mask, as offline with ``lengths``.

        Examples:
            >>> audio = AudioFrameEmbedder(16, sample_rate=8000, n_mels=8, n_fft=64,
            ...                            hop_length=32)
            >>> state = audio.make_stream(2)
            >>> [audio(torch.randn(2, 100), stream=state).length for _ in range(3)]
            [3, 3, 3]
            >>> audio(torch.randn(2, 10), stream=state, final=True).length, state.frames
            (1, 10)
        """
        if lengths is not None:
            lengths = lengths.to(self._param_dtype_device()[1])
        return AudioStream(batch_size, lengths, owner=self)

    def _stream(self, waveform: Tensor, stream: AudioStream, final: bool,
                lengths: Tensor | None, input_rate: int | None, packed: bool) -> Tokens:
        """The Tokens of the frames one more piece completes."""
        if not isinstance(stream, AudioStream):
            raise TypeError(
                f"stream must come from make_stream(batch_size), got {type(stream).__name__}"
            )
        stream.check_piece(self, waveform, input_rate, lengths, packed)
        dtype, device = self._param_dtype_device()
        wave = waveform.to(device=device, dtype=torch.float32)
        if wave.dim() == 3:
            wave = wave.mean(dim=1)  # mix down: (b, c, t) -> (b, t)
        feats, first = stream.push(self, wave, bool(final))  # (b, l, features)
        x = self.proj(feats.to(dtype))
        if self.positional is not None:
            x = self.position(x, offset=first)
        mask = None
        if stream.lengths is not None:
            frames = num_frames(stream.lengths, self.hop_length)
            index = first + torch.arange(x.shape[1], device=device)
            mask = index < rearrange(frames, "b -> b 1")
        return Tokens(x, mask, self._meta(frame_offset=first))

    def edge_frames(self) -> int:
        """At most this many last real frames of a padded clip may differ from it alone."""
        if self.frontend == "raw":
            return 0
        return math.ceil(self.n_fft / 2 / self.hop_length)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, sample_rate={self.sample_rate}, n_mels={self.n_mels}, "
            f"n_fft={self.n_fft}, hop_length={self.hop_length}, frontend={self.frontend!r}, "
            f"positional={self.positional!r}"
        )
