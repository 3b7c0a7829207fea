"""Pattern.compile: the SparseMask equals the dense reference, tile counts are exact, and no
(L, L) tensor is ever allocated (a dispatch-mode watcher at L = 4096)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmattn import Tokens
from mmattn import patterns as P
from tests.mmattn._pattern_cases import fused_tokens, interleaved_tokens, patterns

#: No attention runs here: the MMATTN_FUSED_ATTN=0 pass would repeat these unchanged.
pytestmark = pytest.mark.pins_path

FUSED = fused_tokens()
PATTERNS = {
    **patterns(),
    "documents-causal": P.same("documents") & P.causal(),
    "not-window": ~P.window(3),
    "or": P.edges() | P.chunked(4) | P.modality("text", "text"),
    "per-modality": P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(3), "graph": P.edges(),
                "audio": P.window(2)},
        across=P.modality(query="text") | P.modality(key="text"),
    ),
    "nothing": ~P.full(),
}


def nonempty_tiles(dense: torch.Tensor, block: int) -> int:
    """Tiles of ``dense`` (B, L, L) holding at least one True pair, counted directly."""
    batch, length, _ = dense.shape
    n = -(-length // block)
    pad = n * block - length
    tiles = F.pad(dense, (0, pad, 0, pad)).view(batch, n, block, n, block)
    return int(tiles.any(dim=4).any(dim=2).sum())


@pytest.mark.parametrize("block", [1, 13, 64])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_compile_equals_dense_and_counts_exactly(name, block):
    pattern = PATTERNS[name]
    expected = pattern.dense(FUSED)
    mask = pattern.compile(FUSED, block_size=block)
    assert torch.equal(mask.dense(), expected)
    assert isinstance(mask.nonempty_blocks, int)
    assert mask.nonempty_blocks == nonempty_tiles(expected, block)
    n = -(-FUSED.length // block)
    assert mask.shape == (FUSED.batch_size, FUSED.length, FUSED.length)
    assert mask.block_size == block
    assert mask.density == pytest.approx(mask.nonempty_blocks / (FUSED.batch_size * n * n))


def test_interleaved_and_packed():
    tokens = interleaved_tokens()
    pattern = P.per_modality(within={"image": P.full()}, across=P.causal()) & P.causal() | (
        P.modality("image", "image") & P.same("segments"))
    for block in (3, 5):
        assert torch.equal(pattern.compile(tokens, block).dense(), pattern.dense(tokens))
    parts = {name: Tokens(FUSED.x[:, a:b], FUSED.mask[:, a:b], FUSED.meta[name]).pack()
             for name, (a, b) in FUSED.meta["spans"].items()}
    packed = Tokens.cat(parts)  # spans are per-item (B,) tensors
    assert isinstance(packed.meta["spans"]["image"][0], torch.Tensor)
    pattern = P.per_modality(within={"text": P.causal(), "image": P.neighborhood(3)},
                             across=P.modality(key="text"))
    expected = pattern.dense(packed)
    assert torch.equal(pattern.compile(packed, 7).dense(), expected)
    assert torch.equal(expected, pattern.dense(packed.unpack()))
    # item 1: text has 4 real tokens, so the image starts at 4 in the packed layout
    item = expected[1]
    assert item[4:16, 4:16].sum() == P.neighborhood(3).dense(
        Tokens(torch.zeros(1, 12, 1), meta={"grid": (3, 4)})).sum()


class LargeAllocations(TorchDispatchMode):
    """Records every op whose output owns a storage of at least ``limit`` elements."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= (
                    self.limit * t.element_size()):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def long_fused(length: int = 4096) -> Tokens:
    """text 512 | image 48 x 48 | audio (the rest), with padding at the end of item 1."""
    text, image = 512, 48 * 48
    audio = length - text - image
    mask = torch.ones(2, audio, dtype=torch.bool)
    mask[1, audio // 2:] = False
    parts = {"text": Tokens(torch.zeros(2, text, 1)),
             "image": Tokens(torch.zeros(2, image, 1), meta={"grid": (48, 48)}),
             "audio": Tokens(torch.zeros(2, audio, 1), mask)}
    fused = Tokens.cat(parts)
    fused.meta["documents"] = (torch.arange(length) // 512).expand(2, length).clone()
    return fused


def test_compiling_never_allocates_an_l_by_l_tensor():
    tokens = long_fused()
    length = tokens.length
    cases = [
        P.per_modality(within={"text": P.causal(), "image": P.neighborhood(7),
                               "audio": P.window(32)},
                       across=P.modality(query="text") | P.modality(key="text")),
        ~P.chunked(256, left=1) & P.window(600) & P.same("documents"),
    ]
    for pattern in cases:
        with LargeAllocations(length * length) as watcher:
            mask = pattern.compile(tokens)
        assert watcher.seen == [], watcher.seen
        assert 0 < mask.density < 0.5
    with LargeAllocations(64 * 64) as watcher:  # the watcher does see a dense mask
        P.causal().dense(Tokens(torch.zeros(1, 64, 1)))
    assert watcher.seen
