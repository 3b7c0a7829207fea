"""AudioFrameEmbedder streaming: frames computed piece by piece equal the offline frames.

The reference is the offline front end on the whole waveform (``features(wave)`` and
``embedder(wave, lengths)``). The stream gets the same waveform cut into pieces of random
sizes (0 samples included), the last one with ``final=True``; every frame, the edge frames
included, must agree within 1e-5 of their size, and so must the Tokens and their masks.
"""

from __future__ import annotations

import pytest
import torch

from adapters import AudioFrameEmbedder
from adapters.audio import AudioStream
from tests._tolerance import assert_close_scaled

pytest.importorskip("torchaudio")

SR, MELS, D = 8000, 16, 12


#: Tiny tensors: one intra-op thread (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


def _audio(n_fft=128, hop=32, **kw) -> AudioFrameEmbedder:
    return AudioFrameEmbedder(D, sample_rate=SR, n_mels=MELS, n_fft=n_fft, hop_length=hop, **kw)


def pieces(total: int, seed: int, most: int = 200) -> list[slice]:
    """Cuts of 0..most samples covering 0..total."""
    gen = torch.Generator().manual_seed(seed)
    cuts, start = [], 0
    while start < total:
        size = int(torch.randint(0, most, (), generator=gen))
        cuts.append(slice(start, start + size))
        start += size
    return cuts


@pytest.mark.parametrize(("frontend", "n_fft", "hop"),
                         [("mel", 128, 32), ("mel", 400, 160), ("mel", 64, 48),
                          ("raw", 256, 80)])
@pytest.mark.parametrize("samples", [5, 70, 1777])
def test_streamed_frames_equal_offline_frames(frontend, n_fft, hop, samples):
    audio = _audio(n_fft, hop, frontend=frontend)
    wave = torch.randn(2, samples)
    want = audio.features(wave)
    stream = audio.make_stream(2)
    cuts = pieces(samples, seed=samples)
    got = [audio.features(wave[:, cut], stream=stream, final=cut is cuts[-1]) for cut in cuts]
    got = torch.cat(got, dim=1)
    assert got.shape == want.shape == (2, 1 + samples // hop, want.shape[-1])
    assert_close_scaled(got, want, atol=1e-5)  # log-mel features: values up to ~40
    assert stream.frames == want.shape[1] and stream.ended


@pytest.mark.parametrize("positional", ["sinusoidal", None])
def test_streamed_tokens_equal_a_padded_batch_with_lengths(positional, clips):
    """Clips of different lengths in one padded batch: lengths given to make_stream zero the
    samples past each clip and mask its frames, as offline; positions start at each piece's
    first frame (meta["frame_offset"])."""
    audio = _audio(positional=positional)
    wave, lengths = clips((1600, 1000, 31))
    wave = wave.unsqueeze(1).repeat(1, 2, 1)  # (b, c, t): mixed down as offline
    want = audio(wave, lengths)
    stream = audio.make_stream(3, lengths=lengths)
    cuts = pieces(wave.shape[-1], seed=1, most=300)
    outs = [audio(wave[..., cut], stream=stream, final=cut is cuts[-1]) for cut in cuts]
    offsets = [out.meta["frame_offset"] for out in outs]
    assert offsets == [sum(o.length for o in outs[:i]) for i in range(len(outs))]
    x = torch.cat([out.x for out in outs], dim=1)
    mask = torch.cat([out.mask for out in outs], dim=1)
    assert_close_scaled(x, want.x, atol=1e-5)  # embedded frames: values near 170
    assert torch.equal(mask, want.mask)


def test_without_final_the_edge_frames_wait_and_memory_stays_bounded():
    audio = _audio(n_fft=128, hop=32)
    stream = audio.make_stream(1)
    wave = torch.randn(1, 32 * 400)
    sizes = []
    for cut in range(0, wave.shape[-1], 320):
        out = audio(wave[:, cut:cut + 320], stream=stream)
        sizes.append(stream.nbytes)
    # a frame is emitted once its window (64 samples past its centre) has arrived
    assert stream.frames == (wave.shape[-1] - 64) // 32 + 1 == 1 + 400 - 2
    assert out.length == 10 and max(sizes) <= 4 * (128 + 320)  # float32 samples held
    assert isinstance(stream, AudioStream) and not stream.ended
    stream.reset()
    assert stream.frames == 0 and stream.nbytes == 0


def test_bad_pieces_raise_named_errors():
    audio = _audio()
    stream = audio.make_stream(2)
    with pytest.raises(ValueError, match="stream was made for batch_size=2, got waveform with "
                                         "batch size 3"):
        audio(torch.randn(3, 100), stream=stream)
    with pytest.raises(ValueError, match="input_rate=16000 with stream=: resampling is not "
                                         "streamed"):
        audio(torch.randn(2, 100), input_rate=16000, stream=stream)
    with pytest.raises(ValueError, match="lengths does not apply with stream="):
        audio(torch.randn(2, 100), torch.tensor([100, 50]), stream=stream)
    with pytest.raises(ValueError, match="stream was made by another AudioFrameEmbedder"):
        audio(torch.randn(2, 100), stream=_audio().make_stream(2))
    with pytest.raises(TypeError, match="waveform must have a floating-point dtype"):
        audio(torch.ones(2, 100, dtype=torch.long), stream=stream)
    with pytest.raises(TypeError, match="stream must come from make_stream"):
        audio(torch.randn(2, 100), stream={})
    with pytest.raises(ValueError, match=r"lengths must have shape \(batch_size,\)=\(2,\)"):
        audio.make_stream(2, lengths=torch.tensor([5]))
    audio(torch.randn(2, 100), stream=stream, final=True)
    with pytest.raises(ValueError, match="stream has ended"):
        audio(torch.randn(2, 100), stream=stream)
