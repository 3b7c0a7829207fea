"""AudioFrameEmbedder: frame formula, masks, padded clips vs clips alone, torchaudio references."""

from __future__ import annotations

import pytest
import torch

from adapters import AudioFrameEmbedder, num_frames

torchaudio = pytest.importorskip("torchaudio")

SR, N_FFT, HOP, MELS, D = 8000, 128, 32, 16, 12


def _audio(**kw) -> AudioFrameEmbedder:
    return AudioFrameEmbedder(D, sample_rate=SR, n_mels=MELS, n_fft=N_FFT, hop_length=HOP, **kw)


def test_mel_features_equal_torchaudio_transforms():
    audio = _audio()
    wave = torch.randn(2, 900)
    ref = torchaudio.transforms.MelSpectrogram(
        SR, n_fft=N_FFT, hop_length=HOP, n_mels=MELS, center=True, power=2.0
    )(wave)
    ref = torchaudio.transforms.AmplitudeToDB("power", top_db=None)(ref).transpose(1, 2)
    torch.testing.assert_close(audio.features(wave), ref, atol=1e-4, rtol=1e-5)
    assert ref.shape[1] == num_frames(900, HOP) == 1 + 900 // HOP


def test_raw_frames_are_centred_windows():
    audio = _audio(frontend="raw")
    wave = torch.randn(1, 300)
    frames = audio.features(wave)
    padded = torch.cat([torch.zeros(1, N_FFT // 2), wave, torch.zeros(1, N_FFT // 2)], dim=1)
    assert frames.shape == (1, 1 + 300 // HOP, N_FFT)
    for frame in range(frames.shape[1]):
        assert torch.equal(frames[0, frame], padded[0, frame * HOP : frame * HOP + N_FFT])


@pytest.mark.parametrize("frontend", ["mel", "raw"])
def test_mask_counts_follow_the_frame_formula(frontend, clips):
    wave, lengths = clips((1600, 1000, 1337, 31))
    out = _audio(frontend=frontend)(wave, lengths)
    assert out.x.shape == (4, 1 + 1600 // HOP, D)
    assert out.lengths.tolist() == [1 + n // HOP for n in lengths.tolist()]
    assert out.mask[:, 0].all() and out.meta["hop_length"] == HOP
    assert _audio(frontend=frontend)(wave).mask is None


@pytest.mark.parametrize("frontend", ["mel", "raw"])
def test_padded_clip_equals_clip_alone_except_edge_frames(frontend, clips):
    audio = _audio(frontend=frontend)
    wave, lengths = clips((1600, 1000, 1337))
    batch = audio(wave, lengths)
    for i, n in enumerate(lengths.tolist()):
        alone = audio(wave[i : i + 1, :n])
        real = 1 + n // HOP
        assert alone.x.shape[1] == real
        exact = real if frontend == "raw" else (n - N_FFT // 2) // HOP + 1
        assert real - exact <= audio.edge_frames()
        torch.testing.assert_close(batch.x[i, :exact], alone.x[0, :exact], atol=1e-4, rtol=1e-4)


def test_samples_past_lengths_do_not_leak(clips):
    audio = _audio()
    wave, lengths = clips((1600, 1000))
    noisy = wave.clone()
    noisy[1, 1000:] = 100.0
    torch.testing.assert_close(audio(noisy, lengths).x, audio(wave, lengths).x)


def test_channels_are_mixed_down_by_their_mean():
    audio = _audio()
    stereo = torch.randn(2, 3, 700)
    torch.testing.assert_close(audio(stereo).x, audio(stereo.mean(dim=1)).x)


def test_other_input_rate_is_resampled_with_torchaudio():
    audio = _audio()
    wave = torch.randn(2, 400)  # at 4 kHz: 800 samples at 8 kHz
    lengths = torch.tensor([400, 251])
    out = audio(wave, lengths, input_rate=4000)
    masked = wave * (torch.arange(400) < lengths[:, None])
    up = torchaudio.functional.resample(masked, 4000, SR)
    up_lengths = torch.tensor([800, 502])  # ceil(length * 8000 / 4000)
    ref = audio(up * (torch.arange(up.shape[1]) < up_lengths[:, None]), up_lengths)
    torch.testing.assert_close(out.x, ref.x, atol=1e-4, rtol=1e-4)
    assert out.lengths.tolist() == [1 + 800 // HOP, 1 + 502 // HOP]
    odd = audio(torch.randn(1, 300), torch.tensor([299]), input_rate=11025)  # ceil(299*8000/11025)
    assert odd.lengths.tolist() == [1 + 217 // HOP]


def test_positions_are_added_after_the_projection():
    audio = _audio(positional=None)
    learned = _audio(positional="learned", max_frames=64)
    learned.proj.load_state_dict(audio.proj.state_dict())
    wave = torch.randn(1, 500)
    torch.testing.assert_close(
        learned(wave).x - audio(wave).x, learned.position.weight[None, : 1 + 500 // HOP]
    )


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.zeros(2, 100, dtype=torch.int16),), TypeError, "waveform must have a floating"),
        ((torch.zeros(1, 1, 2, 100),), ValueError, r"waveform must be a 2 or 3-D tensor.*4-D"),
        ((torch.zeros(100),), ValueError, r"waveform must be a 2 or 3-D tensor.*1-D"),
        (
            (torch.zeros(2, 100), torch.tensor([100, 101])),
            ValueError,
            r"lengths must lie in \[1, T=100\]",
        ),
        (
            (torch.zeros(2, 100), torch.tensor([0, 50])),
            ValueError,
            r"lengths must lie in \[1, T=100\]",
        ),
        (
            (torch.zeros(2, 100), torch.tensor([50.0, 60.0])),
            TypeError,
            "lengths must have an integer",
        ),
        (
            (torch.zeros(2, 100), torch.tensor([50])),
            ValueError,
            r"lengths must have shape \(batch,\)=\(2,\)",
        ),
        ((torch.zeros(2, 100), None, 0), ValueError, "input_rate must be >= 1"),
    ],
)
def test_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        _audio()(*args)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="n_fft must be even"):
        AudioFrameEmbedder(8, n_fft=401)
    with pytest.raises(ValueError, match="frontend must be one of"):
        AudioFrameEmbedder(8, frontend="mfcc")
    with pytest.raises(ValueError, match="max_frames must be given when positional='learned'"):
        AudioFrameEmbedder(8, positional="learned")
