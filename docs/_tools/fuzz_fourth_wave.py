"""Fuzz the fourth wave's surfaces (issue 36): patterns and their meta, score modifiers,
streaming caches, attention mass.

    python docs/_tools/fuzz_fourth_wave.py [--seed 0] [--rounds 40] [--timeout 20] [-v]

Run alone it fuzzes only these surfaces; ``docs/_tools/fuzz_api.py`` runs them with the
rest of the public API. The classes are fuzz_api's (ok / named / opaque / silent / refused /
hang). The references (``fuzz_fourth_refs.py`` beside this file) are written from the
docs, in float64 loops, never from the library's helpers:

- a pattern's allowed pairs by a loop over (b, q, k) from docs/patterns.md's table
  (primitives, ``& | ~``, ``per_modality``; padding never attended), token attributes read
  from the meta as the docs say (spans, modality ids and segments, grids, edges, ids);
- attention as softmax over the allowed keys of softcap(q·kᵀ·scale) − m_h·|i − j|, with a
  sink's exp(σ_h) in the denominator (docs/variants.md), a row without keys giving 0;
- a stream as the whole clip under the chunked rule, an encoder as its blocks written out
  (pre-norm attention and MLP, padding zeroed) in float64;
- the mass table as the mean over real queries of modality m of their weight on keys of
  modality n (docs/debugging.md), and top-k weights as the k largest nonzero weights.

Cases whose failure belongs to another item of issue 36 carry ``[item N]`` in the label.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fuzz_api as base  # noqa: E402
from fuzz_fourth_refs import (  # noqa: E402
    Scene,
    allowed_of,
    block_ref,
    chunk_rule,
    layer_ref,
    random_modifiers,
    random_pattern,
    with_sinks,
)

import mmattn  # noqa: E402
from mmattn import Tokens  # noqa: E402
from mmattn import patterns as P  # noqa: E402
from mmattn.debug import attention_mass, top_keys  # noqa: E402

D, H = base.D, base.H

# ------------------------------------------------------------------ subjects


class FourthWave:
    """The fourth wave's subjects, run on a ``fuzz_api.Fuzz`` (its rng, valid, invalid)."""

    def __init__(self, fuzz):
        self.f = fuzz

    def subjects(self):
        return (self.patterns, self.bad_meta, self.empty, self.modifiers, self.streams,
                self.encoder_streams, self.mass)

    # -------------------------------------------------------------- patterns, valid
    def patterns(self, tag):
        f, r = self.f, self.f.rng
        scene = Scene(f, r.choice([1, 2]), r.choice(["spans", "spans", "ids", "plain"]))
        pattern, rule = random_pattern(f, scene)
        want = allowed_of(scene, rule)
        label = f"{tag} {pattern!r} {scene.kind} B={scene.batch} L={scene.length}"[:160]
        block = r.choice([1, 2, 4, 64])
        f.valid(f"{label} dense", lambda: pattern.dense(scene.tokens).float(),
                lambda: want.float(), atol=0.0)
        f.valid(f"{label} compile({block}).dense",
                lambda: pattern.compile(scene.tokens, block_size=block).dense().float(),
                lambda: want.float(), atol=0.0)
        mods = random_modifiers(f)
        layer = with_sinks(mmattn.MultiHeadAttention(D, H, **mods).eval(), f)
        with torch.no_grad():
            f.valid(f"{label} MHA(attn_mask=SparseMask, {mods})",
                    lambda: layer(scene.x, attn_mask=pattern.compile(scene.tokens, block))[0],
                    lambda: layer_ref(layer, scene.x, want[:, None])[0].float())
            if r.random() < 0.3:
                blk = mmattn.TransformerBlock(D, H, pattern=pattern).eval()
                real = torch.tensor(scene.real, dtype=torch.float64).reshape(scene.batch, -1)
                f.valid(f"{label} TransformerBlock(pattern=)", lambda: blk(scene.tokens).x,
                        lambda: block_ref(blk, scene.x, real, want[:, None]).float())

    # -------------------------------------------------------------- patterns, malformed meta
    def bad_meta(self, tag):
        f, r = self.f, self.f.rng
        b, n = r.choice([1, 2]), r.randint(2, 6)
        x = f.randn(b, n, D)

        def run(pattern, meta, mask=None):
            return lambda: pattern.dense(Tokens(x, mask, meta))

        text = P.modality("text")
        per = P.per_modality(within={"text": P.causal()})
        nb = P.neighborhood(3)
        ids = torch.zeros(b, n, dtype=torch.long)
        cases = [
            # spans
            ("spans list", run(text, {"spans": [(0, n)]}), "spans"),
            ("spans entry 3-tuple [item 8]", run(text, {"spans": {"text": (0, 1, 2)}}),
             "spans"),
            ("spans entry str [item 8]", run(text, {"spans": {"text": "0:2"}}), "spans"),
            ("spans float bounds [item 8]", run(text, {"spans": {"text": (0.5, 2)}}), "spans"),
            ("spans start > stop [item 4]", run(text, {"spans": {"text": (2, 1)}}), "spans"),
            ("spans negative start [item 4]", run(text, {"spans": {"text": (-3, 1)}}),
             "spans"),
            ("spans stop past L [item 4]", run(text, {"spans": {"text": (0, n + 3)}}),
             "spans"),
            ("spans per-item B+1 [item 8]", run(text, {"spans": {"text": (
                torch.zeros(b + 1, dtype=torch.long), torch.ones(b + 1, dtype=torch.long))}}),
             "spans"),
            # modality ids
            ("modality_ids float", run(text, {"modality_ids": ids.float(),
                                              "modalities": ["text"]}), "modality_ids"),
            ("modality_ids shape", run(text, {"modality_ids": ids[:, :-1],
                                              "modalities": ["text"]}), "modality_ids"),
            ("modality_ids out of range", run(text, {"modality_ids": ids + 1,
                                                     "modalities": ["text"]}),
             "modality_ids", "modalities"),
            ("modality_ids no names", run(text, {"modality_ids": ids}), "modalities"),
            ("modalities str [item 2]", run(text, {"modality_ids": ids,
                                                   "modalities": "text"}), "modalities"),
            ("modalities ints [item 2]", run(text, {"modality_ids": ids, "modalities": [0]}),
             "modalities"),
            ("no modality facts", run(text, {}), "spans", "modality_ids"),
            # segments
            ("per_modality without segments", run(per, {"modality_ids": ids,
                                                        "modalities": ["text"]}), "segments"),
            ("segments float", run(per, {"modality_ids": ids, "modalities": ["text"],
                                         "segments": ids.float()}), "segments"),
            ("segments shape", run(per, {"modality_ids": ids, "modalities": ["text"],
                                         "segments": ids[:1, :1]}), "segments"),
            ("chunked segments float", run(P.chunked(2), {"segments": ids.float()}),
             "segments"),
            # grids
            ("grid missing", run(nb, {}), "grid"),
            ("grid too large", run(nb, {"grid": (n, n)}), "grid"),
            ("grid float", run(nb, {"grid": (1.5, 2)}), "grid"),
            ("grid zero side", run(nb, {"grid": (0, 2)}), "grid"),
            ("grid 4 sides", run(nb, {"grid": (1, 1, 1, 1)}), "grid"),
            ("grids B+1", run(nb, {"grids": [(1, 1)] * (b + 1)}), "grids", "grid"),
            ("grids tensor B+1", run(nb, {"grids": torch.ones(b + 1, 2, dtype=torch.long)}),
             "grids", "grid"),
            ("span grid float", run(nb, {"spans": {"image": (0, n)},
                                         "image": {"grid": (1.0, 1)}}), "grid"),
            # edges
            ("edge_index float", run(P.edges(), {"edge_index": torch.zeros(2, 1)}),
             "edge_index"),
            ("edge_index 3 rows", run(P.edges(), {"edge_index": torch.zeros(
                3, 1, dtype=torch.long)}), "edge_index"),
            ("edge_index out of range", run(P.edges(), {"edge_index": torch.tensor(
                [[0], [b * n]])}), "edge_index"),
            ("edge_index negative", run(P.edges(), {"edge_index": torch.tensor([[-1], [0]])}),
             "edge_index"),
            ("edge_index missing", run(P.edges(), {}), "edge_index"),
            ("edge_index list", run(P.edges(), {"edge_index": [[0], [0]]}), "edge_index"),
            # documents (P.same)
            ("documents float", run(P.same("documents"), {"documents": ids.float()}),
             "documents"),
            ("documents shape", run(P.same("documents"), {"documents": ids[:, :1]}),
             "documents"),
            ("documents missing", run(P.same("documents"), {}), "documents"),
            ("documents bool", run(P.same("documents"), {"documents": ids.bool()}),
             "documents"),
            # the constructors and the call
            ("window -1", lambda: P.window(-1), "window", "w"),
            ("window float", lambda: P.window(1.5), "window", "w"),
            ("chunked 0", lambda: P.chunked(0), "chunk"),
            ("chunked left -1", lambda: P.chunked(2, left=-1), "left"),
            ("neighborhood even", lambda: P.neighborhood(2), "kernel_size"),
            ("neighborhood dilation 0", lambda: P.neighborhood(3, dilation=0), "dilation"),
            ("same int key", lambda: P.same(3), "key"),
            ("modality int", lambda: P.modality(query=3), "query"),
            ("per_modality list", lambda: P.per_modality(within=[P.full()]), "within"),
            ("per_modality value", lambda: P.per_modality(within={"text": 3}), "within"),
            ("per_modality across", lambda: P.per_modality(within={}, across=1), "across"),
            ("edges loops str", lambda: P.edges(self_loops="yes"), "self_loops"),
            ("and keyword", lambda: bool(P.full()), "&"),  # `P.full() and ...` calls bool
            ("dense of a tensor", lambda: P.causal().dense(x), "tokens"),
            ("compile block 0", lambda: P.causal().compile(Tokens(x), block_size=0),
             "block_size"),
            ("compile block float", lambda: P.causal().compile(Tokens(x), block_size=2.0),
             "block_size"),
            ("runs float", lambda: P.runs(ids.float()), "ids"),
            ("mask of other L", lambda: mmattn.MultiHeadAttention(D, H)(
                x, attn_mask=P.causal().compile(Tokens(f.randn(b, n + 1, D)))), "attn_mask"),
            ("mask on LocalAttention", lambda: mmattn.LocalAttention(D, H, 1)(
                x, attn_mask=P.causal().compile(Tokens(x))), "attn_mask"),
            ("block pattern str", lambda: mmattn.TransformerBlock(D, H, pattern="causal"),
             "pattern"),
            ("block pattern and mask", lambda: mmattn.TransformerBlock(
                D, H, pattern=P.causal())(Tokens(x), attn_mask=torch.ones(n, n).bool()),
             "attn_mask", "pattern"),
        ]
        for name, fn, *names in cases:
            f.invalid(f"{tag} meta {name}", fn, *names)
        grids = torch.tensor([[1, min(n, 2)]] * b)  # valid: a (B, 2) tensor [item 11]
        want = torch.stack([base.nbhd_allowed(1, min(n, 2), 3)] * b)
        want = torch.nn.functional.pad(want, (0, n - want.shape[-1], 0, n - want.shape[-1]))
        f.valid(f"{tag} meta grids (B, 2) tensor [item 11]",
                lambda: nb.dense(Tokens(x, None, {"grids": grids})).float(),
                lambda: want.float(), atol=0.0)

    # -------------------------------------------------------------- empty sizes
    def empty(self, tag):
        f, r = self.f, self.f.rng
        b, n = r.choice([(0, 3), (2, 0), (0, 0)])
        x = f.randn(b, n, D)
        rows = torch.zeros(b, n, dtype=torch.long)
        meta = {"documents": rows, "modality_ids": rows, "modalities": ["text"],
                "segments": rows, "edge_index": torch.zeros(2, 0, dtype=torch.long)}
        if n:
            meta["grid"] = (1, n)
        pattern, _ = random_pattern(f, Scene(f, 1, "ids"))  # a shape; its rule is not needed
        zeros = torch.zeros(b, n, n)
        for p in (pattern, P.causal(), P.same("documents") & P.chunked(2, left=1),
                  P.per_modality(within={"text": P.window(1)}), P.edges()) + (
                      (P.neighborhood(3) & P.full(),) if n else ()):
            tokens = Tokens(x, None, meta)
            item = " [item 7]" if "neighborhood" in repr(p) else ""
            f.valid(f"{tag} empty B={b} L={n} {p!r} dense{item}"[:160],
                    lambda p=p, t=tokens: p.dense(t).float(), lambda: zeros, atol=0.0)
            f.valid(f"{tag} empty B={b} L={n} {p!r} compile{item}"[:160],
                    lambda p=p, t=tokens: p.compile(t, block_size=2).dense().float(),
                    lambda: zeros, atol=0.0)
            for make in (lambda p=p: mmattn.TransformerBlock(D, H, pattern=p),
                         lambda p=p: mmattn.Encoder(D, num_heads=H, depth=2, pattern=p)):
                model = make().eval()
                f.valid(f"{tag} empty B={b} L={n} {type(model).__name__}(pattern={p!r})"
                        f"{item}"[:160], lambda m=model, t=tokens: m(t).x,
                        lambda: torch.zeros(b, n, D))
        layer = mmattn.MultiHeadAttention(D, H, **random_modifiers(f)).eval()
        bias = layer.out_proj.bias.detach()
        f.valid(f"{tag} empty B={b} L={n} MHA(attn_mask=SparseMask)",
                lambda: layer(x, attn_mask=P.causal().compile(Tokens(x)))[0],
                lambda: bias.expand(b, n, D))

    # -------------------------------------------------------------- score modifiers
    def modifiers(self, tag):
        f, r = self.f, self.f.rng
        b, n = r.choice([1, 2]), r.randint(1, 7)
        x = f.randn(b, n, D)
        pad = torch.zeros(b, n, dtype=torch.bool)
        if b > 1 and n > 1:
            pad[1, r.randint(1, n - 1):] = True
        mods = random_modifiers(f)
        real = ~pad
        keys = real[:, None, None, :].expand(b, 1, n, n)
        layer = with_sinks(mmattn.MultiHeadAttention(D, H, **mods).eval(), f)
        w = r.randint(0, 3)
        local = with_sinks(mmattn.LocalAttention(D, H, w, **mods).eval(), f)
        band = base.band(n, w, False)[None, None]
        with torch.no_grad():
            f.valid(f"{tag} MultiHeadAttention {mods} B={b} L={n}",
                    lambda: layer(x, key_padding_mask=pad)[0],
                    lambda: layer_ref(layer, x, keys)[0].float())
            f.valid(f"{tag} LocalAttention w={w} {mods} B={b} L={n}",
                    lambda: local(x, key_padding_mask=pad)[0],
                    lambda: layer_ref(local, x, keys & band)[0].float())
            rows, cols, size = r.randint(1, 3), r.randint(1, 3), r.choice([1, 3])
            grid = [(i // cols, i % cols) for i in range(rows * cols)]
            xs = f.randn(b, rows * cols, D)
            nbhd = with_sinks(mmattn.NeighborhoodAttention(D, H, size, **mods).eval(), f)
            f.valid(f"{tag} NeighborhoodAttention {rows}x{cols} k={size} {mods}",
                    lambda: nbhd(xs, grid=(rows, cols))[0],
                    lambda: layer_ref(nbhd, xs, base.nbhd_allowed(rows, cols, size)[None, None],
                                      q_pos=grid, k_pos=grid)[0].float())
            cross_mods = dict(mods, alibi=False)  # two sequences: no distance
            cross = with_sinks(mmattn.CrossAttention(D, H, **cross_mods).eval(), f)
            ctx = f.randn(b, r.randint(1, 5), D)
            f.valid(f"{tag} CrossAttention {cross_mods}", lambda: cross(x, ctx, ctx)[0],
                    lambda: layer_ref(cross, x, torch.ones(1, 1, 1, 1, dtype=torch.bool),
                                      context=ctx)[0].float())
            f.valid(f"{tag} MHA need_weights {mods}",
                    lambda: layer(x, key_padding_mask=pad, need_weights=True,
                                  average_attn_weights=False)[1],
                    lambda: layer_ref(layer, x, keys)[1].float())
        M = mmattn.MultiHeadAttention
        for name, fn, *names in [
            ("sinks str", lambda: M(D, H, sinks="yes"), "sinks"),
            ("sinks int", lambda: M(D, H, sinks=1), "sinks"),
            ("softcap 0", lambda: M(D, H, softcap=0.0), "softcap"),
            ("softcap negative", lambda: M(D, H, softcap=-1.0), "softcap"),
            ("softcap nan", lambda: M(D, H, softcap=float("nan")), "softcap"),
            ("softcap inf", lambda: M(D, H, softcap=float("inf")), "softcap"),
            ("softcap str", lambda: M(D, H, softcap="3"), "softcap"),
            ("softcap bool", lambda: M(D, H, softcap=True), "softcap"),
            ("softcap tensor", lambda: M(D, H, softcap=torch.ones(2)), "softcap"),
            ("alibi int", lambda: M(D, H, alibi=1), "alibi"),
            ("alibi str", lambda: M(D, H, alibi="yes"), "alibi"),
            ("alibi cross", lambda: mmattn.CrossAttention(D, H, alibi=True), "alibi"),
            ("alibi edges", lambda: mmattn.EdgeAttention(D, H, alibi=True), "alibi"),
            ("alibi linformer", lambda: mmattn.LinformerAttention(D, H, 8, 4, alibi=True),
             "alibi"),
            ("alibi bias_kv", lambda: M(D, H, alibi=True, add_bias_kv=True), "alibi"),
            ("sinks local str", lambda: mmattn.LocalAttention(D, H, 1, sinks="no"), "sinks"),
            ("softcap nbhd 0", lambda: mmattn.NeighborhoodAttention(D, H, 3, softcap=0),
             "softcap"),
        ]:
            f.invalid(f"{tag} modifiers {name}", fn, *names)

    # -------------------------------------------------------------- chunk caches
    def streams(self, tag):
        f, r = self.f, self.f.rng
        b, c, left, n = r.choice([0, 1, 2]), r.randint(1, 4), r.randint(0, 2), r.randint(1, 10)
        mods = random_modifiers(f)
        layer = with_sinks(mmattn.MultiHeadAttention(D, H, **mods).eval(), f)
        x = f.randn(b, n, D)
        pad = torch.zeros(b, n, dtype=torch.bool)
        if b > 1 and n > 1 and r.random() < 0.5:
            pad[1, r.randint(1, n - 1):] = True
        rule = chunk_rule(n, c, left)
        allowed = rule[None, None] & (~pad)[:, None, None, :] & (~pad)[:, None, :, None]

        def stream():
            cache = layer.make_cache(b, chunk=c, left=left)
            return torch.cat([layer(x[:, s:s + c], key_padding_mask=pad[:, s:s + c],
                                    cache=cache)[0] for s in range(0, n, c)], 1)

        with torch.no_grad():
            f.valid(f"{tag} ChunkCache B={b} chunk={c} left={left} L={n} {mods}", stream,
                    lambda: layer_ref(layer, x, allowed)[0].float())
        one = torch.ones(max(b, 1), c, D)
        bb = max(b, 1)

        def after_short():
            cache = layer.make_cache(bb, chunk=c + 1)
            layer(one, cache=cache)
            return layer(one, cache=cache)

        other = mmattn.MultiHeadAttention(D, H).eval()
        mk = layer.make_cache
        for name, fn, *names in [
            ("chunk 0", lambda: mk(bb, chunk=0), "chunk"),
            ("chunk float", lambda: mk(bb, chunk=1.5), "chunk"),
            ("left -1", lambda: mk(bb, chunk=c, left=-1), "left"),
            ("right 1", lambda: mk(bb, chunk=c, right=1), "right"),
            ("max_len with chunk", lambda: mk(bb, 8, chunk=c), "max_len", "chunk"),
            ("batch negative", lambda: mk(-1, chunk=c), "batch_size"),
            ("local chunk", lambda: mmattn.LocalAttention(D, H, 1).make_cache(bb, chunk=c),
             "chunk"),
            ("nbhd left", lambda: mmattn.NeighborhoodAttention(D, H, 3).make_cache(
                bb, 4, left=1), "left"),
            ("chunk too long", lambda: layer(torch.ones(bb, c + 1, D),
                                             cache=mk(bb, chunk=c)), "chunk"),
            ("after a short chunk", after_short, "chunk"),
            ("batch mismatch", lambda: layer(torch.ones(bb + 1, c, D), cache=mk(bb, chunk=c)),
             "batch"),
            ("key shorter [item 3]", lambda: layer(one, one[:, :max(c - 1, 0)],
                                                   cache=mk(bb, chunk=c, left=left)), "key"),
            ("is_causal", lambda: layer(one, cache=mk(bb, chunk=c), is_causal=True),
             "is_causal"),
            ("attn_mask", lambda: layer(one, attn_mask=torch.ones(c, c).bool(),
                                        cache=mk(bb, chunk=c)), "attn_mask"),
            ("padding float", lambda: layer(one, key_padding_mask=torch.zeros(bb, c),
                                            cache=mk(bb, chunk=c)), "key_padding_mask"),
            ("another module", lambda: other(one, cache=mk(bb, chunk=c)), "cache"),
            ("dtype", lambda: layer(one.double(), cache=mk(bb, chunk=c)), "dtype", "query"),
            ("cache str", lambda: layer(one, cache="cache"), "cache"),
            ("unbatched", lambda: layer(one[0], cache=mk(bb, chunk=c)), "batched", "cache"),
            ("block chunk mismatch [item 10]", lambda: mmattn.TransformerBlock(
                D, H, pattern=P.chunked(c, left=left)).eval()(Tokens(one), cache=mmattn.
                TransformerBlock(D, H).attn.make_cache(bb, chunk=c + 1, left=left)),
             "chunk", "cache"),
        ]:
            f.invalid(f"{tag} chunk cache {name}", fn, *names)
        blk = mmattn.TransformerBlock(D, H, pattern=P.chunked(c, left=left)).eval()
        real = torch.tensor((~pad).tolist(), dtype=torch.float64).reshape(b, n)

        def block_stream():
            cache = blk.attn.make_cache(b, chunk=c, left=left)
            return torch.cat([blk(Tokens(x[:, s:s + c], ~pad[:, s:s + c]), cache=cache).x
                              for s in range(0, n, c)], 1)

        with torch.no_grad():
            f.valid(f"{tag} TransformerBlock(pattern=chunked) stream [item 10]", block_stream,
                    lambda: block_ref(blk, x, real, allowed).float())

    # -------------------------------------------------------------- encoder caches
    def encoder_streams(self, tag):
        f, r = self.f, self.f.rng
        b, c, left, n, depth = (r.choice([1, 2]), r.randint(1, 4), r.randint(0, 2),
                                r.randint(1, 9), r.randint(1, 2))
        enc = mmattn.Encoder(D, num_heads=H, depth=depth,
                             pattern=P.chunked(c, left=left)).eval()
        x = f.randn(b, n, D)
        real = torch.ones(b, n, dtype=torch.bool)
        if b > 1 and n > 1 and r.random() < 0.5:
            real[1, r.randint(1, n - 1):] = False
        rule = chunk_rule(n, c, left)
        allowed = rule[None, None] & real[:, None, None, :] & real[:, None, :, None]
        weight = real.double()

        def reference():
            y = x.double()
            for block in enc.blocks:
                y = block_ref(block, y, weight, allowed)
            return (copy.deepcopy(enc.norm).double()(y) * weight[..., None]).float()

        def stream():
            cache = enc.make_cache(b)
            return torch.cat([enc(Tokens(x[:, s:s + c], real[:, s:s + c]), cache=cache).x
                              for s in range(0, n, c)], 1)

        with torch.no_grad():
            f.valid(f"{tag} Encoder stream B={b} chunk={c} left={left} L={n} depth={depth}",
                    stream, reference)
        one = Tokens(torch.ones(b, c, D))
        plain = mmattn.Encoder(D, num_heads=H, depth=1).eval()
        for name, fn, *names in [
            ("no pattern", lambda: plain.make_cache(b), "pattern"),
            ("other pattern", lambda: mmattn.Encoder(
                D, num_heads=H, depth=1, pattern=P.causal()).make_cache(b), "pattern"),
            ("looks ahead", lambda: mmattn.Encoder(D, num_heads=H, depth=1, pattern=P.chunked(
                c, right=1)).make_cache(b), "right"),
            ("batch float", lambda: enc.make_cache(1.5), "batch_size"),
            ("another encoder", lambda: mmattn.Encoder(
                D, num_heads=H, depth=depth, pattern=P.chunked(c, left=left))(
                one, cache=enc.make_cache(b)), "cache"),
            ("a layer cache", lambda: enc(one, cache=enc.blocks[0].attn.make_cache(
                b, chunk=c)), "cache"),
            ("batch mismatch", lambda: enc(Tokens(torch.ones(b + 1, c, D)),
                                           cache=enc.make_cache(b)), "batch"),
            ("chunk too long", lambda: enc(Tokens(torch.ones(b, c + 1, D)),
                                           cache=enc.make_cache(b)), "chunk"),
            ("attn_mask", lambda: enc(one, torch.ones(c, c).bool(), cache=enc.make_cache(b)),
             "attn_mask"),
            ("packed", lambda: enc(one.pack(), cache=enc.make_cache(b)), "packed"),
            ("tensor input", lambda: enc(one.x, cache=enc.make_cache(b)), "tokens"),
        ]:
            f.invalid(f"{tag} encoder cache {name}", fn, *names)

    # -------------------------------------------------------------- attention mass, top keys
    def mass(self, tag):
        f, r = self.f, self.f.rng
        scene = Scene(f, r.choice([1, 2]), r.choice(["spans", "ids"]))
        mods = random_modifiers(f)
        layer = with_sinks(mmattn.MultiHeadAttention(D, H, **mods).eval(), f)
        real = torch.tensor(scene.real, dtype=torch.bool).reshape(scene.batch, -1)
        n = scene.length
        keys = real[:, None, None, :].expand(scene.batch, 1, n, n)
        label = f"{tag} {scene.kind} B={scene.batch} L={n} {mods}"

        def table():
            weights = layer_ref(layer, scene.x, keys)[1]  # (b, h, i, j)
            names = scene.names
            out = torch.full((1, H, len(names), len(names)), float("nan"), dtype=torch.float64)
            for m in range(len(names)):
                rows = [(b, i) for b in range(scene.batch) for i in range(n)
                        if scene.real[b][i] and scene.modality[b][i] == m]
                for c in range(len(names)):
                    if not rows:
                        continue
                    total = sum(weights[b, :, i, [j for j in range(n)
                                                  if scene.modality[b][j] == c]].sum(-1)
                                for b, i in rows)
                    out[0, :, m, c] = total / len(rows)
            return out

        def measured():
            got = attention_mass(layer, scene.tokens).table.double()
            want = table()
            return torch.where(want.isnan(), 0.0, got)  # no query of that modality: any value

        with torch.no_grad():
            if scene.modality is not None and any(v >= 0 for row in scene.modality for v in row):
                f.valid(f"{label} attention_mass", measured,
                        lambda: torch.nan_to_num(table(), 0.0))
            k = r.randint(1, n + 2)

            def top():  # padded queries list nothing (weight 0)
                weights = layer_ref(layer, scene.x, keys)[1] * real[:, None, :, None]
                pad = torch.zeros(*weights.shape[:-1], max(k - n, 0), dtype=torch.float64)
                return torch.cat([weights, pad], -1).topk(k).values[None].float()

            f.valid(f"{label} top_keys k={k}",
                    lambda: top_keys(layer, scene.tokens, k=k).weights, top)
        t = scene.tokens
        for name, fn, *names in [
            ("model str", lambda: attention_mass("model", t), "model"),
            ("by str", lambda: attention_mass(layer, t, by="token"), "by"),
            ("block 0", lambda: attention_mass(layer, t, block_size=0), "block_size"),
            ("block float", lambda: attention_mass(layer, t, block_size=2.5), "block_size"),
            ("no modality facts", lambda: attention_mass(layer, Tokens(scene.x)),
             "spans", "modality"),
            ("modalities str [item 2]", lambda: attention_mass(layer, Tokens(
                scene.x, None, {"modality_ids": torch.zeros(scene.batch, n, dtype=torch.long),
                                "modalities": "text"})), "modalities"),
            ("top k 0", lambda: top_keys(layer, t, k=0), "k"),
            ("top k float", lambda: top_keys(layer, t, k=2.0), "k"),
            ("top k bool", lambda: top_keys(layer, t, k=True), "k"),
            ("top model None", lambda: top_keys(None, t), "model"),
            ("top block -1", lambda: top_keys(layer, t, block_size=-1), "block_size"),
        ]:
            f.invalid(f"{tag} mass {name}", fn, *names)


def main() -> int:
    return base.main(only="fourth")


if __name__ == "__main__":
    sys.exit(main())
