"""torch.distributed on the CPU (gloo): DDP, FSDP2, DCP and SequenceParallel vs one process.

Each launch starts real worker processes (tests/_dist_worker.py) with a hard timeout, so a
hang fails instead of stalling CI; all scenarios of one world size share one launch. The
reference is always the same model (same seed, float64) run here in a single process on the
full batch or the full sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock
from mmattn.distributed import SequenceParallel
from tests import _dist_worker as worker
from tests._features import FSDP2_REASON, fsdp2

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")

TIMEOUT = 240.0  # seconds for a whole launch; a healthy one takes a fraction of it
FSDP2 = pytest.mark.skipif(not fsdp2(), reason=FSDP2_REASON)
TWO_RANKS = ["ddp", "ddp_unused", *(["fsdp"] if fsdp2() else []), "sp_errors",
             *(f"sp_{c}" for c in worker.SP_CASES)]
FOUR_RANKS = [f"sp_{c}" for c in worker.SP_CASES]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist2")
    return worker.launch(2, TWO_RANKS, out, TIMEOUT), out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist4")
    return worker.launch(4, FOUR_RANKS, out, TIMEOUT), out


def _result(results: list[dict], name: str) -> list:
    per_rank = [r[name] for r in results]
    for rank, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"rank {rank} failed in {name}:\n{res['error']}")
    return per_rank


def _reference_grads(unused: bool = False) -> list[dict[str, torch.Tensor]]:
    model = worker.build_classifier(unused)
    ids, target = worker.classifier_batch()
    return worker.train_steps(model, ids, target)


def _assert_grads(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=atol, msg=name)


# --- Tokens through torch.distributed, export, checkpoint (single process) ---------------


def test_tokens_pytree_roundtrip_keeps_meta_and_finds_meta_tensors():
    import torch.utils._pytree as pytree

    inner = Tokens(torch.randn(1, 2, 4))
    batch = torch.arange(3)
    tokens = Tokens(torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool),
                    {"grid": (1, 3), "batch": batch, "context": inner, "name": "img"})
    leaves, spec = pytree.tree_flatten(tokens)
    assert [t.shape for t in leaves] == [(2, 3, 4), (2, 3), (3,), (1, 2, 4)]
    back = pytree.tree_unflatten([t * 1 for t in leaves], spec)
    assert isinstance(back, Tokens) and isinstance(back.meta["context"], Tokens)
    assert back.meta["grid"] == (1, 3) and back.meta["name"] == "img"
    torch.testing.assert_close(back.meta["batch"], batch)
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(tokens)[0]]
    assert paths == [".x", ".mask", ".meta['batch']", ".meta['context'].x"]
    spec_back = pytree.treespec_loads(pytree.treespec_dumps(spec))
    assert spec_back == spec

    packed = Tokens.from_packed(torch.randn(5, 4), torch.tensor([0, 2, 5]), {"grid": (1, 5)})
    leaves, spec = pytree.tree_flatten(packed)
    assert len(leaves) == 2 and leaves[0].is_nested and leaves[1] is None  # x, mask
    back = pytree.tree_unflatten(leaves, spec)
    assert back.is_packed and back.mask is None and back.meta == {"grid": (1, 5)}


def test_export_and_checkpoint_see_through_tokens(tmp_path):
    block = TransformerBlock(8, 2).eval()

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, tokens: Tokens) -> Tokens:
            return self.block(tokens)

    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    tokens = Tokens(torch.randn(2, 5, 8), mask, {"grid": (1, 5)})
    program = torch.export.export(Wrap(), (tokens,))
    path = tmp_path / "block.pt2"
    torch.export.save(program, path)
    with torch.serialization.safe_globals([Tokens]):
        loaded = torch.export.load(path)
    for run in (program.module(), loaded.module()):
        out = run(tokens)
        assert isinstance(out, Tokens) and out.meta == {"grid": (1, 5)}
        torch.testing.assert_close(out.x, block(tokens).x)

    block.train()
    x = tokens.x.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(block, Tokens(x, mask), use_reentrant=False)
    (grad,) = torch.autograd.grad(out.x.sum(), x)
    x2 = tokens.x.clone().requires_grad_()
    (want,) = torch.autograd.grad(block(Tokens(x2, mask)).x.sum(), x2)
    torch.testing.assert_close(grad, want)


# --- data parallel ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ddp", "ddp_unused"])
def test_ddp_gradients_equal_full_batch(two, name):
    results, _ = two
    want = _reference_grads(unused=name == "ddp_unused")
    for rank_grads in _result(results, name):
        for got, ref in zip(rank_grads, want, strict=True):  # two SGD steps
            _assert_grads(got, ref)


@FSDP2
def test_fsdp2_gradients_equal_full_batch(two):
    results, _ = two
    want = _reference_grads()
    for res in _result(results, "fsdp"):
        for got, ref in zip(res["grads"], want, strict=True):
            _assert_grads(got, ref)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@FSDP2
def test_dcp_saved_by_two_ranks_loads_into_one(two):
    import torch.distributed.checkpoint as dcp

    results, out = two
    trained = _result(results, "fsdp")[0]["params"]
    model = worker.build_classifier()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    model.load_state_dict(state)
    fresh = worker.build_classifier()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), trained[name], atol=0, rtol=0, msg=name)
    assert not torch.equal(model.head.weight, fresh.head.weight)  # trained, not initial


# --- sequence parallel -------------------------------------------------------------------


def _sp_reference(case: str):
    attn, x, mask, grad = worker.build_sp(case)
    x = x.clone().requires_grad_()
    out, _ = attn(x, key_padding_mask=mask, is_causal=worker.sp_causal(case))
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters()}


def _check_sp(results: list[dict], case: str, ranks: int) -> None:
    out, grad_x, grad_params = _sp_reference(case)
    n = worker.SP_LENGTH // ranks
    for rank, res in enumerate(_result(results, f"sp_{case}")):
        rows = slice(rank * n, (rank + 1) * n)
        torch.testing.assert_close(res["out"], out[:, rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["grad_x"], grad_x[:, rows], atol=1e-5, rtol=1e-5)
        for name, want in grad_params.items():
            torch.testing.assert_close(res["grad_params"][name], want, atol=1e-5, rtol=1e-5,
                                       msg=name)


@pytest.mark.parametrize("case", list(worker.SP_CASES))
def test_sequence_parallel_two_ranks_equals_one_process(two, case):
    _check_sp(two[0], case, 2)


@pytest.mark.parametrize("case", list(worker.SP_CASES))
def test_sequence_parallel_four_ranks_equals_one_process(four, case):
    _check_sp(four[0], case, 4)


def test_sequence_parallel_bad_input_raises_on_every_rank(two):
    for rank, errors in enumerate(_result(two[0], "sp_errors")):
        assert "window_size=5" in errors["short"] and "shard length 4" in errors["short"]
        assert "same (batch, shard length) on every rank" in errors["widths"]
        assert "rank 0: (1, 6)" in errors["widths"] and "rank 1: (1, 8)" in errors["widths"]
        if rank == 1:
            assert "query must be a 3-D shard (B, n, 8)" in errors["one_rank_bad_dim"]
        else:
            assert "rank(s) [1] got bad input" in errors["one_rank_bad_dim"]
        # bad input only one rank can see: that rank's error there, named on the other
        prefix = "SequenceParallel: rank(s) [1] got bad input: rank 1: "
        for case, message in (
            ("one_rank_not_tensor", "query must be a torch.Tensor, got list"),
            ("one_rank_dtype", "query must have the module's dtype torch.float64 (on every "
                               "rank), got torch.float32"),
            ("one_rank_meta_mask", "key_padding_mask must be on the query's device cpu, got "
                                   "meta"),
        ):
            want = message if rank == 1 else f"{prefix}{message}"
            assert errors[case] == want, (case, errors[case])
        assert errors["all_reduce_grads_list"] == (
            "all_reduce_grads takes the module whose parameter gradients to sum (an "
            "nn.Module), got list"
        )
        assert "num_global_tokens=5" in errors["global"] and "rank 0's shard" in errors["global"]


def test_sequence_parallel_without_process_group_names_init():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    sp = SequenceParallel(LocalAttention(8, 2, window_size=2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        sp(torch.randn(1, 4, 8))


def test_sequence_parallel_wraps_local_or_full_attention_only():
    with pytest.raises(TypeError, match="MultiHeadAttention .all-to-all over heads., got Linear"):
        SequenceParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        SequenceParallel(MultiHeadAttention(8, 2, add_bias_kv=True))
