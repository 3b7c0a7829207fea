"""Interleaved images and text: a model that writes what each digit is, documents packed.

Each document is one handwritten digit (scikit-learn's 8x8 digits, cut by ``ImagePatcher``
into 16 patch tokens) followed by its caption in bytes (``ByteTokenizer`` /
``TextTokenEmbedder``): ``>seven``. Sixty-four documents are packed into one row of 1,472
tokens, as packed pre-training does. The model learns the captions by next-byte prediction
and is scored by writing them, greedily, byte after byte: a caption counts when every byte
is right.

The attention pattern is the one of Transfusion and Gemma 3, inside each document::

    P.same("documents") & P.per_modality(within={"text": P.causal(), "image": P.full()},
                                         across=P.causal())

text is causal, an image attends all of itself, text sees the image before it, and no
token sees another document. The pattern is compiled once into a block-sparse mask (12 % of
the 64 x 64 tiles; every row has the same layout, so every batch shares it, passed to the
``Encoder`` as ``attn_mask``), so each epoch also costs less than full attention. The same
model with full attention (no pattern) is trained on the same batches from the same
weights. It fails twice over: every token sees all 64 documents, whose positions restart
alike, so a caption cannot tell its own image from the 63 others (its training loss stays
high); and in training each caption byte was visible at the position that predicts it,
which is not so when the caption is written. Seconds per epoch are process CPU time, the
two models' epochs interleaved.

Baseline: the same model with full attention.

Run: ``python -m examples.interleaved_digits``
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import ByteTokenizer, ImagePatcher, TextTokenEmbedder
from examples._common import Result, Timer, main_for, progress, seed_everything
from examples.image_digits import load_digits_split
from mmattn import Encoder, Tokens
from mmattn import patterns as P

EXAMPLE = "interleaved_digits"
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PATCHES = 16  # 2x2 patches of an 8x8 digit
CAPTION = 1 + max(map(len, NAMES))  # ">" and the name, padded with "."
DOC = PATCHES + CAPTION  # 23 tokens a document
PER_ROW = 64  # documents packed in one row (1,472 tokens)

EMPTY = ">" + "." * (CAPTION - 1)  # a caption not written yet

#: Transfusion / Gemma 3 inside each packed document.
PATTERN = P.same("documents") & P.per_modality(
    within={"text": P.causal(), "image": P.full()}, across=P.causal()
)


def captions(labels: Tensor) -> Tensor:
    """(N, CAPTION) byte ids of ">name", padded with "." to one length."""
    texts = [(">" + NAMES[int(d)]).ljust(CAPTION, ".") for d in labels]
    return ByteTokenizer().encode(texts)


def row_meta(rows: int, device: torch.device) -> dict:
    """Documents, modality ids and segments (one per image, one per caption) of a row."""
    kinds = torch.tensor([0] * PATCHES + [1] * CAPTION, device=device).repeat(PER_ROW)
    docs = torch.arange(PER_ROW, device=device).repeat_interleave(DOC)
    segments = docs * 2 + kinds
    return {
        "documents": docs.expand(rows, -1), "modality_ids": kinds.expand(rows, -1),
        "modalities": ("image", "text"), "segments": segments.expand(rows, -1),
    }


class CaptionModel(nn.Module):
    """[16 patch tokens, caption bytes] per document, packed → Encoder → next byte."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4,
                 pattern: P.Pattern | None = None) -> None:
        super().__init__()
        vocab = ByteTokenizer.vocab_size
        self.patcher = ImagePatcher(dim, patch_size=2, in_channels=1, img_size=8)
        self.text = TextTokenEmbedder(vocab, dim, positional="learned", max_len=CAPTION)
        self.kind = nn.Parameter(torch.zeros(2, dim))  # image, text
        nn.init.normal_(self.kind, std=0.02)
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0)
        self.head = nn.Linear(dim, vocab)
        self.pattern = pattern
        self._masks: dict[int, P.SparseMask] = {}

    def sparse_mask(self, tokens: Tokens) -> P.SparseMask | None:
        """The pattern compiled for rows of this layout: once, as every batch shares it."""
        if self.pattern is None:
            return None
        if tokens.batch_size not in self._masks:
            self._masks[tokens.batch_size] = self.pattern.compile(tokens)
        return self._masks[tokens.batch_size]

    def forward(self, images: Tensor, text: Tensor) -> Tensor:
        """Logits (R, PER_ROW, CAPTION, vocab): position t of a caption predicts byte t + 1.

        Shape:
            - images: (R * PER_ROW, 1, 8, 8); text: (R * PER_ROW, CAPTION)
        """
        rows = images.shape[0] // PER_ROW
        patches = self.patcher(images).x + self.kind[0]
        words = self.text(text).x + self.kind[1]
        x = torch.cat([patches, words], dim=1).reshape(rows, PER_ROW * DOC, -1)
        tokens = Tokens(x, meta=row_meta(rows, x.device))
        out = self.encoder(tokens, attn_mask=self.sparse_mask(tokens)).x
        out = out.view(rows, PER_ROW, DOC, -1)[:, :, PATCHES:]
        return self.head(out)


def loss_of(model: CaptionModel, images: Tensor, text: Tensor) -> Tensor:
    logits = model(images, text)[:, :, :-1]  # ">" predicts the first letter, ...
    target = text.view(logits.shape[0], PER_ROW, CAPTION)[:, :, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, 2), target.flatten())


@torch.no_grad()
def write_captions(model: CaptionModel, images: Tensor) -> Tensor:
    """Greedy decoding, every document of a row at once: byte t is written from the bytes
    before it (those after it are still the "." of an empty caption)."""
    text = ByteTokenizer().encode([EMPTY]).to(images.device).repeat(images.shape[0], 1)
    for t in range(1, CAPTION):
        logits = model(images, text).flatten(0, 1)  # (R * PER_ROW, CAPTION, vocab)
        text[:, t] = logits[:, t - 1].argmax(-1)
    return text


def caption_accuracy(model: CaptionModel, images: Tensor, labels: Tensor) -> tuple[float, list]:
    """The share of captions written right (whole rows of the test digits), and the first
    few captions written."""
    model.eval()
    rows = images.shape[0] // PER_ROW * PER_ROW
    written = torch.cat([
        write_captions(model, part) for part in images[:rows].split(8 * PER_ROW)
    ])
    right = (written == captions(labels[:rows]).to(written.device)).all(-1)
    return float(right.float().mean()), ByteTokenizer().decode(written[:4].cpu())


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
    images, labels, train, test = load_digits_split(seed)
    if quick:
        train, test = train[:4 * PER_ROW], test[:2 * PER_ROW]
    epochs, rows_per_batch = (1, 1) if quick else (12, 1)
    text = captions(labels)
    models = {
        "pattern": CaptionModel(pattern=PATTERN).to(device),
        "full": CaptionModel().to(device),
    }
    models["full"].load_state_dict(models["pattern"].state_dict())  # the same start
    optims = {k: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
              for k, m in models.items()}
    seconds = {k: 0.0 for k in models}
    losses: dict[str, list[float]] = {k: [] for k in models}
    generator = torch.Generator().manual_seed(seed)
    per_batch = rows_per_batch * PER_ROW
    for _ in progress(range(epochs), desc="interleaved: captions", enabled=show_progress):
        order = train[torch.randperm(len(train), generator=generator)]
        order = order[: len(order) // per_batch * per_batch].split(per_batch)
        for name, model in models.items():  # the same batches, one model after the other
            model.train()
            losses[name] = []
            start = time.process_time()
            for idx in order:
                loss = loss_of(model, images[idx].to(device), text[idx].to(device))
                optims[name].zero_grad(set_to_none=True)
                loss.backward()
                optims[name].step()
                losses[name].append(loss.item())
            seconds[name] += time.process_time() - start
    scores = {k: caption_accuracy(m, images[test].to(device), labels[test].to(device))
              for k, m in models.items()}
    accuracy = {k: s[0] for k, s in scores.items()}
    epoch = {k: s / epochs for k, s in seconds.items()}
    density = PATTERN.compile(
        Tokens(torch.zeros(1, PER_ROW * DOC, 1), meta=row_meta(1, torch.device("cpu")))
    ).density
    shown = len(test) // PER_ROW * PER_ROW
    print(f"digits {[int(d) for d in labels[test[:4]]]}: the pattern model wrote "
          f"{scores['pattern'][1]}, the full-attention model {scores['full'][1]}")
    for name in models:
        print(f"{name:>7}: last-epoch training loss {sum(losses[name]) / len(losses[name]):.3f}"
              f", captions right {accuracy[name]:.3f} of {shown} held-out digits, "
              f"{epoch[name]:.2f} s per epoch (CPU)")
    print(f"the pattern computes {density:.0%} of the 64 x 64 tiles of a row")
    return [
        Result(EXAMPLE, "digit images + captions, packed: write the caption",
               "exact caption rate", accuracy["pattern"], accuracy["full"],
               "same model, full attention", 0.9, timer.seconds),
        Result(f"{EXAMPLE}/speed", "training seconds per epoch", "full / pattern time",
               epoch["full"] / epoch["pattern"], 1.0, "full attention", None, timer.seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
