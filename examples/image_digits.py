"""Image: a small ViT on scikit-learn's handwritten digits (8x8, ships with scikit-learn).

``ImagePatcher`` cuts each 8x8 digit into 2x2 patches (a 4x4 grid of 16 tokens with learned
2D positions), a learned class token is prepended, an ``Encoder`` of two blocks mixes them,
and the class token is classified. Held-out accuracy is measured on a stratified 25 % split.
The attention of the class token over the patches (last block, mean over heads, recorded
with ``mmattn.debug.record_attention``) is drawn on one digit by ``mmattn.viz.image_attention``.

Baseline: chance (10 %).

Run: ``python -m examples.image_digits``
"""

from __future__ import annotations

from pathlib import Path

import torch
from einops import repeat
from torch import Tensor, nn

from adapters import ImagePatcher
from examples._common import (
    Result,
    Timer,
    accuracy,
    main_for,
    seed_everything,
    train_classifier,
)
from mmattn import Encoder, Tokens
from mmattn.debug import record_attention

EXAMPLE = "image_digits"


def load_digits_split(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Images (N, 1, 8, 8) in [0, 1], labels (N,), train and test index tensors."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train, test = train_test_split(
        range(len(labels)), test_size=0.25, random_state=seed, stratify=digits.target
    )
    return images, labels, torch.tensor(train), torch.tensor(test)


class DigitViT(nn.Module):
    """ImagePatcher → [class token; patches] → Encoder → class token → linear."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4, classes: int = 10):
        super().__init__()
        self.patcher = ImagePatcher(dim, patch_size=2, in_channels=1, img_size=8)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.normal_(self.cls, std=0.02)
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0)
        self.head = nn.Linear(dim, classes)

    def tokens(self, images: Tensor) -> Tokens:
        patches = self.patcher(images)
        cls = repeat(self.cls, "1 1 d -> b 1 d", b=images.shape[0])
        return self.encoder(Tokens(torch.cat([cls, patches.x], dim=1), meta=patches.meta))

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.tokens(images).x[:, 0])


def save_attention_picture(model: DigitViT, image: Tensor, label: int, path: Path) -> None:
    """One digit and its class token's attention over the 4x4 patch grid (mmattn.viz)."""
    from mmattn.viz import image_attention

    last = f"encoder.blocks.{len(model.encoder.blocks) - 1}.attn"
    with torch.no_grad(), record_attention(model) as maps:
        pred = int(model(image[None]).argmax(-1))
    patches = model.patcher(image[None])
    cls_attn = maps[last][0][0, 0, 1:]  # the class token's row, without its own column
    image_attention(cls_attn, image, patches, path=path,
                    title=f"digit {label} (predicted {pred}): what the class token looks at")


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
    out_dir = Path(out_dir or Path("out") / EXAMPLE)
    out_dir.mkdir(parents=True, exist_ok=True)
    images, labels, train, test = load_digits_split(seed)
    images, labels = images.to(device), labels.to(device)
    if quick:
        train, test = train[:256], test[:128]
    model = DigitViT().to(device)

    def forward(idx: Tensor) -> Tensor:
        return model(images[idx.to(device)])

    train_classifier(model, forward, labels, train, epochs=2 if quick else 40, batch_size=64,
                     lr=3e-3, desc="image: ViT", show=show_progress)
    acc = accuracy(forward, labels, test)
    picture = out_dir / "image_digits_attention.png"
    first = int(test[0])
    save_attention_picture(model, images[first], int(labels[first]), picture)
    print(f"held-out accuracy {acc:.3f} on {len(test)} digits; attention picture: {picture}")
    return [
        Result(EXAMPLE, "ViT on sklearn digits (8x8)", "test accuracy", acc, 0.1, "chance",
               0.95, timer.seconds)
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
