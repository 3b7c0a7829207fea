"""Fuzz the public API with valid and invalid inputs and classify every result (issue 29).

    python docs/_tools/fuzz_api.py [--seed 0] [--rounds 40] [--timeout 20] [-v]

Not a unit test (a few minutes on one core). Each case calls one public name: the layers
(MultiHeadAttention, LocalAttention, NeighborhoodAttention, EdgeAttention), the kernels
(``mmattn.kernels.dense.attend``, ``blocked.local_attend``, ``neighborhood.neighborhood_attend``,
``segment.edge_attend`` / ``edge_attend_explicit``), ``mmattn.functional``, the transformers
entry (``integrations.huggingface.attention_forward``), ``DecodeStep`` and the grid/edge
helpers of ``mmattn.masks``, on both paths (``fused_attn(True)`` and ``(False)``). A case is

- ``ok``: valid input, the result equals a naive float64 loop written here (softmax over the
  allowed keys; a row with none gives 0), no NaN;
- ``named``: invalid input refused by ValueError / TypeError / IndexError whose message names
  the argument;
- ``opaque``: invalid input refused by another error, or one that does not name it;
- ``silent``: valid input with wrong numbers (or NaN), or invalid input accepted;
- ``refused``: valid input that raised;
- ``hang``: no answer within ``--timeout`` seconds.

The exit status is 1 when any case is silent, refused or a hang, or more than 5 are opaque.
The fourth wave's surfaces (patterns, modifiers, streaming, mass) are in
``fuzz_fourth_wave.py`` beside this file, the sixth wave's (video, 3-D and causal
neighbourhoods, frame-causal patterns, multi-axis positions) in ``fuzz_sixth_wave.py``;
both run here too (alone: run that file).
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import signal
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an install

import mmattn  # noqa: E402
from mmattn import functional as MF  # noqa: E402
from mmattn import masks  # noqa: E402
from mmattn.integrations import huggingface as hf  # noqa: E402
from mmattn.integrations.export import DecodeStep  # noqa: E402
from mmattn.kernels import blocked, dense, neighborhood, packed, segment  # noqa: E402

D, H = 8, 2
NAMED = (ValueError, TypeError, IndexError)


class Hang(Exception):
    pass


# ------------------------------------------------------------------ references (float64)


def naive(q, k, v, allowed, scale=None):
    """(b, h, i, e) attention in float64 by loops over rows; ``allowed`` (b|1, h|1, i, j)."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:  # grouped heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    b, h, i, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    allowed = allowed.expand(b, h, i, k.shape[2])
    out = torch.zeros(b, h, i, v.shape[-1], dtype=torch.float64)
    for n in range(b):
        for m in range(h):
            for r in range(i):
                keys = allowed[n, m, r].nonzero().flatten()
                if len(keys) == 0:
                    continue
                s = (q[n, m, r] @ k[n, m, keys].T) * scale
                w = torch.exp(s - s.max())
                out[n, m, r] = (w / w.sum()) @ v[n, m, keys]
    return out


def naive_layer(module, x, allowed, context=None):
    """A layer's projections in float64 around :func:`naive`; ``allowed`` (b|1, 1, i, j);
    keys and values from ``context`` (default ``x``)."""
    p = {k: t.double() for k, t in module.state_dict().items()}
    b, n, _ = x.shape
    hk = p["k_proj.weight"].shape[0] // (D // H)
    x = x.double()
    context = x if context is None else context.double()

    def split(t, heads):
        return t.reshape(b, t.shape[1], heads, D // H).transpose(1, 2)

    q = split(x @ p["q_proj.weight"].T + p["q_proj.bias"], H)
    k = split(context @ p["k_proj.weight"].T + p["k_proj.bias"], hk)
    v = split(context @ p["v_proj.weight"].T + p["v_proj.bias"], hk)
    out = naive(q, k, v, allowed).transpose(1, 2).reshape(b, n, D)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


def window(n, size, dilation=1):
    """(n, n) bool: the clamped window of NATTEN along one axis (key j for query i)."""
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        phase, pos, m = i % dilation, i // dilation, len(range(i % dilation, n, dilation))
        start = min(max(pos - size // 2, 0), max(m - size, 0))
        for t in range(start, min(start + size, m)):
            out[i, phase + t * dilation] = True
    return out


def nbhd_allowed(rows, cols, size, dilation=1):
    a, b = window(rows, size, dilation), window(cols, size, dilation)
    return (a[:, None, :, None] & b[None, :, None, :]).reshape(rows * cols, rows * cols)


def band(n, w, causal):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    return ((i - j).abs() <= w) & ((j <= i) if causal else True)


# ------------------------------------------------------------------ cases


def _dense(edge_index, nodes):
    out = torch.zeros(nodes, nodes)
    out[edge_index[1], edge_index[0]] = 1.0
    return out


class Fuzz:
    def __init__(self, seed, timeout, verbose):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.timeout, self.verbose = timeout, verbose
        self.counts = collections.Counter()
        self.bad: list[str] = []

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(dtype)

    def _timed(self, fn):
        def alarm(*_):
            raise Hang

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def record(self, outcome, label, detail=""):
        self.counts[outcome] += 1
        if outcome not in ("ok", "named"):
            self.bad.append(f"{outcome:8s} {label}: {detail}")
        if self.verbose:
            print(f"{outcome:8s} {label} {detail}"[:300])

    def valid(self, label, fn, ref, atol=1e-4):
        """``fn()`` must equal ``ref()`` (a tensor or None = only run it), finite."""
        try:
            got = self._timed(fn)
        except Hang:
            return self.record("hang", label)
        except Exception as error:  # noqa: BLE001
            return self.record("refused", label, f"{type(error).__name__}: {error}"[:300])
        want = ref() if ref is not None else None
        got = got[0] if isinstance(got, tuple) else got
        if not torch.isfinite(got).all():
            return self.record("silent", label, "non-finite output")
        if want is not None:
            if got.shape != want.shape:
                return self.record("silent", label, f"shape {tuple(got.shape)} vs "
                                   f"{tuple(want.shape)}")
            err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
            if err > atol:
                return self.record("silent", label, f"max error {err:.3g}")
        self.record("ok", label)

    def invalid(self, label, fn, *names):
        """``fn()`` must raise a named error mentioning one of ``names``."""
        try:
            self._timed(fn)
        except Hang:
            return self.record("hang", label)
        except NAMED as error:
            text = str(error)
            if any(name in text for name in names):
                return self.record("named", label)
            return self.record("opaque", label, f"{type(error).__name__}: {text}"[:300])
        except Exception as error:  # noqa: BLE001
            where = traceback.extract_tb(error.__traceback__)[-1]
            return self.record("opaque", label, f"{type(error).__name__}: {error} "
                               f"({where.filename.split('/')[-1]}:{where.lineno})"[:300])
        self.record("silent", label, "invalid input accepted")

    # -------------------------------------------------------------- subjects

    def sdpa(self, tag):
        r = self.rng
        b, h, i, j, e = r.choice([0, 1, 2]), r.choice([1, 2]), r.randint(1, 6), r.randint(1, 6), 4
        q, k, v = self.randn(b, h, i, e), self.randn(b, h, j, e), self.randn(b, h, j, e)
        allowed = torch.rand(b, 1, i, j, generator=self.gen) > 0.3
        causal, scale = r.random() < 0.4, r.choice([None, 0.5, 0.0, -1.0])
        want_allowed = allowed & torch.ones(i, j, dtype=torch.bool).tril() if causal else allowed
        self.valid(f"{tag} functional.sdpa b={b} i={i} j={j} causal={causal} scale={scale}",
                   lambda: MF.scaled_dot_product_attention(q, k, v, allowed, is_causal=causal,
                                                           scale=scale),
                   lambda: naive(q, k, v, want_allowed, scale).float())
        self.valid(f"{tag} kernels.dense.attend b={b} i={i} j={j}",
                   lambda: dense.attend(q, k, v, allowed, scale=scale)[0],
                   lambda: naive(q, k, v, allowed, scale).float())
        f = MF.scaled_dot_product_attention
        bad = [
            ("query long", lambda: f(q.long(), k, v), "query"),
            ("key width", lambda: f(q, self.randn(b, h, j, e + 1), v), "key"),
            ("value length", lambda: f(q, k, self.randn(b, h, j + 1, e)), "value"),
            ("mask shape", lambda: f(q, k, v, allowed[..., :1, :].expand(b, 1, i + 1, j)),
             "attn_mask"),
            ("mask int", lambda: f(q, k, v, allowed.int()), "attn_mask"),
            ("scale str", lambda: f(q, k, v, scale="1"), "scale"),
            ("is_causal int", lambda: f(q, k, v, is_causal=2), "is_causal"),
            ("dropout 1.5", lambda: f(q, k, v, dropout_p=1.5), "dropout_p"),
            ("query str", lambda: f("cpu", k, v), "query"),
            ("kernel query long", lambda: dense.attend(q.long(), k, v, None), "q"),
            ("kernel mask int", lambda: dense.attend(q, k, v, allowed.int()), "mask"),
        ]
        for name, fn, *names in bad:
            self.invalid(f"{tag} sdpa {name}", fn, *names)

    def local(self, tag):
        r = self.rng
        b, n, w, causal = r.choice([0, 1, 2]), r.randint(1, 40), r.randint(1, 5), r.random() < .5
        q, k, v = (self.randn(b, H, n, 4) for _ in range(3))
        allowed = band(n, w, causal)
        self.valid(f"{tag} kernels.blocked.local_attend b={b} n={n} w={w} causal={causal}",
                   lambda: blocked.local_attend(q, k, v, w, causal=causal)[0],
                   lambda: naive(q, k, v, allowed).float())
        self.valid(f"{tag} functional.local_attention n={n} w={w}",
                   lambda: MF.local_attention(q, k, v, w, causal=causal),
                   lambda: naive(q, k, v, allowed).float())
        layer = mmattn.LocalAttention(D, H, w, causal=causal).eval()
        x = self.randn(b, n, D)
        with torch.no_grad():
            self.valid(f"{tag} LocalAttention b={b} n={n} w={w} causal={causal}",
                       lambda: layer(x)[0], lambda: naive_layer(layer, x, allowed).float())
        for name, fn, *names in [
            ("window float", lambda: blocked.local_attend(q, k, v, 2.0), "window_size"),
            ("window bool", lambda: blocked.local_attend(q, k, v, True), "window_size"),
            ("window -1 layer", lambda: mmattn.LocalAttention(D, H, -1), "window_size"),
            ("window bool layer", lambda: mmattn.LocalAttention(D, H, True), "window_size"),
            ("kernel q long", lambda: blocked.local_attend(q.long(), k, v, 2), "q"),
            ("kernel k fp64", lambda: blocked.local_attend(q, k.double(), v, 2), "k"),
            ("causal str", lambda: mmattn.LocalAttention(D, H, 2, causal="no"), "causal"),
            ("key_mask shape", lambda: blocked.local_attend(
                q, k, v, 2, key_mask=torch.ones(b, n + 1, dtype=torch.bool)), "key_mask"),
            ("layer width", lambda: layer(self.randn(b, n, D + 1)), "query"),
            ("layer long", lambda: layer(x.long()), "query"),
        ]:
            self.invalid(f"{tag} local {name}", fn, *names)

    def nbhd(self, tag):
        r = self.rng
        rows, cols, size = r.randint(1, 6), r.randint(1, 6), r.choice([1, 3, 5, 7])
        dil = r.choice([1, 1, 2]) if size * 2 <= min(rows, cols) else 1  # larger k: clamped
        b, n = r.choice([0, 1, 2]), rows * cols
        q, k, v = (self.randn(b, H, n, 4) for _ in range(3))
        allowed = nbhd_allowed(rows, cols, size, dil)
        self.valid(f"{tag} kernels.neighborhood_attend b={b} grid={rows}x{cols} k={size} "
                   f"d={dil}",
                   lambda: neighborhood.neighborhood_attend(q, k, v, (rows, cols), size,
                                                            dilation=dil)[0],
                   lambda: naive(q, k, v, allowed).float())
        self.valid(f"{tag} masks.neighborhood_mask grid={rows}x{cols} k={size} d={dil}",
                   lambda: masks.neighborhood_mask((rows, cols), size, dilation=dil,
                                                   device="cpu").float(),
                   lambda: allowed.float())
        layer = mmattn.NeighborhoodAttention(D, H, size, dilation=dil).eval()
        x = self.randn(b, n, D)
        with torch.no_grad():
            self.valid(f"{tag} NeighborhoodAttention b={b} grid={rows}x{cols} k={size}",
                       lambda: layer(x, grid=(rows, cols))[0],
                       lambda: naive_layer(layer, x, allowed).float())
        for name, fn, *names in [
            ("grid float", lambda: masks.neighborhood_mask((2.5, 4), 1), "grid"),
            ("grid bool", lambda: masks.neighborhood_mask((True, 4), 1), "grid"),
            ("grid 4 sides", lambda: masks.neighborhood_mask((2, 2, 2, 2), 1), "grid"),
            ("kernel float", lambda: masks.neighborhood_mask((4, 4), 3.0), "kernel_size"),
            ("kernel bool", lambda: mmattn.NeighborhoodAttention(D, H, True), "kernel_size"),
            ("kernel even", lambda: masks.neighborhood_mask((4, 4), 2), "kernel_size"),
            ("kernel bool kernel", lambda: neighborhood.neighborhood_attend(
                q, k, v, (rows, cols), True), "kernel_size"),
            ("dilation float", lambda: mmattn.NeighborhoodAttention(D, H, 3, dilation=1.0),
             "dilation"),
            ("layer grid float", lambda: layer(x, grid=(rows + 0.5, cols)), "grid"),
            ("layer grid mismatch", lambda: layer(self.randn(1, n + 1, D), grid=(rows, cols)),
             "grid"),
            ("kernel grid mismatch", lambda: neighborhood.neighborhood_attend(
                q, k, v, (rows, cols + 1), size), "grid"),
            ("kernel q long", lambda: neighborhood.neighborhood_attend(
                q.long(), k, v, (rows, cols), size), "q"),
            ("device bad str", lambda: masks.neighborhood_mask((2, 2), 1, device="nope"),
             "device"),
        ]:
            self.invalid(f"{tag} nbhd {name}", fn, *names)

    def edges(self, tag):
        r = self.rng
        n, m = r.randint(1, 7), r.randint(1, 7)
        pairs = sorted({(r.randrange(m), r.randrange(n)) for _ in range(r.randint(0, 12))})
        r.shuffle(pairs)  # unsorted on purpose: valid input
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        q, k, v = self.randn(n, H, 4), self.randn(m, H, 4), self.randn(m, H, 4)
        allowed = torch.zeros(n, m, dtype=torch.bool)
        allowed[dst, src] = True

        def ref():
            out = naive(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                        v.transpose(0, 1)[None], allowed)
            return out[0].transpose(0, 1).float()

        for fn in (segment.edge_attend, segment.edge_attend_explicit):
            self.valid(f"{tag} kernels.segment.{fn.__name__} n={n} m={m} E={len(pairs)}",
                       lambda fn=fn: fn(q, k, v, src, dst)[0], ref)
        # the layer on a padded batch: edges in the flat token order, within each item
        b, length = r.choice([0, 1, 2]), r.randint(1, 6)
        x = self.randn(b, length, D)
        flat = sorted({(it * length + r.randrange(length), it * length + r.randrange(length))
                       for it in range(b) for _ in range(r.randint(0, 5))})
        r.shuffle(flat)
        loops = r.random() < 0.5
        edge_index = torch.tensor(flat, dtype=torch.long).reshape(-1, 2).T
        full = torch.zeros(b * length, b * length, dtype=torch.bool)
        full[edge_index[1], edge_index[0]] = True
        if loops:
            full |= torch.eye(b * length, dtype=torch.bool)
        block = torch.stack([full[t * length:(t + 1) * length, t * length:(t + 1) * length]
                             for t in range(b)]) if b else torch.zeros(0, length, length,
                                                                        dtype=torch.bool)
        layer = mmattn.EdgeAttention(D, H, add_self_loops=loops).eval()
        with torch.no_grad():
            self.valid(f"{tag} EdgeAttention b={b} L={length} E={len(flat)} loops={loops}",
                       lambda: layer(x, edge_index=edge_index)[0],
                       lambda: naive_layer(layer, x, block[:, None]).float())
        e = segment.edge_attend
        for name, fn, *names in [
            ("src out of range", lambda: e(q, k, v, torch.tensor([m]), torch.tensor([0])),
             "src"),
            ("dst out of range", lambda: e(q, k, v, torch.tensor([0]), torch.tensor([n])),
             "dst"),
            ("src negative", lambda: e(q, k, v, torch.tensor([-1]), torch.tensor([0])), "src"),
            ("src bool", lambda: e(q, k, v, torch.tensor([True]), torch.tensor([0])), "src"),
            ("bias shape", lambda: e(q, k, v, src, dst, bias=self.randn(len(pairs) + 1, H)),
             "bias"),
            ("src float", lambda: e(q, k, v, torch.tensor([0.0]), torch.tensor([0])), "src"),
            ("lengths differ", lambda: e(q, k, v, torch.tensor([0, 0]), torch.tensor([0])),
             "src", "dst"),
            ("k heads", lambda: e(q, self.randn(m, 3, 4), v, src, dst), "k", "heads"),
            ("explicit dst oob", lambda: segment.edge_attend_explicit(
                q, k, v, torch.tensor([0]), torch.tensor([n + 3])), "dst"),
            ("layer edge float", lambda: layer(x, edge_index=edge_index.float()),
             "edge_index"),
            ("layer edge oob", lambda: layer(x, edge_index=torch.tensor([[0], [b * length]])),
             "edge_index"),
            ("layer edge 3 rows", lambda: layer(x, edge_index=torch.zeros(3, 1, dtype=torch.long)),
             "edge_index"),
            ("loops str", lambda: mmattn.EdgeAttention(D, H, add_self_loops="no"),
             "add_self_loops"),
            ("loops None", lambda: mmattn.EdgeAttention(D, H, add_self_loops=None),
             "add_self_loops"),
            ("k_hop float", lambda: masks.k_hop_edges(edge_index, 1.5), "num_hops", "k"),
        ]:
            self.invalid(f"{tag} edge {name}", fn, *names)

    def mha(self, tag):
        r = self.rng
        b, n, kv = r.choice([0, 1, 2]), r.randint(1, 6), r.choice([1, 2])
        layer = mmattn.MultiHeadAttention(D, H, num_kv_heads=kv).eval()
        x = self.randn(b, n, D)
        pad = torch.zeros(b, n, dtype=torch.bool)
        if b:
            pad[0, n - r.randint(0, n - 1):] = True  # padded keys, at least one real
            pad[0, n - 1] = n > 1
        x = x.masked_fill(pad[..., None], 0.0)
        allowed = (~pad)[:, None, None, :]
        with torch.no_grad():
            self.valid(f"{tag} MultiHeadAttention b={b} n={n} kv={kv}",
                       lambda: layer(x, x, x, key_padding_mask=pad)[0],
                       lambda: naive_layer(layer, x, allowed).float())
        for name, fn, *names in [
            ("pad shape", lambda: layer(x, x, x, key_padding_mask=pad[:, :-1]),
             "key_padding_mask"),
            ("pad float str", lambda: layer(x, x, x, key_padding_mask="x"),
             "key_padding_mask"),
            ("heads float", lambda: mmattn.MultiHeadAttention(D, 2.0), "num_heads"),
            ("heads bool", lambda: mmattn.MultiHeadAttention(D, True), "num_heads"),
            ("embed not divisible", lambda: mmattn.MultiHeadAttention(D, 3), "num_heads",
             "embed_dim"),
            ("device bad str", lambda: mmattn.MultiHeadAttention(D, H, device="nope"),
             "device"),
            ("query fp64", lambda: layer(x.double()), "query"),
            ("dropout 1.5", lambda: mmattn.MultiHeadAttention(D, H, dropout=1.5), "dropout"),
            ("kv heads 3", lambda: mmattn.MultiHeadAttention(D, H, num_kv_heads=3),
             "num_kv_heads"),
            ("attn_mask shape", lambda: layer(x, attn_mask=torch.ones(n + 1, n,
                                                                       dtype=torch.bool)),
             "attn_mask"),
        ]:
            self.invalid(f"{tag} mha {name}", fn, *names)

    def cross(self, tag):
        r = self.rng
        b, i, j, c = r.choice([0, 1, 2]), r.randint(1, 6), r.randint(1, 6), 6
        layer = mmattn.CrossAttention(D, H, kdim=c, vdim=c).eval()
        x, ctx = self.randn(b, i, D), self.randn(b, j, c)
        pad = torch.rand(b, j, generator=self.gen) < 0.3  # a row may lose every key: 0
        with torch.no_grad():
            self.valid(f"{tag} CrossAttention b={b} i={i} j={j}",
                       lambda: layer(x, ctx, ctx, key_padding_mask=pad)[0],
                       lambda: naive_layer(layer, x, (~pad)[:, None, None], ctx).float())
        for name, fn, *names in [
            ("context width", lambda: layer(x, self.randn(b, j, c + 1), None), "key"),
            ("pad int", lambda: layer(x, ctx, ctx, key_padding_mask=pad.long()),
             "key_padding_mask"),
            ("kdim float", lambda: mmattn.CrossAttention(D, H, kdim=6.0), "kdim"),
        ]:
            self.invalid(f"{tag} cross {name}", fn, *names)

    def packed_rows(self, tag):
        r = self.rng
        lengths = [r.randint(0, 5) for _ in range(r.randint(1, 3))]
        lengths[0] = max(lengths[0], 1)
        offsets = torch.tensor([0] + lengths).cumsum(0)
        t = int(offsets[-1])
        q, k, v = (self.randn(t, H, 4) for _ in range(3))
        allowed = torch.zeros(t, t, dtype=torch.bool)
        for a, z in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            allowed[a:z, a:z] = True

        def ref():
            return naive(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                         v.transpose(0, 1)[None], allowed)[0].transpose(0, 1).float()

        self.valid(f"{tag} kernels.packed.jagged_sdpa lengths={lengths}",
                   lambda: packed.jagged_sdpa(q, k, v, offsets, offsets, dropout_p=0.0,
                                              is_causal=False), ref)
        for name, fn, *names in [
            ("offsets float", lambda: packed.jagged_sdpa(q, k, v, offsets.float(), offsets,
                                                         dropout_p=0.0, is_causal=False),
             "q_offsets"),
            ("k fp64", lambda: packed.jagged_sdpa(q, k.double(), v, offsets, offsets,
                                                  dropout_p=0.0, is_causal=False), "k"),
            ("q rank", lambda: packed.jagged_sdpa(q[None], k, v, offsets, offsets,
                                                  dropout_p=0.0, is_causal=False), "q"),
        ]:
            self.invalid(f"{tag} packed {name}", fn, *names)

    def hf_entry(self, tag):
        r = self.rng
        b, h, i, e, kv = r.choice([0, 1, 2]), 2, r.randint(1, 6), 4, r.choice([1, 2])
        q, k, v = self.randn(b, h, i, e), self.randn(b, kv, i, e), self.randn(b, kv, i, e)
        allowed = torch.rand(b, 1, i, i, generator=self.gen) > 0.3
        # an additive mask is a number added, not "no key": a row of finfo.min is uniform
        # in float32 but not in float64, so the float case keeps one key per row
        some = allowed.clone()
        some[..., 0] = True
        additive = torch.zeros(b, 1, i, i).masked_fill(~some, torch.finfo(torch.float32).min)
        module = torch.nn.Module().eval()
        module.is_causal = False
        for kind, mask, want in (("bool", allowed, allowed), ("float", additive, some)):
            self.valid(f"{tag} hf.attention_forward {kind} mask b={b} i={i} kv={kv}",
                       lambda mask=mask: hf.attention_forward(module, q, k, v, mask)[0],
                       lambda want=want: naive(q, k, v, want).transpose(1, 2).float())
        a = hf.attention_forward
        for name, fn, *names in [
            ("mask int", lambda: a(module, q, k, v, allowed.int()), "attention_mask"),
            ("mask length", lambda: a(module, q, k, v, allowed[..., :1].expand(
                b, 1, i, i + 1)), "attention_mask"),
            ("scaling str", lambda: a(module, q, k, v, None, scaling="x"), "scaling"),
            ("query int", lambda: a(module, q.long(), k, v, None), "query"),
            ("dropout -0.1", lambda: a(module, q, k, v, None, dropout=-0.1), "dropout"),
            ("key fp16", lambda: a(module, q, k.half(), v, None), "key"),
            ("value width", lambda: a(module, q, k, self.randn(b, kv, i + 1, e), None),
             "value"),
            ("heads", lambda: a(module, q, self.randn(b, 3, i, e), self.randn(b, 3, i, e),
                                None), "key", "heads"),
        ]:
            self.invalid(f"{tag} hf {name}", fn, *names)

    def decode(self, tag):
        r = self.rng
        b, steps = r.choice([1, 2]), r.randint(1, 5)
        layer = mmattn.MultiHeadAttention(D, H).eval()
        step = DecodeStep(layer, max_len=8).eval()
        x = self.randn(b, steps, D)

        def run():
            state, outs = step.init_state(b), []
            for t in range(steps):
                out, state = step(x[:, t:t + 1], state)
                outs.append(out)
            return torch.cat(outs, 1)

        with torch.no_grad():
            self.valid(f"{tag} DecodeStep b={b} steps={steps}", run,
                       lambda: naive_layer(layer, x, torch.ones(steps, steps,
                                                                dtype=torch.bool).tril()).float())
            for name, fn, *names in [
                ("state batch", lambda: step(x[:, :1], step.init_state(b + 1)), "batch"),
                ("state tuple short", lambda: step(x[:, :1], step.init_state(b)[:1]),
                 "state"),
                ("x width", lambda: step(self.randn(b, 1, D + 1), step.init_state(b)),
                 "query", "x"),
                ("max_len float", lambda: DecodeStep(layer, max_len=8.0), "max_len"),
                ("max_len bool", lambda: DecodeStep(layer, max_len=True), "max_len"),
            ]:
                self.invalid(f"{tag} decode {name}", fn, *names)

    def helpers(self, tag):
        r = self.rng
        n, w = r.randint(1, 8), r.randint(0, 4)
        self.valid(f"{tag} masks.band_mask n={n} w={w}",
                   lambda: masks.band_mask(n, w, device="cpu").float(),
                   lambda: band(n, w, False).float())
        lengths = torch.tensor([r.randint(0, 5) for _ in range(r.randint(0, 3))],
                               dtype=torch.long)
        top = int(lengths.max()) if len(lengths) else 0
        self.valid(f"{tag} masks.padding_mask lengths={lengths.tolist()}",
                   lambda: masks.padding_mask(lengths, top + 1).float(),
                   lambda: (torch.arange(top + 1)[None] < lengths[:, None]).float())
        nodes = r.randint(1, 6)
        edges = torch.tensor([[r.randrange(nodes), r.randrange(nodes)]
                              for _ in range(r.randint(0, 8))], dtype=torch.long).reshape(-1, 2).T
        adj = torch.zeros(nodes, nodes, dtype=torch.long)
        adj[edges[1], edges[0]] = 1  # adj[i, j]: j -> i
        hops = r.randint(1, 3)
        reach, power = torch.zeros_like(adj), torch.eye(nodes, dtype=torch.long)
        for _ in range(hops):
            power = (adj @ power).clamp(max=1)
            reach |= power
        self.valid(f"{tag} masks.k_hop_edges nodes={nodes} E={edges.shape[1]} k={hops}",
                   lambda: _dense(masks.k_hop_edges(edges, hops, nodes), nodes),
                   lambda: reach.float())
        for name, fn, *names in [
            ("band float", lambda: masks.band_mask(4.0, 1), "q_len"),
            ("band bool", lambda: masks.band_mask(4, True), "window_size"),
            ("band negative", lambda: masks.band_mask(4, -1), "window_size"),
            ("padding float lengths", lambda: masks.padding_mask(lengths.float() + 0.5),
             "lengths"),
            ("causal str", lambda: masks.causal_mask("4"), "size", "q_len", "length"),
            ("k_hop 0", lambda: masks.k_hop_edges(edges, 0), "num_hops"),
            ("k_hop bool", lambda: masks.k_hop_edges(edges, True), "num_hops"),
            ("k_hop nodes small", lambda: masks.k_hop_edges(torch.tensor([[0], [5]]), 1, 3),
             "num_nodes", "edge_index"),
            ("edges float", lambda: masks.k_hop_edges(edges.float(), 1), "edge_index"),
            ("tokens mask shape", lambda: mmattn.Tokens(self.randn(2, 3, D),
                                                        torch.ones(2, 4, dtype=torch.bool)),
             "mask"),
            ("tokens x int", lambda: mmattn.Tokens(torch.ones(2, 3, D, dtype=torch.long)), "x"),
            ("block heads", lambda: mmattn.TransformerBlock(D, 3), "num_heads", "embed_dim"),
            ("block device", lambda: mmattn.TransformerBlock(D, H, device=3.0), "device"),
            ("block attention", lambda: mmattn.TransformerBlock(D, H, attention="nope"),
             "attention"),
        ]:
            self.invalid(f"{tag} helpers {name}", fn, *names)


def main(only: str | None = None) -> int:
    """Run every subject, or ``only`` "fourth" / "sixth" (the waves' own tools)."""
    from fuzz_fourth_wave import FourthWave  # beside this file; they import this module
    from fuzz_sixth_wave import SixthWave

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fuzz = Fuzz(args.seed, args.timeout, args.verbose)
    subjects = (fuzz.sdpa, fuzz.local, fuzz.nbhd, fuzz.edges, fuzz.mha, fuzz.cross,
                fuzz.packed_rows, fuzz.hf_entry, fuzz.decode, fuzz.helpers)
    waves = {"fourth": FourthWave(fuzz).subjects(), "sixth": SixthWave(fuzz).subjects()}
    subjects = waves[only] if only else subjects + waves["fourth"] + waves["sixth"]
    for rnd in range(args.rounds):
        for fused in (True, False):
            with MF.fused_attn(fused):
                for subject in subjects:
                    subject(f"[{rnd} fused={int(fused)}]")
    total = sum(fuzz.counts.values())
    print(f"{total} cases: " + ", ".join(f"{k} {fuzz.counts[k]}" for k in
                                         ("ok", "named", "opaque", "silent", "refused", "hang")))
    for line in fuzz.bad:
        print(line)
    failed = any(fuzz.counts[k] for k in ("silent", "refused", "hang")) or \
        fuzz.counts["opaque"] > 5
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
