"""VideoPatcher against nn.Conv3d and torchvision's swin3d patch embedding with the same
weights, an einops reference, and each clip run alone (lengths, packing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import adapters
from adapters import VideoPatcher
from mmattn import Tokens
from mmattn._features import features
from mmattn.position import resample_2d, sinusoidal_1d, sinusoidal_2d
from mmattn.rotary import mrope_positions
from tests._features import reason

D = 24
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(params=[True, False], ids=["fused", "linear"])
def fused(request) -> bool:
    return request.param


def _conv(patcher: VideoPatcher) -> nn.Conv3d:
    """nn.Conv3d(kernel = stride = tubelet) holding the patcher's projection."""
    kt, kh, kw = patcher.tubelet
    conv = nn.Conv3d(patcher.in_channels, D, patcher.tubelet, stride=patcher.tubelet)
    with torch.no_grad():
        conv.weight.copy_(patcher.proj.weight.view(D, patcher.in_channels, kt, kh, kw))
        conv.bias.copy_(patcher.proj.bias)
    return conv


def test_tokens_equal_conv3d_and_einops_references(fused):
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=6, img_size=(8, 12), positional=None)
    patcher.fused = fused
    video = torch.randn(2, 3, 6, 8, 12)
    out = patcher(video)
    assert out.x.shape == (2, 3 * 2 * 3, D) and out.mask is None
    assert out.meta["grid"] == (3, 2, 3) and out.meta["modality"] == "video"
    conv = _conv(patcher)(video)  # (b, d, gt, gh, gw)
    torch.testing.assert_close(out.x, rearrange(conv, "b d t h w -> b (t h w) d"), **TOL)
    tubelets = rearrange(video, "b c (t a) (h p) (w q) -> b (t h w) (c a p q)", a=2, p=4, q=4)
    want = tubelets @ patcher.proj.weight.T + patcher.proj.bias
    torch.testing.assert_close(out.x, want, **TOL)


def test_sizes_not_divisible_follow_torchvision_swin3d_patch_embedding(fused):
    video_models = pytest.importorskip("torchvision.models.video.swin_transformer")
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), positional=None)
    patcher.fused = fused
    embed = video_models.PatchEmbed3d([2, 4, 4], in_channels=3, embed_dim=D)
    embed.proj.load_state_dict(_conv(patcher).state_dict())
    video = torch.randn(2, 3, 5, 9, 14)  # pads 1 frame, 3 rows, 2 columns at the end
    out = patcher(video)
    assert out.meta["grid"] == (3, 3, 4) and out.meta["padding"] == (1, 3, 2)
    torch.testing.assert_close(out.x, rearrange(embed(video), "b t h w d -> b (t h w) d"), **TOL)
    small = patcher(torch.randn(1, 3, 1, 2, 3))  # smaller than one tubelet: one padded one
    assert small.meta["grid"] == (1, 1, 1) and small.x.shape == (1, 1, D)


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_path_equals_the_linear_path(channels_last):
    patcher = VideoPatcher(D, tubelet=(3, 2, 5), num_frames=6, img_size=10)
    video, *_ = patcher._prepare(torch.randn(2, 3, 7, 9, 10), None)
    torch.testing.assert_close(
        patcher.patches_conv(video, channels_last=channels_last),
        patcher.patches_linear(video), **TOL,
    )


def test_fused_and_linear_paths_agree_in_values_and_gradients():
    patcher = VideoPatcher(D, tubelet=(2, 3, 3), num_frames=6, img_size=6)
    video = torch.randn(2, 3, 5, 7, 6)
    results = []
    for fused in (True, False):
        patcher.zero_grad()
        patcher.fused = fused
        out = patcher(video, lengths=torch.tensor([5, 2]))
        out.x[out.mask].pow(2).sum().backward()
        results.append((out.x.detach(), [p.grad.clone() for p in patcher.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lengths_mask_tubelets_and_each_clip_equals_itself_alone(fused):
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=8, img_size=8)
    patcher.fused = fused
    video = torch.randn(3, 3, 7, 8, 8)
    lengths = torch.tensor([7, 3, 1])
    out = patcher(video, lengths=lengths)
    # a tubelet is real when it holds a real frame: ceil(length / 2) time steps of 2 x 2
    assert out.lengths.tolist() == [16, 8, 4]
    frames = out.meta["frames"]
    assert frames.shape == (3, 16) and frames.dtype == torch.long
    assert frames[1].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    torch.testing.assert_close(out.mask, frames * 2 < lengths[:, None], atol=0, rtol=0)
    for b, n in enumerate(lengths.tolist()):
        alone = patcher(video[b:b + 1, :, :n])
        real = out.mask[b]
        torch.testing.assert_close(out.x[b][real], alone.x[0], **TOL)


def test_frames_past_lengths_never_leak(fused):
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=6, img_size=8)
    patcher.fused = fused
    video = torch.randn(2, 3, 6, 8, 8)
    lengths = torch.tensor([6, 3])
    out = patcher(video, lengths=lengths)
    changed = video.clone()
    changed[1, :, 3:] = float("nan")
    again = patcher(changed, lengths=lengths)
    torch.testing.assert_close(again.x, out.x, atol=0, rtol=0)  # padded tokens as well


def test_without_positions_a_token_depends_on_its_own_tubelet_only():
    patcher = VideoPatcher(D, tubelet=(2, 2, 2), positional=None)
    video = torch.randn(1, 3, 4, 4, 6, requires_grad=True)
    out = patcher(video).x  # grid (2, 2, 3)
    token = 7  # time 1, row 0, column 1
    (grad,) = torch.autograd.grad(out[0, token].sum(), video)
    touched = grad[0].abs().sum(0) > 0  # (t, h, w)
    want = torch.zeros(4, 4, 6, dtype=torch.bool)
    want[2:4, 0:2, 2:4] = True
    assert torch.equal(touched, want)


def test_uint8_is_scaled_to_unit_range():
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=4, img_size=8)
    video = torch.randint(0, 256, (2, 3, 4, 8, 8), dtype=torch.uint8)
    torch.testing.assert_close(patcher(video).x, patcher(video.float() / 255).x)


def test_torchvision_clip_layout_goes_in_by_a_permute():
    """torchvision.io / transforms.v2 hold a clip as (T, C, H, W); its models take
    (B, C, T, H, W): a clip goes in as ``clip.permute(1, 0, 2, 3)[None]``."""
    patcher = VideoPatcher(D, tubelet=(1, 4, 4), positional=None)
    clip = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)  # (T, C, H, W)
    out = patcher(clip.permute(1, 0, 2, 3)[None])
    frame = clip[1].float()[None] / 255  # frame 1 is time step 1
    cols = F.unfold(frame, 4, stride=4).transpose(1, 2)  # (1, 4, c*16)
    torch.testing.assert_close(out.x[0, 4:8], (cols @ patcher.proj.weight.T + patcher.proj.bias)[0],
                               **TOL)


def test_learned_positions_on_and_off_the_construction_grid():
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=4, img_size=(8, 12))  # (2, 2, 3)
    with torch.no_grad():
        patcher.position.weight.normal_()
        patcher.temporal.normal_()
    video = torch.randn(1, 3, 4, 8, 12)
    added = patcher(video).x - patcher.patches_linear(video)
    want = patcher.temporal[:, None] + patcher.position.weight[None]  # (t, h*w, d)
    torch.testing.assert_close(added[0], rearrange(want, "t s d -> (t s) d"))
    shorter = torch.randn(1, 3, 1, 16, 12)  # grid (1, 4, 3): space resampled, time indexed
    added = patcher(shorter).x - patcher.patches_linear(F.pad(shorter, (0, 0, 0, 0, 0, 1)))
    space = resample_2d(patcher.position.weight, (2, 3), (4, 3))
    want = patcher.temporal[:1, None] + space[None]
    torch.testing.assert_close(added[0], rearrange(want, "t s d -> (t s) d"), **TOL)
    with pytest.raises(ValueError, match=r"3 time steps of 2 frames, more than the learned "
                                         r"temporal table of num_frames=4 \(2 steps\)"):
        patcher(torch.randn(1, 3, 5, 8, 12))


def test_sincos_positions():
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), positional="sincos")
    video = torch.randn(1, 3, 6, 8, 12)
    added = patcher(video).x - patcher.patches_linear(video)
    want = sinusoidal_1d(3, D)[:, None] + sinusoidal_2d(2, 3, D)[None]
    torch.testing.assert_close(added[0], rearrange(want, "t s d -> (t s) d"))
    assert list(patcher.parameters()) == [patcher.proj.weight, patcher.proj.bias]


def test_packed_batch_keeps_only_real_tubelets():
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=6, img_size=8)
    video, lengths = torch.randn(2, 3, 6, 8, 8), torch.tensor([6, 2])
    padded = patcher(video, lengths=lengths)
    packed = patcher(video, lengths=lengths, packed=True)
    assert packed.is_packed and packed.lengths.tolist() == [12, 4]
    torch.testing.assert_close(packed.x.values(), padded.x[padded.mask])
    assert packed.meta["frames"][1].tolist() == [0] * 4 + [-1] * 8  # (B, max l), -1 past


def test_packed_list_of_clips_each_on_its_own_grid():
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=4, img_size=8)
    clips = [torch.randn(3, 4, 8, 8), torch.randn(3, 3, 4, 12)]
    out = patcher(clips, packed=True)
    assert out.meta["grids"] == [(2, 2, 2), (2, 1, 3)]
    assert out.meta["paddings"] == [(0, 0, 0), (1, 0, 0)]
    assert out.meta["frames"].tolist() == [[0] * 4 + [1] * 4, [0, 0, 0, 1, 1, 1, -1, -1]]
    rows = out.x.values()
    torch.testing.assert_close(rows[:8], patcher(clips[0][None]).x[0])
    torch.testing.assert_close(rows[8:], patcher(clips[1][None]).x[0])
    assert mrope_positions(out)[1, :6, 2].tolist() == [0, 1, 2, 0, 1, 2]


def test_registered_and_fused_with_text_positions():
    patcher = adapters.create("video", embed_dim=D, tubelet=(2, 4, 4), num_frames=4, img_size=8)
    assert isinstance(patcher, VideoPatcher) and "video" in adapters.available()
    video = patcher(torch.randn(1, 3, 4, 8, 8))
    fused = Tokens.cat({"text": Tokens(torch.randn(1, 3, D)), "video": video})
    pos = mrope_positions(fused)[0]
    assert pos[3:11, 0].tolist() == [3] * 4 + [4] * 4  # time: start 3 + frame step
    assert pos[3:7, 1].tolist() == [3, 3, 4, 4] and pos[3:7, 2].tolist() == [3, 4, 3, 4]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p: p(torch.randn(1, 1, 4, 8, 8)), ValueError,
         r"in_channels=3 channels.*\(1, 1, 4, 8, 8\)"),
        (lambda p: p(torch.randn(3, 4, 8, 8)), ValueError, r"video must be a 5-D tensor.*4-D"),
        (lambda p: p(torch.zeros(1, 3, 4, 8, 8, dtype=torch.int32)), TypeError,
         "video must be floating or torch.uint8"),
        (lambda p: p(torch.randn(1, 3, 0, 8, 8)), ValueError, "at least 1 frame"),
        (lambda p: p(torch.randn(2, 3, 4, 8, 8), torch.tensor([4.0, 2.0])), TypeError,
         "lengths must have an integer dtype"),
        (lambda p: p(torch.randn(2, 3, 4, 8, 8), torch.tensor([4])), ValueError,
         r"lengths must have shape \(batch,\)=\(2,\), got \(1,\)"),
        (lambda p: p(torch.randn(2, 3, 4, 8, 8), torch.tensor([5, 0])), ValueError,
         r"lengths must lie in \[1, T=4\].*\[0, 5\]"),
        (lambda p: p([torch.randn(3, 4, 8, 8)]), TypeError, "needs packed=True"),
        (lambda p: p([torch.randn(3, 4, 8, 8)], torch.tensor([4]), packed=True), TypeError,
         "lengths must be None for a list"),
        (lambda p: p("a clip"), TypeError, "video must be a torch.Tensor, got str"),
    ],
)
def test_bad_video(call, error, match):
    with pytest.raises(error, match=match):
        call(VideoPatcher(D, tubelet=(2, 4, 4), num_frames=4, img_size=8))


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match=r"tubelet must be an int or \(frames, rows, cols\)"):
        VideoPatcher(D, tubelet=(2, 4))
    with pytest.raises(ValueError, match=r"tubelet\[0\] must be >= 1"):
        VideoPatcher(D, tubelet=(0, 4, 4))
    with pytest.raises(ValueError, match=r"positional must be one of \('learned', 'sincos'"):
        VideoPatcher(D, positional="rope")
    with pytest.raises(ValueError, match="embed_dim must be divisible by 4"):
        VideoPatcher(6, positional="sincos")


@pytest.mark.parametrize("form", ["exported", "compiled"])
def test_exported_and_compiled_forms_give_eager_numbers(form):
    patcher = VideoPatcher(D, tubelet=(2, 4, 4), num_frames=8, img_size=8).eval()
    if form == "exported":
        # as the export suite (tests/mmattn/integrations/test_export.py): torch 2.5 and 2.6
        # specialise the batch and cannot prove the ceil padding >= 0 for a dynamic side
        if not features().is_exporting:
            pytest.skip(reason("is_exporting"))
        dims = {0: torch.export.Dim("B", min=1, max=8), 2: torch.export.Dim("T", min=3, max=8),
                3: torch.export.Dim("H", min=5, max=64), 4: torch.export.Dim("W", min=5, max=64)}
        run = torch.export.export(
            patcher, (torch.rand(2, 3, 6, 8, 12), torch.tensor([6, 3])),
            dynamic_shapes=(dims, {0: dims[0]}),
        ).module()
    torch._dynamo.reset()
    if form == "compiled":
        run = torch.compile(patcher, backend="aot_eager", fullgraph=True, dynamic=True)
    for video, lengths in ((torch.rand(3, 3, 8, 12, 16), torch.tensor([8, 5, 1])),
                           (torch.rand(1, 3, 5, 9, 20), torch.tensor([4]))):
        want, got = patcher(video, lengths), run(video, lengths)
        torch.testing.assert_close(got.x, want.x, **TOL)
        assert torch.equal(got.mask, want.mask) and torch.equal(got.meta["frames"],
                                                                want.meta["frames"])
    torch._dynamo.reset()
