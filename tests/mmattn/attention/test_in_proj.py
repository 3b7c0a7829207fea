"""``in_proj_weight`` / ``in_proj_bias`` written and assigned as on ``nn.MultiheadAttention``.

The reference is torch's own module: the same write (or assignment) is made on it and on
ours (``from_torch`` of it), then both must read back the same packed tensors and give the
same outputs. The writes are the ones user code and torch's test suite make
(test/nn/test_multihead_attention.py assigns a new ``in_proj_bias`` Parameter and reads
slices of ``in_proj_weight`` into ``F.multi_head_attention_forward``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmattn import CrossAttention, LocalAttention, MultiHeadAttention


def _pair(dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    return ref, MultiHeadAttention.from_torch(ref)


def _same(ref, ours, dtype=torch.float32, kdim=8):
    torch.manual_seed(1)
    x, ctx = torch.randn(2, 3, 8, dtype=dtype), torch.randn(2, 4, kdim, dtype=dtype)
    want = ref(x, ctx, ctx, need_weights=False)[0]
    # large random weights: the two modules' float32 paths round differently (~1e-5 rel.)
    torch.testing.assert_close(ours(x, ctx, ctx)[0], want, rtol=1e-4, atol=1e-4)
    for name in ("in_proj_weight", "in_proj_bias"):
        mine, theirs = getattr(ours, name), getattr(ref, name)
        assert (mine is None) == (theirs is None), name
        if theirs is not None:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def _seeded(write):
    def run(m):
        torch.manual_seed(7)
        write(m)

    return run


def _no_grad(write):
    def run(m):
        with torch.no_grad():
            write(m)

    return run


WRITES = {
    "zero_-bias": _no_grad(lambda m: m.in_proj_bias.zero_()),
    "copy_-slice": _no_grad(lambda m: m.in_proj_weight[:8].copy_(torch.eye(8))),
    "setitem": _no_grad(lambda m: m.in_proj_weight.__setitem__(slice(16, None), torch.eye(8))),
    "data-mul_": lambda m: m.in_proj_weight.data.mul_(2),
    "data-add_-slice": lambda m: m.in_proj_bias.data[8:16].add_(1),
    "normal_": _seeded(_no_grad(lambda m: m.in_proj_weight.normal_(std=0.1))),
    "init-orthogonal_-chunk": _seeded(_no_grad(
        lambda m: nn.init.orthogonal_(m.in_proj_weight.chunk(3)[1]))),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=list(WRITES))
def test_in_place_writes_reach_the_projections(write):
    ref, ours = _pair()
    write(ref)
    write(ours)
    _same(ref, ours)


def test_writes_after_a_dtype_move_and_with_other_widths():
    ref, ours = _pair()
    ref, ours = ref.double(), ours.double()  # each parameter gets new memory: packed anew
    for m in (ref, ours):
        with torch.no_grad():
            m.in_proj_weight[8:16].zero_()
    _same(ref, ours, torch.float64)
    ref, ours = _pair(kdim=5, vdim=5)  # no packed weight; the packed bias still writes through
    for m in (ref, ours):
        with torch.no_grad():
            m.in_proj_bias.fill_(0.5)
    _same(ref, ours, kdim=5)
    for cls, kw in ((CrossAttention, {}), (LocalAttention, {"window_size": 1})):
        module = cls(8, 2, **kw)
        with torch.no_grad():
            module.in_proj_bias.fill_(3.0)
        assert (module.k_proj.bias == 3).all()


def test_an_optimizer_built_before_the_first_read_keeps_training_the_projections():
    ref, ours = _pair()
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.1)
    x = torch.randn(2, 3, 8)
    F.linear(x, ours.in_proj_weight, ours.in_proj_bias).square().sum().backward()
    expected = {n: p - 0.1 * p.grad for n, p in ours.named_parameters() if p.grad is not None}
    optimizer.step()
    for name, param in ours.named_parameters():
        if name in expected:
            torch.testing.assert_close(param, expected[name])
    torch.testing.assert_close(ours.in_proj_weight, torch.cat(
        [ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))


def test_assigning_a_parameter_splits_it_into_the_projections():
    ref, ours = _pair()
    weight, bias = nn.Parameter(torch.randn(24, 8)), nn.Parameter(torch.randn(24))
    ref.in_proj_weight, ref.in_proj_bias = weight, bias
    ours.in_proj_weight, ours.in_proj_bias = weight, bias
    _same(ref, ours)
    assert torch.equal(ours.q_proj.weight, weight[:8]) and torch.equal(ours.v_proj.bias, bias[16:])
    frozen = nn.Parameter(torch.randn(24, 8), requires_grad=False)
    ours.in_proj_weight = frozen  # requires_grad comes along, as the Parameter's own
    assert not any(p.weight.requires_grad for p in (ours.q_proj, ours.k_proj, ours.v_proj))
    assert ours.q_proj.bias.requires_grad
    mixed = MultiHeadAttention(8, 2, kdim=5, vdim=5)
    mixed.k_proj_weight = nn.Parameter(torch.ones(8, 5))
    assert torch.equal(mixed.k_proj.weight, torch.ones(8, 5))


def test_torch_suite_assigns_a_half_precision_bias_to_a_double_module():
    """test_multihead_attn_fast_path_query_and_bias_have_different_dtypes, on both modules."""
    ref, ours = _pair(torch.float64)
    half = nn.Parameter(ref.in_proj_bias.detach().to(torch.half))
    ref.in_proj_bias = half
    ours.in_proj_bias = half  # copied in, cast to the module's dtype
    assert ours.in_proj_bias.dtype == torch.float64
    assert torch.equal(ours.in_proj_bias, half.double())
    q = torch.randn(4, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(q)[0], ref.eval()(q, q, q)[0])


def test_torch_suite_reads_into_multi_head_attention_forward():
    """test_multihead_attention's reference: F.multi_head_attention_forward on the packed
    tensors, and slices of them as the per-projection weights."""
    ref, ours = _pair()
    x = torch.randn(3, 2, 8)  # (L, B, D): the functional form is sequence-first
    args = (8, 2, ours.in_proj_weight, ours.in_proj_bias, None, None, False, 0.0,
            ours.out_proj.weight, ours.out_proj.bias)
    got, _ = F.multi_head_attention_forward(x, x, x, *args, need_weights=False)
    torch.testing.assert_close(got.transpose(0, 1), ours(x.transpose(0, 1))[0])
    torch.testing.assert_close(ours.in_proj_weight[8:16], ref.in_proj_weight[8:16])
    torch.testing.assert_close(ours.in_proj_bias[:8], ours.q_proj.bias)


def test_bad_assignments_raise_naming_the_attribute():
    module = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"in_proj_weight \(torch.nn.Parameter or None"):
        module.in_proj_weight = torch.zeros(24, 8)  # torch: TypeError too
    with pytest.raises(TypeError) as torch_error:
        nn.MultiheadAttention(8, 2).in_proj_weight = torch.zeros(24, 8)
    assert "torch.nn.Parameter or None expected" in str(torch_error.value)
    with pytest.raises(ValueError, match=r"in_proj_bias must have shape \(24,\).* got \(8,\)"):
        module.in_proj_bias = nn.Parameter(torch.zeros(8))
    with pytest.raises(AttributeError, match="in_proj_bias cannot be set to None"):
        module.in_proj_bias = None
    with pytest.raises(AttributeError, match="in_proj_weight does not exist.*grouped"):
        MultiHeadAttention(8, 2, num_kv_heads=1).in_proj_weight = nn.Parameter(
            torch.zeros(16, 8))
    with pytest.raises(AttributeError, match="in_proj_weight does not exist.*q_proj_weight"):
        MultiHeadAttention(8, 2, kdim=4).in_proj_weight = nn.Parameter(torch.zeros(24, 8))
    no_bias = MultiHeadAttention(8, 2, bias=False)
    no_bias.in_proj_bias = None  # as torch: nothing to remove
    assert no_bias.in_proj_bias is None
    assert "in_proj_weight" not in module.state_dict()


@pytest.mark.slow  # a dynamo compile
def test_reads_under_compile_and_deepcopy_compute_the_same():
    _, ours = _pair()
    x = torch.randn(2, 3, 8)

    def project(m, x):
        return F.linear(x, m.in_proj_weight, m.in_proj_bias)

    want = project(ours, x)
    compiled = torch.compile(project, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(ours, x), want)
    twin = copy.deepcopy(ours)
    with torch.no_grad():
        twin.in_proj_bias.zero_()
    assert (twin.k_proj.bias == 0).all() and not (ours.k_proj.bias == 0).all()
