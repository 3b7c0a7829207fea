"""Text: associative recall over byte-tokenized strings — "a:3 k:7 x:1 ? k" → 7.

Each string lists 2–6 ``key:digit`` pairs with distinct letters, then ``?`` and one of the
keys; the answer is that key's digit. Strings differ in length (the padding mask matters).
No fixed position holds the answer, so a model must look the query key up in the string:
attention does exactly that (the query token attends the matching key, whose neighbour holds
the digit). Baseline: chance (10 %), and the same model with attention removed (each token
sees only itself, then mean pooling), trained alike.

Model: ``ByteTokenizer`` → ``TextTokenEmbedder`` → a causal ``LocalAttention`` block (window
2: each digit binds to its key) → a full-attention block (the query finds its key) → the last
real token → linear.

Run: ``python -m examples.text_recall``
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import ByteTokenizer, TextTokenEmbedder
from examples._common import Result, Timer, main_for, progress, seed_everything
from mmattn import TransformerBlock
from mmattn.debug import record_attention

EXAMPLE = "text_recall"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_strings(n: int, rng: random.Random, min_pairs: int = 2, max_pairs: int = 6):
    """``n`` recall strings and their answers (the digit of the queried key)."""
    texts, answers = [], []
    for _ in range(n):
        keys = rng.sample(LETTERS, rng.randint(min_pairs, max_pairs))
        values = [rng.randrange(10) for _ in keys]
        query = rng.randrange(len(keys))
        pairs = " ".join(f"{k}:{v}" for k, v in zip(keys, values))
        texts.append(f"{pairs} ? {keys[query]}")
        answers.append(values[query])
    return texts, torch.tensor(answers)


class RecallModel(nn.Module):
    """Bytes → tokens → a local block, a full block → the last real token → 10 logits.

    The local block (causal, window 2) binds each digit to the key letter two bytes before
    it; the full block lets the final query letter look the matching key up anywhere.
    """

    def __init__(self, dim: int = 64, heads: int = 4, attention: bool = True):
        super().__init__()
        self.attention = attention
        self.embed = TextTokenEmbedder(ByteTokenizer.vocab_size, dim, max_len=64)
        self.blocks = nn.ModuleList([
            TransformerBlock(dim, heads, mlp_ratio=2.0, attention="local", window_size=2,
                             causal=True),
            TransformerBlock(dim, heads, mlp_ratio=2.0),
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, ids: Tensor) -> Tensor:
        tokens = self.embed(ids)
        # without attention every token sees only itself (the identity mask), then mean pool
        eye = None if self.attention else ~torch.eye(tokens.length, dtype=torch.bool,
                                                     device=ids.device)
        for block in self.blocks:
            tokens = block(tokens, attn_mask=eye)
        if self.attention:
            return self.head(self.norm(tokens.x[torch.arange(ids.shape[0]), tokens.lengths - 1]))
        mask = tokens.full_mask()[..., None]
        return self.head(self.norm((tokens.x * mask).sum(1) / mask.sum(1)))


def save_attention_picture(model: RecallModel, text: str, tok: ByteTokenizer, path: Path,
                           device: torch.device) -> None:
    """The full block's attention over one string, characters as labels (mmattn.viz)."""
    from mmattn.viz import attention_heatmap

    with torch.no_grad(), record_attention(model.blocks[1]) as maps:
        answer = int(model(tok.encode([text]).to(device)).argmax(-1))
    weights = maps["attn"][0][0]  # (i, j) mean over heads
    labels = [ch if ch != " " else "␣" for ch in text]  # a visible space
    attention_heatmap(weights, labels, path=path,
                      title=f"{text!r} -> {answer}: full-attention block (mean over heads)")


def _train(model: nn.Module, steps: int, batch: int, lr: float, rng: random.Random,
           tok: ByteTokenizer, device: torch.device, desc: str, show: bool) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    model.train()
    bar = progress(range(steps), desc=desc, enabled=show)
    for step in bar:
        texts, answers = make_strings(batch, rng)
        logits = model(tok.encode(texts).to(device))
        loss = nn.functional.cross_entropy(logits, answers.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if show and step % 50 == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


@torch.no_grad()
def _accuracy(model: nn.Module, ids: Tensor, answers: Tensor) -> float:
    return float((model(ids).argmax(-1) == answers).float().mean())


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
    rng = random.Random(seed)
    tok = ByteTokenizer()
    steps, batch = (30, 32) if quick else (500, 64)
    test_texts, test_answers = make_strings(200 if quick else 2000, random.Random(seed + 1))
    test_ids, test_answers = tok.encode(test_texts).to(device), test_answers.to(device)
    print(f"e.g. {test_texts[0]!r} -> {int(test_answers[0])}")

    model = RecallModel().to(device)
    _train(model, steps, batch, 3e-3, rng, tok, device, "text: attention", show_progress)
    acc = _accuracy(model, test_ids, test_answers)

    plain = RecallModel(attention=False).to(device)
    _train(plain, max(20, steps // 3), batch, 3e-3, rng, tok, device, "text: no attention",
           show_progress)
    plain_acc = _accuracy(plain, test_ids, test_answers)
    picture = Path(out_dir or Path("out") / EXAMPLE) / "text_recall_attention.png"
    save_attention_picture(model, test_texts[0], tok, picture, device)
    print(f"attention picture: {picture}")
    print(f"held-out accuracy: attention {acc:.3f}, without attention {plain_acc:.3f}, "
          f"chance 0.100")
    return [
        Result(EXAMPLE, "associative recall 'a:3 k:7 ? k' -> 7", "test accuracy", acc,
               max(plain_acc, 0.1), "no-attention model / chance", 0.95, timer.seconds)
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
