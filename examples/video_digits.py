"""Video + text: a model that says which digit moves across a noisy canvas, and where to.

Each clip is 8 frames of a 16x16 noisy canvas on which one of scikit-learn's 8x8 digits
moves one pixel a frame, left, right, up or down. ``VideoPatcher`` cuts the clip into
2-frame x 4x4-pixel tubelets (a 4 x 4 x 4 grid, 64 tokens); the caption that follows is
written in bytes (``ByteTokenizer`` / ``TextTokenEmbedder``): ``>7 left``.
``MultiModalEncoder`` fuses the two (modality embeddings, spans, positions) and its encoder
attends with one pattern per modality::

    P.per_modality(within={"video": VIDEO, "text": P.causal()}, across=P.causal())
    VIDEO = P.neighborhood((3, 3, 3), causal=(True, False, False)) | P.same("frames")

so a tubelet sees all of its own time step and a 3x3 window of the two steps before it,
never a later step (the pattern allows nothing outside ``P.causal(by="frames")``, which the
example checks); the caption is causal and reads the whole clip before it. Positions are
Qwen2-VL's multi-modal RoPE: ``mmattn.rotary.mrope_positions`` gives every token its
(time, row, column) — a tubelet at step t, row r, column c of a clip starting at s gets
(s + t, s + r, s + c), caption bytes advance all three — and ``MultiAxisRotary`` rotates
each head's frequency pairs by one of the three. The model learns the captions by next-byte
prediction and is scored by writing them, greedily, byte after byte: a caption counts when
every byte is right. Every clip has the same layout, so the pattern is made once, as one
(72, 72) mask: at this length the dense kernel is the fastest on the CPU.

Baseline: chance, 1 in 40 (ten digits, four directions).

Saves ``video_digits_frame.png``: one test clip, and what a tubelet of its last time step
attends to in the first block (its frame, and its window in the two steps before).

Run: ``python -m examples.video_digits``
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import ByteTokenizer, TextTokenEmbedder, VideoPatcher
from examples._common import Result, Timer, main_for, progress, seed_everything
from examples.image_digits import load_digits_split
from mmattn import MultiModalEncoder, Tokens
from mmattn import patterns as P
from mmattn.rotary import MultiAxisRotary, mrope_positions

EXAMPLE = "video_digits"
FRAMES, CANVAS, DIGIT = 8, 16, 8
TUBELET = (2, 4, 4)
GRID = (FRAMES // TUBELET[0], CANVAS // TUBELET[1], CANVAS // TUBELET[2])  # (4, 4, 4)
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
CAPTION = 8  # ">7 right", shorter ones padded with "."
EMPTY = ">" + "." * (CAPTION - 1)  # a caption not written yet
NOISE = 0.05
EPOCHS, BATCH, LR = 24, 32, 6e-3

#: Video: its own time step, and a 3x3 window of the two steps before (never a later one).
VIDEO = P.neighborhood((3, 3, 3), causal=(True, False, False)) | P.same("frames")
PATTERN = P.per_modality(within={"video": VIDEO, "text": P.causal()}, across=P.causal())


def make_clips(images: Tensor, labels: Tensor, generator: torch.Generator) -> tuple:
    """Clips (N, 1, FRAMES, CANVAS, CANVAS), caption byte ids (N, CAPTION), directions (N,).

    Each digit moves one pixel a frame from a start that leaves room for its whole path;
    across the motion it starts on the tubelets' 4-pixel grid. The canvas gets Gaussian
    noise of std ``NOISE``.
    """
    n = images.shape[0]
    names = list(DIRECTIONS)
    heading = torch.randint(0, len(names), (n,), generator=generator)
    travel, free, side = FRAMES - 1, CANVAS - DIGIT, TUBELET[1]
    video = torch.randn(n, 1, FRAMES, CANVAS, CANVAS, generator=generator) * NOISE
    across = torch.randint(0, free // side + 1, (n,), generator=generator) * side
    along = torch.randint(0, free - travel + 1, (n,), generator=generator)
    for i in range(n):
        step = torch.tensor(DIRECTIONS[names[int(heading[i])]])
        moving = step != 0
        first = torch.where(step < 0, free - along[i], along[i])  # along the motion
        origin = torch.where(moving, first, across[i])
        for t in range(FRAMES):
            r, c = (origin + t * step).tolist()
            video[i, 0, t, r:r + DIGIT, c:c + DIGIT] += images[i, 0]
    texts = [f">{int(d)} {names[int(h)]}".ljust(CAPTION, ".") for d, h in zip(labels, heading)]
    return video, ByteTokenizer().encode(texts), heading


class VideoCaptioner(nn.Module):
    """VideoPatcher + caption bytes → MultiModalEncoder (a pattern per modality, M-RoPE)
    → next byte."""

    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        vocab = ByteTokenizer.vocab_size
        head_dim = dim // heads
        parts = {
            "video": VideoPatcher(dim, tubelet=TUBELET, in_channels=1, positional=None),
            "text": TextTokenEmbedder(vocab, dim, positional=None, max_len=CAPTION),
        }
        # M-RoPE's sections: frequency pairs per axis (time, row, column), summing to
        # head_dim / 2, shared as Qwen2-VL's (16, 24, 24) share head width 128
        space = 3 * head_dim // 16
        rope = MultiAxisRotary(head_dim, (head_dim // 2 - 2 * space, space, space))
        self.fusion = MultiModalEncoder(
            parts, dim, depth, heads, mlp_ratio=2.0, attention_kwargs={"position": rope},
            positions=mrope_positions,
        )
        self.head = nn.Linear(dim, vocab)
        self._mask: Tensor | None = None

    def attn_mask(self, tokens: Tokens) -> Tensor:
        """PATTERN as one (L, L) mask (True = not allowed): every clip has the same layout,
        so it is built once. At 72 tokens a dense mask is the fastest kernel on the CPU;
        longer clips would pass ``PATTERN.compile(tokens)`` (block-sparse) instead."""
        if self._mask is None or self._mask.device != tokens.device:
            self._mask = ~PATTERN.dense(tokens)[0]
        return self._mask

    def tokens(self, video: Tensor, text: Tensor) -> Tokens:
        """The fused input Tokens, with the video's time steps as ``meta["frames"]``."""
        fused = self.fusion.embed({"video": video, "text": text})
        start, stop = fused.meta["spans"]["video"]
        frames = torch.full(fused.x.shape[:2], -1, dtype=torch.long, device=fused.device)
        frames[:, start:stop] = fused.meta["video"]["frames"]  # -1: not a video token
        return fused.replace(frames=frames)

    def forward(self, video: Tensor, text: Tensor) -> Tensor:
        """Logits (N, CAPTION, vocab): position t of the caption predicts byte t + 1."""
        tokens = self.tokens(video, text)
        out = self.fusion.encoder(tokens, attn_mask=self.attn_mask(tokens))
        start, stop = out.meta["spans"]["text"]
        return self.head(out.x[:, start:stop])


def loss_of(model: VideoCaptioner, video: Tensor, text: Tensor) -> Tensor:
    logits = model(video, text)[:, :-1]
    return nn.functional.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())


@torch.no_grad()
def write_captions(model: VideoCaptioner, video: Tensor) -> Tensor:
    """Greedy decoding: byte t is written from the clip and the bytes before it."""
    text = ByteTokenizer().encode([EMPTY]).to(video.device).repeat(video.shape[0], 1)
    for t in range(1, CAPTION):
        text[:, t] = model(video, text)[:, t - 1].argmax(-1)
    return text


def caption_rate(model: VideoCaptioner, video: Tensor, text: Tensor) -> tuple[float, list]:
    model.eval()
    written = torch.cat([write_captions(model, part) for part in video.split(256)])
    right = (written == text).all(-1)
    return float(right.float().mean()), ByteTokenizer().decode(written[:4].cpu())


def save_frame_picture(model: VideoCaptioner, video: Tensor, text: Tensor, path: Path) -> None:
    """A test clip, and the first block's attention of one tubelet of its last time step
    (mean over heads) over the clip: its frame, and its window in the two steps before;
    grey where the pattern allows nothing (``mmattn.viz.video_attention``)."""
    from mmattn.debug import record_attention
    from mmattn.viz import video_attention

    with torch.no_grad(), record_attention(model, average_attn_weights=True) as maps:
        model(video[None], text[None])
    tokens = model.tokens(video[None], text[None])
    start, stop = tokens.meta["spans"]["video"]
    steps, rows, cols = GRID
    query = (steps - 1) * rows * cols + 2 * cols + 1  # last step, row 2, column 1
    weights = maps["fusion.encoder.blocks.0.attn"][0][0, start + query, start:stop]
    allowed = VIDEO.dense(tokens)[0, start + query, start:stop]
    video_attention(weights, video, tokens.meta["video"]["grid"], query=query,
                    allowed=allowed, path=path,
                    title="what the red tubelet of the last step attends to (block 1)")


def check_frame_causal(model: VideoCaptioner, video: Tensor, text: Tensor) -> bool:
    """Whether the video pattern allows nothing outside ``P.causal(by="frames")``."""
    tokens = model.tokens(video, text)
    outside = VIDEO.dense(tokens) & ~P.causal(by="frames").dense(tokens)
    return not bool(outside.any())


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
    if quick:
        train, test = train[:128], test[:64]
    epochs = 1 if quick else EPOCHS
    generator = torch.Generator().manual_seed(seed)
    test_video, test_text, _ = make_clips(images[test], labels[test], generator)
    model = VideoCaptioner().to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        optim, max_lr=LR, total_steps=epochs * (len(train) // BATCH), pct_start=0.1
    )
    start = time.process_time()
    for _ in progress(range(epochs), desc="video: captions", enabled=show_progress):
        order = train[torch.randperm(len(train), generator=generator)]
        video, text, _ = make_clips(images[order], labels[order], generator)  # new motions
        model.train()
        for i in range(0, len(order) // BATCH * BATCH, BATCH):
            loss = loss_of(model, video[i:i + BATCH].to(device), text[i:i + BATCH].to(device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
    seconds = time.process_time() - start
    rate, written = caption_rate(model, test_video.to(device), test_text.to(device))
    picture = out_dir / "video_digits_frame.png"
    model = model.cpu()
    save_frame_picture(model, test_video[0], test_text[0], picture)
    causal = check_frame_causal(model, test_video[:2], test_text[:2])
    print(f"clips of digits {[int(d) for d in labels[test[:4]]]}: the model wrote {written}")
    print(f"captions right {rate:.3f} of {len(test)} held-out clips; training "
          f"{seconds / epochs:.2f} s per epoch (CPU); video pattern inside "
          f"P.causal(by='frames'): {causal}; picture: {picture}")
    return [
        Result(EXAMPLE, "moving digit, 8 frames + caption: digit and direction",
               "exact caption rate", rate, 1 / 40, "chance: 10 digits x 4 directions", 0.9,
               timer.seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
