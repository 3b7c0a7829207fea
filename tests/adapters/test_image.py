"""ImagePatcher against F.unfold, an einops rearrange and a Conv2d with the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from adapters import IMAGENET_MEAN, IMAGENET_STD, ImagePatcher, image_transform
from mmattn.position import resample_2d, sinusoidal_2d

D, P = 24, 4


@pytest.fixture(params=[True, False], ids=["fused", "unfold"])
def fused(request) -> bool:
    return request.param


def test_tokens_equal_unfold_einops_and_conv2d_references(fused):
    patcher = ImagePatcher(D, patch_size=P, img_size=(8, 12), positional=None)
    patcher.fused = fused
    images = torch.randn(2, 3, 8, 12)
    out = patcher(images)
    assert out.x.shape == (2, 6, D) and out.mask is None and out.meta["grid"] == (2, 3)
    w, b = patcher.proj.weight, patcher.proj.bias

    unfold = F.unfold(images, kernel_size=P, stride=P).transpose(1, 2) @ w.T + b
    torch.testing.assert_close(out.x, unfold, atol=1e-5, rtol=1e-5)

    einops_ref = rearrange(images, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=P, p2=P)
    torch.testing.assert_close(out.x, einops_ref @ w.T + b, atol=1e-5, rtol=1e-5)

    conv = nn.Conv2d(3, D, P, stride=P)
    with torch.no_grad():
        conv.weight.copy_(w.reshape(D, 3, P, P))
        conv.bias.copy_(b)
    torch.testing.assert_close(out.x, conv(images).flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [4, 3])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_kernel_path_equals_unfold(stride, channels_last):
    patcher = ImagePatcher(D, patch_size=P, stride=stride, img_size=12)
    images, _, _ = patcher._prepare(torch.randn(2, 3, 12, 16))
    torch.testing.assert_close(
        patcher.patches_conv(images, channels_last=channels_last),
        patcher.patches_unfold(images),
        atol=1e-5,
        rtol=1e-5,
    )


def test_fused_and_unfold_paths_agree_in_values_and_gradients():
    patcher = ImagePatcher(D, patch_size=P, stride=3, img_size=11)
    images = torch.randn(2, 3, 11, 13)
    grads = []
    for fused in (True, False):
        patcher.zero_grad()
        patcher.fused = fused
        out = patcher(images)
        out.x.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in patcher.parameters()])
        if fused:
            first = out.x.detach()
    torch.testing.assert_close(first, out.x.detach(), atol=1e-5, rtol=1e-5)
    for g_fused, g_unfold in zip(*grads):
        torch.testing.assert_close(g_fused, g_unfold, atol=1e-4, rtol=1e-4)


def test_overlapping_patches_follow_unfold(fused):
    patcher = ImagePatcher(D, patch_size=4, stride=2, img_size=10, positional=None)
    patcher.fused = fused
    images = torch.randn(2, 3, 10, 10)
    out = patcher(images)
    ref = F.unfold(images, kernel_size=4, stride=2).transpose(1, 2) @ patcher.proj.weight.T
    torch.testing.assert_close(out.x, ref + patcher.proj.bias, atol=1e-5, rtol=1e-5)
    assert out.meta["grid"] == (4, 4) and out.meta["padding"] == (0, 0)


def test_sizes_not_divisible_are_zero_padded(fused):
    patcher = ImagePatcher(D, patch_size=16, img_size=32, positional=None)
    patcher.fused = fused
    images = torch.randn(1, 3, 37, 50)
    out = patcher(images)
    assert out.meta["grid"] == (3, 4) and out.meta["padding"] == (11, 14)
    padded = torch.zeros(1, 3, 48, 64)
    padded[..., :37, :50] = images
    ref = F.unfold(padded, 16, stride=16).transpose(1, 2) @ patcher.proj.weight.T
    torch.testing.assert_close(out.x, ref + patcher.proj.bias, atol=1e-5, rtol=1e-5)
    small = patcher(torch.randn(1, 3, 5, 9))  # smaller than one patch: one padded patch
    assert small.meta["grid"] == (1, 1) and small.x.shape == (1, 1, D)


def test_uint8_is_scaled_to_unit_range():
    patcher = ImagePatcher(D, patch_size=P, img_size=8)
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    torch.testing.assert_close(patcher(images).x, patcher(images.float() / 255).x)


def test_learned_positions_on_and_off_the_construction_grid():
    patcher = ImagePatcher(D, patch_size=P, img_size=(8, 12))  # grid (2, 3)
    images = torch.randn(1, 3, 8, 12)
    patcher.position.weight.data.normal_()
    out = patcher(images)
    torch.testing.assert_close(
        out.x - patcher.patches_unfold(images), patcher.position.weight[None]
    )
    bigger = torch.randn(1, 3, 16, 20)  # grid (4, 5): the table is resampled
    out = patcher(bigger)
    table = resample_2d(patcher.position.weight, (2, 3), (4, 5))
    torch.testing.assert_close(out.x - patcher.patches_unfold(bigger), table[None])
    with torch.no_grad():
        patcher.position.weight.fill_(0.5)  # a constant table stays constant when resampled
    torch.testing.assert_close(
        patcher(bigger).x - patcher.patches_unfold(bigger), torch.full((1, 20, D), 0.5)
    )


def test_sincos_positions():
    patcher = ImagePatcher(D, patch_size=P, img_size=8, positional="sincos")
    images = torch.randn(1, 3, 12, 8)
    out = patcher(images)
    torch.testing.assert_close(out.x - patcher.patches_unfold(images), sinusoidal_2d(3, 2, D)[None])
    assert list(patcher.parameters()) == [patcher.proj.weight, patcher.proj.bias]


@pytest.mark.parametrize(
    "images, error, match",
    [
        (torch.randn(1, 1, 8, 8), ValueError, r"in_channels=3 channels.*\(1, 1, 8, 8\)"),
        (torch.randn(3, 8, 8), ValueError, r"images must be a 4-D tensor.*got 3-D"),
        (torch.zeros(1, 3, 8, 8, dtype=torch.int32), TypeError, "floating or torch.uint8"),
        ("an image", TypeError, "images must be a torch.Tensor, got str"),
    ],
)
def test_bad_images(images, error, match):
    with pytest.raises(error, match=match):
        ImagePatcher(D, patch_size=P, img_size=8)(images)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="stride must be <= patch_size=4"):
        ImagePatcher(D, patch_size=4, stride=5)
    with pytest.raises(ValueError, match=r"positional must be one of \('learned', 'sincos'"):
        ImagePatcher(D, positional="rope")
    with pytest.raises(ValueError, match="embed_dim must be divisible by 4"):
        ImagePatcher(6, positional="sincos")
    with pytest.raises(TypeError, match="img_size must be an int or a pair"):
        ImagePatcher(D, img_size=(1, 2, 3))


def test_image_transform_normalizes_uint8_and_pil_alike():
    pil = pytest.importorskip("PIL.Image")
    image = torch.randint(0, 256, (3, 6, 7), dtype=torch.uint8)
    transform = image_transform((6, 7))
    out = transform(image)
    mean, std = (
        torch.tensor(IMAGENET_MEAN)[:, None, None],
        torch.tensor(IMAGENET_STD)[:, None, None],
    )
    torch.testing.assert_close(out, (image.float() / 255 - mean) / std)
    from_pil = transform(pil.fromarray(image.permute(1, 2, 0).numpy()))
    torch.testing.assert_close(from_pil, out)
    resized = image_transform(4, mean=(0.5,) * 3, std=(0.5,) * 3)(
        torch.full((3, 9, 5), 255, dtype=torch.uint8)
    )
    torch.testing.assert_close(resized, torch.ones(3, 4, 4))
    with pytest.raises(ValueError, match="mean and std must have the same length"):
        image_transform(4, mean=(0.5,), std=(0.5, 0.5))
