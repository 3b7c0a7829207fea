"""Fuzz the sixth wave's surfaces (issues 42 and 44): video tubelets, neighbourhoods of 1 to 3
axes with causal axes and dilation, frame-causal patterns, multi-axis rotary positions and
``positions=`` on the layers, M-RoPE position ids, the video attention picture.

    python docs/_tools/fuzz_sixth_wave.py [--seed 0] [--rounds 40] [--timeout 20] [-v]

Run alone it fuzzes only these surfaces; ``docs/_tools/fuzz_api.py`` runs them with the
rest of the public API. The classes are fuzz_api's (ok / named / opaque / silent / refused /
hang). The references (``fuzz_sixth_refs.py`` beside this file) are float64 loops written
from DESIGN.md "Sixth wave", never from the library's helpers; the rotary, positions and
M-RoPE cases are in ``fuzz_sixth_positions.py``. ContextParallel has its own
multi-process fuzz (``fuzz_distributed.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fuzz_api as base  # noqa: E402
import fuzz_sixth_refs as refs  # noqa: E402
from fuzz_fourth_refs import layer_ref, random_modifiers, with_sinks  # noqa: E402
from fuzz_sixth_positions import PositionCases, _key_pad  # noqa: E402

import mmattn  # noqa: E402
from adapters import VideoPatcher  # noqa: E402
from mmattn import Tokens, masks  # noqa: E402
from mmattn import patterns as P  # noqa: E402
from mmattn.kernels import neighborhood  # noqa: E402
from mmattn.viz import video_attention  # noqa: E402

D, H = base.D, base.H


def _per_axis(r, axes, choices):
    """One value per axis, or (sometimes) one scalar for every axis."""
    values = tuple(r.choice(choices) for _ in range(axes))
    return (values[0], (values[0],) * axes) if r.random() < 0.3 else (values, values)


def _dense_and_tiles(f, label, pattern, tokens, want, block):
    """``pattern.dense`` and its SparseMask's ``dense()`` at ``block`` equal ``want``."""
    f.valid(f"{label} dense", lambda: pattern.dense(tokens).float(), lambda: want.float(),
            atol=0.0)
    f.valid(f"{label} compile({block})",
            lambda: pattern.compile(tokens, block_size=block).dense().float(),
            lambda: want.float(), atol=0.0)


class SixthWave(PositionCases):
    """The sixth wave's subjects, run on a ``fuzz_api.Fuzz`` (its rng, valid, invalid); the
    position subjects are ``PositionCases``' (``fuzz_sixth_positions.py``)."""

    def __init__(self, fuzz):
        self.f = fuzz

    def subjects(self):
        return (self.neighborhoods, self.video_layers, self.frames, self.fused, self.video,
                self.rotary, self.positions, self.mrope, self.picture)

    # -------------------------------------------------------------- neighbourhoods in 1-3 D
    def neighborhoods(self, tag):
        f, r = self.f, self.f.rng
        axes = r.choice([1, 2, 3, 3])
        grid = tuple(r.randint(1, 4) for _ in range(axes))
        kernel, kt = _per_axis(r, axes, [1, 3, 5])
        dilation, dt = _per_axis(r, axes, [1, 1, 2])
        causal, ct = _per_axis(r, axes, [False, True])
        g = r.choice([0, 0, 1])
        want = refs.nbhd_mask(grid, kt, dt, ct, g)
        n = want.shape[0]
        label = f"{tag} grid={grid} k={kernel} d={dilation} causal={causal} g={g}"
        f.valid(f"{label} masks.neighborhood_mask",
                lambda: masks.neighborhood_mask(grid, kernel, dilation=dilation, causal=causal,
                                                num_global_tokens=g).float(),
                lambda: want.float(), atol=0.0)
        b = r.choice([0, 1, 2])
        x = f.randn(b, n, D)
        pad = _key_pad(b, n, r)
        layer = mmattn.NeighborhoodAttention(D, H, kernel, dilation=dilation, causal=causal,
                                             num_global_tokens=g).eval()
        with torch.no_grad():
            f.valid(f"{label} NeighborhoodAttention B={b}",
                    lambda: layer(x, key_padding_mask=pad, grid=grid)[0],
                    lambda: refs.layer(layer, x, want[None] & ~pad[:, None]).float())
        q, k, v = (f.randn(b, H, n, 4) for _ in range(3))
        f.valid(f"{label} kernels.neighborhood_attend",
                lambda: neighborhood.neighborhood_attend(
                    q, k, v, grid, kernel, dilation=dilation, causal=causal,
                    num_global_tokens=g)[0],
                lambda: base.naive(q, k, v, want[None, None]).float())
        cells, extra = n - g, r.choice([0, 0, 2])  # tokens past the grid match nothing
        tokens = Tokens(f.randn(max(b, 1), cells + extra, D), None, {"grid": grid})
        grid_only = torch.zeros(cells + extra, cells + extra, dtype=torch.bool)
        grid_only[:cells, :cells] = want[g:, g:]
        pattern = P.neighborhood(kernel, dilation=dilation, causal=causal)
        block = r.choice([1, 2, 4, 64])
        _dense_and_tiles(f, f"{label} {pattern!r}", pattern, tokens,
                         grid_only.expand(max(b, 1), -1, -1), block)
        nm, NA = masks.neighborhood_mask, mmattn.NeighborhoodAttention
        three = mmattn.NeighborhoodAttention(D, H, (3, 3, 3), causal=(True, False, False))
        x3 = f.randn(1, 8, D)
        video = Tokens(x3, None, {"grid": (2, 2, 2)})
        for name, fn, *names in [
            ("grid float side", lambda: nm((2.0, 2, 2), 3), "grid"),
            ("grid bool side", lambda: nm((2, True, 2), 3), "grid"),
            ("grid 4 sides", lambda: nm((2, 2, 2, 2), 3), "grid"),
            ("grid zero side", lambda: nm((2, 0, 2), 3), "grid"),
            ("grid str", lambda: nm("222", 3), "grid"),
            ("kernel even on an axis", lambda: nm((2, 2, 2), (3, 2, 3)), "kernel_size"),
            ("kernel 2 for 3 axes", lambda: nm((2, 2, 2), (3, 3)), "kernel_size"),
            ("kernel float on an axis", lambda: nm((2, 2, 2), (3, 3.0, 3)), "kernel_size"),
            ("dilation 0 on an axis", lambda: nm((2, 2, 2), 3, dilation=(1, 0, 1)),
             "dilation"),
            ("dilation 2 for 3 axes", lambda: nm((2, 2, 2), 3, dilation=(1, 1)), "dilation"),
            ("causal 2 for 3 axes", lambda: nm((2, 2, 2), 3, causal=(True, False)), "causal"),
            ("causal str", lambda: nm((2, 2, 2), 3, causal="time"), "causal"),
            ("causal ints", lambda: nm((2, 2, 2), 3, causal=(1, 0, 0)), "causal"),
            ("causal None on an axis", lambda: nm((2, 2, 2), 3, causal=(True, None, False)),
             "causal"),
            ("globals -1", lambda: nm((2, 2, 2), 3, num_global_tokens=-1),
             "num_global_tokens"),
            ("layer kernel 4 axes", lambda: NA(D, H, (3, 3, 3, 3)), "kernel_size"),
            ("layer causal str", lambda: NA(D, H, 3, causal="yes"), "causal"),
            ("layer causal list of str", lambda: NA(D, H, 3, causal=("a", "b", "c")),
             "causal"),
            ("layer dilation float", lambda: NA(D, H, (3, 3, 3), dilation=(1, 1.5, 1)),
             "dilation"),
            ("layer grid mismatch", lambda: three(f.randn(1, 9, D), grid=(2, 2, 2)), "grid"),
            ("layer 2-D grid, 3 kernels", lambda: three(f.randn(1, 4, D), grid=(2, 2)),
             "kernel_size", "grid"),
            ("layer causal of 2 on a 3-D grid", lambda: NA(D, H, 3, causal=(True, False))(
                x3, grid=(2, 2, 2)), "causal=(True, False)"),
            ("layer kernel of 2 on a 3-D grid", lambda: NA(D, H, (3, 3))(x3, grid=(2, 2, 2)),
             "kernel_size"),
            ("layer grid float", lambda: three(x3, grid=(2, 2, 2.0)), "grid"),
            ("layer grid bool", lambda: three(x3, grid=(2, True, 4)), "grid"),
            ("layer grids of mixed axes", lambda: three(
                f.randn(2, 8, D), grid=[(2, 2, 2), (2, 4)]), "grid"),
            ("pattern even kernel", lambda: P.neighborhood((3, 2, 3)), "kernel_size"),
            ("pattern causal str", lambda: P.neighborhood(3, causal="t"), "causal"),
            ("pattern causal of 2 on 3-D", lambda: P.neighborhood(
                (3, 3, 3), causal=(True, False)), "causal"),
            ("pattern 2 kernels on 3-D grid", lambda: P.neighborhood((3, 3)).dense(video),
             "kernel_size", "grid"),
            ("pattern 2 causal on 3-D grid", lambda: P.neighborhood(
                3, causal=(True, False)).dense(video), "causal=(True, False)"),
            ("pattern kernel 4 axes", lambda: P.neighborhood((3, 3, 3, 3)), "kernel_size"),
            ("pattern dilation 0 axes", lambda: P.neighborhood(3, dilation=()), "dilation"),
            ("pattern grid float", lambda: P.neighborhood(3).dense(
                Tokens(x3, None, {"grid": (2, 2, 2.0)})), "grid"),
            ("pattern grid too large", lambda: P.neighborhood(3).dense(
                Tokens(x3, None, {"grid": (2, 2, 3)})), "grid"),
            ("kernel causal 2 on 3-D", lambda: neighborhood.neighborhood_attend(
                q, k, v, (1, 1, n), 1, causal=(True, False)), "causal"),
            ("kernel grid bool", lambda: neighborhood.neighborhood_attend(
                q, k, v, (True, 1, n), 1), "grid"),
        ]:
            f.invalid(f"{tag} nbhd3d {name}", fn, *names)

    # -------------------------------------------------------------- 3-D layer geometry
    def video_layers(self, tag):
        f, r = self.f, self.f.rng
        kernel = (r.choice([1, 3]), r.choice([1, 3, 5]), r.choice([1, 3]))
        dilation = (1, r.choice([1, 2]), 1)
        causal = (r.random() < 0.7, False, r.random() < 0.2)
        g = r.choice([0, 1])
        layer = mmattn.NeighborhoodAttention(D, H, kernel, dilation=dilation, causal=causal,
                                             num_global_tokens=g).eval()
        label = f"{tag} video NeighborhoodAttention k={kernel} d={dilation} c={causal} g={g}"
        # per-item grids: item m is its first g + prod(grid_m) tokens, as if alone
        grids = [tuple(r.randint(1, 3) for _ in range(3)) for _ in range(2)]
        sizes = [g + t * h * w for t, h, w in grids]
        n = max(sizes) + r.choice([0, 1])
        x = f.randn(2, n, D)
        real = torch.arange(n)[None] < torch.tensor(sizes)[:, None]

        def alone():
            rows = []
            for m, (grid, size) in enumerate(zip(grids, sizes)):
                want = refs.nbhd_mask(grid, kernel, dilation, causal, g)
                out = refs.layer(layer, x[m:m + 1, :size], want[None])[0]
                rows.append(torch.cat([out, torch.zeros(n - size, D, dtype=out.dtype)]))
            return torch.stack(rows).float()

        with torch.no_grad():
            f.valid(f"{label} per-item grids {grids}",
                    lambda: layer(x, key_padding_mask=~real, grid=grids)[0] * real[..., None],
                    alone)
            # grid_start: the grid inside a longer sequence, every other token global
            grid = grids[0]
            cells = grid[0] * grid[1] * grid[2]
            start, after = r.randint(0, 2), r.randint(0, 2)
            whole = torch.ones(start + cells + after, start + cells + after, dtype=torch.bool)
            whole[start:start + cells, start:start + cells] = refs.nbhd_mask(
                grid, kernel, dilation, causal)
            y = f.randn(1, whole.shape[0], D)
            f.valid(f"{label} grid_start={start} grid={grid} +{after}",
                    lambda: layer(y, grid=grid, grid_start=start)[0],
                    lambda: refs.layer(layer, y, whole[None]).float())
            mods = random_modifiers(f)
            mod = with_sinks(mmattn.NeighborhoodAttention(
                D, H, kernel, dilation=dilation, causal=causal, **mods).eval(), f)
            coords = [(i // (grid[1] * grid[2]), (i // grid[2]) % grid[1], i % grid[2])
                      for i in range(cells)]
            want = refs.nbhd_mask(grid, kernel, dilation, causal)[None, None]
            z = f.randn(1, cells, D)
            f.valid(f"{label} modifiers {mods} grid={grid}", lambda: mod(z, grid=grid)[0],
                    lambda: layer_ref(mod, z, want, q_pos=coords, k_pos=coords)[0].float())
            f.valid(f"{label} need_weights grid={grid}",
                    lambda: mod(z, grid=grid, need_weights=True)[1],
                    lambda: layer_ref(mod, z, want, q_pos=coords, k_pos=coords)[1].mean(
                        1).float())

    # -------------------------------------------------------------- fused video + text
    def fused(self, tag):
        f, r = self.f, self.f.rng
        b = r.choice([1, 2])
        steps, rows, cols = r.randint(1, 3), r.randint(1, 3), r.randint(1, 2)
        cells = steps * rows * cols
        words = r.randint(1, 4)
        frames = torch.arange(steps).repeat_interleave(rows * cols).expand(b, cells)
        video = Tokens(f.randn(b, cells, D), None, {"grid": (steps, rows, cols),
                                                    "frames": frames})
        text = Tokens(f.randn(b, words, D))
        order = r.choice([("text", "video"), ("video", "text")])
        fused = Tokens.cat({name: {"text": text, "video": video}[name] for name in order})
        n = cells + words
        at = 0 if order[0] == "video" else words  # where the video sits
        kernel = (r.choice([1, 3]), r.choice([1, 3]), r.choice([1, 3]))
        near = refs.nbhd_mask((steps, rows, cols), kernel, (1, 1, 1), (True, False, False))
        ids = [-1] * n
        ids[at:at + cells] = [c // (rows * cols) for c in range(cells)]
        by_frame = refs.frames_rule([ids], [[True] * n], n)[0]
        video_rule = torch.zeros(n, n, dtype=torch.bool)
        video_rule[at:at + cells, at:at + cells] = near
        video_rule |= by_frame
        text_at = [i for i in range(n) if ids[i] < 0]
        text_rule = torch.zeros(n, n, dtype=torch.bool)
        for i in text_at:
            for j in text_at:
                text_rule[i, j] = j <= i
        across = r.random() < 0.5
        rule = video_rule | text_rule
        if across:  # text sees all the video and the video all the text
            is_text = torch.tensor([i < 0 for i in ids])
            rule |= is_text[:, None] != is_text[None, :]
        pattern = P.per_modality(
            within={"video": P.neighborhood(kernel, causal=(True, False, False))
                    | P.causal(by="frames"), "text": P.causal()},
            across=P.full() if across else ~P.full())
        want = rule.expand(b, n, n)
        block = r.choice([1, 2, 4, 64])
        label = f"{tag} fused {order} video {steps}x{rows}x{cols} k={kernel} across={across}"
        _dense_and_tiles(f, label, pattern, fused, want, block)
        f.valid(f"{tag} fused {order} causal(by='frames') on the span's own frames",
                lambda: P.causal(by="frames").dense(fused).float(),
                lambda: by_frame.expand(b, n, n).float(), atol=0.0)
        layer = mmattn.MultiHeadAttention(D, H).eval()
        with torch.no_grad():
            f.valid(f"{label} MHA(attn_mask=SparseMask)",
                    lambda: layer(fused.x, attn_mask=pattern.compile(fused, block))[0],
                    lambda: refs.layer(layer, fused.x, want).float())

    # -------------------------------------------------------------- P.causal(by=...)
    def frames(self, tag):
        f, r = self.f, self.f.rng
        b, n = r.choice([0, 1, 2, 2]), r.randint(0, 10)
        ids = [sorted(r.randint(-1, 3) for _ in range(n)) if r.random() < 0.5 else
               [r.randint(-1, 3) for _ in range(n)] for _ in range(b)]
        pad = _key_pad(b, n, r)
        real = (~pad).tolist()
        x = f.randn(b, n, D)
        key = r.choice(["frames", "chunks"])
        tokens = Tokens(x, ~pad, {key: torch.tensor(ids, dtype=torch.long).reshape(b, n)})
        want = refs.frames_rule(ids, real, n)
        pattern = P.causal(by=key)
        block = r.choice([1, 2, 4, 64])
        label = f"{tag} causal(by={key!r}) B={b} L={n}"
        _dense_and_tiles(f, label, pattern, tokens, want, block)
        mods = random_modifiers(f)
        layer = with_sinks(mmattn.MultiHeadAttention(D, H, **mods).eval(), f)
        with torch.no_grad():
            f.valid(f"{label} MHA(attn_mask=SparseMask, {mods})",
                    lambda: layer(x, attn_mask=pattern.compile(tokens, block))[0],
                    lambda: layer_ref(layer, x, want[:, None])[0].float())
        # video tokens from the patcher: neighbourhood | / & frame-causal, streamed by frame
        steps, rows, cols, kt = r.randint(1, 3), r.randint(1, 3), r.randint(1, 3), r.choice(
            [1, 2])
        patcher = VideoPatcher(D, tubelet=(kt, 1, 1), in_channels=1, positional=None)
        frames = steps * kt - r.randint(0, kt - 1)
        lengths = [r.randint(1, frames) for _ in range(b)]
        clip = patcher(f.randn(b, 1, frames, rows, cols), torch.tensor(lengths, dtype=torch.long))
        cells = steps * rows * cols
        time = [[c // (rows * cols) for c in range(cells)]] * b
        live = [[t * kt < lengths[m] for t in time[m]] for m in range(b)]
        kernel = (r.choice([1, 3]), r.choice([1, 3]), r.choice([1, 3]))
        near = refs.nbhd_mask((steps, rows, cols), kernel, (1, 1, 1), (True, False, False))
        causal = refs.frames_rule(time, live, cells)
        alive = torch.tensor(live, dtype=torch.bool).reshape(b, cells)
        keep = alive[:, :, None] & alive[:, None, :]
        nb = P.neighborhood(kernel, causal=(True, False, False))
        for op, combined, rule in (("|", nb | P.causal(by="frames"), (near[None] & keep) | causal),
                                   ("&", nb & P.causal(by="frames"), near[None] & causal)):
            f.valid(f"{tag} video {steps}x{rows}x{cols} kt={kt} nbhd{kernel} {op} "
                    f"causal(by='frames') compile",
                    lambda c=combined: c.compile(clip, block_size=block).dense().float(),
                    lambda rule=rule: rule.float(), atol=0.0)
        plain = mmattn.MultiHeadAttention(D, H).eval()
        xs = clip.x.detach()
        per = rows * cols
        one = [[0] * cells]

        def stream():  # a ChunkCache of one frame per chunk and every frame kept
            cache = plain.make_cache(b, chunk=per, left=steps)
            return torch.cat([plain(xs[:, s:s + per], cache=cache)[0]
                              for s in range(0, cells, per)], 1)

        with torch.no_grad():
            f.valid(f"{tag} video frame-causal ChunkCache stream {steps}x{rows}x{cols}", stream,
                    lambda: refs.layer(plain, xs, refs.frames_rule(
                        time, [[True] * cells] * b, cells)).float())
        bad = torch.tensor(ids, dtype=torch.long).reshape(b, n)
        for name, fn, *names in [
            ("by int", lambda: P.causal(by=3), "by"),
            ("by list", lambda: P.causal(by=["frames"]), "by"),
            ("frames missing", lambda: P.causal(by="frames").dense(Tokens(x)), "frames"),
            ("frames float", lambda: pattern.dense(Tokens(x, None, {key: bad.float()})), key),
            ("frames bool", lambda: pattern.dense(Tokens(x, None, {key: bad >= 0})), key),
            ("frames L+1", lambda: pattern.dense(Tokens(x, None, {key: torch.zeros(
                b, n + 1, dtype=torch.long)})), key),
            ("frames B+1", lambda: pattern.dense(Tokens(x, None, {key: torch.zeros(
                b + 1, n, dtype=torch.long)})), key),
            ("frames list", lambda: pattern.dense(Tokens(x, None, {key: ids})), key),
            ("frames 3-D", lambda: pattern.dense(Tokens(x, None, {key: bad[..., None]})), key),
            ("frames of one", lambda: pattern.dense(Tokens(x, None, {key: one})), key),
            ("frames on meta", lambda: pattern.dense(Tokens(x, None, {key: bad.to("meta")})),
             key),
        ]:
            f.invalid(f"{tag} frames {name}", fn, *names)

    # -------------------------------------------------------------- VideoPatcher
    def video(self, tag):
        f, r = self.f, self.f.rng
        b, c = r.choice([0, 1, 2, 2]), r.choice([1, 3])
        t, h, w = r.randint(1, 5), r.randint(1, 6), r.randint(1, 6)
        tub = tuple(r.randint(1, 3) for _ in range(3))
        positional = r.choice([None, "learned"])
        gt, gh, gw = -(-t // tub[0]), -(-h // tub[1]), -(-w // tub[2])
        patcher = VideoPatcher(D, tubelet=tub, in_channels=c, positional=positional,
                               num_frames=t + r.randint(0, 3), img_size=(gh * tub[1],
                                                                         gw * tub[2])).eval()
        lengths = [r.randint(1, t) for _ in range(b)] if r.random() < 0.5 else None
        raw = r.random() < 0.3
        video = (torch.randint(0, 256, (b, c, t, h, w), generator=f.gen, dtype=torch.uint8)
                 if raw else f.randn(b, c, t, h, w))
        pixels = video.double() / 255.0 if raw else video.double()
        patches, grid = refs.tubelets(pixels, tub, lengths)
        p = {name: v.detach().double() for name, v in patcher.named_parameters()}
        want = patches @ p["proj.weight"].T + p["proj.bias"]
        if positional == "learned":
            space = p["position.weight"].reshape(gh * gw, D)
            want = want + (p["temporal"][:gt, None] + space[None]).reshape(-1, D)
        step = torch.arange(gt).repeat_interleave(gh * gw)
        real = (torch.ones(b, len(step), dtype=torch.bool) if lengths is None else
                step[None] * tub[0] < torch.tensor(lengths, dtype=torch.long)[:, None])
        label = f"{tag} VideoPatcher B={b} C={c} T,H,W={t},{h},{w} tubelet={tub} " \
                f"{positional} lengths={lengths} uint8={raw}"
        with torch.no_grad():
            out = None

            def run():
                nonlocal out
                out = patcher(video, None if lengths is None else torch.tensor(
                    lengths, dtype=torch.long))
                return out.x

            f.valid(f"{label} x", run, lambda: want.float())
            if out is not None:
                f.valid(f"{label} mask", lambda: out.full_mask().float(),
                        lambda: real.float(), atol=0.0)
                f.valid(f"{label} meta frames, grid", lambda: torch.cat(
                    [out.meta["frames"].flatten(), torch.tensor(out.meta["grid"])]).float(),
                    lambda: torch.cat([step.repeat(b), torch.tensor(grid)]).float(), atol=0.0)
            if out is not None and lengths is not None:  # packed: only the real tubelets
                f.valid(f"{label} packed=True", lambda: patcher(video, torch.tensor(
                    lengths, dtype=torch.long), packed=True).x.values(),
                    lambda: want[real].float())
            clips = [f.randn(c, r.randint(1, 4), r.randint(1, 4), r.randint(1, 4))
                     for _ in range(r.randint(1, 3))]
            free = VideoPatcher(D, tubelet=tub, in_channels=c, positional=None).eval()
            p = {name: v.detach().double() for name, v in free.named_parameters()}
            rows = [refs.tubelets(clip[None].double(), tub)[0][0] @ p["proj.weight"].T
                    + p["proj.bias"] for clip in clips]
            f.valid(f"{tag} VideoPatcher packed list of {len(clips)} tubelet={tub}",
                    lambda: free(clips, packed=True).x.values(),
                    lambda: torch.cat(rows).float())
        V, one = VideoPatcher, torch.ones(1, c, 2, 2, 2)
        bb = max(b, 1)  # the invalid calls: a batch of at least one clip
        video = torch.ones(bb, c, t, h, w)
        small = VideoPatcher(D, tubelet=(1, 1, 1), in_channels=c, num_frames=2, img_size=2)
        for name, fn, *names in [
            ("video 4-D", lambda: patcher(video[0]), "video"),
            ("video 6-D", lambda: patcher(video[None]), "video"),
            ("video channels", lambda: patcher(torch.ones(1, c + 1, t, h, w)), "channels",
             "video"),
            ("video int32", lambda: patcher(video.int()), "video"),
            ("video bool", lambda: patcher(video > 0), "video"),
            ("video complex", lambda: patcher(torch.ones(1, c, 1, 1, 1,
                                                         dtype=torch.complex64)), "video"),
            ("video str", lambda: patcher("clip.mp4"), "video"),
            ("video empty side", lambda: patcher(torch.ones(1, c, 0, h, w)), "video"),
            ("video meta device", lambda: patcher(torch.ones(1, c, t, h, w, device="meta")),
             "video"),
            ("lengths float", lambda: patcher(video, torch.ones(bb)), "lengths"),
            ("lengths bool", lambda: patcher(video, torch.ones(bb, dtype=torch.bool)),
             "lengths"),
            ("lengths B+1", lambda: patcher(video, torch.ones(bb + 1, dtype=torch.long)),
             "lengths"),
            ("lengths 0", lambda: patcher(video, torch.zeros(bb, dtype=torch.long)),
             "lengths"),
            ("lengths past T", lambda: patcher(video, torch.full((bb,), t + 1)), "lengths"),
            ("lengths list", lambda: patcher(video, [1] * bb), "lengths"),
            ("lengths 2-D", lambda: patcher(video, torch.ones(bb, 1, dtype=torch.long)),
             "lengths"),
            ("tubelet of 2", lambda: V(D, tubelet=(2, 2)), "tubelet"),
            ("tubelet 0", lambda: V(D, tubelet=0), "tubelet"),
            ("tubelet float", lambda: V(D, tubelet=2.0), "tubelet"),
            ("tubelet bool entry", lambda: V(D, tubelet=(1, True, 1)), "tubelet"),
            ("tubelet str", lambda: V(D, tubelet="222"), "tubelet"),
            ("positional str", lambda: V(D, positional="rope"), "positional"),
            ("sincos width 6", lambda: V(6, positional="sincos"), "embed_dim"),
            ("embed_dim 0", lambda: V(0), "embed_dim"),
            ("in_channels float", lambda: V(D, in_channels=3.0), "in_channels"),
            ("num_frames 0", lambda: V(D, num_frames=0), "num_frames"),
            ("img_size 3 sides", lambda: V(D, img_size=(2, 2, 2)), "img_size"),
            ("longer than num_frames", lambda: small(torch.ones(1, c, 3, 2, 2)),
             "num_frames"),
            ("list without packed", lambda: patcher([video[0]]), "packed"),
            ("list with lengths", lambda: patcher([video[0]], torch.ones(1), packed=True),
             "lengths"),
            ("list of 5-D", lambda: patcher([one], packed=True), "video"),
            ("list empty", lambda: patcher([], packed=True), "video"),
            ("list of str", lambda: patcher(["a"], packed=True), "video"),
        ]:
            f.invalid(f"{tag} video {name}", fn, *names)

    # -------------------------------------------------------------- viz.video_attention
    def picture(self, tag):
        f, r = self.f, self.f.rng
        if r.random() < 0.75:  # matplotlib figures are slow: one round in four
            return
        steps, rows, cols = r.randint(1, 3), r.randint(1, 3), r.randint(1, 3)
        cells = steps * rows * cols
        weights = torch.rand(cells, generator=f.gen)
        allowed = torch.rand(cells, generator=f.gen) < 0.6
        video = torch.rand(steps * r.randint(1, 2), 4, 4, generator=f.gen)

        def keys():  # the keys each step's title counts
            fig = video_attention(weights, video, (steps, rows, cols), query=cells - 1,
                                  allowed=allowed)
            titles = [ax.get_title() for ax in fig.axes[steps:2 * steps]]
            return torch.tensor([float(t.split(": ")[1].split()[0]) for t in titles])

        f.valid(f"{tag} viz.video_attention {steps}x{rows}x{cols}", keys,
                lambda: allowed.reshape(steps, -1).sum(1).float(), atol=0.0)
        va = video_attention
        grid = (steps, rows, cols)
        for name, fn, *names in [
            ("attention size", lambda: va(torch.rand(cells + 1), video, grid), "attention"),
            ("allowed size", lambda: va(weights, video, grid, allowed=allowed[1:]), "allowed"),
            ("attention str", lambda: va("w", video, grid), "attention"),
            ("grid of 2", lambda: va(weights, video, (rows, cols)), "grid"),
            ("grid float", lambda: va(weights, video, (steps, rows, float(cols))), "grid"),
            ("grid zero", lambda: va(weights, video, (0, rows, cols)), "grid"),
            ("grid Tokens 2-D", lambda: va(weights, video, Tokens(
                torch.zeros(1, cells, D), None, {"grid": (rows, cols)})), "grid"),
            ("video 2-D", lambda: va(weights, video[0], grid), "video"),
            ("video too few frames", lambda: va(weights, video[:0], grid), "video"),
            ("query past the grid", lambda: va(weights, video, grid, query=cells), "query"),
            ("query negative", lambda: va(weights, video, grid, query=-1), "query"),
            ("query float", lambda: va(weights, video, grid, query=1.0), "query"),
        ]:
            f.invalid(f"{tag} video_attention {name}", fn, *names)


def main() -> int:
    return base.main(only="sixth")


if __name__ == "__main__":
    sys.exit(main())
