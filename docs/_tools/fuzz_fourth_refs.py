"""References for ``fuzz_fourth_wave.py``, written from the docs in float64 loops (issue 36).

Attention over allowed pairs with the score modifiers (docs/variants.md), a pre-norm block,
a random batch of Tokens with its meta read as docs/patterns.md says, and random patterns
with their rule as a Python function of (b, q, k). Nothing here calls the library's own
masks, pattern rules or kernels: the library is what they are compared with.
"""

from __future__ import annotations

import copy
import math

import fuzz_api as base
import torch

from mmattn import Tokens
from mmattn import patterns as P

D, H = base.D, base.H
NAMES = ("text", "image", "audio")

# ------------------------------------------------------------------ references (float64)


def slopes(heads):
    """ALiBi slopes of Press et al. (2022) for a power-of-two head count."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def attend(q, k, v, allowed, sinks=None, softcap=None, alibi=None, q_pos=None, k_pos=None):
    """(b, h, i, e) float64 attention over ``allowed`` (b, 1|h, i, j) with the modifiers."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, i, e = q.shape
    out = torch.zeros(b, h, i, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(b, h, i, k.shape[2], dtype=torch.float64)
    q_pos = list(range(i)) if q_pos is None else q_pos
    k_pos = list(range(k.shape[2])) if k_pos is None else k_pos
    allowed = allowed.expand(b, h, i, k.shape[2])
    for n in range(b):
        for m in range(h):
            for r in range(i):
                keys = allowed[n, m, r].nonzero().flatten().tolist()
                if not keys:
                    continue
                s = torch.stack([q[n, m, r] @ k[n, m, j] for j in keys]) / math.sqrt(e)
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if alibi is not None:  # |i - j| on a sequence, Euclidean between cells
                    s = s - alibi[m] * torch.tensor([math.dist(*(
                        (a,) if isinstance(a, int) else a for a in (q_pos[r], k_pos[j])))
                        for j in keys], dtype=torch.float64)
                top = s.max() if sinks is None else torch.maximum(s.max(), sinks[m].double())
                w = torch.exp(s - top)
                total = w.sum() + (0.0 if sinks is None else torch.exp(sinks[m].double() - top))
                weights[n, m, r, keys] = w / total
                out[n, m, r] = (w / total) @ v[n, m, keys]
    return out, weights


def layer_ref(module, x, allowed, context=None, **mods):
    """MultiHeadAttention's projections around :func:`attend`; ``allowed`` (b, 1, i, j);
    keys and values from ``context`` (default ``x``)."""
    p = {name: t.double() for name, t in module.state_dict().items()}
    b, n, _ = x.shape
    x = x.double()
    context = x if context is None else context.double()

    def heads(t):
        return t.reshape(b, t.shape[1], H, D // H).transpose(1, 2)

    q = heads(x @ p["q_proj.weight"].T + p["q_proj.bias"])
    k, v = (heads(context @ p[f"{w}_proj.weight"].T + p[f"{w}_proj.bias"]) for w in "kv")
    sinks = None if getattr(module, "sinks", None) is None else module.sinks.detach()
    alibi = slopes(H) if getattr(module, "alibi_slopes", None) is not None else None
    out, weights = attend(q, k, v, allowed, sinks=sinks, softcap=module.softcap, alibi=alibi,
                          **mods)
    out = out.transpose(1, 2).reshape(b, n, D)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"], weights


def block_ref(block, x, real, allowed):
    """A pre-norm TransformerBlock in float64: x + attn(LN1 x), + MLP(LN2 x), padding 0."""
    twin = copy.deepcopy(block).double()
    x = x.double() * real[..., None]
    x = x + layer_ref(block.attn, twin.norm1(x), allowed)[0]
    x = x + twin.mlp(twin.norm2(x))
    return x * real[..., None]


# ------------------------------------------------------------------ token attributes


class Scene:
    """A random batch of Tokens with its meta, and every attribute as a plain list."""

    def __init__(self, fuzz, batch, kind):
        r = fuzz.rng
        self.batch, self.kind, self.meta = batch, kind, {}
        self.modality = self.segment = None  # [b][i] ints, -1 = none
        self.names, self.grid = (), None  # grid: (start, rows, cols)
        if kind == "spans":
            names = r.sample(NAMES, r.randint(1, 3))
            sizes = [r.randint(1, 4) for _ in names]
            if "image" in names:
                rows, cols = r.randint(1, 3), r.randint(1, 3)
                sizes[names.index("image")] = rows * cols
            self.length = sum(sizes) + r.choice([0, 0, 1, 2])  # tokens after every span
            spans, start = {}, 0
            for name, size in zip(names, sizes):
                spans[name] = (start, start + size)
                self.meta[name] = {}
                start += size
            self.meta["spans"], self.names = spans, tuple(names)
            if "image" in names:
                self.meta["image"]["grid"] = (rows, cols)
                self.grid = (spans["image"][0], rows, cols)
            ids = [-1] * self.length
            for index, (a, z) in enumerate(spans.values()):
                ids[a:z] = [index] * (z - a)
            self.modality = self.segment = [list(ids) for _ in range(batch)]
        elif kind == "ids":
            self.length = r.randint(1, 9)
            self.names = ("text", "image")
            ids = [[r.choice([-1, 0, 0, 1, 1]) for _ in range(self.length)] for _ in range(batch)]
            self.modality = ids
            self.meta.update(modality_ids=torch.tensor(ids, dtype=torch.long).reshape(
                batch, self.length), modalities=list(self.names))
            if r.random() < 0.7:  # without them: no segments (patterns do not guess runs)
                self.segment = [runs(row) for row in ids]
                self.meta["segments"] = torch.tensor(self.segment, dtype=torch.long).reshape(
                    batch, self.length)
        else:
            self.length = r.randint(1, 10)
            rows, cols = r.randint(1, 3), r.randint(1, 3)
            if rows * cols <= self.length:
                self.meta["grid"], self.grid = (rows, cols), (0, rows, cols)
        n = self.length
        self.documents = [[r.choice([-1, 0, 0, 1, 2]) for _ in range(n)] for _ in range(batch)]
        self.meta["documents"] = torch.tensor(self.documents, dtype=torch.long).reshape(batch, n)
        flat = {(it * n + r.randrange(n), it * n + r.randrange(n))
                for it in range(batch) for _ in range(r.randint(0, 4))} if n else set()
        self.edges = sorted(flat)
        self.meta["edge_index"] = torch.tensor(self.edges, dtype=torch.long).reshape(-1, 2).T
        self.real = [[True] * n for _ in range(batch)]
        if batch > 1 and n > 1 and r.random() < 0.6:
            cut = r.randint(1, n - 1)
            self.real[1][cut:] = [False] * (n - cut)
        self.x = fuzz.randn(batch, n, D)
        mask = torch.tensor(self.real, dtype=torch.bool).reshape(batch, n)
        self.tokens = Tokens(self.x, mask, self.meta)

    def cell(self, i):
        """(row, col) of token i in the grid, or None outside it."""
        if self.grid is None:
            return None
        start, rows, cols = self.grid
        local = i - start
        return divmod(local, cols) if 0 <= local < rows * cols else None


def runs(ids):
    """Segment ids: one per contiguous run of equal ids >= 0, numbered along the row."""
    out, number = [], -1
    for i, value in enumerate(ids):
        if value >= 0 and (i == 0 or ids[i - 1] != value):
            number += 1
        out.append(number if value >= 0 else -1)
    return out


def offsets(scene, b):
    """Each token's position from the start of its segment's run (from 0 outside)."""
    seg = scene.segment[b] if scene.segment is not None else [-1] * scene.length
    out = []
    for i, s in enumerate(seg):
        start = i
        while s >= 0 and start > 0 and seg[start - 1] == s:
            start -= 1
        out.append(i - start if s >= 0 else i)
    return out


# ------------------------------------------------------------------ patterns and their rules


def primitive(fuzz, scene, what=None):
    """A random primitive the scene can serve (of kind ``what`` if given): (pattern,
    rule(b, q, k) -> bool)."""
    r = fuzz.rng
    options = ["full", "causal", "window", "same", "edges", "chunked"]
    if scene.names:
        options += ["modality", "modality"] + (["per_modality"] if scene.segment else [])
    if scene.grid is not None:
        options.append("neighborhood")
    what = what or r.choice(options)
    if what == "full":
        return P.full(), lambda b, q, k: True
    if what == "causal":
        return P.causal(), lambda b, q, k: k <= q
    if what == "window":
        w = r.randint(0, 3)
        return P.window(w), lambda b, q, k: abs(q - k) <= w
    if what == "same":
        ids = scene.documents
        return P.same("documents"), lambda b, q, k: ids[b][q] == ids[b][k] and ids[b][q] >= 0
    if what == "edges":
        loops, n, edges = r.random() < 0.5, scene.length, set(scene.edges)
        return P.edges(self_loops=loops), lambda b, q, k: (
            (b * n + k, b * n + q) in edges or (loops and q == k))
    if what == "chunked":
        c, left, right = r.randint(1, 4), r.randint(0, 2), r.randint(0, 1)
        table = [offsets(scene, b) for b in range(scene.batch)]
        return P.chunked(c, left=left, right=right), lambda b, q, k: (
            table[b][q] // c - left <= table[b][k] // c <= table[b][q] // c + right)
    if what == "neighborhood":
        size = r.choice([1, 3, 5])
        _, rows, cols = scene.grid
        wr, wc = base.window(rows, size), base.window(cols, size)

        def rule(b, q, k):
            cq, ck = scene.cell(q), scene.cell(k)
            return cq is not None and ck is not None and bool(wr[cq[0], ck[0]]) and bool(
                wc[cq[1], ck[1]])

        return P.neighborhood(size), rule
    mods = scene.modality
    if what == "modality":
        query = r.choice([None, r.choice(scene.names), tuple(r.sample(scene.names, 1))])
        key = r.choice([None, r.choice(scene.names)])

        def wanted(spec, index):
            if spec is None:
                return True
            spec = (spec,) if isinstance(spec, str) else spec
            return index >= 0 and scene.names[index] in spec

        return P.modality(query=query, key=key), lambda b, q, k: (
            wanted(query, mods[b][q]) and wanted(key, mods[b][k]))
    within = {}
    for name in r.sample(scene.names, r.randint(0, len(scene.names))):
        if name == "image" and scene.grid is not None and r.random() < 0.5:
            within[name] = primitive(fuzz, scene, "neighborhood")
        else:
            within[name] = primitive(fuzz, scene, r.choice(["causal", "window", "full"]))
    across = primitive(fuzz, scene, r.choice(["full", "causal", "modality"]))
    seg = scene.segment

    def rule(b, q, k):
        if seg[b][q] >= 0 and seg[b][q] == seg[b][k]:
            name = scene.names[mods[b][q]] if mods[b][q] >= 0 else None
            return within[name][1](b, q, k) if name in within else True
        return across[1](b, q, k)

    pattern = P.per_modality(within={n: p for n, (p, _) in within.items()}, across=across[0])
    return pattern, rule


def random_pattern(fuzz, scene, depth=2):
    r = fuzz.rng
    if depth == 0 or r.random() < 0.4:
        return primitive(fuzz, scene)
    op = r.choice(["&", "|", "~"])
    a, fa = random_pattern(fuzz, scene, depth - 1)
    if op == "~":
        return ~a, lambda b, q, k: not fa(b, q, k)
    c, fc = random_pattern(fuzz, scene, depth - 1)
    if op == "&":
        return a & c, lambda b, q, k: fa(b, q, k) and fc(b, q, k)
    return a | c, lambda b, q, k: fa(b, q, k) or fc(b, q, k)


def allowed_of(scene, rule):
    """(B, L, L) bool by the loop; padded keys and padded query rows False."""
    n, real = scene.length, scene.real
    return torch.tensor([[[bool(real[b][q] and real[b][k] and rule(b, q, k)) for k in range(n)]
                          for q in range(n)] for b in range(scene.batch)],
                        dtype=torch.bool).reshape(scene.batch, n, n)


def chunk_rule(n, chunk, left):
    """(n, n) bool: P.chunked(chunk, left=left) from position 0 (docs/streaming.md): key k
    is allowed to query q iff q // chunk - left <= k // chunk <= q // chunk."""
    return torch.tensor([[q // chunk - left <= k // chunk <= q // chunk for k in range(n)]
                         for q in range(n)], dtype=torch.bool)


def random_modifiers(fuzz):
    r = fuzz.rng
    return {"sinks": r.random() < 0.4, "softcap": r.choice([None, None, 0.5, 5.0]),
            "alibi": r.random() < 0.4}


def with_sinks(module, fuzz):
    """Random sink logits (they start at zero), so a wrong sink shows."""
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(fuzz.randn(H))
    return module
