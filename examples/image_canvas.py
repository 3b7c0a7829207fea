"""Image, where locality matters: find and read a digit on a noisy 64x64 canvas (1,024 patches).

Each scikit-learn digit (8x8, upscaled to 16x16) is pasted at a random spot of a 64x64
canvas of noise. ``ImagePatcher`` cuts the canvas into 2x2 patches: a 32x32 grid, 1,024
tokens, without absolute positions. An ``Encoder`` of two ``NeighborhoodAttention`` blocks
(5x5 windows with rotary positions, ``attention="neighborhood"``; the blocks read the grid
from ``Tokens.meta``) builds local features, and their maximum over the patches is
classified, wherever the digit is. A training digit gets a new spot and new noise at every
visit; the held-out digits sit on fixed canvases.

The same model with full attention is timed on a few training batches, so the log reports
the time per epoch of both. ``mmattn.viz.neighborhood_attention`` draws one patch's window
and weights over the canvas.

Baseline: chance (10 %).

Run: ``python -m examples.image_canvas``
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters import ImagePatcher
from examples._common import Result, Timer, accuracy, main_for, seed_everything, train_classifier
from examples.image_digits import load_digits_split
from mmattn import Encoder, Tokens
from mmattn.debug import record_attention

EXAMPLE = "image_canvas"
CANVAS, DIGIT, PATCH = 64, 16, 2
#: Pixel normalisation: without it a dim noise patch and a bright digit patch of the same
#: pattern are the same token after the blocks' LayerNorm (a linear patch embedding without
#: bias is scale-free), and nothing is learned.
MEAN, STD = 0.5, 0.25


def canvases(digits: Tensor, generator: torch.Generator, noise: float = 0.3) -> Tensor:
    """(N, 1, 64, 64): each (1, 8, 8) digit upscaled to 16x16 at a random spot, in noise.

    Pixels are in [0, 1]; the model normalises them (:data:`MEAN`, :data:`STD`).
    """
    n = digits.shape[0]
    big = F.interpolate(digits, size=(DIGIT, DIGIT), mode="bilinear", align_corners=False)
    out = noise * torch.rand(n, 1, CANVAS, CANVAS, generator=generator)
    spots = torch.randint(0, CANVAS - DIGIT + 1, (n, 2), generator=generator)
    for m, (r, c) in enumerate(spots.tolist()):
        region = out[m, :, r:r + DIGIT, c:c + DIGIT]
        out[m, :, r:r + DIGIT, c:c + DIGIT] = torch.maximum(region, big[m])
    return out


class CanvasViT(nn.Module):
    """ImagePatcher → 1,024 patches → neighbourhood Encoder (RoPE) → max over patches.

    No absolute positions: the digit may be anywhere, so the patches carry only their
    pixels, rotary positions inside the attention give each window its relative layout,
    and the max over patches finds the digit wherever it is.
    """

    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 2, kernel: int = 5,
                 attention: str = "neighborhood", classes: int = 10):
        super().__init__()
        self.patcher = ImagePatcher(dim, patch_size=PATCH, in_channels=1, img_size=CANVAS,
                                    positional=None)
        kwargs = {"position": "rotary"}
        if attention == "neighborhood":
            kwargs["kernel_size"] = kernel
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0, attention=attention,
                               attention_kwargs=kwargs)
        self.head = nn.Linear(dim, classes)

    def tokens(self, images: Tensor) -> Tokens:
        return self.encoder(self.patcher((images - MEAN) / STD))

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.tokens(images).x.amax(dim=1))


def epoch_seconds(model: nn.Module, images: Tensor, labels: Tensor, batch: int, steps: int,
                  train_size: int) -> float:
    """CPU seconds per training epoch from ``steps`` fwd+bwd batches (after a warm-up one).

    Process CPU time, not wall time: with one torch thread it is the steadier clock on a
    shared machine (the demo runs several examples at once).
    """
    model.train()
    for step in range(steps + 1):
        if step == 1:
            start = time.process_time()
        loss = F.cross_entropy(model(images[:batch]), labels[:batch])
        loss.backward()
    model.zero_grad(set_to_none=True)
    return (time.process_time() - start) / steps * (train_size / batch)


def save_window_picture(model: CanvasViT, image: Tensor, path: Path) -> None:
    """The first block's window and weights of the patch at the digit's centre."""
    from mmattn.viz import neighborhood_attention

    first = "encoder.blocks.0.attn"
    with torch.no_grad(), record_attention(model) as maps:
        model(image[None])
    weights = maps[first][0][0]  # (patches, patches)
    rows, cols = CANVAS // PATCH, CANVAS // PATCH
    ink = image[0].unfold(0, PATCH, PATCH).unfold(1, PATCH, PATCH).mean((-1, -2))
    query = int(ink.flatten().argmax())  # a patch on the digit
    kernel = model.encoder.blocks[0].attn.kernel_size
    neighborhood_attention(weights[query], image, (rows, cols), query, kernel_size=kernel,
                           path=path, title=f"patch {divmod(query, cols)}: its "
                           f"{kernel[0]}x{kernel[1]} window")


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
    digits, labels, train, test = load_digits_split(seed)
    if quick:
        train, test = train[:64], test[:32]
    generator = torch.Generator().manual_seed(seed)
    test_images = canvases(digits[test], generator).to(device)
    labels = labels.to(device)
    model = CanvasViT().to(device)
    batch, epochs = 16, 1 if quick else 4

    def forward(idx: Tensor) -> Tensor:  # a fresh spot and fresh noise at every visit
        return model(canvases(digits[idx], generator).to(device))

    start = time.process_time()
    train_classifier(model, forward, labels, train, epochs=epochs, batch_size=batch, lr=2e-3,
                     desc="image: canvas", show=show_progress)
    ours_epoch = (time.process_time() - start) / epochs
    lookup = {int(i): n for n, i in enumerate(test.tolist())}
    acc = accuracy(lambda idx: model(test_images[[lookup[int(i)] for i in idx]]), labels, test,
                   bs=64)
    full = CanvasViT(attention="full").to(device)
    sample = canvases(digits[train[:batch]], generator).to(device)
    full_epoch = epoch_seconds(full, sample, labels[train[:batch]], batch, 1 if quick else 3,
                               len(train))
    ours_timed = epoch_seconds(model, sample, labels[train[:batch]], batch,
                               1 if quick else 3, len(train))
    model.eval()
    picture = out_dir / "image_canvas_window.png"
    save_window_picture(model, test_images[0], picture)
    print(f"held-out accuracy {acc:.3f} on {len(test)} canvases of 1,024 patches; "
          f"CPU time per epoch: neighborhood {ours_epoch:.1f} s in training ({ours_timed:.1f} "
          f"s timed on {batch}-canvas batches), full attention {full_epoch:.1f} s "
          f"({full_epoch / ours_timed:.1f}x slower); window picture: {picture}")
    return [
        Result(EXAMPLE, "digit on a noisy 64x64 canvas, 1,024 patches", "test accuracy", acc,
               0.1, "chance", 0.7, timer.seconds),
        Result(f"{EXAMPLE}/epoch_time", "CPU seconds per training epoch",
               "full / neighborhood time", full_epoch / ours_timed, 1.0, "full attention",
               None, timer.seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
