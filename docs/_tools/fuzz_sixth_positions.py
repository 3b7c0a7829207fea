"""The sixth wave's position cases for ``fuzz_sixth_wave.py`` (issue 42): MultiAxisRotary
and RotaryEmbedding at per-token positions, ``positions=`` on the layers, KV-cache decoding,
blocks and ``MultiModalEncoder(positions=mrope_positions)``, and ``mrope_positions``, each
against ``fuzz_sixth_refs.py``; and their bad arguments.
"""

from __future__ import annotations

import copy

import fuzz_api as base
import fuzz_sixth_refs as refs
import torch

import mmattn
from adapters import VideoPatcher
from mmattn import Tokens
from mmattn import patterns as P
from mmattn.rotary import MultiAxisRotary, RotaryEmbedding, mrope_positions

D = base.D
DP, HP = 24, 2  # the width of the positions cases: heads of 12, 6 frequency pairs


class _Vectors(torch.nn.Module):
    """A minimal adapter: (B, L, 3) vectors to Tokens of width ``d``."""

    def __init__(self, d):
        super().__init__()
        self.proj = torch.nn.Linear(3, d)

    def forward(self, v):
        return Tokens(self.proj(v))


def _split(total, parts, r):
    """A random composition of ``total`` into ``parts`` positive ints."""
    cuts = sorted(r.sample(range(1, total), parts - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


def _key_pad(b, n, r):
    pad = torch.zeros(b, n, dtype=torch.bool)
    if b > 1 and n > 1 and r.random() < 0.5:
        pad[1, r.randint(1, n - 1):] = True
    return pad




class PositionCases:
    """Rotary, positions and M-RoPE subjects (mixed into ``SixthWave``, which holds ``f``)."""

    # -------------------------------------------------------------- MultiAxisRotary
    def rotary(self, tag):
        f, r = self.f, self.f.rng
        pairs = r.randint(1, 6)
        e, axes = 2 * pairs, r.randint(1, min(3, pairs))
        sections = _split(pairs, axes, r)
        base_ = r.choice([10000.0, 100.0, 2.5])
        rope = MultiAxisRotary(e, sections, base=base_)
        b, h, n = r.choice([0, 1, 2]), r.choice([1, 2]), r.randint(1, 6)
        x = f.randn(b, h, n, e)
        shared = r.random() < 0.3
        shape = (n, axes) if shared else (b, n, axes)
        pos = (torch.randint(0, 20, shape, generator=f.gen) if r.random() < 0.7 else
               torch.rand(shape, generator=f.gen) * 20)
        label = f"{tag} MultiAxisRotary e={e} sections={sections} base={base_} B={b} L={n}"
        f.valid(f"{label} positions {tuple(shape)} {pos.dtype}", lambda: rope(x, pos),
                lambda: refs.rotate(x, pos if not shared else pos[None], sections,
                                    base_).float())
        offset = r.randint(0, 9)
        line = (torch.arange(n) + offset)[None, :, None].expand(1, n, axes)
        f.valid(f"{label} offset {offset}", lambda: rope(x, offset),
                lambda: refs.rotate(x, line, sections, base_).float())
        one = torch.randint(0, 20, (b, n), generator=f.gen)
        f.valid(f"{tag} RotaryEmbedding e={e} per-token (B, L) positions",
                lambda: RotaryEmbedding(e, base=base_)(x, one),
                lambda: refs.rotate(x, one[..., None], (pairs,), base_).float())
        f.valid(f"{label} equal axes = RotaryEmbedding",
                lambda: rope(x, one[..., None].expand(b, n, axes)),
                lambda: RotaryEmbedding(e, base=base_)(x, one))
        M = MultiAxisRotary
        for name, fn, *names in [
            ("sections sum", lambda: M(e, (*sections[:-1], sections[-1] + 1)), "sections"),
            ("sections empty", lambda: M(e, ()), "sections"),
            ("sections str", lambda: M(e, "123"), "sections"),
            ("sections int", lambda: M(e, pairs), "sections"),
            ("sections zero", lambda: M(e, (0, pairs)), "sections"),
            ("sections float", lambda: M(e, (float(pairs),)), "sections"),
            ("sections bool", lambda: M(2, (True,)), "sections"),
            ("sections negative", lambda: M(e, (-1, pairs + 1)), "sections"),
            ("head_dim odd", lambda: M(e + 1, sections), "head_dim"),
            ("head_dim 0", lambda: M(0, ()), "head_dim", "sections"),
            ("head_dim float", lambda: M(float(e), sections), "head_dim"),
            ("base 1", lambda: M(e, sections, base=1.0), "base"),
            ("base -1", lambda: M(e, sections, base=-1.0), "base"),
            ("base str", lambda: M(e, sections, base="10000"), "base"),
            ("base nan", lambda: M(e, sections, base=float("nan")), "base"),
            ("positions axes+1", lambda: rope(x, torch.zeros(b, n, axes + 1)), "positions"),
            ("positions L+1", lambda: rope(x, torch.zeros(b, n + 1, axes)), "positions"),
            ("positions B+1", lambda: rope(x, torch.zeros(b + 1, n, axes)), "positions"),
            ("positions (L,)", lambda: rope(x, torch.zeros(n, dtype=torch.long)),
             "positions"),
            ("positions bool", lambda: rope(x, torch.zeros(b, n, axes, dtype=torch.bool)),
             "positions"),
            ("positions complex", lambda: rope(x, torch.zeros(b, n, axes,
                                                              dtype=torch.complex64)),
             "positions"),
            ("positions meta device", lambda: rope(x, torch.zeros(b, n, axes, device="meta")),
             "positions"),
            ("positions list", lambda: rope(x, [[0] * axes] * n), "positions", "offset"),
            ("positions str", lambda: rope(x, "0"), "positions", "offset"),
            ("x long", lambda: rope(x.long(), pos), "x"),
            ("x width", lambda: rope(f.randn(b, h, n, e + 2), pos), "x"),
            ("x 1-D", lambda: rope(torch.ones(e), 0), "x"),
            ("x list", lambda: rope([[0.0] * e], 0), "x"),
            ("1-D positions (B, L, 1)", lambda: RotaryEmbedding(e)(x, one[..., None]),
             "positions"),
            ("1-D positions bool", lambda: RotaryEmbedding(e)(x, one > 0), "positions"),
            ("offset negative", lambda: rope(x, -1), "offset"),
            ("offset float", lambda: rope(x, 1.5), "offset"),
        ]:
            f.invalid(f"{tag} rotary {name}", fn, *names)

    # -------------------------------------------------------------- positions= on layers
    def positions(self, tag):
        f, r = self.f, self.f.rng
        axes = r.randint(1, 3)
        sections = _split(DP // HP // 2, axes, r)
        b, n = r.choice([0, 1, 2]), r.randint(1, 8)
        x = f.randn(b, n, DP)
        pos = torch.randint(0, 12, (b, n, axes), generator=f.gen)
        if r.random() < 0.3:  # positions may be floats (fractional frame times)
            pos = pos + torch.rand(b, n, axes, generator=f.gen)
        pad = _key_pad(b, n, r)
        keys = ~pad[:, None]

        def turn(t):
            return refs.rotate(t, pos, sections)

        rope = MultiAxisRotary(DP // HP, sections)
        w = r.randint(0, 3)
        rows = r.choice([d for d in range(1, n + 1) if n % d == 0])
        size = r.choice([1, 3])
        layers = [
            ("MultiHeadAttention", mmattn.MultiHeadAttention(DP, HP, position=rope),
             {}, torch.ones(n, n, dtype=torch.bool)),
            (f"LocalAttention w={w}", mmattn.LocalAttention(DP, HP, w, position=rope), {},
             base.band(n, w, False)),
            (f"NeighborhoodAttention {rows}x{n // rows} k={size}",
             mmattn.NeighborhoodAttention(DP, HP, size, position=rope),
             {"grid": (rows, n // rows)}, refs.nbhd_mask((rows, n // rows), (size, size),
                                                         (1, 1), (False, False))),
            ("MHA + P.causal() SparseMask", mmattn.MultiHeadAttention(DP, HP, position=rope),
             {"attn_mask": P.causal().compile(Tokens(x, ~pad))},
             torch.ones(n, n, dtype=torch.bool).tril()),
        ]
        label = f"{tag} positions sections={sections} B={b} L={n}"
        with torch.no_grad():
            for name, layer, kwargs, allowed in layers:
                layer.eval()
                want = allowed[None] & keys
                if "attn_mask" in kwargs:  # a pattern never lets padded queries attend
                    want = want & ~pad[:, :, None]
                f.valid(f"{label} {name}",
                        lambda m=layer, kw=kwargs: m(x, key_padding_mask=None if "attn_mask"
                                                     in kw else pad, positions=pos, **kw)[0],
                        lambda m=layer, a=want: refs.layer(m, x, a, turn).float())
            flat = pos[..., 0]
            rotary = mmattn.MultiHeadAttention(DP, HP, position="rotary").eval()
            f.valid(f"{label} MHA(position='rotary') (B, L)",
                    lambda: rotary(x, key_padding_mask=pad, positions=flat)[0],
                    lambda: refs.layer(rotary, x, keys, lambda t: refs.rotate(
                        t, flat[..., None], (DP // HP // 2,))).float())
            mha = layers[0][1]

            def decode():  # one token at a time with a KV cache and each token's position
                cache = mha.make_cache(b, n)
                return torch.cat([mha(x[:, s:s + 1], cache=cache, is_causal=True,
                                      positions=pos[:, s:s + 1])[0]
                                  for s in range(n)], 1)

            f.valid(f"{label} KVCache decode with positions", decode,
                    lambda: refs.layer(mha, x, torch.ones(n, n, dtype=torch.bool).tril()[None],
                                       turn).float())
            blk = mmattn.TransformerBlock(DP, HP, attention_kwargs={"position": rope}).eval()
            real = (~pad).double()

            def block_ref():
                twin = copy.deepcopy(blk).double()
                y = x.double() * real[..., None]
                y = y + refs.layer(blk.attn, twin.norm1(y), keys, turn)
                y = y + twin.mlp(twin.norm2(y))
                return (y * real[..., None]).float()

            f.valid(f"{label} TransformerBlock meta['positions']",
                    lambda: blk(Tokens(x, ~pad, {"positions": pos})).x, block_ref)
            f.valid(f"{label} TransformerBlock packed, meta['positions']",
                    lambda: blk(Tokens(x, ~pad, {"positions": pos}).pack()).unpack().x,
                    lambda: block_ref()[:, :max([int((~p).sum()) for p in pad], default=0)])
            self._encoder(tag, sections)
            kv = mmattn.MultiHeadAttention(DP, HP, num_kv_heads=1, position=rope).eval()
            f.valid(f"{label} MHA num_kv_heads=1", lambda: kv(x, key_padding_mask=pad,
                                                               positions=pos)[0],
                    lambda: refs.layer(kv, x, keys, turn).float())
        M = mmattn.MultiHeadAttention
        plain, mha = M(DP, HP), layers[0][1]
        long = torch.zeros(b, n, dtype=torch.long)
        for name, fn, *names in [
            ("no position module", lambda: plain(x, positions=pos), "positions"),
            ("(B, L) for multi-axis", lambda: mha(x, positions=long), "positions"),
            ("(B, L, A) for 1-D", lambda: rotary(x, positions=pos), "positions"),
            ("axes+1", lambda: mha(x, positions=torch.zeros(b, n, axes + 1)), "positions"),
            ("L+1", lambda: mha(x, positions=torch.zeros(b, n + 1, axes)), "positions"),
            ("B+1", lambda: mha(x, positions=torch.zeros(b + 1, n, axes)), "positions"),
            ("bool", lambda: mha(x, positions=pos > 0), "positions"),
            ("complex", lambda: mha(x, positions=pos.to(torch.complex64)), "positions"),
            ("list", lambda: mha(x, positions=pos.tolist()), "positions"),
            ("meta device", lambda: mha(x, positions=torch.zeros(b, n, axes, device="meta")),
             "positions"),
            ("key of another length", lambda: mha(x, f.randn(b, n + 1, DP),
                                                  positions=pos), "key"),
            ("decode step of 2 positions", lambda: mha(
                x[:, :1], cache=mha.make_cache(b, n), is_causal=True,
                positions=torch.zeros(b, 2, axes)), "positions"),
            ("decode step, 1-D positions", lambda: mha(
                x[:, :1], cache=mha.make_cache(b, n), is_causal=True,
                positions=torch.zeros(b, 1)), "positions"),
            ("edge layer", lambda: mmattn.EdgeAttention(DP, HP)(
                x, edge_index=torch.zeros(2, 0, dtype=torch.long), positions=pos),
             "positions"),
            ("cross layer", lambda: mmattn.CrossAttention(DP, HP)(
                x, x, x, positions=pos), "positions"),
            ("local no position", lambda: mmattn.LocalAttention(DP, HP, 1)(
                x, positions=pos), "positions"),
            ("nbhd no position", lambda: mmattn.NeighborhoodAttention(DP, HP, 1)(
                x, grid=(n,), positions=pos), "positions"),
            ("block meta positions (B, L)", lambda: blk(Tokens(x, None, {"positions": long})),
             "positions"),
            ("block meta positions list", lambda: blk(Tokens(
                x, None, {"positions": pos.tolist()})), "positions"),
            ("position module width", lambda: M(DP, HP, position=MultiAxisRotary(6, (3,))),
             "position"),
            ("encoder positions str", lambda: mmattn.MultiModalEncoder(
                {"v": VideoPatcher(DP, 1, 1, None)}, DP, 1, HP, positions="mrope"),
             "positions"),
            ("encoder positions tensor", lambda: mmattn.MultiModalEncoder(
                {"v": VideoPatcher(DP, 1, 1, None)}, DP, 1, HP, positions=pos), "positions"),
        ]:
            f.invalid(f"{tag} positions {name}", fn, *names)

    def _encoder(self, tag, sections):
        """MultiModalEncoder(positions=mrope_positions): text + video, the blocks written out
        with the positions of the reference rule."""
        f, r = self.f, self.f.rng
        b, words = r.choice([1, 2]), r.randint(1, 3)
        steps, rows, cols = r.randint(1, 2), r.randint(1, 3), r.randint(1, 3)
        rope = MultiAxisRotary(DP // HP, sections) if len(sections) == 3 else None
        if rope is None:
            return
        enc = mmattn.MultiModalEncoder(
            {"text": _Vectors(DP), "video": VideoPatcher(DP, 1, 1, None)}, DP, r.randint(1, 2),
            HP, attention_kwargs={"position": rope}, positions=mrope_positions).eval()
        inputs = {"text": f.randn(b, words, 3), "video": f.randn(b, 1, steps, rows, cols)}
        cells = steps * rows * cols
        pos = refs.mrope([(words, None, [[True] * words] * b),
                          (cells, (steps, rows, cols), [[True] * cells] * b)], b)
        label = f"{tag} MultiModalEncoder(positions=mrope_positions) text {words} + video " \
                f"{steps}x{rows}x{cols} sections={sections}"
        f.valid(f"{label} meta['positions']",
                lambda: enc.embed(inputs).meta["positions"].float(), lambda: pos.float(),
                atol=0.0)

        def reference():
            y = enc.embed(inputs).x.double()
            every = torch.ones(1, y.shape[1], y.shape[1], dtype=torch.bool)
            for block in enc.encoder.blocks:
                twin = copy.deepcopy(block).double()
                y = y + refs.layer(block.attn, twin.norm1(y), every,
                                   lambda t: refs.rotate(t, pos, sections))
                y = y + twin.mlp(twin.norm2(y))
            return copy.deepcopy(enc.encoder.norm).double()(y).float()

        f.valid(label, lambda: enc(inputs).x, reference)

    # -------------------------------------------------------------- mrope_positions
    def mrope(self, tag):
        f, r = self.f, self.f.rng
        b = r.choice([1, 2])
        names = r.sample(["text", "image", "video", "answer"], r.randint(1, 3))
        parts, inputs = [], {}
        for name in names:
            if name in ("text", "answer"):
                size, grid = r.randint(1, 4), None
                real = torch.ones(b, size, dtype=torch.bool)
                if b > 1 and size > 1 and r.random() < 0.5:
                    real[1, r.randint(1, size - 1):] = False
            else:
                grid = tuple(r.randint(1, 3) for _ in range(2 if name == "image" else 3))
                size = int(torch.tensor(grid).prod())
                real = torch.ones(b, size, dtype=torch.bool)
                if name == "video" and b > 1 and grid[0] > 1 and r.random() < 0.5:
                    real[1, size // grid[0] * r.randint(1, grid[0] - 1):] = False
            parts.append((size, grid, real.tolist()))
            meta = {} if grid is None else {"grid": grid}
            inputs[name] = Tokens(f.randn(b, size, D), real, meta)
        fused = Tokens.cat(inputs)
        f.valid(f"{tag} mrope_positions {[(n, p[1]) for n, p in zip(names, parts)]} B={b}",
                lambda: mrope_positions(fused).float(), lambda: refs.mrope(parts, b).float(),
                atol=0.0)
        want = refs.mrope(parts, b)
        alive = fused.full_mask()
        longest = int(alive.sum(1).max()) if b else 0
        packed_want = torch.zeros(b, longest, 3, dtype=torch.long)
        for m in range(b):
            packed_want[m, :int(alive[m].sum())] = want[m][alive[m]]
        f.valid(f"{tag} mrope_positions packed", lambda: mrope_positions(fused.pack()).float(),
                lambda: packed_want.float(), atol=0.0)
        size, grid, real = parts[0]
        single = Tokens(f.randn(b, size, D), None, {} if grid is None else {"grid": grid})
        f.valid(f"{tag} mrope_positions one part grid={grid}",
                lambda: mrope_positions(single).float(),
                lambda: refs.mrope([(size, grid, [[True] * size] * b)], b).float(), atol=0.0)
        x4 = f.randn(b, 4, D)

        def one_part(meta):
            return lambda: mrope_positions(Tokens(x4, None, meta))

        def in_span(meta):
            return lambda: mrope_positions(Tokens.cat({"text": Tokens(x4), "image": Tokens(
                x4, None, meta)}))

        for name, fn, *names_ in [
            ("tokens tensor", lambda: mrope_positions(x4), "tokens"),
            ("tokens None", lambda: mrope_positions(None), "tokens"),
            ("modality_ids without spans", one_part(
                {"modality_ids": torch.zeros(b, 4, dtype=torch.long),
                 "modalities": ["text"]}), "spans"),
            ("grid float", one_part({"grid": (2.0, 2)}), "grid"),
            ("grid bool", one_part({"grid": (True, 4)}), "grid"),
            ("grid 4 sides", one_part({"grid": (1, 1, 2, 2)}), "grid"),
            ("grid 1 side", one_part({"grid": (4,)}), "grid"),
            ("grid zero", one_part({"grid": (0, 4)}), "grid"),
            ("grid too small", one_part({"grid": (1, 3)}), "grid"),
            ("grid str", one_part({"grid": "2x2"}), "grid"),
            ("grids B+1", one_part({"grids": [(2, 2)] * (b + 1)}), "grids"),
            ("span grid float", in_span({"grid": (2, 2.0)}), "grid"),
            ("span grid too small", in_span({"grid": (1, 1, 3)}), "grid"),
            ("spans past L", one_part({"spans": {"text": (0, 9)}, "text": {}}), "spans"),
        ]:
            f.invalid(f"{tag} mrope {name}", fn, *names_)
