"""References for ``fuzz_sixth_wave.py``, written from DESIGN.md "Sixth wave" and the docs,
in float64 loops over coordinates (issues 42 and 44).

Nothing here calls the library's masks, rotary tables, patterns or patchers: the library
is what they are compared with.

- a neighbourhood (1 to 3 axes, per-axis kernel, dilation and causal flag) as the product
  of NATTEN's window along every axis, by a loop over pairs of cells;
- rotary positions as an explicit rotation of every frequency pair by the position of the
  axis its section gives it;
- attention as a float64 softmax over the allowed keys of a layer's projections, queries
  and keys optionally rotated first;
- a clip's tubelets by slicing each (kt, kh, kw) block out of the zero-padded clip;
- M-RoPE positions by walking the parts of each item (text +1 per real token, a grid part
  at (s + t, s + r, s + c), the next part at s + max(h, w)).
"""

from __future__ import annotations

import itertools
import math

import torch


def axis_keys(n, k, d, causal, p):
    """Key positions of query ``p`` along one axis of ``n`` (NATTEN, DESIGN.md)."""
    phase = p % d
    sub = list(range(phase, n, d))  # the subgrid of p's dilation phase
    at = sub.index(p)
    if causal:  # at most k subgrid positions ending at p
        return set(sub[max(at - k + 1, 0):at + 1])
    size = min(k, len(sub))
    start = at - k // 2  # centred, then shifted inward
    start = max(0, min(start, len(sub) - size))
    return set(sub[start:start + size])


def nbhd_mask(grid, kernel, dilation, causal, globals_=0):
    """(L, L) bool, L = globals_ + prod(grid), cells row-major, by a loop over cell pairs."""
    cells = list(itertools.product(*(range(n) for n in grid)))
    length = globals_ + len(cells)
    out = torch.ones(length, length, dtype=torch.bool)
    for i, qc in enumerate(cells):
        keys = [axis_keys(n, k, d, c, p) for n, k, d, c, p in
                zip(grid, kernel, dilation, causal, qc)]
        for j, kc in enumerate(cells):
            out[globals_ + i, globals_ + j] = all(x in s for x, s in zip(kc, keys))
    return out


def rotate(x, positions, sections, base=10000.0):
    """``x`` (b|1, h, l, e) rotated pair by pair: pair i (columns i and i + e/2) turns by
    ``positions[..., a(i)] * base ** (-2 i / e)``; ``positions`` (b|1, l, A) float64."""
    x, positions = x.double(), positions.double()
    e = x.shape[-1]
    half = e // 2
    owner = [a for a, count in enumerate(sections) for _ in range(count)]
    out = x.clone()
    for i in range(half):
        angle = positions[..., owner[i]] * base ** (-2.0 * i / e)  # (b, l)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        out[..., i] = x[..., i] * cos - x[..., i + half] * sin
        out[..., i + half] = x[..., i + half] * cos + x[..., i] * sin
    return out


def layer(module, x, allowed, turn=None):
    """A layer's projections in float64 around a softmax over ``allowed`` (b|1, i, j);
    ``turn(t)`` rotates the head-split queries and keys (b, h, l, e)."""
    p = {name: t.double() for name, t in module.state_dict().items()}
    heads = module.num_heads
    b, n, width = x.shape
    e = width // heads
    x = x.double()

    def split(t):
        return t.reshape(b, n, t.shape[-1] // e, e).transpose(1, 2)

    q, k, v = (split(x @ p[f"{w}_proj.weight"].T + p[f"{w}_proj.bias"]) for w in "qkv")
    if turn is not None:
        q, k = turn(q), turn(k)
    group = heads // k.shape[1]  # grouped-query attention: each key head serves `group`
    allowed = allowed.expand(b, n, n)
    out = torch.zeros(b, heads, n, e, dtype=torch.float64)
    for m in range(b):
        for h in range(heads):
            for r in range(n):
                keys = allowed[m, r].nonzero().flatten()
                if len(keys) == 0:
                    continue
                s = q[m, h, r] @ k[m, h // group, keys].T / math.sqrt(e)
                w = torch.softmax(s, -1)
                out[m, h, r] = w @ v[m, h // group, keys]
    out = out.transpose(1, 2).reshape(b, n, width)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


def tubelets(video, tubelet, lengths=None):
    """(b, gt * gh * gw, c * kt * kh * kw) float64: each tubelet of the clip zeroed past
    ``lengths`` frames and padded with zeros, flattened channel-major, row-major order."""
    video = video.double().clone()
    b, c, t, h, w = video.shape
    if lengths is not None:
        for m, n in enumerate(lengths):
            video[m, :, n:] = 0.0
    kt, kh, kw = tubelet
    gt, gh, gw = -(-t // kt), -(-h // kh), -(-w // kw)
    padded = torch.zeros(b, c, gt * kt, gh * kh, gw * kw, dtype=torch.float64)
    padded[:, :, :t, :h, :w] = video
    rows = []
    for i, j, k in itertools.product(range(gt), range(gh), range(gw)):
        block = padded[:, :, i * kt:(i + 1) * kt, j * kh:(j + 1) * kh, k * kw:(k + 1) * kw]
        rows.append(block.reshape(b, c * kt * kh * kw))
    return torch.stack(rows, 1), (gt, gh, gw)


def mrope(parts, batch):
    """(B, L, 3) long: ``parts`` [(size, grid or None, real (B, size) bools)] in order."""
    length = sum(size for size, _, _ in parts)
    out = torch.zeros(batch, length, 3, dtype=torch.long)
    for m in range(batch):
        s, at = 0, 0
        for size, grid, real in parts:
            idx = [i for i in range(size) if real[m][i]]
            if grid is None:
                for rank, i in enumerate(idx):
                    out[m, at + i] = torch.tensor([s + rank] * 3)
                s += len(idx)
            else:
                t, h, w = (1, *grid) if len(grid) == 2 else grid
                for i in idx:
                    out[m, at + i] = torch.tensor([s + i // (h * w), s + (i // w) % h, s + i % w])
                s += max(h, w) if idx else 0
            at += size
    return out


def frames_rule(ids, real, n):
    """(B, L, L) bool: key j for query i when 0 <= ids[j] <= ids[i], both real."""
    b = len(ids)
    return torch.tensor([[[bool(real[m][i] and real[m][j] and 0 <= ids[m][j] <= ids[m][i])
                           for j in range(n)] for i in range(n)] for m in range(b)],
                        dtype=torch.bool).reshape(b, n, n)
