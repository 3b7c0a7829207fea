"""Audio: which telephone key was pressed? DTMF tones synthesised with the ITU-T Q.23
frequencies, with noise, random durations and silence.

Each clip is 0.05–0.2 s of a key's two sines between random stretches of silence, in white
noise at 0–20 dB SNR, so clips differ in length and a padded batch needs its mask (padded
frames are silent, -100 dB log-mel, and would swamp the mean if they leaked in).
``AudioFrameEmbedder`` makes log-mel frame tokens (8 kHz, 10 ms hop), an ``Encoder`` of
``LocalAttention`` blocks (each frame sees ±4 frames) mixes them, masked mean pooling and a
linear head pick one of the 16 keys. Baseline: chance (1/16).

Run: ``python -m examples.audio_dtmf``
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import AudioFrameEmbedder
from examples._common import Result, Timer, accuracy, main_for, seed_everything, train_classifier
from examples._dtmf import KEYS, SAMPLE_RATE, synthesize
from mmattn import Encoder, masked_mean
from mmattn.debug import record_attention

EXAMPLE = "audio_dtmf"


def dtmf_dataset(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` clips of random keys: waves (n, T_max), lengths (n,), labels (n,) key indices."""
    labels = torch.randint(len(KEYS), (n,), generator=generator)
    waves, lengths = synthesize([KEYS[i] for i in labels], generator)
    return waves, lengths, labels


def audio_adapter(dim: int) -> AudioFrameEmbedder:
    return AudioFrameEmbedder(dim, sample_rate=SAMPLE_RATE, n_mels=48, n_fft=256, hop_length=80)


class KeyClassifier(nn.Module):
    """AudioFrameEmbedder → local-attention Encoder → masked mean → 16 keys."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4, window: int = 4):
        super().__init__()
        self.audio = audio_adapter(dim)
        self.norm_in = nn.LayerNorm(dim)
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0, attention="local",
                               window_size=window)
        self.head = nn.Linear(dim, len(KEYS))

    def forward(self, waves: Tensor, lengths: Tensor) -> Tensor:
        tokens = self.audio(waves, lengths)
        tokens = tokens.replace(self.norm_in(tokens.x))
        return self.head(masked_mean(self.encoder(tokens)))


def save_attention_picture(model: KeyClassifier, wave: Tensor, key: str, path: Path) -> None:
    """The attention each frame of one clip receives in the last block, under its spectrogram.

    The local blocks give each frame's attention over its ±window neighbours; the picture
    shows the mean over query frames of what each key frame receives (mmattn.viz).
    """
    from mmattn.viz import audio_attention

    last = f"encoder.blocks.{len(model.encoder.blocks) - 1}.attn"
    length = torch.tensor([wave.shape[-1]], device=wave.device)
    with torch.no_grad(), record_attention(model) as maps:
        model(wave[None], length)
        spectrogram = model.audio.features(wave[None])[0]
    received = maps[last][0][0].mean(0)  # (j,): mean over the query frames
    audio_attention(received, spectrogram, frame_rate=SAMPLE_RATE / 80, path=path,
                    title=f"DTMF key {key!r}: attention each frame receives (last block)")


def run(
    device: torch.device | str = "cpu",
    seed: int = 0,
    quick: bool = False,
    out_dir: Path | None = None,
    show_progress: bool = True,
) -> list[Result]:
    timer = Timer()
    seed_everything(seed)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    n_train, n_test, epochs = (128, 64, 2) if quick else (2000, 500, 12)
    waves, lengths, labels = dtmf_dataset(n_train + n_test, generator)
    waves, lengths, labels = waves.to(device), lengths.to(device), labels.to(device)
    print(f"{n_train + n_test} clips of {lengths.min() / SAMPLE_RATE:.2f}–"
          f"{lengths.max() / SAMPLE_RATE:.2f} s")
    train, test = torch.arange(n_train), torch.arange(n_train, n_train + n_test)
    model = KeyClassifier().to(device)

    def forward(idx: Tensor) -> Tensor:
        idx = idx.to(device)
        longest = int(lengths[idx].max())  # trim the batch to its longest clip
        return model(waves[idx, :longest], lengths[idx])

    train_classifier(model, forward, labels, train, epochs=epochs, batch_size=64, lr=3e-3,
                     desc="audio: DTMF", show=show_progress)
    acc = accuracy(forward, labels, test)
    picture = Path(out_dir or Path("out") / EXAMPLE) / "audio_dtmf_attention.png"
    first = int(test[0])
    save_attention_picture(model, waves[first, : int(lengths[first])], KEYS[int(labels[first])],
                           picture)
    print(f"held-out accuracy {acc:.3f} on {n_test} clips; attention picture: {picture}")
    return [
        Result(EXAMPLE, "DTMF key from noisy tones (16 keys)", "test accuracy", acc,
               1 / len(KEYS), "chance", 0.95, timer.seconds)
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
