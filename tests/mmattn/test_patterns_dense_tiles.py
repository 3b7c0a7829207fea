"""A dense bool mask read into a SparseMask (mmattn.patterns._dense_tiles) equals the mask.

The reference for the tile classes is a plain loop over every tile with ``any`` / ``all``.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Tokens
from mmattn import patterns as P
from mmattn.patterns._dense_tiles import classify_tiles, sparse_from_dense


def _loop_classes(mask: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length = mask.shape[0], mask.shape[-1]
    n = -(-length // s)
    nonempty = torch.zeros(batch, n, n, dtype=torch.bool)
    full = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                tile = mask[b, i * s:(i + 1) * s, j * s:(j + 1) * s]
                nonempty[b, i, j] = bool(tile.any())
                whole = tile.shape == (s, s)
                full[b, i, j] = whole and bool(tile.all())
    return nonempty, full


def _masks(length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(length)
    random = torch.rand(4, length, length, generator=gen) < 0.3
    random[1] = True  # every tile full (but the ragged border ones)
    random[2] = False  # every tile empty
    random[3] = torch.ones(length, length, dtype=torch.bool).tril()
    return random


@pytest.mark.parametrize(("length", "block"), [(100, 32), (128, 64), (70, 8), (33, 5), (1, 4)])
def test_classes_equal_a_loop_and_the_mask_comes_back(length, block):
    mask = _masks(length)
    nonempty, full = _loop_classes(mask, block)
    _, got_nonempty, got_full = classify_tiles(mask, block)
    assert torch.equal(got_nonempty, nonempty)
    assert torch.equal(got_full, full)
    sparse = sparse_from_dense(mask, block)
    assert sparse.shape == (4, length, length) and sparse.block_size == block
    assert sparse.nonempty_blocks == int(nonempty.sum())
    assert torch.equal(sparse.dense(), mask)


def test_one_item_serves_the_batch_and_dense_masks_are_declined():
    mask = _masks(96)[3:]  # causal: 3 of 4 tiles of 48 non-empty
    shared = sparse_from_dense(mask, 48, batch=3)
    assert shared.shape == (3, 96, 96) and shared.nonempty_blocks == 9
    assert torch.equal(shared.dense(), mask.expand(3, 96, 96))
    assert sparse_from_dense(mask, 48, max_density=0.5) is None
    assert sparse_from_dense(mask, 48, max_density=0.75) is not None


def test_a_compiled_pattern_and_its_dense_mask_give_the_same_tiles():
    ids = torch.tensor([[0] * 50 + [1] * 70 + [2] * 30])
    tokens = Tokens(torch.zeros(1, 150, 4), meta={"documents": ids})
    pattern = P.same("documents") & P.causal()
    compiled = pattern.compile(tokens, block_size=32)
    read = sparse_from_dense(pattern.dense(tokens), 32)
    assert read.nonempty_blocks == compiled.nonempty_blocks
    assert torch.equal(read.dense(), compiled.dense())
