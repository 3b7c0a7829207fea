"""Multi-axis rotary positions against transformers' Qwen2-VL: ``MultiAxisRotary`` against
``Qwen2VLRotaryEmbedding`` + ``apply_rotary_pos_emb``, ``mrope_positions`` against
``Qwen2VLModel.get_rope_index`` (tiny configs, nothing downloaded); and against the 1-D
``RotaryEmbedding`` when every axis holds the same position."""

from __future__ import annotations

import inspect

import pytest
import torch

import mmattn.position
from mmattn import Tokens
from mmattn.rotary import MultiAxisRotary, RotaryEmbedding, mrope_positions

TEXT, IMAGE, VIDEO = 0, 1, 2


def _qwen2_vl():
    """transformers' Qwen2-VL module, or a skip."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    return modeling_qwen2_vl


def _text_config(head_dim: int, sections: tuple[int, ...], base: float):
    from transformers import Qwen2VLTextConfig

    return Qwen2VLTextConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=8, num_hidden_layers=1, vocab_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": base,
                         "mrope_section": list(sections)},
    )


def test_names_are_exported():
    for name in ("MultiAxisRotary", "mrope_positions"):
        assert getattr(mmattn.position, name) is getattr(mmattn.rotary, name)
        assert name in mmattn.rotary.__all__ and name in mmattn.position.__all__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "head_dim, sections, base", [(128, (16, 24, 24), 10000.0), (16, (2, 3, 3), 1e6)]
)
def test_equals_transformers_qwen2_vl_rotary(head_dim, sections, base, dtype, device):
    qwen = _qwen2_vl()
    rotary = qwen.Qwen2VLRotaryEmbedding(_text_config(head_dim, sections, base)).to(device)
    batch, heads, length = 2, 3, 40
    q = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
    position_ids = torch.randint(0, 5000, (3, batch, length), device=device)  # (axes, b, l)
    cos, sin = rotary(q, position_ids)
    if hasattr(qwen, "apply_rotary_pos_emb"):  # the sections are mixed in the rotary module
        want_q, want_k = qwen.apply_rotary_pos_emb(q, k, cos, sin)
    else:  # transformers 5.0: cos and sin per axis, mixed by section when applied
        want_q, want_k = qwen.apply_multimodal_rotary_pos_emb(q, k, cos, sin, list(sections))

    rope = MultiAxisRotary(head_dim, sections, base=base).to(device)
    positions = position_ids.permute(1, 2, 0)  # (b, l, axes)
    # the same float32 angles, cast to the input's dtype as transformers does: equal numbers
    torch.testing.assert_close(rope(q, positions), want_q, atol=0, rtol=0)
    torch.testing.assert_close(rope(k, positions), want_k, atol=0, rtol=0)


def test_every_axis_at_one_position_is_the_1d_rotary(device):
    rope, rope1d = MultiAxisRotary(32, (4, 6, 6)), RotaryEmbedding(32)
    x = torch.randn(2, 3, 9, 32, device=device)
    at = torch.randint(0, 100, (2, 9), device=device)
    torch.testing.assert_close(rope(x, at[..., None].expand(2, 9, 3)), rope1d(x, at))
    torch.testing.assert_close(rope(x, 7), rope1d(x, 7), atol=0, rtol=0)  # an offset: text
    steps = torch.arange(9, device=device) + 4
    torch.testing.assert_close(
        rope(x, steps[:, None].expand(9, 3)), rope1d(x, 4), atol=0, rtol=0
    )


def test_1d_rotary_at_per_token_positions_equals_the_complex_rotation():
    """RoPE of pair (x_i, x_{i+e/2}) is multiplication by exp(i p theta_i) (RoFormer)."""
    e, base = 8, 10000.0
    x = torch.randn(2, 2, 5, e, dtype=torch.float64)
    at = torch.tensor([[0, 3, 3, 10, 2], [7, 8, 9, 10, 11]])
    theta = base ** (-torch.arange(0, e, 2, dtype=torch.float64) / e)
    angles = at[:, None, :, None] * theta  # (b, 1, l, e/2)
    turn = torch.polar(torch.ones_like(angles), angles)
    z = torch.complex(x[..., : e // 2], x[..., e // 2:]) * turn
    want = torch.cat([z.real, z.imag], dim=-1)
    # the angles are float32 (as transformers'): a few ulps of p * theta
    torch.testing.assert_close(RotaryEmbedding(e)(x, at), want, atol=1e-5, rtol=1e-5)


def test_relative_positions_on_each_axis():
    """q·k after M-RoPE depends only on the difference of the positions, axis by axis."""
    rope = MultiAxisRotary(16, (2, 3, 3))
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16,
                                                                       dtype=torch.float64)
    pq, pk = torch.tensor([[[5, 2, 9]]]), torch.tensor([[[1, 7, 3]]])
    shift = torch.tensor([[[40, -2, 11]]]) + 10
    score = (rope(q, pq) * rope(k, pk)).sum()
    moved = (rope(q, pq + shift) * rope(k, pk + shift)).sum()
    torch.testing.assert_close(score, moved, atol=1e-5, rtol=1e-5)  # float32 angles
    other = (rope(q, pq) * rope(k, pk + torch.tensor([[[0, 0, 1]]]))).sum()
    assert not torch.isclose(score, other)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: MultiAxisRotary(16, (2, 3, 2)), ValueError,
         r"sections must sum to head_dim / 2 = 8.*\(2, 3, 2\) \(sum 7\)"),
        (lambda: MultiAxisRotary(15, (2, 3, 3)), ValueError, "head_dim must be divisible by 2"),
        (lambda: MultiAxisRotary(16, (2, 3.0, 3)), TypeError, r"sections\[1\] must be an int"),
        (lambda: MultiAxisRotary(16, ()), TypeError, "sections must be a non-empty sequence"),
        (lambda: MultiAxisRotary(16, (8, 0)), ValueError, r"sections\[1\] must be >= 1"),
        (lambda: MultiAxisRotary(16, (2, 3, 3), base=1), ValueError, "base must be"),
        (lambda: MultiAxisRotary(16, (2, 3, 3))(torch.randn(2, 2, 5, 16), torch.zeros(2, 5)),
         ValueError, r"positions for MultiAxisRotary must have shape \(L, A\) or \(B, L, A\)="
                     r"\(5, 3\) or \(2, 5, 3\).*got \(2, 5\)"),
        (lambda: MultiAxisRotary(16, (2, 3, 3))(torch.randn(2, 2, 5, 16),
                                                torch.zeros(2, 5, 3, dtype=torch.bool)),
         TypeError, "positions must hold integers or floats, got torch.bool"),
        (lambda: MultiAxisRotary(16, (2, 3, 3))(torch.randn(2, 2, 5, 8), 0), ValueError,
         "head_dim=16"),
        (lambda: RotaryEmbedding(8)(torch.randn(2, 2, 5, 8), torch.zeros(2, 4, dtype=torch.long)),
         ValueError, r"offset \(per-token positions\) for RotaryEmbedding must have shape "
                     r"\(L,\) or \(B, L\)"),
    ],
)
def test_bad_input_raises_named_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_axis_table_follows_the_module_and_stays_out_of_the_state_dict():
    rope = MultiAxisRotary(16, (2, 3, 3)).to(torch.bfloat16)
    assert rope.axis_index.dtype == torch.long
    assert rope.axis_index.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert rope.state_dict() == {}
    assert "sections=(2, 3, 3)" in repr(rope)


# ------------------------------------------------------------------------ mrope_positions


def _part(length: int, real: list[int], grid=None) -> Tokens:
    """A part of ``length`` tokens whose item b has its first ``real[b]`` tokens real."""
    mask = torch.arange(length) < torch.tensor(real)[:, None]
    meta = {} if grid is None else {"grid": grid}
    return Tokens(torch.randn(len(real), length, 4), mask, meta)


def _fused():
    """text | image (2 x 3) | text | video (3 frames of 2 x 4, fewer in item 1) | text,
    with padding inside the text parts, and an item without the middle text."""
    video = _part(24, [24, 16, 8], grid=(3, 2, 4))
    parts = {
        "prompt": _part(4, [4, 2, 3]),
        "image": _part(6, [6, 6, 6], grid=(2, 3)),
        "middle": _part(3, [2, 3, 0]),
        "video": video,
        "answer": _part(5, [5, 1, 3]),
    }
    return Tokens.cat(parts), parts


def _transformers_rope_index(fused: Tokens, parts: dict) -> torch.Tensor:
    """Qwen2-VL's get_rope_index on the same layout (token types, grids, attention mask)."""
    qwen = _qwen2_vl()
    from transformers import Qwen2VLConfig

    if "mm_token_type_ids" not in inspect.signature(qwen.Qwen2VLModel.get_rope_index).parameters:
        pytest.skip("needs get_rope_index(input_ids, mm_token_type_ids, ...): transformers "
                    "5.0's finds the parts by special token ids, which this layout has not")

    config = Qwen2VLConfig(
        text_config=dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=8, num_hidden_layers=1, vocab_size=32),
        vision_config=dict(depth=1, embed_dim=8, num_heads=2, hidden_size=16,
                           spatial_merge_size=1, patch_size=2, temporal_patch_size=1),
    )
    model = qwen.Qwen2VLModel(config)
    kinds = {"image": IMAGE, "video": VIDEO}
    types = torch.cat([torch.full((part.length,), kinds.get(name, TEXT))
                       for name, part in parts.items()])
    types = types.expand(fused.batch_size, -1)
    images, videos = [], []
    for b in range(fused.batch_size):  # grids in order of appearance, item by item
        for name, part in parts.items():
            real = int(part.mask[b].sum())
            if name == "image" and real:
                images.append((1, *part.meta["grid"]))
            if name == "video" and real:
                t, h, w = part.meta["grid"]
                videos.append((real // (h * w), h, w))
    position_ids, _ = model.get_rope_index(
        torch.zeros(fused.x.shape[:2], dtype=torch.long), types,
        image_grid_thw=torch.tensor(images), video_grid_thw=torch.tensor(videos),
        attention_mask=fused.mask.long(),
    )
    return position_ids.permute(1, 2, 0)  # (b, l, 3)


def test_mrope_positions_equal_transformers_get_rope_index():
    fused, parts = _fused()
    want = _transformers_rope_index(fused, parts)
    got = mrope_positions(fused)
    assert got.dtype == torch.long and got.shape == (3, fused.length, 3)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # padding: 0 in both


def test_mrope_positions_hand_checked_video_rule():
    """A video (t, h, w) at s takes (s + t, s + r, s + c); the next part starts at
    s + max(h, w) even when t is larger (transformers 5.x)."""
    fused = Tokens.cat({
        "text": _part(2, [2]), "video": _part(12, [12], grid=(6, 1, 2)), "after": _part(1, [1]),
    })
    pos = mrope_positions(fused)[0]
    assert pos[:2].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert pos[2:14, 0].tolist() == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # frames
    assert pos[2:14, 1].tolist() == [2] * 12  # one row
    assert pos[2:14, 2].tolist() == [2, 3] * 6  # two columns
    assert pos[14].tolist() == [4, 4, 4]  # s + max(h, w) = 2 + 2, not 2 + 6


def test_mrope_positions_of_packed_tokens_follow_the_unpacked_layout():
    fused, _ = _fused()
    padded = mrope_positions(fused)
    packed = mrope_positions(fused.pack())
    lengths = fused.mask.sum(1)
    assert packed.shape == (3, int(lengths.max()), 3)
    for b in range(3):
        torch.testing.assert_close(packed[b, : lengths[b]], padded[b][fused.mask[b]])
    # Tokens.pack moves meta["positions"] the same way
    moved = fused.replace(positions=padded).pack().meta["positions"]
    for b in range(3):
        torch.testing.assert_close(moved[b, : lengths[b]], packed[b, : lengths[b]])


def test_mrope_positions_of_a_single_part():
    video = _part(12, [12, 6], grid=(3, 2, 2))
    pos = mrope_positions(video)
    assert pos[0, :, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert pos[0, :, 1].tolist() == [0, 0, 1, 1] * 3 and pos[0, :, 2].tolist() == [0, 1] * 6
    assert pos[1, 6:].abs().sum() == 0  # padding holds 0
    text = Tokens(torch.randn(2, 5, 4), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool())
    torch.testing.assert_close(
        mrope_positions(text)[1], torch.tensor([[0] * 3, [1] * 3, [2] * 3, [0] * 3, [0] * 3])
    )
    per_item = Tokens(torch.randn(2, 6, 4), None, {"grids": [(2, 3), (3, 2)]})
    assert mrope_positions(per_item)[1, :, 2].tolist() == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        (torch.randn(2, 3, 4), TypeError, "tokens must be mmattn.Tokens, got Tensor"),
        (Tokens(torch.randn(1, 5, 4), None, {"grid": (2, 2)}), ValueError,
         r"grid must hold all its tokens.*index 4.*\[4\] cells"),
        (Tokens(torch.randn(1, 4, 4), None, {"grid": (2, 0)}), ValueError,
         r"meta\['grid'\] must be \(rows, cols\) or \(frames, rows, cols\) of positive ints"),
        (Tokens(torch.randn(1, 4, 4), None, {"modality_ids": torch.zeros(1, 4).long()}),
         ValueError, "interleaved meta\\['modality_ids'\\] without spans"),
        (Tokens(torch.randn(1, 4, 4), None, {"spans": {"a": (0, 9)}}), ValueError,
         r"meta\['spans'\]\['a'\] must satisfy 0 <= start <= stop <= length=4"),
    ],
)
def test_mrope_positions_bad_input(tokens, error, match):
    with pytest.raises(error, match=match):
        mrope_positions(tokens)
