"""SparseMask.block_mask(): FlexAttention's BlockMask of the classified tiles — its block
counts are the SparseMask's tiles, its mask_mod is the exact mask, nothing of L·L elements is
allocated nor read back to the host, and tile widths FlexAttention cannot run exactly are
refused."""

from __future__ import annotations

import pytest
import torch

from mmattn import Tokens
from mmattn import patterns as P
from tests._features import needs
from tests.mmattn._pattern_cases import fused_tokens, per_modality_pattern
from tests.mmattn.test_patterns_compile import LargeAllocations, long_fused
from tests.mmattn.test_patterns_mask_mod import HostReads

pytest.importorskip("torch.nn.attention.flex_attention")

#: No attention runs here: the MMATTN_FUSED_ATTN=0 pass would repeat these unchanged.
pytestmark = pytest.mark.pins_path

FUSED = fused_tokens()
PER_MODALITY = per_modality_pattern()


def tiles_per_row(tiles: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """(B, n) how many of ``tiles`` (t, 3) each query tile has, counted in Python."""
    counts = torch.zeros(batch, n, dtype=torch.long)
    for b, qi, _ in tiles.tolist():
        counts[b, qi] += 1
    return counts


@needs("block_mask_seq_lengths")
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("pattern", [PER_MODALITY, P.same("documents") & P.causal(),
                                     ~P.full(), P.full()], ids=["per-modality", "docs",
                                                                "nothing", "full"])
def test_block_counts_are_the_sparse_masks_tiles(pattern, block):
    mask = pattern.compile(FUSED, block_size=block)
    bm = mask.block_mask()
    n = mask.tiles_per_axis
    assert bm.BLOCK_SIZE == (block, block)
    assert bm.shape[-2:] == (FUSED.length, FUSED.length)
    partial = tiles_per_row(mask.mixed_tiles, FUSED.batch_size, n)
    full = tiles_per_row(mask.full_tiles, FUSED.batch_size, n)
    assert torch.equal(bm.kv_num_blocks[:, 0].long(), partial)
    assert torch.equal(bm.full_kv_num_blocks[:, 0].long(), full)
    # the listed key tiles are the SparseMask's, in increasing order
    for kind, tiles, num, idx in (("mixed", mask.mixed_tiles, bm.kv_num_blocks, bm.kv_indices),
                                  ("full", mask.full_tiles, bm.full_kv_num_blocks,
                                   bm.full_kv_indices)):
        listed = {(b, qi, int(idx[b, 0, qi, c])) for b in range(FUSED.batch_size)
                  for qi in range(n) for c in range(int(num[b, 0, qi]))}
        assert listed == set(map(tuple, tiles.tolist())), kind
    assert mask.block_mask() is bm  # cached


@needs("vmap_index")
def test_mask_mod_is_the_exact_mask():
    mask = PER_MODALITY.compile(FUSED, block_size=16)
    mask_mod = mask.block_mask().mask_mod
    batch, length = FUSED.batch_size, FUSED.length
    b, q, k = torch.meshgrid(*(torch.arange(n) for n in (batch, length, length)), indexing="ij")
    flat = torch.vmap(mask_mod)(b.flatten(), torch.zeros_like(b.flatten()), q.flatten(),
                                k.flatten())
    assert torch.equal(flat.view(b.shape), PER_MODALITY.dense(FUSED))


@pytest.mark.parametrize("block", [1, 8, 13, 24])
def test_tile_widths_flex_cannot_run_exactly_are_refused(block):
    mask = P.causal().compile(Tokens(torch.zeros(1, 40, 1)), block_size=block)
    with pytest.raises(ValueError, match=rf"block_size a multiple of 16.*got {block}"):
        mask.block_mask()


def test_block_mask_never_allocates_an_l_by_l_tensor():
    length = 16384
    tokens = long_fused(length)
    pattern = P.per_modality(within={"text": P.causal(), "image": P.neighborhood(7),
                                     "audio": P.window(32)},
                             across=P.modality(query="text") | P.modality(key="text"))
    mask = pattern.compile(tokens, block_size=64)
    with LargeAllocations(length * length) as watcher, HostReads() as reads:
        bm = mask.block_mask()
    assert watcher.seen == [], watcher.seen
    assert reads.count == 0  # built on the device: nothing read back
    assert int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) == mask.nonempty_blocks
