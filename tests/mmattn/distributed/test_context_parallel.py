"""ContextParallel (pattern calls split by query tiles) on gloo processes vs one process, and
the plan it runs on (dispatch, balance, what travels) checked without any process group.

The launches run real worker processes (tests/_dist_worker.py, cases in tests/_dist_context.py)
with a hard timeout, so a hang fails. The reference is the same module (same seed, float64)
run here on the whole sequence; the workers gather their rows back (``plan.gather``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock
from mmattn import patterns as P
from mmattn.distributed import ContextParallel, context_plan
from mmattn.distributed._dispatch import lpt
from mmattn.distributed.context_plan import build_plan
from tests import _dist_context as cases
from tests import _dist_worker as worker

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")

TIMEOUT = 240.0
TWO_RANKS = ["cp_errors", *(f"cp_{c}" for c in cases.CASES)]
FOUR_RANKS = [f"cp_{c}" for c in cases.CASES]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return worker.launch(2, TWO_RANKS, tmp_path_factory.mktemp("cp2"), TIMEOUT)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return worker.launch(4, FOUR_RANKS, tmp_path_factory.mktemp("cp4"), TIMEOUT)


def _result(results: list[dict], name: str) -> list:
    per_rank = [r.get(name, {"error": "no result (an earlier scenario failed)"})
                for r in results]
    failed = [f"rank {rank} failed in {name}:\n{res['error']}"
              for rank, res in enumerate(per_rank) if isinstance(res, dict) and "error" in res]
    if failed:  # every rank's: the first to fail is often not rank 0
        pytest.fail("\n".join(failed))
    return per_rank


def _check(results: list[dict], case: str, ranks: int) -> None:
    want = cases.reference(case)
    module, tokens, mask, _ = cases.CASES[case].build()
    every_row = []
    for res in _result(results, f"cp_{case}"):
        torch.testing.assert_close(res["out"], want["out"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["grad_x"], want["grad_x"], atol=1e-6, rtol=1e-6)
        for name, grad in want["grad_params"].items():
            torch.testing.assert_close(res["grad_params"][name], grad, atol=1e-6, rtol=1e-6,
                                       msg=name)
        every_row.append(res["rows"])
    rows = torch.cat(every_row)  # the ranks' rows: every row of the padded sequence, once
    assert torch.equal(rows.sort().values, torch.arange(rows.shape[0]))
    assert len(every_row) == ranks


@pytest.mark.parametrize("case", list(cases.CASES))
def test_context_parallel_two_ranks_equals_one_process(two, case):
    _check(two, case, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(cases.CASES))
def test_context_parallel_four_ranks_equals_one_process(four, case):
    _check(four, case, 4)


def test_context_parallel_bad_input_raises_the_same_error_on_every_rank(two):
    prefix = "ContextParallel: rank(s) [1] got bad input: rank 1: "
    for rank, errors in enumerate(_result(two, "cp_errors")):
        assert errors["need_weights"] == ("ContextParallel does not gather attention "
                                          "weights: need_weights must be False")
        for case, message in (
            ("one_rank_not_mask", "ContextParallel needs attn_mask = the ContextPlan"),
            ("one_rank_rows", "query: this rank holds"),
            ("one_rank_dtype", "query must have the module's dtype torch.float64"),
            ("one_rank_key", "key must be None (or the query itself)"),
        ):
            got = errors[case]
            assert got is not None, case
            assert message in got, (case, got)
            assert got.startswith(prefix) == (rank == 0), (case, got)
        assert "the ranks hold different SparseMasks" in errors["masks_differ"]
        assert errors["causal_differs"] == ("ContextParallel: ranks disagree on is_causal: "
                                            "[False, True]")
        assert "positions= needs a position module" in errors["positions_differ"]
        assert errors["positions_differ"].startswith(prefix) == (rank == 0)
        assert f"this ContextPlan is rank {(rank + 1) % 2}'s of 2, but this is rank {rank}" in \
            errors["plan_of_another_rank"]


# --- the plan, without a process group ---------------------------------------------------


def _dense_tiles(mask) -> torch.Tensor:
    """(B, n, n) bool: the non-empty tiles, from the dense mask (independent of the plan)."""
    s, n = mask.block_size, mask.tiles_per_axis
    dense = torch.nn.functional.pad(mask.dense(), (0, n * s - mask.length) * 2)
    return dense.view(mask.batch, n, s, n, s).any(dim=(2, 4))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("case", ["documents", "per_modality"])
def test_plan_work_rows_and_exchange_against_the_dense_mask(case, ranks):
    _, tokens, mask, _ = cases.CASES[case].build()
    plans = [build_plan(mask, ranks, rank) for rank in range(ranks)]
    s, n, length = mask.block_size, mask.tiles_per_axis, mask.length
    dense = mask.dense()  # (B, L, L)
    owner = plans[0].owner.view(mask.batch, n).repeat_interleave(s, dim=1)[:, :length]
    work = _dense_tiles(mask).sum(2).flatten()
    for plan in plans:
        assert torch.equal(plan.owner, plans[0].owner)  # every rank plans the same
        mine = owner == plan.rank  # (B, L)
        # work: the non-empty tiles of its query tiles
        assert plan.work[plan.rank] == work[plan.owner == plan.rank].sum()
        # rows: whole tiles of its own, scatter and restore are inverse
        assert torch.equal(plan.real.sum(), mine.sum())
        # received: exactly the keys its queries attend that another rank holds
        needed = ((dense & mine[:, :, None]).any(dim=1) & ~mine).sum()
        assert plan.recv_rows[plan.rank] == needed
        assert sum(plan.recv_splits) == needed and sum(plan.send_splits) == \
            plan.send_rows[plan.rank]
    x = tokens.x
    parts = [plan.scatter(x) for plan in plans]
    assert torch.equal(plans[0].restore(parts), x)
    local = plans[1].scatter(tokens)
    assert torch.equal(local.mask[0], plans[1].scatter(tokens.full_mask())[0] & plans[1].real)


def test_packed_documents_receive_their_documents_not_the_sequence():
    """Communication: each rank receives the key rows its documents need, far less than the
    sequence (acceptance: at most the needed rows plus one tile per run)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 120, (60,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(60), lengths)[:2048]
    tokens = Tokens(torch.zeros(1, 2048, 1), meta={"documents": ids[None]})
    mask = cases.DOCUMENTS.compile(tokens, block_size=16)
    dense = mask.dense()[0]
    for ranks in (2, 4):
        plan = build_plan(mask, ranks, 0)
        owner = plan.owner.repeat_interleave(16)
        for rank in range(ranks):
            mine = owner == rank
            needed = (dense[mine].any(dim=0) & ~mine).nonzero().squeeze(1)
            runs = int((needed.diff() != 1).sum()) + int(needed.numel() > 0)
            assert plan.recv_rows[rank] <= needed.numel() + 16 * runs
            assert plan.recv_rows[rank] < 0.25 * 2048, plan.recv_rows


def _benchmark():
    path = ROOT / "benchmarks" / "context_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_context_parallel", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # compiling the per-modality mask at L = 32768 takes a few seconds
def test_balance_within_five_percent_on_the_benchmark_masks():
    """Acceptance: tile work max / mean <= 1.05 on 4 ranks, L = 32768, each benchmark mask;
    contiguous shards of a causal text give the last rank 7/4 of the mean."""
    bench = _benchmark()
    spreads, contiguous = {}, {}
    for name, (tokens, pattern) in bench.masks(bench.LENGTH).items():
        mask = pattern.compile(tokens, block_size=bench.BLOCK)
        spreads[name] = build_plan(mask, 4, 0).balance
        contiguous[name] = build_plan(mask, 4, 0, bench.contiguous(mask, 4)).balance
    assert all(s <= 1.05 for s in spreads.values()), spreads
    assert contiguous["causal"] > 1.7 and contiguous["per-modality"] > 2, contiguous


def test_lpt_gives_the_heaviest_parts_first_to_the_least_loaded_rank():
    # works 3, 7, 5, 4, 3 in order 7, 5, 4, 3 (the earlier), 3: 7 | 5, 4 | 7 + 3 | 9 + 3
    owner, loads = lpt([(0, 1, 3), (1, 2, 7), (2, 3, 5), (3, 4, 4), (4, 5, 3)], 2)
    assert owner == [0, 0, 1, 1, 1] and loads == [10, 12]
    owner, loads = lpt([(0, 2, 0), (2, 3, 4), (3, 4, 4)], 2)
    assert loads == [4, 4] and owner[0] == 0  # the empty part: the rank with fewer rows


@pytest.mark.slow  # torchrun and two processes: half a minute on a loaded machine
def test_the_torchrun_script_of_the_docs_runs_and_equals_one_process(tmp_path):
    text = (ROOT / "docs" / "distributed.md").read_text("utf-8")
    start = text.index('"""cp_encoder.py')
    script = tmp_path / "cp_encoder.py"
    script.write_text(text[start:text.index("```", start)], "utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks, the same as one process: True" in done.stdout, done.stdout
    assert "ContextPlan(ranks=2, rank=0" in done.stdout


# --- refusals ------------------------------------------------------------------------------


def test_context_parallel_wraps_pattern_attention_only():
    with pytest.raises(TypeError, match="got LocalAttention"):
        ContextParallel(LocalAttention(8, 2, window_size=2))
    with pytest.raises(TypeError, match="got LocalAttention"):
        ContextParallel(TransformerBlock(8, 2, attention="local", window_size=2))
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        ContextParallel(MultiHeadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="has none: give the SparseMask"):
        ContextParallel(MultiHeadAttention(8, 2)).plan(Tokens(torch.zeros(1, 4, 8)))
    with pytest.raises(TypeError, match="mask must be a mmattn.patterns.SparseMask"):
        context_plan(torch.ones(4, 4))


def test_context_parallel_without_process_group_names_init():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    mask = P.causal().compile(Tokens(torch.zeros(1, 8, 8)), block_size=4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallel(MultiHeadAttention(8, 2))(torch.zeros(1, 8, 8), attn_mask=mask)
