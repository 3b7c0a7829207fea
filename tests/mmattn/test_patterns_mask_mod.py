"""Pattern.mask_mod is pure indexing: traced as FlexAttention traces it (dynamo lifts the
tensors the closure holds as inputs), its graph makes no tensor constant and breaks nowhere;
and pattern.compile reads the device a constant number of times, however many tiles."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmattn import Tokens
from mmattn import patterns as P
from tests._features import needs
from tests.mmattn._pattern_cases import (
    fused_tokens,
    interleaved_tokens,
    patterns,
    per_modality_pattern,
)
from tests.mmattn.test_patterns_compile import long_fused

#: No attention runs here: the MMATTN_FUSED_ATTN=0 pass would repeat these unchanged.
pytestmark = pytest.mark.pins_path

FUSED = fused_tokens()
PER_MODALITY = per_modality_pattern()
CASES = {
    **patterns(),
    "neighborhood-modality": P.neighborhood(3, modality="image"),
    "and": P.same("documents") & P.causal(),
    "or": P.edges() | P.chunked(4),
    "not": ~P.window(3),
    "per-modality": PER_MODALITY,
}


def aten_graph(fn, *args) -> str:
    """The aten graph FlexAttention's compile would see: dynamo (full graph: no break) then
    AOT autograd; tensors the closure holds become inputs, tensors made inside constants."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = []

    def capture(gm, example_inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(*args)
    return "\n".join(codes)


@pytest.mark.parametrize("name", list(CASES))
def test_mask_mod_graph_has_no_tensor_constant(name):
    mask_mod = CASES[name].mask_mod(FUSED)
    one = torch.ones(1, dtype=torch.int32)  # FlexAttention's int32 indices, one pair
    code = aten_graph(mask_mod, one, one * 0, one * 5, one * 3)
    assert "_tensor_constant" not in code and "lift_fresh" not in code, code
    # (the check does catch a rule that builds its table inside)
    table = [True, False]
    made = aten_graph(lambda b, h, q, k: torch.tensor(table)[q % 2], one, one, one, one)
    assert "lift_fresh" in made


@needs("vmap_index")
def test_mask_mod_equals_dense_on_every_pair():
    b, q, k = torch.meshgrid(*(torch.arange(n) for n in (2, FUSED.length, FUSED.length)),
                             indexing="ij")
    for name, pattern in CASES.items():
        flat = torch.vmap(pattern.mask_mod(FUSED))(
            b.flatten().int(), torch.zeros_like(b.flatten()), q.flatten().int(),
            k.flatten().int())
        assert torch.equal(flat.view(b.shape), pattern.dense(FUSED)), name


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host."""

    OPS = ("aten.nonzero", "aten.item", "aten._local_scalar_dense", "aten.is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.OPS):
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads(pattern, tokens, block) -> tuple[int, int]:
    with HostReads() as watcher:
        mask = pattern.compile(tokens, block_size=block)
    return watcher.count, mask.mixed_tiles.shape[0]


def plan_reads(mask) -> tuple[int, int, set]:
    """Host reads of the bucket plan and of every bucket's additive mask."""
    with HostReads() as watcher:
        plan = mask.plan(64)
        for bucket in plan.buckets:
            bucket.fused_mask(torch.float32)
    for bucket in plan.buckets:  # the flags read at once are each bucket's own
        assert bucket.all_live == bool(bucket.allowed.any(dim=-1).all())
    return watcher.count, len(plan.buckets), {b.all_live for b in plan.buckets}


def test_compile_reads_the_host_a_constant_number_of_times():
    pattern = P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(7), "audio": P.window(32)},
        across=P.modality(query="text") | P.modality(key="text"))
    counts = {}
    for length, block in ((4096, 64), (4096, 8), (8192, 8)):
        counts[(length, block)] = reads(pattern, long_fused(length), block)
    host, tiles = zip(*counts.values())
    assert tiles[0] < tiles[1] < tiles[2] and tiles[2] > 10_000, counts  # many chunks
    assert len(set(host)) == 1 and host[0] <= 12, counts
    # and the kernel's bucket plan, however many buckets
    plans = [plan_reads(pattern.compile(long_fused(length), block_size=block))
             for length, block in ((4096, 64), (8192, 16), (4010, 48))]
    assert plans[0][1] < plans[1][1] and plans[0][0] == plans[1][0] == plans[2][0] <= 6, plans
    assert plans[2][2] == {True, False}  # (padding ends inside a tile: dead rows there)
    # the interleaved rows (segments from meta, edges) too
    edges = PER_MODALITY & ~P.window(0)
    assert reads(edges, FUSED, 1)[0] <= 16
    assert reads(P.same("segments") & P.causal(), interleaved_tokens(), 1)[0] <= 8


def test_mask_mod_of_a_custom_primitive_calls_its_rule():
    class Even(P.Pattern):
        def rule(self, ctx, b, q, k):
            return (q + k) % 2 == 0

        def bound(self, ctx, tiles):
            return torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, 1, dtype=torch.bool)

    t = Tokens(torch.zeros(1, 5, 1))
    mask_mod = (Even() & P.causal()).mask_mod(t)
    assert bool(mask_mod(torch.tensor(0), None, torch.tensor(3), torch.tensor(1)))
    assert not bool(mask_mod(torch.tensor(0), None, torch.tensor(3), torch.tensor(2)))
    with pytest.raises(NotImplementedError, match="rule.*or prepare"):
        P.Pattern().rule(None, torch.tensor(0), torch.tensor(0), torch.tensor(0))
