"""Compiled FlexAttention (CPU, forward) runs every pattern exactly: with
``create_block_mask(pattern.mask_mod(tokens))`` (also when the mask build is compiled,
``_compile=True``) and with ``pattern.compile(tokens, block_size=s).block_mask()``, it equals
SDPA with ``pattern.dense(tokens)`` on the rows that attend something, on padded Tokens.

CPU flex compiles take seconds each (one per mask_mod; about 15 s each with a cold inductor
cache on 2 cores, 19 minutes for the sweep): the whole sweep is marked ``flex_sweep``, which
``make test`` leaves out and ``make test-flex`` runs. The per-modality pattern (every primitive
but chunked and same, and ``&``, ``|``, ``~``) runs always, with a compiled mask build and
with ``block_mask()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmattn import patterns as P
from mmattn._features import features
from tests._features import needs, reason, recompile_limits
from tests.mmattn._pattern_cases import fused_tokens, patterns, per_modality_pattern

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

#: No mmattn attention runs here: the MMATTN_FUSED_ATTN=0 pass would repeat these unchanged.
#: (torch 2.14 deprecates ``_compile=True``, the issue's case: it still traces the mask_mod.)
pytestmark = [pytest.mark.pins_path,
              pytest.mark.filterwarnings("ignore:_compile flag:DeprecationWarning")]

FUSED = fused_tokens()  # L = 34, padding inside every part of item 1
HEADS, WIDTH = 2, 16
#: One compiled flex for every case (static shapes: CPU flex's code for dynamic ones fails
#: to build when the block size changes); each mask_mod is one more graph.
FLEX = torch.compile(flex_module.flex_attention, dynamic=False)

PER_MODALITY = per_modality_pattern()
CASES = {
    **patterns(),
    "modality-query": P.modality(query="text"),
    "neighborhood-modality": P.neighborhood(3, modality="image"),
    "per-modality-within": P.per_modality(within={"text": P.causal(),
                                                  "image": P.neighborhood(3)}),
    "per-modality": PER_MODALITY,
    "and": P.same("documents") & P.causal(),
    "or": P.edges() | P.chunked(4),
    "not": ~P.window(3),
}
#: The cases that run without ``slow`` (about 40 s each on a busy 2-core CPU).
ALWAYS = {("per-modality", True), ("per-modality", 16)}


@pytest.fixture(autouse=True)
def _room_for_every_graph():
    """One graph per mask_mod: more than dynamo's default limit of recompiles."""
    with torch._dynamo.config.patch(**recompile_limits(256, 4096)):
        yield


def qkv() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(2, HEADS, FUSED.length, WIDTH, generator=gen) for _ in range(3))


def assert_equals_sdpa(pattern, block_mask) -> None:
    q, k, v = qkv()
    dense = pattern.dense(FUSED)
    with torch.no_grad():
        out = FLEX(q, k, v, block_mask=block_mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    live = dense.any(-1)[:, None, :, None].expand_as(ref)  # rows with a key
    assert live.any()
    torch.testing.assert_close(out[live], ref[live], rtol=0,
                               atol=1e-5 * float(ref[live].abs().max()))


def cases(variants: list, ids: list[str]) -> list:
    return [pytest.param(name, variant, id=f"{name}-{tag}",
                         marks=[] if (name, variant) in ALWAYS
                         else [pytest.mark.slow, pytest.mark.flex_sweep])
            for name in CASES for variant, tag in zip(variants, ids)]


@pytest.mark.parametrize(("name", "compiled"),
                         cases([False, True], ["eager-build", "compiled-build"]))
def test_flex_with_mask_mod_equals_sdpa(name, compiled):
    if compiled and not features().block_mask_seq_lengths:  # torch 2.5's compiled build
        pytest.skip(reason("block_mask_seq_lengths"))  # reads the mask_mod past the length
    pattern = CASES[name]
    block_mask = flex_module.create_block_mask(
        pattern.mask_mod(FUSED), FUSED.batch_size, None, FUSED.length, FUSED.length,
        device="cpu", BLOCK_SIZE=16, _compile=compiled)
    assert_equals_sdpa(pattern, block_mask)


@needs("block_mask_seq_lengths")  # torch 2.5 pads the blocks and reads past the length
@pytest.mark.parametrize(("name", "block"), cases([16, 64], ["16", "64"]))
def test_flex_with_block_mask_equals_sdpa(name, block):
    pattern = CASES[name]
    assert_equals_sdpa(pattern, pattern.compile(FUSED, block_size=block).block_mask())


@pytest.mark.slow
@pytest.mark.flex_sweep
def test_compiled_mask_build_equals_the_eager_one_and_the_tiles():
    """``create_block_mask(..., _compile=True)`` traces ``mask_mod`` on its first use: its
    tables exist before, so the build gives the eager one's blocks, whose non-empty blocks
    per query tile are the SparseMask's (flex finds full blocks exactly, mmattn's bounds
    may leave a full tile mixed: only the sum is compared)."""
    mask_mod = PER_MODALITY.mask_mod(FUSED)
    batch, length = FUSED.batch_size, FUSED.length
    eager, compiled = (flex_module.create_block_mask(
        mask_mod, batch, None, length, length, device="cpu", BLOCK_SIZE=16, _compile=c)
        for c in (False, True))
    assert torch.equal(eager.to_dense(), compiled.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(eager, name), getattr(compiled, name)), name
    sparse = PER_MODALITY.compile(FUSED, block_size=16)
    ours = torch.zeros(batch, sparse.tiles_per_axis, dtype=torch.long)
    for b, qi, _ in torch.cat([sparse.full_tiles, sparse.mixed_tiles]).tolist():
        ours[b, qi] += 1
    assert torch.equal((eager.kv_num_blocks + eager.full_kv_num_blocks)[:, 0].long(), ours)
