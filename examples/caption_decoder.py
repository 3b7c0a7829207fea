"""Decoding: a byte decoder names the telephone key in a DTMF tone, one byte at a time.

A clip (the noisy DTMF tones of examples/_dtmf.py) becomes log-mel frame tokens
(``AudioFrameEmbedder``) and a local-attention ``Encoder`` mixes them. A small decoder then
writes the key's name in UTF-8 bytes — "five", "star", "bravo" — from a BOS byte to an
EOS byte: each layer is a causal ``TransformerBlock`` (rotary positions, grouped-query
attention with 2 key/value heads) followed by a ``CrossAttentionBlock`` over the audio.

Training is teacher-forced on whole sequences. Generation is greedy and incremental: every
self-attention layer keeps a ``KVCache`` (each step feeds one byte and attends the bytes
before it), every cross-attention layer a ``ContextCache`` (the audio's keys and values are
projected once per clip). The run checks the cached decoder against the same model run on
the whole generated sequence: every step's logits must agree within 1e-4 of their size.

Baseline: chance (1/16 keys).

Run: ``python -m examples.caption_decoder``
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters import AudioFrameEmbedder, ByteTokenizer
from examples._common import Result, Timer, main_for, seed_everything, train_classifier
from examples._dtmf import KEYS, SAMPLE_RATE, synthesize
from mmattn import CrossAttentionBlock, Encoder, Tokens, TransformerBlock

EXAMPLE = "caption_decoder"
NAMES = dict(zip(KEYS, ["one", "two", "three", "alpha", "four", "five", "six", "bravo",
                        "seven", "eight", "nine", "charlie", "star", "zero", "hash", "delta"]))
TOKENIZER = ByteTokenizer(add_bos=True, add_eos=True)
PAD, BOS, EOS = TOKENIZER.pad_id, TOKENIZER.bos_id, TOKENIZER.eos_id


def caption_dataset(n: int, generator: torch.Generator):
    """Clips, lengths, and captions as (n, L) byte ids: BOS + name + EOS, padded with PAD."""
    labels = torch.randint(len(KEYS), (n,), generator=generator)
    waves, lengths = synthesize([KEYS[i] for i in labels], generator)
    ids = TOKENIZER.encode([NAMES[KEYS[i]] for i in labels])
    return waves, lengths, ids


class CaptionDecoder(nn.Module):
    """Audio encoder + a causal byte decoder that cross-attends the audio."""

    def __init__(self, dim: int = 48, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.audio = AudioFrameEmbedder(dim, sample_rate=SAMPLE_RATE, n_mels=48, n_fft=256,
                                        hop_length=80)
        self.norm_in = nn.LayerNorm(dim)
        self.encoder = Encoder(dim, 1, heads, mlp_ratio=2.0, attention="local",
                               window_size=4)
        self.embed = nn.Embedding(TOKENIZER.vocab_size, dim)
        self.self_blocks = nn.ModuleList(
            TransformerBlock(dim, heads, mlp_ratio=2.0, causal=True,
                             attention_kwargs={"position": "rotary", "num_kv_heads": 2})
            for _ in range(depth)
        )
        self.cross_blocks = nn.ModuleList(
            CrossAttentionBlock(dim, heads, mlp_ratio=2.0) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, TOKENIZER.vocab_size)

    def encode(self, waves: Tensor, lengths: Tensor) -> Tokens:
        tokens = self.audio(waves, lengths)
        return self.encoder(tokens.replace(self.norm_in(tokens.x)))

    def forward(self, ids: Tensor, context: Tokens, caches: list | None = None) -> Tensor:
        """Logits (B, L, vocab) for byte ids (B, L): the whole sequence, or with ``caches``
        the next ``L`` bytes after those already cached."""
        x = Tokens(self.embed(ids))
        caches = caches or [(None, None)] * len(self.self_blocks)
        for block, cross, (self_cache, context_cache) in zip(
            self.self_blocks, self.cross_blocks, caches
        ):
            x = block(x, cache=self_cache)
            x = cross(x, context, cache=context_cache)
        return self.head(self.norm(x.x))

    def make_caches(self, batch_size: int, max_len: int, context: Tokens) -> list:
        return [
            (block.attn.make_cache(batch_size, max_len),
             cross.attn.make_cache(batch_size, context.length))
            for block, cross in zip(self.self_blocks, self.cross_blocks)
        ]

    @torch.no_grad()
    def generate(self, waves: Tensor, lengths: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """Greedy decoding with caches: ids (B, T) from BOS, and each step's logits."""
        context = self.encode(waves, lengths)
        batch = waves.shape[0]
        caches = self.make_caches(batch, max_len, context)
        ids = torch.full((batch, 1), BOS, dtype=torch.long, device=waves.device)
        steps = []
        done = torch.zeros(batch, dtype=torch.bool, device=waves.device)
        for _ in range(max_len - 1):
            logits = self(ids[:, -1:], context, caches)  # one new byte per call
            steps.append(logits)
            next_id = logits[:, -1].argmax(-1).masked_fill(done, PAD)
            ids = torch.cat([ids, next_id[:, None]], dim=1)
            done |= next_id == EOS
            if bool(done.all()):
                break
        return ids, torch.cat(steps, dim=1)


def caption_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-byte cross-entropy; targets (B, L + 1) hold BOS ... EOS PAD ..."""
    return F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), ignore_index=PAD)


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
    n_train, n_test, epochs = (128, 32, 2) if quick else (1500, 300, 10)
    waves, lengths, ids = (t.to(device) for t in caption_dataset(n_train + n_test, generator))
    train, test = torch.arange(n_train), torch.arange(n_train, n_train + n_test)
    model = CaptionDecoder().to(device)

    def forward(idx: Tensor) -> Tensor:
        idx = idx.to(device)
        longest = int(lengths[idx].max())
        context = model.encode(waves[idx, :longest], lengths[idx])
        return model(ids[idx, :-1], context)  # teacher forcing: predict ids[1:]

    train_classifier(model, forward, ids, train, epochs=epochs, batch_size=64, lr=3e-3,
                     desc="caption: DTMF -> bytes", show=show_progress, loss_fn=caption_loss)

    model.eval()
    test = test.to(device)
    longest = int(lengths[test].max())
    generated, step_logits = model.generate(waves[test, :longest], lengths[test],
                                            max_len=ids.shape[1] + 2)
    texts = TOKENIZER.decode(generated)
    truth = TOKENIZER.decode(ids[test])
    exact = sum(a == b for a, b in zip(texts, truth)) / len(test)
    # The same model on the whole generated sequence, in one call, without caches.
    with torch.no_grad():
        context = model.encode(waves[test, :longest], lengths[test])
        whole = model(generated[:, :step_logits.shape[1]], context)
    # relative to each step's logit size: other CPUs round float32 sums otherwise
    diff = (whole - step_logits).abs().amax(dim=-1) / whole.abs().amax(dim=-1).clamp(min=1)
    agree = float((diff <= 1e-4).float().mean())
    for text, want in list(zip(texts, truth))[:4]:
        print(f"  heard {want!r:>10} -> wrote {text!r}")
    print(f"exact captions {exact:.3f} on {len(test)} clips; cached decoding vs the whole "
          f"sequence: max relative |logit diff| = {float(diff.max()):.2e} over "
          f"{diff.numel()} steps")
    seconds = timer.seconds
    return [
        Result(EXAMPLE, "name the DTMF key, byte by byte (16 keys)", "exact caption rate",
               exact, 1 / len(KEYS), "chance", 0.9, seconds),
        Result(f"{EXAMPLE}/cache", "cached decoding = whole-sequence run",
               "steps within 1e-4 (relative)", agree, 0.0, "none", 1.0, seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
