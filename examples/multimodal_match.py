"""Multimodal: does the tone's key match the digit? A handwritten digit (scikit-learn) and a
DTMF key press (synthesised, ITU-T Q.23), fused by ``MultiModalEncoder``.

Each example pairs a digit image with a noisy DTMF clip of a key 0–9; half the pairs match.
``ImagePatcher`` (16 patch tokens) and ``AudioFrameEmbedder`` (log-mel frames, clips of
different lengths) feed a ``MultiModalEncoder(fusion="concat")``: learned modality
embeddings are added, the two token sequences are concatenated with their masks, and
self-attention over the joint sequence lets image patches and audio frames attend each other
(cross-attention between the modalities). The match head reads the masked mean of the fused
tokens. Two auxiliary heads (the digit from the image span, the key from the audio span,
found through ``meta["spans"]``) speed up training; the reported accuracy is the match
head's, on held-out images and fresh clips. Baseline: chance (50 %).

After training, ``mmattn.debug.attention_mass`` measures, in every layer, how much the image
patches attend to the audio frames and back (computed tile by tile, no (L, L) map); the
table is printed and drawn by ``mmattn.viz.modality_mass`` into
``multimodal_match_mass.png``.

Run: ``python -m examples.multimodal_match``
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import ImagePatcher
from examples._common import Result, Timer, main_for, progress, seed_everything
from examples._dtmf import synthesize
from examples.audio_dtmf import audio_adapter
from examples.image_digits import load_digits_split
from mmattn import MultiModalEncoder, Tokens, masked_mean
from mmattn.debug import attention_mass

EXAMPLE = "multimodal_match"


def make_pairs(image_idx: Tensor, labels: Tensor, n: int, generator: torch.Generator):
    """``n`` (image index, key digit, match) triples, half of them matching."""
    pick = image_idx[torch.randint(len(image_idx), (n,), generator=generator)]
    digit = labels[pick]
    match = torch.rand(n, generator=generator) < 0.5
    other = (digit + torch.randint(1, 10, (n,), generator=generator)) % 10  # never the digit
    key = torch.where(match, digit, other)
    waves, lengths = synthesize([str(int(k)) for k in key], generator)
    return pick, key, match.long(), waves, lengths


def _span(tokens: Tokens, name: str) -> Tokens:
    start, stop = tokens.meta["spans"][name]
    mask = None if tokens.mask is None else tokens.mask[:, start:stop]
    return Tokens(tokens.x[:, start:stop], mask)


class MatchModel(nn.Module):
    """MultiModalEncoder over image + audio → match head (+ auxiliary digit and key heads)."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4, fusion: str = "concat"):
        super().__init__()
        self.encoder = MultiModalEncoder(
            {
                "image": ImagePatcher(dim, patch_size=2, in_channels=1, img_size=8),
                "audio": audio_adapter(dim),
            },
            dim, depth, heads, fusion, mlp_ratio=2.0,
        )
        self.audio_norm = nn.LayerNorm(dim)
        self.match_head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 2))
        self.digit_head = nn.Linear(dim, 10)
        self.key_head = nn.Linear(dim, 10)

    def forward(self, images: Tensor, waves: Tensor, lengths: Tensor):
        fused = self.encoder({"image": images, "audio": (waves, lengths)})
        match = self.match_head(masked_mean(fused))
        digit = self.digit_head(masked_mean(_span(fused, "image")))
        key = self.key_head(masked_mean(_span(fused, "audio")))
        return match, digit, key


def save_mass_picture(model: MatchModel, inputs: tuple, path: Path) -> None:
    """Print and draw how much each modality attends to the other, layer by layer."""
    from mmattn.viz import modality_mass

    with torch.no_grad():
        mass = attention_mass(model, *inputs)
    print("attention mass (rows: query modality, columns: key modality; mean over heads)")
    print(mass)
    modality_mass(mass, title="share of attention, query modality -> key modality",
                  path=path)
    print(f"attention mass picture: {path}")


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
    images, labels, train_img, test_img = load_digits_split(seed)
    n_train, n_test, epochs = (128, 64, 1) if quick else (3000, 600, 10)
    train = make_pairs(train_img, labels, n_train, generator)
    test = make_pairs(test_img, labels, n_test, generator)
    images, labels = images.to(device), labels.to(device)
    model = MatchModel().to(device)

    def batch(data, idx: Tensor):
        pick, key, match, waves, lengths = data
        longest = int(lengths[idx].max())
        inputs = (images[pick[idx]].to(device), waves[idx, :longest].to(device),
                  lengths[idx].to(device))
        targets = (match[idx].to(device), labels[pick[idx]].to(device), key[idx].to(device))
        return inputs, targets

    batch_size = 64
    steps = epochs * ((n_train + batch_size - 1) // batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps,
                                                pct_start=0.15)
    bar = progress(range(epochs), desc="multimodal: match", enabled=show_progress)
    model.train()
    for _ in bar:
        for idx in torch.randperm(n_train, generator=generator).split(batch_size):
            inputs, (match, digit, key) = batch(train, idx)
            m_logits, d_logits, k_logits = model(*inputs)
            ce = nn.functional.cross_entropy
            loss = ce(m_logits, match) + 0.5 * ce(d_logits, digit) + 0.5 * ce(k_logits, key)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        if show_progress and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    correct = 0
    with torch.no_grad():
        for idx in torch.arange(n_test).split(256):
            inputs, (match, _, _) = batch(test, idx)
            correct += int((model(*inputs)[0].argmax(-1) == match).sum())
    acc = correct / n_test
    print(f"held-out match accuracy {acc:.3f} on {n_test} image/tone pairs")
    out_dir = Path(out_dir or Path("out") / EXAMPLE)
    save_mass_picture(model, batch(test, torch.arange(min(n_test, 64)))[0],
                      out_dir / "multimodal_match_mass.png")
    return [
        Result(EXAMPLE, "digit image + DTMF tone: same key?", "test accuracy", acc, 0.5,
               "chance", 0.90, timer.seconds)
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
