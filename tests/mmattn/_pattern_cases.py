"""Shared cases for the pattern tests: fused and interleaved Tokens, and a naive reference.

The reference reads the spec's words (DESIGN, fourth wave) one pair at a time with Python
ints and lists: no tensor rule of mmattn.patterns is used.
"""

from __future__ import annotations

import torch

from mmattn import Tokens
from mmattn import patterns as P
from mmattn.masks import neighborhood_mask


def fused_tokens(dim: int = 8) -> Tokens:
    """text (7) | image 3 x 4 | graph (6 nodes) | audio (9), batch 2, padding inside parts."""
    gen = torch.Generator().manual_seed(0)

    def part(length, real, meta=None):
        mask = torch.arange(length)[None] < torch.tensor(real)[:, None]
        return Tokens(torch.randn(2, length, dim, generator=gen), mask, meta or {})

    parts = {
        "text": part(7, [7, 4]),
        "image": part(12, [12, 12], {"grid": (3, 4)}),
        "graph": part(6, [6, 5]),
        "audio": part(9, [9, 6]),
    }
    fused = Tokens.cat(parts)
    start = fused.meta["spans"]["graph"][0]
    length = fused.length
    local = [(0, 1), (1, 2), (2, 0), (3, 4), (5, 3), (1, 1)]  # (source, target) in item 0
    flat = [(start + s, start + t) for s, t in local]
    flat += [(length + start + s, length + start + t) for s, t in [(0, 3), (4, 2), (2, 4)]]
    fused.meta["edge_index"] = torch.tensor(flat).T.contiguous()
    fused.meta["documents"] = torch.tensor([[0] * 10 + [1] * 14 + [-1] * 3 + [2] * 7,
                                            [3] * 5 + [-1] * 5 + [4] * 24])
    return fused


def interleaved_tokens(dim: int = 8) -> Tokens:
    """Gemma-3-like rows: text and image runs interleaved, with token_type_ids."""
    types = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
                          [0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0]])
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 10:] = False
    meta = {"modality_ids": types, "modalities": ["text", "image"], "segments": P.runs(types)}
    return Tokens(torch.randn(2, 12, dim), mask, meta)


class Naive:
    """Token attributes as Python lists, read the way the spec words them."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens
        self.batch, self.length = tokens.batch_size, tokens.length
        meta = tokens.meta
        self.real = tokens.full_mask().tolist()
        self.modality = [[None] * self.length for _ in range(self.batch)]
        self.segment = [[-1] * self.length for _ in range(self.batch)]
        if "spans" in meta:
            for index, (name, (start, stop)) in enumerate(meta["spans"].items()):
                for b in range(self.batch):
                    for i in range(start, stop):
                        self.modality[b][i], self.segment[b][i] = name, index
        elif "modality_ids" in meta:
            names = meta["modalities"]
            for b in range(self.batch):
                for i in range(self.length):
                    m = int(meta["modality_ids"][b, i])
                    self.modality[b][i] = names[m] if m >= 0 else None
                    self.segment[b][i] = int(meta["segments"][b, i])
        self.edges = set()
        if "edge_index" in meta:
            for s, t in meta["edge_index"].T.tolist():
                self.edges.add((s, t))

    def start(self, b: int, i: int) -> int:
        """Start of token i's segment (its run of one segment id); 0 outside segments."""
        seg = self.segment[b][i]
        if seg < 0:
            return 0
        while i > 0 and self.segment[b][i - 1] == seg:
            i -= 1
        return i

    def grid_allowed(self, b: int, q: int, k: int, kernel, dilation) -> bool:
        meta = self.tokens.meta
        for name, (start, _) in meta["spans"].items():
            grid = meta[name].get("grid") if isinstance(meta.get(name), dict) else None
            if grid is None:
                continue
            cells = grid[0] * grid[1]
            if start <= q < start + cells and start <= k < start + cells:
                dense = neighborhood_mask(grid, kernel, dilation=dilation)
                return bool(dense[q - start, k - start])
        return False

    def mask(self, rule) -> torch.Tensor:
        """(B, L, L) bool from ``rule(b, q, k)`` on real pairs."""
        out = torch.zeros(self.batch, self.length, self.length, dtype=torch.bool)
        for b in range(self.batch):
            for q in range(self.length):
                for k in range(self.length):
                    out[b, q, k] = bool(self.real[b][q] and self.real[b][k] and rule(b, q, k))
        return out


def naive_rules(n: Naive) -> dict:
    """The spec's words for each primitive, as ``rule(b, q, k)``."""
    docs = n.tokens.meta.get("documents")

    def same_docs(b, q, k):
        return docs[b, q] == docs[b, k] and docs[b, q] >= 0

    def chunked(c, left, right):
        def rule(b, q, k):
            cq, ck = (q - n.start(b, q)) // c, (k - n.start(b, k)) // c
            return cq - left <= ck <= cq + right
        return rule

    return {
        "full": lambda b, q, k: True,
        "causal": lambda b, q, k: k <= q,
        "window": lambda b, q, k: abs(q - k) <= 2,
        "same": same_docs,
        "modality": lambda b, q, k: n.modality[b][q] == "text" and
        n.modality[b][k] in ("image", "audio"),
        "modality-any": lambda b, q, k: n.modality[b][k] == "graph",
        "neighborhood": lambda b, q, k: n.grid_allowed(b, q, k, (3, 3), (1, 1)),
        "neighborhood-dilated": lambda b, q, k: n.grid_allowed(b, q, k, (1, 3), (1, 2)),
        "edges": lambda b, q, k: (b * n.length + k, b * n.length + q) in n.edges or q == k,
        "edges-no-loops": lambda b, q, k: (b * n.length + k, b * n.length + q) in n.edges,
        "chunked": chunked(3, 1, 0),
        "chunked-right": chunked(2, 0, 1),
    }


def patterns() -> dict:
    """The primitives matching :func:`naive_rules`."""
    return {
        "full": P.full(),
        "causal": P.causal(),
        "window": P.window(2),
        "same": P.same("documents"),
        "modality": P.modality(query="text", key=("image", "audio")),
        "modality-any": P.modality(key="graph"),
        "neighborhood": P.neighborhood(3),
        "neighborhood-dilated": P.neighborhood((1, 3), dilation=(1, 2)),
        "edges": P.edges(),
        "edges-no-loops": P.edges(self_loops=False),
        "chunked": P.chunked(3, left=1),
        "chunked-right": P.chunked(2, right=1),
    }


def per_modality_pattern() -> P.Pattern:
    """The per-modality pattern of the flex and BlockMask tests: every primitive but
    ``same`` and ``chunked`` (causal text, image neighbourhood, graph edges, audio window)
    and ``&``, ``|``, ``~`` through :func:`P.per_modality`, text <-> everything across."""
    return P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(3), "graph": P.edges(),
                "audio": P.window(2)},
        across=P.modality(query="text") | P.modality(key="text"),
    )
