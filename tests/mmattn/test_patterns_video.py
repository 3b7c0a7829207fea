"""Patterns on video: ``P.neighborhood`` on (t, h, w) grids with causal axes and
``P.causal(by="frames")``, against references written here.

References: ``masks.neighborhood_mask`` (held to a pair-by-pair loop and to natten in
tests/mmattn/kernels/test_neighborhood_axes.py) placed on each item's grid, and the
frame-causal rule by a pair-by-pair Python loop over the ids. Each pattern's three faces
agree: ``dense``, ``compile(...).dense()`` at several block sizes and ``mask_mod``; the
block-sparse attention equals the dense masked module; streaming frame by frame through a
ChunkCache equals the whole clip.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmattn import Encoder, MultiHeadAttention, Tokens
from mmattn import patterns as P
from mmattn.functional import fused_attn
from mmattn.masks import neighborhood_mask
from tests._tolerance import assert_close_scaled

D, H = 16, 4
pytestmark = pytest.mark.usefixtures("one_thread")


def video(batch: int, grid: tuple[int, int, int], real: list[int] | None = None) -> Tokens:
    """Video tokens: x (B, T·H·W, D), the grid and the frame of every token (as VideoPatcher
    writes them); item b's tokens from ``real[b]`` on are padding."""
    length = math.prod(grid)
    frames = (torch.arange(length) // (grid[1] * grid[2])).expand(batch, length).clone()
    mask = None
    if real is not None:
        mask = torch.arange(length)[None] < torch.tensor(real)[:, None]
    return Tokens(torch.randn(batch, length, D), mask, {"grid": grid, "frames": frames})


def frame_loop(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, L, L): ids[k] <= ids[q], both >= 0 and real, by a loop over every pair."""
    rows = []
    for row, ok in zip(ids.tolist(), real.tolist()):
        rows.append([[ok[q] and ok[k] and 0 <= row[k] <= row[q] and row[q] >= 0
                      for k in range(len(row))] for q in range(len(row))])
    return torch.tensor(rows, dtype=torch.bool)


def assert_faces(pattern, tokens: Tokens, want: torch.Tensor) -> None:
    """dense, compiled (several blocks) and mask_mod all equal ``want``."""
    assert torch.equal(pattern.dense(tokens), want)
    for block in (8, 16, 64):
        mask = pattern.compile(tokens, block)
        assert torch.equal(mask.dense(), want), block
        n = mask.tiles_per_axis
        padded = torch.zeros(want.shape[0], n * block, n * block, dtype=torch.bool)
        padded[:, :want.shape[1], :want.shape[2]] = want
        tiles = padded.view(want.shape[0], n, block, n, block).any(4).any(2)
        assert mask.nonempty_blocks == int(tiles.sum())  # exactly the tiles with a pair
    rule = pattern.mask_mod(tokens)
    b = torch.arange(want.shape[0])[:, None, None]
    i = torch.arange(want.shape[1])
    assert torch.equal(rule(b, torch.zeros((), dtype=torch.long), i[None, :, None],
                            i[None, None, :]), want)


NEIGHBORHOOD = [  # (grid, kernel, dilation, causal)
    ((4, 5, 6), (3, 3, 3), 1, (True, False, False)),
    ((5, 4, 4), (3, 3, 3), (2, 1, 1), (True, True, False)),
    ((3, 6, 5), 3, 1, False),
]


@pytest.mark.parametrize("case", NEIGHBORHOOD, ids=str)
def test_neighborhood_on_a_video_grid_equals_the_mask(case):
    grid, kernel, dilation, causal = case
    length = math.prod(grid)
    tokens = video(2, grid, real=[length, length - 7])
    one = neighborhood_mask(grid, kernel, dilation=dilation, causal=causal)
    real = tokens.full_mask()
    want = one[None] & real[:, :, None] & real[:, None, :]
    assert_faces(P.neighborhood(kernel, dilation, causal), tokens, want)


def test_per_item_video_grids_and_a_video_span_among_text():
    grids = [(2, 3, 4), (3, 2, 2)]
    x = torch.randn(2, 24, D)
    as_list = Tokens(x, meta={"grids": grids})
    as_tensor = Tokens(x, meta={"grids": torch.tensor(grids)})
    want = torch.zeros(2, 24, 24, dtype=torch.bool)
    for b, grid in enumerate(grids):
        n = math.prod(grid)
        want[b, :n, :n] = neighborhood_mask(grid, 3, causal=(True, False, False))
    pattern = P.neighborhood((3, 3, 3), causal=(True, False, False))
    assert_faces(pattern, as_list, want)
    assert torch.equal(pattern.dense(as_tensor), want)
    fused = Tokens.cat({"text": Tokens(torch.randn(2, 5, D)), "video": as_list})
    got = pattern.dense(fused)
    assert torch.equal(got[:, 5:, 5:], want) and not got[:, :5].any() and not got[:, :, :5].any()


def test_image_and_video_grids_in_one_sequence():
    image = Tokens(torch.randn(1, 12, D), meta={"grid": (3, 4)})
    clip = video(1, (2, 3, 3))
    fused = Tokens.cat({"image": image, "video": clip})
    both = P.neighborhood(3).dense(fused)[0]  # one int: every axis of every grid
    assert torch.equal(both[:12, :12], neighborhood_mask((3, 4), 3))
    assert torch.equal(both[12:, 12:], neighborhood_mask((2, 3, 3), 3))
    assert not both[:12, 12:].any() and not both[12:, :12].any()
    wide = P.neighborhood((3, 3, 3), causal=(True, False, False), modality="video")
    assert torch.equal(wide.dense(fused)[0, 12:, 12:],
                       neighborhood_mask((2, 3, 3), 3, causal=(True, False, False)))
    assert not wide.dense(fused)[0, :12].any()
    flat = P.neighborhood((3, 3), modality="image")  # the video grid is not its business
    assert torch.equal(flat.dense(fused)[0, :12, :12], neighborhood_mask((3, 4), 3))
    with pytest.raises(ValueError, match=r"window \(kernel_size=\(3, 3\), dilation=\(1, 1\), "
                                         r"causal=\(False, False\)\) has 2 axes, but the "
                                         r"tokens hold a grid of 3 axes"):
        P.neighborhood((3, 3)).dense(fused)
    # axes fixed by causal alone: the message shows causal (fuzz_sixth_wave.py found it
    # naming a kernel_size (3, 3) that was never given)
    with pytest.raises(ValueError, match=r"causal=\(True, False\)\) has 2 axes"):
        P.neighborhood(3, causal=(True, False)).dense(fused)
    with pytest.raises(ValueError, match=r"kernel_size must have one entry per grid axis, "
                                         r"1 to 3"):
        P.neighborhood((3, 3, 3, 3))


def test_frame_causal_equals_a_pair_by_pair_loop():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, 3], [0, 1, 1, 1, 2, 2, -1, -1, 3, 3]])
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 9] = False
    tokens = Tokens(torch.randn(2, 10, D), mask, {"frames": ids})
    want = frame_loop(ids, mask)
    assert_faces(P.causal(by="frames"), tokens, want)
    chunks = Tokens(torch.randn(2, 10, D), mask, {"chunks": ids})  # any key of ids
    assert torch.equal(P.causal(by="chunks").dense(chunks), want)


def test_frame_causal_composes():
    clip = video(2, (4, 3, 4), real=[48, 40])
    real = clip.full_mask()
    frames = frame_loop(clip.meta["frames"], real)
    window = neighborhood_mask((4, 3, 4), (3, 3, 3), causal=(True, False, False))[None] & (
        real[:, :, None] & real[:, None, :])
    by = P.causal(by="frames")
    nbhd = P.neighborhood((3, 3, 3), causal=(True, False, False))
    assert_faces(by & nbhd, clip, frames & window)
    assert_faces(by | P.window(2), clip, frames | (P.window(2).dense(clip)))
    inverse = ~frames & real[:, :, None] & real[:, None, :]
    assert_faces(~by, clip, inverse)
    assert_faces(~by | nbhd, clip, inverse | window)


def test_frame_causal_in_fused_tokens_and_per_modality():
    text = Tokens(torch.randn(2, 4, D))
    clip = video(2, (3, 2, 2))
    fused = Tokens.cat({"text": text, "video": clip})  # the frames stay in meta["video"]
    got = P.causal(by="frames").dense(fused)
    ids = torch.cat([torch.full((2, 4), -1), clip.meta["frames"]], dim=1)
    assert torch.equal(got, frame_loop(ids, fused.full_mask()))
    pattern = P.per_modality(within={"text": P.causal(), "video": P.causal(by="frames")},
                             across=P.modality(key="text"))
    dense = pattern.dense(fused)[0]
    assert torch.equal(dense[4:, 4:], frame_loop(clip.meta["frames"][:1],
                                                 torch.ones(1, 12, dtype=torch.bool))[0])
    assert torch.equal(dense[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert dense[4:, :4].all() and not dense[:4, 4:].any()
    assert torch.equal(pattern.compile(fused, 4).dense(), pattern.dense(fused))


def test_frame_tiles_are_skipped_or_full_whole():
    # frames of exactly one block: every tile is empty (a later frame) or full, none mixed
    clip = video(1, (8, 4, 4))
    mask = P.causal(by="frames").compile(clip, block_size=16)
    assert mask.mixed_tiles.shape[0] == 0
    assert mask.nonempty_blocks == 8 * 9 // 2


def test_errors_name_the_key():
    plain = Tokens(torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match=r"P.causal\(by='frames'\) needs meta\['frames'\]"):
        P.causal(by="frames").dense(plain)
    with pytest.raises(TypeError, match="by must be a meta key .str. or None, got int"):
        P.causal(by=3)
    bad = Tokens(torch.zeros(1, 4, 2), meta={"frames": torch.zeros(4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"meta\['frames'\] must have shape \(1, 4\)"):
        P.causal(by="frames").compile(bad)
    with pytest.raises(ValueError, match="kernel_size, dilation and causal must have one"):
        P.neighborhood((3, 3, 3), causal=(True, False))


@pytest.mark.parametrize("fused", [True, False])
def test_block_sparse_attention_equals_the_dense_mask(fused):
    clip = video(2, (4, 4, 4), real=[64, 50])
    pattern = P.causal(by="frames") & P.neighborhood((3, 3, 3), causal=(True, False, False))
    module = MultiHeadAttention(D, H).double()
    x = clip.x.double().requires_grad_()
    dense = (~pattern.dense(clip)).repeat_interleave(H, 0)
    with fused_attn(fused):
        out, _ = module(x, attn_mask=pattern.compile(clip, 16))
        want, _ = module(x, attn_mask=dense)
    torch.testing.assert_close(out, want)
    got_g = torch.autograd.grad(out.sum(), x)[0]
    want_g = torch.autograd.grad(want.sum(), x)[0]
    torch.testing.assert_close(got_g, want_g)


def test_encoder_pattern_equals_the_dense_mask():
    clip = video(2, (4, 4, 4), real=[64, 50])
    pattern = P.causal(by="frames") & P.neighborhood((3, 3, 3), causal=(True, False, False))
    sparse = Encoder(D, 2, H, pattern=pattern).eval()
    dense = Encoder(D, 2, H).eval()
    dense.load_state_dict(sparse.state_dict())
    with torch.no_grad():
        out = sparse(clip).x
        want = dense(clip, attn_mask=(~pattern.dense(clip)).repeat_interleave(H, 0)).x
    assert_close_scaled(out, want, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_streaming_frame_by_frame_equals_the_whole_clip(fused):
    grid = (5, 3, 4)
    per_frame, frames = grid[1] * grid[2], grid[0]
    clip = video(2, grid, real=[60, 41])  # item 1 ends inside frame 3
    module = MultiHeadAttention(D, H, position="rotary").eval()
    with torch.no_grad(), fused_attn(fused):
        whole, _ = module(clip.x, key_padding_mask=clip.key_padding_mask,
                          attn_mask=P.causal(by="frames").compile(clip))
        cache = module.make_cache(2, chunk=per_frame, left=frames - 1)
        steps = []
        for t in range(frames):
            part = slice(t * per_frame, (t + 1) * per_frame)
            out, _ = module(clip.x[:, part], key_padding_mask=clip.key_padding_mask[:, part],
                            cache=cache)
            steps.append(out)
    real = clip.full_mask()
    streamed = torch.cat(steps, dim=1)
    assert_close_scaled(streamed[real], whole[real], atol=1e-5)


def test_encoder_recipe_trains_frame_causal_and_streams_chunked():
    grid = (4, 2, 3)
    per_frame, frames = grid[1] * grid[2], grid[0]
    clip = video(2, grid)
    # on whole frames of one size, frame-causal is the chunked rule with every past chunk
    assert torch.equal(P.causal(by="frames").dense(clip),
                       P.chunked(per_frame, left=frames - 1).dense(clip))
    trained = Encoder(D, 2, H, pattern=P.causal(by="frames")).eval()
    stream = Encoder(D, 2, H, pattern=P.chunked(per_frame, left=frames - 1)).eval()
    stream.load_state_dict(trained.state_dict())
    cache = stream.make_cache(batch_size=2)
    with torch.no_grad():
        whole = trained(clip).x
        steps = [stream(Tokens(clip.x[:, t * per_frame:(t + 1) * per_frame]), cache=cache).x
                 for t in range(frames)]
    assert_close_scaled(torch.cat(steps, dim=1), whole, atol=1e-5)


@pytest.mark.slow
@pytest.mark.flex_sweep
@pytest.mark.pins_path
@pytest.mark.filterwarnings("ignore:_compile flag:DeprecationWarning")
def test_mask_mod_compiles_in_flex_attention():
    # (a CPU flex compile takes tens of seconds: ``make test-flex`` runs it, as the sweep)
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import torch.nn.functional as F

    clip = video(2, (3, 4, 4), real=[48, 37])
    pattern = P.causal(by="frames") & P.neighborhood((3, 3, 3), causal=(True, False, False))
    dense = pattern.dense(clip)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=gen) for _ in range(3))
    with torch._dynamo.config.patch(recompile_limit=64):
        block = flex.create_block_mask(pattern.mask_mod(clip), 2, None, 48, 48, device="cpu",
                                       BLOCK_SIZE=16, _compile=True)
        with torch.no_grad():
            out = torch.compile(flex.flex_attention, dynamic=False)(q, k, v, block_mask=block)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    live = dense.any(-1)[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(out[live], ref[live], rtol=0,
                               atol=1e-5 * float(ref[live].abs().max()))
