"""How much each modality attends to each other, and the top keys of every query, without an
(L, L) map.

Axis key: ``c`` attention calls, ``b`` batch, ``h`` heads, ``l`` query positions, ``m`` /
``n`` query / key groups (modalities or segments), ``k`` top keys.

Both functions run the model once and record its attention calls
(:mod:`mmattn.debug._mass_calls`): the mass is an attention call with the keys' one-hot
groups as values, on the layer's own kernel; the top keys come from each kernel's weight
tiles, k best keys a row. No (L, L) tensor is formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.debug._mass_calls import Session

__all__ = ["AttentionMass", "TopKeys", "attention_mass", "top_keys"]

BY = ("modality", "segment")


@dataclass
class AttentionMass:
    """What :func:`attention_mass` found.

    Attributes:
        table: (calls, heads, M, M): entry [c, h, m, n] is the mean, over the real query
            tokens of group m, of the total weight head h of call c gives to the keys of
            group n. NaN where call c has no real query token of group m (or fewer heads).
        modalities: the M group names, in span order (with ``by="segment"``: one name per
            segment, ``"image[0]"``, ``"image[1]"``, ...).
        modules: the qualified module name of each call ("" for the model itself).
        counts: (calls, M) real query tokens of each group in each call.
        skipped: ``(module, reason)`` for every attention call left out.
        output: what the model's forward returned.
    """

    table: Tensor
    modalities: list[str]
    modules: list[str]
    counts: Tensor
    skipped: list[tuple[str, str]] = field(default_factory=list)
    output: Any = None

    def __str__(self) -> str:
        lines = []
        width = max(6, *(len(name) for name in self.modalities)) if self.modalities else 6
        for c, module in enumerate(self.modules):
            mean = self.table[c].nanmean(dim=0) if self.table.shape[1] else self.table[c, 0]
            lines.append(f"[{c}] {module or '(model)'}: query \\ key (mean over heads)")
            lines.append(" " * width + "".join(f"{n:>{width + 2}}" for n in self.modalities))
            for m, name in enumerate(self.modalities):
                cells = "".join(f"{v:>{width + 2}.3f}" for v in mean[m].tolist())
                lines.append(f"{name:<{width}}{cells}")
        return "\n".join(lines) if lines else "no attention calls"


@dataclass
class TopKeys:
    """What :func:`top_keys` found.

    Attributes:
        indices: (calls, B, heads, L, k) int64: the position (in its item) of each of the k
            keys a query attends most, best first; -1 where the query is padding or has
            fewer than k keys of nonzero weight.
        weights: (calls, B, heads, L, k): their weights (0 where the index is -1).
        modules: the qualified module name of each call.
        skipped: ``(module, reason)`` for every attention call left out.
        output: what the model's forward returned.
    """

    indices: Tensor
    weights: Tensor
    modules: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    output: Any = None


def attention_mass(
    model: nn.Module,
    tokens: Any,
    *args: Any,
    by: str = "modality",
    block_size: int | None = None,
    **kwargs: Any,
) -> AttentionMass:
    """Run ``model(tokens, *args, **kwargs)`` once and measure, for every attention call,
    how much the queries of each modality attend to the keys of each modality.

    .. math::
        \\mathrm{table}[c, h, m, n] = \\frac{1}{|Q_m|} \\sum_{i \\in Q_m}
        \\sum_{j \\in K_n} a^{c,h}_{ij}

    with :math:`Q_m` the real query tokens of group m and :math:`a^{c,h}` the attention
    weights of head h in call c. A row sums to 1 over the groups unless some of its weight
    goes to keys of no group (``add_bias_kv`` / ``add_zero_attn`` keys, tokens outside every
    span) or the row has no allowed key (a dead row gives 0, as the kernels do).

    The groups come from the ``Tokens.meta`` of each call (the Tokens its block was given,
    so a ``MultiModalEncoder`` inside any model works): ``meta["spans"]`` (``Tokens.cat``,
    ``MultiModalEncoder``), or ``meta["modality_ids"]`` (B, L) indexing
    ``meta["modalities"]``, with ``meta["segments"]`` for interleaved sequences.
    ``by="modality"`` makes one group per modality; ``by="segment"`` one per segment,
    named by modality and rank inside the item (``"image[0]"``, ``"image[1]"``): the mass
    each image receives. Segments default to the runs of equal modality id.

    Every self-attention call of an mmattn attention module counts, on every kernel, padded
    or packed; cross-attention, decoding steps (``cache=``), Linformer's projected slots and
    calls whose Tokens carry no modality facts are listed in ``.skipped``. Each attention
    step of a call takes the groups as more value columns (one pass; the model's outputs the
    same within float rounding); with dropout the step runs once more on the groups without
    it: the weights are those before dropout. Memory: the layer's own, never (L, L).
    ``model`` may also be a single attention layer, called on ``tokens.x`` with the Tokens'
    key padding and geometry (``grid``, ``edge_index``).

    Args:
        model: the model (or an attention layer).
        tokens: its first input (Tokens, or whatever the model takes).
        *args, **kwargs: the rest of its inputs.
        by: ``"modality"`` or ``"segment"``.
        block_size: checked as for :func:`top_keys`, but without effect here: the layer's
            kernel chooses its own tiles.

    Returns:
        An :class:`AttentionMass` (``.table``, ``.modalities``, ``.modules``, ``.counts``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``by`` is not one of "modality", "segment"; ``block_size`` < 1; no
            call could be measured (the message gives each call's reason).

    Examples:
        >>> from mmattn import Encoder, Tokens
        >>> parts = {"text": Tokens(torch.randn(2, 5, 16)), "image": Tokens(torch.randn(2, 4, 16))}
        >>> mass = attention_mass(Encoder(16, depth=2, num_heads=2).eval(), Tokens.cat(parts))
        >>> mass.table.shape, mass.modalities, mass.modules
        (torch.Size([2, 2, 2, 2]), ['text', 'image'], ['blocks.0.attn', 'blocks.1.attn'])
        >>> torch.allclose(mass.table.sum(-1), torch.ones(2, 2, 2))
        True
    """
    checks.check_choice("by", by, BY)
    session = Session(by, None, block_size)
    output = session.run(model, tokens, args, kwargs, "attention_mass")
    names: list[str] = []
    for call in session.calls:
        names.extend(n for n in call.names if n not in names)
    heads = max(call.sums.shape[0] for call in session.calls)
    table = torch.full((len(session.calls), heads, len(names), len(names)), float("nan"))
    counts = torch.zeros(len(session.calls), len(names), dtype=torch.long)
    for c, call in enumerate(session.calls):
        index = torch.tensor([names.index(n) for n in call.names], dtype=torch.long)
        group = call.group[call.group >= 0].cpu()  # the real queries' groups
        sums, count = call.sums.cpu(), torch.bincount(group, minlength=len(index))
        mean = (sums / count[None, :, None]).float()  # NaN (0 / 0) where no query of a group
        table[c][:sums.shape[0], index[:, None], index[None, :]] = mean
        counts[c, index] = count
    return AttentionMass(table, names, [call.name for call in session.calls], counts,
                         session.skipped, output)


def top_keys(
    model: nn.Module,
    tokens: Any,
    *args: Any,
    k: int = 8,
    block_size: int | None = None,
    **kwargs: Any,
) -> TopKeys:
    """Run ``model(tokens, *args, **kwargs)`` once and keep, for every attention call, the
    ``k`` keys each query attends most, with their weights.

    Computed tile by tile from the kernels' own tensors (memory O(L · k) for the result,
    O(L · block) while running; never (L, L)) on mmattn's own kernels (``engines.use(
    "fallback")``: an engine's report holds no tiles; on the CPU nothing changes). The same
    calls count as for :func:`attention_mass`, but Tokens without modality facts are fine.

    Ties: among keys of equal weight the lower key position comes first (``torch.topk``
    leaves the order of ties unspecified). Keys of zero weight are never listed: a query
    with fewer than k keys of nonzero weight (a small window, a dead row) gets index -1 and
    weight 0 in the remaining places, as do padded queries. Appended ``bias_k`` / zero keys
    are not tokens and are not listed.

    Args:
        model: the model (or an attention layer).
        tokens: its first input (Tokens, or whatever the model takes).
        *args, **kwargs: the rest of its inputs.
        k: keys kept per query.
        block_size: query rows per tile (default: 64; a local band uses its own block).

    Returns:
        A :class:`TopKeys` with ``.indices`` and ``.weights`` of shape (calls, B, heads, L,
        k) (B and L the largest of the calls; packed items padded to the longest).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``k`` is not an int.
        ValueError: ``k`` < 1; ``block_size`` < 1; no call could be measured.

    Examples:
        >>> from mmattn import MultiHeadAttention, Tokens
        >>> mha, x = MultiHeadAttention(8, 2).eval(), torch.randn(1, 5, 8)
        >>> found = top_keys(mha, Tokens(x), k=3)
        >>> found.indices.shape, found.modules
        (torch.Size([1, 1, 2, 5, 3]), [''])
        >>> _, w = mha(x, need_weights=True, average_attn_weights=False)  # (1, 2, 5, 5)
        >>> torch.allclose(found.weights[0], w.topk(3).values, atol=1e-6)
        True
    """
    checks.check_positive_int("k", k)
    session = Session(None, k, block_size)
    output = session.run(model, tokens, args, kwargs, "top_keys")
    tops = [call.tally.top for call in session.calls]
    shape = [max(t[0].shape[d] for t in tops) for d in range(4)]
    weights = torch.zeros(len(tops), *shape)
    indices = torch.full((len(tops), *shape), -1, dtype=torch.long)
    for c, (w, i) in enumerate(tops):
        b, h, length, _ = w.shape
        weights[c, :b, :h, :length] = w.cpu()
        indices[c, :b, :h, :length] = i.cpu()
    return TopKeys(indices, weights, [call.name for call in session.calls], session.skipped,
                   output)

