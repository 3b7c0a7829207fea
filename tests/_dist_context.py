"""Context-parallel cases for tests/mmattn/distributed/test_context_parallel.py.

The builders are shared by the gloo workers (tests/_dist_worker.py runs :data:`SCENARIOS`)
and by the single-process reference in the test, so a model, its Tokens and its mask are
identical wherever they are built (same seeds, float64). Every rank holds the full-sequence
Tokens and compiles the same mask; it attends its own rows (``plan.scatter``) and returns the
gathered output, input gradient and its parameter gradients summed over ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mmattn import Encoder, MultiHeadAttention, Tokens, TransformerBlock
from mmattn import patterns as P
from mmattn.rotary import MultiAxisRotary, mrope_positions

DTYPE = torch.float64
D = 8
BLOCK = 4  # small tiles: many of them at these lengths, and a last tile that is cut short
DOCUMENTS = P.same("documents") & P.causal()
PER_MODALITY = P.per_modality(
    within={"text": P.causal(), "image": P.neighborhood(3), "audio": P.window(2)},
    across=P.modality(query="text") | P.modality(key="text"),
)


def documents_tokens() -> Tokens:
    """Two rows of packed documents (L = 37, not a multiple of the tile): -1 gaps inside,
    row 1 padded at its end."""
    gen = torch.Generator().manual_seed(5)
    docs = torch.tensor([[0] * 9 + [1] * 12 + [-1] * 3 + [2] * 6 + [3] * 7,
                         [4] * 3 + [5] * 17 + [-1] * 2 + [6] * 8 + [7] * 7])
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 30:] = False
    return Tokens(torch.randn(2, 37, D, generator=gen, dtype=DTYPE), mask, {"documents": docs})


def mrope_tokens() -> Tokens:
    """:func:`fused_tokens` with their multi-axis positions in ``meta["positions"]`` (text
    advancing every axis, the image's cells at (s, s + row, s + column))."""
    tokens = fused_tokens()
    tokens.meta["positions"] = mrope_positions(tokens)
    return tokens


def fused_tokens() -> Tokens:
    """text (6) | image 4 x 5 | audio (11), batch 2, padding inside the text and audio."""
    gen = torch.Generator().manual_seed(6)

    def part(length: int, real: list[int], meta: dict | None = None) -> Tokens:
        mask = torch.arange(length)[None] < torch.tensor(real)[:, None]
        return Tokens(torch.randn(2, length, D, generator=gen, dtype=DTYPE), mask, meta or {})

    return Tokens.cat({"text": part(6, [6, 4]), "image": part(20, [20, 20], {"grid": (4, 5)}),
                       "audio": part(11, [11, 7])})


def _attention(**kwargs) -> MultiHeadAttention:
    torch.manual_seed(7)
    attn = MultiHeadAttention(D, kwargs.pop("heads", 2), **kwargs).to(DTYPE).eval()
    if attn.sinks is not None:  # zeros at construction: make them matter
        with torch.no_grad():
            attn.sinks.normal_()
    return attn


class Case:
    """One context-parallel case: ``build()`` gives the module, the full Tokens and what the
    call takes (``mask``: the SparseMask of an attention call, or None for a block / Encoder
    that compiles its pattern; ``kwargs``: the call's other arguments on the full sequence)."""

    def __init__(self, make_module: Callable[[], nn.Module], make_tokens: Callable[[], Tokens],
                 pattern=None, padding: bool = False, causal: bool = False) -> None:
        self.make_module, self.make_tokens = make_module, make_tokens
        self.pattern, self.padding, self.causal = pattern, padding, causal

    def build(self):
        module, tokens = self.make_module(), self.make_tokens()
        mask = None if self.pattern is None else self.pattern.compile(tokens, block_size=BLOCK)
        gen = torch.Generator().manual_seed(8)
        grad = torch.randn(*tokens.x.shape, generator=gen, dtype=DTYPE)
        return module, tokens, mask, grad

    def attention_kwargs(self, tokens: Tokens) -> dict:
        """The call's keywords on the full sequence (``plan.scatter`` makes them local)."""
        kwargs = {"is_causal": True} if self.causal else {}
        if self.padding:
            kwargs["key_padding_mask"] = ~tokens.full_mask()
        if "positions" in tokens.meta:
            kwargs["positions"] = tokens.meta["positions"]
        return kwargs


def _encoder() -> Encoder:
    torch.manual_seed(9)
    encoder = Encoder(D, 2, 2, pattern=P.same("documents") | P.window(1), causal=True)
    return encoder.to(DTYPE).eval()


def _mrope_encoder() -> Encoder:
    torch.manual_seed(12)
    encoder = Encoder(D, 2, 1, pattern=PER_MODALITY, attention_kwargs={
        "position": MultiAxisRotary(D, (2, 1, 1))})
    return encoder.to(DTYPE).eval()


def _block() -> TransformerBlock:
    torch.manual_seed(10)
    return TransformerBlock(D, 2, causal=True).to(DTYPE).eval()


#: name -> Case. Attention calls get ``attn_mask=mask`` (the SparseMask); blocks and the
#: Encoder get Tokens (with ``pattern=``: the plan of the pattern compiled on them).
CASES = {
    # packed documents, causal inside, -1 gaps, padding: the mask holds all of it
    "documents": Case(_attention, documents_tokens, DOCUMENTS),
    # the same documents without the causal rule in the mask: is_causal at the rows' true
    # positions, and the key padding mask travelling with the keys
    "documents_flags": Case(_attention, documents_tokens, P.same("documents"), padding=True,
                            causal=True),
    # text causal, image 3 x 3 neighbourhood, audio window, text <-> everything across
    "per_modality": Case(_attention, fused_tokens, PER_MODALITY),
    # sinks and ALiBi (at absolute positions) with rotary positions
    "sinks_alibi": Case(lambda: _attention(sinks=True, alibi=True, position="rotary"),
                        documents_tokens, DOCUMENTS),
    # grouped-query attention (4 query heads on 2 key heads) with softcap
    "gqa_softcap": Case(lambda: _attention(heads=4, num_kv_heads=2, softcap=1.5),
                        fused_tokens, PER_MODALITY),
    # an Encoder of 2 blocks with pattern= (causal: the rule joins the compiled pattern)
    "encoder": Case(_encoder, documents_tokens),
    # a causal block given a SparseMask: the Tokens' padding and causal rule are added
    "block_mask": Case(_block, fused_tokens, PER_MODALITY),
    # multi-axis rotary positions (M-RoPE) given per token, scattered like the rows
    "mrope": Case(lambda: _attention(heads=1, position=MultiAxisRotary(D, (2, 1, 1))),
                  mrope_tokens, PER_MODALITY),
    # an Encoder whose blocks hand meta["positions"] to their MultiAxisRotary
    "mrope_encoder": Case(_mrope_encoder, mrope_tokens),
    # one tile in all: the other ranks hold no rows (and still join every exchange)
    "one_tile": Case(lambda: _attention(sinks=True), lambda: Tokens(
        torch.randn(1, 3, D, generator=torch.Generator().manual_seed(11), dtype=DTYPE)),
        P.causal()),
}


def reference(name: str) -> dict:
    """The case in one process: output, input gradient, parameter gradients."""
    case = CASES[name]
    module, tokens, mask, grad = case.build()
    x = tokens.x.clone().requires_grad_()
    if isinstance(module, MultiHeadAttention):
        out, _ = module(x, attn_mask=mask, **case.attention_kwargs(tokens))
    else:
        out = module(tokens.replace(x), mask).x
    (out * grad).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad,
            "grad_params": {n: p.grad.clone() for n, p in module.named_parameters()}}


def run_context(name: str, outdir: Path) -> dict:
    """The case on this rank: its rows through ContextParallel, gathered back."""
    from mmattn.distributed import ContextParallel, all_reduce_grads

    case = CASES[name]
    module, tokens, mask, grad = case.build()
    cp = ContextParallel(module)
    plan = cp.plan(mask) if mask is not None else cp.plan(tokens, block_size=BLOCK)
    local = plan.scatter(tokens)
    x = local.x.clone().requires_grad_()
    if isinstance(module, MultiHeadAttention):
        kwargs = case.attention_kwargs(tokens)
        if "key_padding_mask" in kwargs:
            kwargs["key_padding_mask"] = ~local.mask
        if "positions" in kwargs:
            kwargs["positions"] = local.meta["positions"]
        out, _ = cp(x, attn_mask=plan, **kwargs)
    else:
        out = cp(local.replace(x), attn_mask=plan).x
    (out * plan.scatter(grad)).sum().backward()
    all_reduce_grads(module)
    return {"out": plan.gather(out.detach()), "grad_x": plan.gather(x.grad),
            "grad_params": {n: p.grad.clone() for n, p in module.named_parameters()},
            "work": plan.work, "recv_rows": plan.recv_rows, "rows": plan.rows}


def context_errors(outdir: Path) -> dict:
    """Bad input on one rank or on all: the same ValueError on every rank, never a hang."""
    from mmattn.distributed import ContextParallel

    rank = dist.get_rank()
    attn, tokens, mask, _ = CASES["documents"].build()
    cp = ContextParallel(attn)
    plan = cp.plan(mask)
    x = plan.scatter(tokens.x)
    other = P.same("documents").compile(tokens, block_size=BLOCK)  # another mask
    cases = {
        "need_weights": lambda: cp(x, attn_mask=plan, need_weights=True),
        "one_rank_not_mask": lambda: cp(x, attn_mask=tokens.mask if rank else plan),
        "one_rank_rows": lambda: cp(x[:, 1:] if rank else x, attn_mask=plan),
        "one_rank_dtype": lambda: cp(x.float() if rank else x, attn_mask=plan),
        "one_rank_key": lambda: cp(x, x.clone() if rank else None, attn_mask=plan),
        "masks_differ": lambda: cp(x if rank == 0 else other_rows(other), attn_mask=mask
                                   if rank == 0 else other),
        "causal_differs": lambda: cp(x, attn_mask=plan, is_causal=bool(rank)),
        "positions_differ": lambda: cp(x, attn_mask=plan,
                                       positions=plan.positions[None] if rank else None),
        "plan_of_another_rank": lambda: cp(x, attn_mask=_foreign(plan)),
    }

    def other_rows(m):
        return cp.plan(m).scatter(tokens.x)

    errors = {}
    for case, call in cases.items():
        try:
            call()
            errors[case] = None
        except ValueError as err:
            errors[case] = str(err)
    return errors


def _foreign(plan):
    """The plan of the next rank (what a rank gets when it builds the wrong one)."""
    from mmattn.distributed.context_plan import build_plan

    return build_plan(plan.mask, plan.ranks, (plan.rank + 1) % plan.ranks)


SCENARIOS: dict[str, Callable[[Path], object]] = {
    "cp_errors": context_errors,
    **{f"cp_{name}": (lambda out, name=name: run_context(name, out)) for name in CASES},
}
