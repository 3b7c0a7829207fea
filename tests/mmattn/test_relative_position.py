"""mmattn.position.RelativePositionBias against a loop over positions and against Swin's own.

References: the definition written as a Python loop over (query, key) pairs, torchvision's
``ShiftedWindowAttention.get_relative_position_bias`` and timm's Swin ``WindowAttention``
(their tables loaded into ours), and the scores of an explicit softmax.
"""

from __future__ import annotations

import pytest
import torch

from mmattn.functional import scaled_dot_product_attention
from mmattn.position import (
    RelativePositionBias,
    relative_position_bias,
    relative_position_index,
)


def _loop_bias(table: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    rows, cols = window
    n = rows * cols
    out = torch.empty(table.shape[1], n, n, dtype=table.dtype)
    for i in range(n):
        for j in range(n):
            dr, dc = i // cols - j // cols, i % cols - j % cols
            out[:, i, j] = table[(dr + rows - 1) * (2 * cols - 1) + dc + cols - 1]
    return out


@pytest.mark.parametrize("window", [(1, 1), (3, 3), (2, 4), (7, 7)])
def test_bias_is_the_table_at_each_pairs_offset(window):
    rpb = RelativePositionBias(3, window).double()
    assert rpb.relative_position_bias_table.shape == ((2 * window[0] - 1) * (2 * window[1] - 1), 3)
    torch.testing.assert_close(rpb(), _loop_bias(rpb.relative_position_bias_table.detach(),
                                                 window), atol=0, rtol=0)
    torch.testing.assert_close(rpb(grid=window), rpb(), atol=0, rtol=0)


def test_lookup_gives_the_bias_of_any_offsets():
    rpb = RelativePositionBias(2, (3, 5))
    bias = rpb()
    for i in range(15):
        for j in range(15):
            got = rpb.lookup(torch.tensor(i // 5 - j // 5), torch.tensor(i % 5 - j % 5))
            assert torch.equal(got, bias[:, i, j])
    dr = torch.tensor([[-2, 2], [0, 1]])
    assert rpb.lookup(dr, -dr).shape == (2, 2, 2)


def test_gradient_reaches_each_table_row_once_per_pair_using_it():
    rpb = RelativePositionBias(1, 2)
    rpb().sum().backward()
    counts = torch.zeros(9)
    for i in range(4):
        for j in range(4):
            counts[(i // 2 - j // 2 + 1) * 3 + i % 2 - j % 2 + 1] += 1
    torch.testing.assert_close(rpb.relative_position_bias_table.grad[:, 0], counts)


def test_matches_torchvision_and_timm_swin_and_loads_their_state_dicts():
    torchvision = pytest.importorskip("torchvision")
    timm_swin = pytest.importorskip("timm.models.swin_transformer")
    tv = torchvision.models.swin_transformer.ShiftedWindowAttention(12, [3, 4], [0, 0], 3)
    tm = timm_swin.WindowAttention(12, 3, window_size=(3, 4))
    for stock, want in ((tv, tv.get_relative_position_bias()[0]),
                        (tm, tm._get_rel_pos_bias()[0])):
        ours = RelativePositionBias(3, (3, 4))
        state = {k: v for k, v in stock.state_dict().items() if k.startswith("relative_")}
        ours.load_state_dict(state, strict=True)  # torchvision: flat index; timm: none
        torch.testing.assert_close(ours(), want, atol=0, rtol=0)
    assert tv.relative_position_index.shape == (144,) and "relative_position_index" not in (
        tm.state_dict())
    square = {"relative_position_bias_table": tv.relative_position_bias_table.detach(),
              "relative_position_index": tv.relative_position_index.reshape(12, 12)}
    RelativePositionBias(3, (3, 4)).load_state_dict(square, strict=True)  # Microsoft's Swin
    assert sorted(RelativePositionBias(3, 2).state_dict()) == [
        "relative_position_bias_table", "relative_position_index"]


def test_functions_are_the_modules_core():
    index = relative_position_index((2, 3))
    assert index.shape == (6, 6) and index.dtype == torch.int64
    assert int(index.min()) == 0 and int(index.max()) == 3 * 5 - 1
    assert torch.equal(index.diagonal(), torch.full((6,), 1 * 5 + 2))
    table = torch.randn(15, 4)
    torch.testing.assert_close(relative_position_bias(table, index), _loop_bias(table, (2, 3)))
    torch.testing.assert_close(relative_position_bias(table, index.flatten()),
                               _loop_bias(table, (2, 3)))


def test_as_an_attention_mask_it_is_added_to_the_scores():
    rpb = RelativePositionBias(2, (2, 3)).double()
    with torch.no_grad():
        rpb.relative_position_bias_table.normal_()
    q, k, v = (torch.randn(3, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    got = scaled_dot_product_attention(q, k, v, attn_mask=rpb())
    scores = q @ k.transpose(-1, -2) / 2 + _loop_bias(rpb.relative_position_bias_table.detach(),
                                                      (2, 3))
    torch.testing.assert_close(got, scores.softmax(-1) @ v)


def test_errors_name_the_argument():
    rpb = RelativePositionBias(2, 3)
    with pytest.raises(ValueError, match=r"grid must match the table's window \(3, 3\).*\(4, 4\)"):
        rpb(grid=(4, 4))
    with pytest.raises(TypeError, match="window must be an int or a pair"):
        RelativePositionBias(2, (3, 3, 3))
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        RelativePositionBias(0, 3)
    with pytest.raises(ValueError, match="window\\[1\\] must be >= 1"):
        RelativePositionBias(2, (3, 0))
    state = rpb.state_dict()
    state["relative_position_index"] = state["relative_position_index"].flip(0)
    with pytest.raises(ValueError, match="relative_position_index must be Swin's index"):
        rpb.load_state_dict(state)
    with pytest.raises(ValueError, match=r"table must have shape \(25, 2\) for the window "
                       r"\(3, 3\) and 2 heads, got \(81, 2\)"):
        rpb.load_state_dict(RelativePositionBias(2, 5).state_dict())


def _natten_pb_start(index: int, length: int, kernel: int, dilation: int) -> int:
    """NATTEN's ``get_pb_start`` (its naive CPU kernels): where query ``index``'s first
    neighbour reads the (2k - 1) bias axis; neighbour ``ki`` reads ``pb_start + ki``."""
    half = kernel // 2
    if dilation <= 1:
        return (half + (index < half) * (half - index)
                + (index + half >= length) * (length - index - 1 - half))
    if index - half * dilation < 0:
        return kernel - 1 - index // dilation
    if index + half * dilation >= length:
        return (length - index - 1) // dilation
    return half


def _natten_window_start(index: int, length: int, kernel: int, dilation: int) -> int:
    """NATTEN's ``get_window_start``: the first key of query ``index``'s window."""
    half = kernel // 2
    if dilation <= 1:
        return max(index - half, 0) + (index + half >= length) * (length - index - half - 1)
    start = index - half * dilation
    if start < 0:
        return index % dilation
    if index + half * dilation >= length:
        imod = index % dilation
        a = (length // dilation) * dilation
        b = length - a
        return length - b + imod - 2 * half * dilation if imod < b else a + imod - kernel * dilation
    return start


@pytest.mark.parametrize("length, kernel, dilation", [(7, 3, 1), (9, 5, 1), (11, 3, 2), (5, 5, 1)])
def test_from_nat_reads_natten_s_bias_of_every_neighbour(length, kernel, dilation):
    """Per axis, NATTEN adds rpb[pb_start(i) + ki] for the neighbour at window_start(i) + ki·d;
    ours adds lookup(i - key) with the table converted by from_nat."""
    gen = torch.Generator().manual_seed(0)
    nat = torch.randn(2, 2 * kernel - 1, 2 * kernel - 1, generator=gen)
    ours = RelativePositionBias.from_nat(nat)
    assert ours.window == (kernel, kernel)
    for i in range(length):
        pi = _natten_pb_start(i, length, kernel, dilation)
        key_i = [_natten_window_start(i, length, kernel, dilation) + ki * dilation
                 for ki in range(kernel)]
        j = (i * 3) % length  # a column query too
        pj = _natten_pb_start(j, length, kernel, dilation)
        key_j = [_natten_window_start(j, length, kernel, dilation) + kj * dilation
                 for kj in range(kernel)]
        for ki, ri in enumerate(key_i):
            for kj, cj in enumerate(key_j):
                got = ours.lookup(torch.tensor((i - ri) // dilation),
                                  torch.tensor((j - cj) // dilation))
                torch.testing.assert_close(got, nat[:, pi + ki, pj + kj], atol=0, rtol=0)
    with pytest.raises(ValueError, match="rpb must be NAT's"):
        RelativePositionBias.from_nat(torch.zeros(2, 4, 5))


def test_relative_position_bias_checks_its_table_and_index():
    index = relative_position_index(2)
    with pytest.raises(TypeError, match="table must have a floating-point dtype"):
        relative_position_bias(torch.zeros(9, 2, dtype=torch.long), index)
    with pytest.raises(ValueError, match="table must be a 2-D tensor"):
        relative_position_bias(torch.zeros(9), index)
    with pytest.raises(TypeError, match="index must have an integer dtype"):
        relative_position_bias(torch.zeros(9, 2), index.float())
    with pytest.raises(ValueError, match=r"index must be \(n, n\) or \(n \* n,\), got \(4, 3\)"):
        relative_position_bias(torch.zeros(9, 2), index[:, :3])
    with pytest.raises(TypeError, match="table must be a torch.Tensor"):
        relative_position_bias([[0.0]], index)
