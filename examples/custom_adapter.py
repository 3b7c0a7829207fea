"""Custom adapter: bring a new modality — a multivariate time series — in ~20 lines, register
it, and fuse it with a built-in adapter (text) in a ``MultiModalEncoder``.

``TimeSeriesAdapter`` subclasses ``adapters.ModalityAdapter`` with ``modality =
"timeseries"``; defining the class registers it, so ``adapters.create("timeseries", ...)``
builds one. It projects each time step's channels to ``embed_dim``, adds sinusoidal
positions and marks the steps past each series' length as padding.

Task: a 3-channel series (channels x, y, z; 20–60 steps, noisy trends up or down) and a
question in text, "is y rising?". The answer depends on both modalities: the text names the
channel, the series holds its trend. Fusion is Perceiver-style (``fusion="latent"``): 8
latents cross-attend the text bytes and the time steps together. Baseline: chance (50 %).

Run: ``python -m examples.custom_adapter``
"""

from __future__ import annotations

from pathlib import Path

import torch
from einops import rearrange
from torch import Tensor, nn

import adapters
from adapters import ByteTokenizer, ModalityAdapter, TextTokenEmbedder
from examples._common import Result, Timer, accuracy, main_for, seed_everything, train_classifier
from mmattn import MultiModalEncoder, Tokens, masked_mean
from mmattn.masks import padding_mask
from mmattn.position import SinusoidalPositionalEncoding

EXAMPLE = "custom_adapter"
CHANNELS = "xyz"


class TimeSeriesAdapter(ModalityAdapter):
    """Multivariate time series (B, T, C) with lengths → one token per time step.

    Shape:
        - series: (B, T, C) float; lengths: (B,) integer, None = all T steps real
        - Output: Tokens x (B, T, D), mask (B, T), meta ``channels``
    """

    modality = "timeseries"

    @classmethod
    def example(cls) -> tuple[dict, tuple]:
        """Constructor kwargs and an input, so the adapter contract test checks this class."""
        return dict(embed_dim=16, channels=3), (torch.randn(2, 7, 3), torch.tensor([7, 4]))

    def __init__(self, embed_dim: int, channels: int) -> None:
        super().__init__(embed_dim)
        self.channels = channels
        self.proj = nn.Linear(channels, embed_dim)
        self.position = SinusoidalPositionalEncoding(embed_dim)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, channels={self.channels}"

    def forward(self, series: Tensor, lengths: Tensor | None = None) -> Tokens:
        if series.dim() != 3 or series.shape[-1] != self.channels:
            raise ValueError(
                f"series must have shape (batch, time, {self.channels}), got "
                f"{tuple(series.shape)}"
            )
        dtype, device = self._param_dtype_device()  # tokens follow the module (contract)
        mask = None if lengths is None else padding_mask(lengths, series.shape[1]).to(device)
        x = self.position(self.proj(series.to(device=device, dtype=dtype)))
        return Tokens(x, mask, {"modality": self.modality, "channels": self.channels})


def make_data(n: int, generator: torch.Generator, steps: tuple[int, int] = (20, 60)):
    """Series (n, T_max, 3), lengths, question ids and labels (1 = the channel rises)."""
    lengths = torch.randint(steps[0], steps[1] + 1, (n,), generator=generator)
    t_max = int(lengths.max())
    t = rearrange(torch.arange(t_max) / steps[1], "t -> 1 t 1")
    slope = torch.where(torch.rand(n, 1, 3, generator=generator) < 0.5, -1.0, 1.0)
    slope = slope * (0.5 + torch.rand(n, 1, 3, generator=generator))
    series = slope * t * 3 + 0.3 * torch.randn(n, t_max, 3, generator=generator)
    series = series * padding_mask(lengths, t_max)[..., None]
    channel = torch.randint(3, (n,), generator=generator)
    questions = [f"is {CHANNELS[c]} rising?" for c in channel]
    labels = (slope[torch.arange(n), 0, channel] > 0).long()
    return series, lengths, ByteTokenizer().encode(questions), labels


class TrendModel(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 4):
        super().__init__()
        series = adapters.create("timeseries", embed_dim=dim, channels=3)  # from the registry
        text = TextTokenEmbedder(ByteTokenizer.vocab_size, dim, max_len=32)
        self.encoder = MultiModalEncoder({"text": text, "timeseries": series}, dim, depth,
                                         heads, fusion="latent", num_latents=8, mlp_ratio=2.0)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: Tensor, series: Tensor, lengths: Tensor) -> Tensor:
        fused = self.encoder({"text": ids, "timeseries": (series, lengths)})
        return self.head(masked_mean(fused))


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
    print(f"registered modalities: {adapters.available()}")
    generator = torch.Generator().manual_seed(seed)
    n_train, n_test, epochs = (128, 64, 1) if quick else (2000, 500, 12)
    series, lengths, ids, labels = (
        t.to(device) for t in make_data(n_train + n_test, generator)
    )
    train, test = torch.arange(n_train), torch.arange(n_train, n_train + n_test)
    model = TrendModel().to(device)

    def forward(idx: Tensor) -> Tensor:
        idx = idx.to(device)
        longest = int(lengths[idx].max())
        return model(ids[idx], series[idx, :longest], lengths[idx])

    train_classifier(model, forward, labels, train, epochs=epochs, batch_size=64, lr=3e-3,
                     desc="custom: time series + text", show=show_progress)
    acc = accuracy(forward, labels, test)
    print(f"held-out accuracy {acc:.3f} on {n_test} (series, question) pairs")
    return [
        Result(EXAMPLE, "new 'timeseries' adapter + text: is <ch> rising?", "test accuracy",
               acc, 0.5, "chance", None, timer.seconds)
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
