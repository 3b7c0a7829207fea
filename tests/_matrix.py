"""The machinery of the bad-input matrix (``tests/test_bad_inputs.py``).

A :class:`Subject` says how to build one public callable and make a valid call from a few
named sizes; an :class:`Arg` says what each tensor argument is. :func:`cases` derives the
cases of one subject, each asserting one of three outcomes:

- ``raises``: a ValueError / TypeError whose message names the argument;
- ``matches``: a correct result, checked against a reference (the clean call at the real
  positions, the contiguous call, or the expected empty shape);
- ``confined``: NaN at the real positions of sample 0 leaves every other sample unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mmattn import functional as MF
from mmattn.tokens import Tokens

RAISES, MATCHES, CONFINED = "raises", "matches", "confined"
NAN, INF = float("nan"), float("inf")

SIZES = {"b": 2, "h": 2, "i": 5, "j": 6, "l": 6, "d": 8, "e": 4, "c": 3, "y": 4, "x": 4}
PADDED = 2  # sample 0 has its last PADDED positions padded; the others none


# --------------------------------------------------------------------------- specs


@dataclass
class Arg:
    """One tensor (or Tokens) argument of a subject.

    Args:
        axes: its axis names, e.g. "b i d" (a Tokens argument: those of its ``x``).
        kind: "float", "mask" (bool), "index" (integer ids / lengths / edges) or "tokens".
        called: the name the error message must use (default: the keyword).
        width: the axis whose size the callee fixes (grown by one, it must raise).
        ranks: other ranks that are valid on their own (not perturbed).
        bad_dtypes: dtypes that must raise TypeError.
        device: an input on another device than the rest must raise.
        pad: kwargs -> bool, broadcastable to the argument, True at padded positions.
        broadcasts: a size of 1 on any axis is valid (an SDPA mask), so no batch case.
    """

    axes: str
    kind: str = "float"
    called: str | None = None
    width: str | None = None
    ranks: tuple[int, ...] = ()
    bad_dtypes: tuple[torch.dtype, ...] | None = None
    device: bool = True
    pad: Callable[[dict], Tensor] | None = None
    broadcasts: bool = False

    def dtypes(self) -> tuple[torch.dtype, ...]:
        if self.bad_dtypes is not None:
            return self.bad_dtypes
        return {
            "float": (torch.long,),
            "mask": (torch.int32,),
            "index": (torch.float32, torch.bool),
            "tokens": (torch.float64,),
        }[self.kind]


@dataclass
class Subject:
    """One public callable and how to call it validly.

    Args:
        name: the case id prefix.
        build: () -> the callable (a module in eval mode, or a function).
        inputs: sizes -> the keyword arguments of a valid call.
        args: the tensor arguments the matrix perturbs.
        out: the output's axis names, or sizes -> its shape.
        pick: result -> the output tensor compared.
        real_out: (kwargs, out) -> bool broadcastable to out, True where the output is real.
        empty_ok: axes that may be 0 (an empty result of the right shape).
        empty_error: axis -> the argument a size of 0 must name in its error.
        batched: samples are independent (so NaN in sample 0 stays in sample 0).
        path: "fused" / "explicit" to run under that attention path.
        oob: (argument, kwargs -> bad value) pairs that must raise naming the argument.
        wrong: (argument, label, name the error must use, kwargs -> bad value): other named
            wrong values, for arguments that are not tensors (a cache made for another
            batch, dtype or device; a negative length).
        sizes: overrides of :data:`SIZES`.
    """

    name: str
    build: Callable[[], Callable]
    inputs: Callable[[dict], dict]
    args: dict[str, Arg]
    out: str | Callable[[dict], tuple]
    pick: Callable[[Any], Tensor] = lambda r: r
    real_out: Callable[[dict, Tensor], Tensor] | None = None
    empty_ok: tuple[str, ...] = ()
    empty_error: dict[str, str] = field(default_factory=dict)
    batched: bool = True
    path: str | None = None
    oob: tuple[tuple[str, Callable[[dict], Any]], ...] = ()
    wrong: tuple[tuple[str, str, str, Callable[[dict], Any]], ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def callee(self) -> Callable:
        """The callable, built once (calls never change it: eval mode, no grad)."""
        if "callee" not in self.cache:
            self.cache["callee"] = self.build()
        return self.cache["callee"]

    def make(self, sizes: dict[str, int]) -> dict:
        """The valid call's keyword arguments, the same values every time."""
        torch.manual_seed(1)
        return self.inputs(sizes)

    def all_sizes(self, **changes: int) -> dict[str, int]:
        return {**SIZES, **self.sizes, **changes}

    def call(self, fn: Callable, kwargs: dict) -> Tensor:
        context = nullcontext() if self.path is None else MF.fused_attn(self.path == "fused")
        with context, torch.no_grad():
            return self.pick(fn(**kwargs))

    def shape(self, sizes: dict) -> tuple:
        if callable(self.out):
            return tuple(self.out(sizes))
        return tuple(sizes[a] for a in self.out.split())



# --------------------------------------------------------------------------- inputs


def pad_mask(b: int, n: int) -> Tensor:
    """(b, n) bool, True at padding: the last PADDED positions of sample 0."""
    pad = torch.zeros(b, n, dtype=torch.bool)
    if b and n > PADDED:
        pad[0, -PADDED:] = True
    return pad


def padded_tokens(b: int, n: int, d: int) -> Tokens:
    return Tokens(torch.randn(b, n, d), ~pad_mask(b, n))


def real_rows(name: str) -> Callable[[dict, Tensor], Tensor]:
    """real_out for an output whose rows follow the Tokens (or padding) of ``name``."""

    def real(kwargs: dict, out: Tensor) -> Tensor:
        value = kwargs[name]
        mask = value.full_mask() if isinstance(value, Tokens) else ~value
        return mask.reshape(*mask.shape, *(1,) * (out.dim() - mask.dim()))

    return real


def module(cls: Callable, *args: Any, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls(*args, **kwargs).eval()

    return build



# --------------------------------------------------------------------------- perturbations


def _axis(arg: Arg, name: str) -> int | None:
    axes = arg.axes.split()
    return axes.index(name) if name in axes else None


def _on(value: Any, fx: Callable[[Tensor], Tensor], fm: Callable | None = None) -> Any:
    """Apply ``fx`` to a tensor, or to a Tokens' x (and ``fm`` to its mask)."""
    if isinstance(value, Tokens):
        mask = value.mask if value.mask is None or fm is None else fm(value.mask)
        return Tokens(fx(value.x), mask, value.meta)
    return fx(value)


def _grow(t: Tensor, axis: int) -> Tensor:
    return torch.cat([t, t.narrow(axis, 0, 1) if t.shape[axis] else t.new_zeros(
        *t.shape[:axis], 1, *t.shape[axis + 1:])], dim=axis)


def _pad_of(arg: Arg, kwargs: dict, name: str) -> Tensor | None:
    value = kwargs[name]
    if isinstance(value, Tokens):
        return None if value.mask is None else ~value.mask[..., None]
    return None if arg.pad is None else arg.pad(kwargs)


def _fill(value: Any, where: Tensor, fill: float) -> Any:
    return _on(value, lambda x: torch.where(where, torch.tensor(fill, dtype=x.dtype), x))


def _expect_error(subject: Subject, kwargs: dict, *called: str) -> None:
    """A ValueError / TypeError whose message names one of ``called``."""
    fn = subject.callee()
    with pytest.raises((ValueError, TypeError)) as info:
        subject.call(fn, kwargs)
    message = str(info.value)
    names = [alias for name in called for alias in name.split("|")]
    assert any(name in message for name in names), f"{message!r} does not name {names}"


def _expect_same(subject: Subject, kwargs: dict, reference: dict,
                 real: Callable[[dict, Tensor], Tensor] | None = None) -> None:
    fn = subject.callee()
    out, ref = subject.call(fn, kwargs), subject.call(fn, reference)
    assert out.shape == ref.shape
    if real is not None:
        keep = real(reference, ref).expand_as(ref)
        out, ref = out[keep], ref[keep]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _case(outcome: str, subject: Subject, label: str, run: Callable[[], None]):
    return pytest.param(outcome, run, id=f"{subject.name}-{label}")


def cases(subject: Subject):  # noqa: C901 - one branch per kind of perturbation
    def with_arg(name: str, transform: Callable[[Any], Any]) -> Callable[[], dict]:
        def make() -> dict:
            kwargs = subject.make(subject.all_sizes())
            return {**kwargs, name: transform(kwargs[name])}

        return make

    def raises(name: str, label: str, make: Callable[[], dict], *called: str):
        return _case(RAISES, subject, f"{name}-{label}",
                     lambda: _expect_error(subject, make(), *called))

    def matches(label: str, make: Callable[[], dict], reference: Callable[[dict], dict],
                real: Callable | None = None):
        def run() -> None:
            kwargs = make()
            _expect_same(subject, kwargs, reference(kwargs), real)

        return _case(MATCHES, subject, label, run)

    sizes = subject.all_sizes()
    batched_args = [n for n, a in subject.args.items() if _axis(a, "b") is not None]
    batch_names = [subject.args[n].called or n for n in batched_args]
    for name, arg in subject.args.items():
        called = arg.called or name
        rank = len(arg.axes.split())
        tokens = arg.kind == "tokens"
        if not tokens:
            if rank + 1 not in arg.ranks:
                yield raises(name, "rank+1", with_arg(name, lambda t: t[None]), called)
            if rank > 1 and rank - 1 not in arg.ranks:
                yield raises(name, "rank-1", with_arg(name, lambda t: t[0]), called)
        if arg.width is not None:
            axis = _axis(arg, arg.width)
            yield raises(name, "width", with_arg(name, lambda v, a=axis: _on(
                v, lambda t: _grow(t, a))), called)
        if len(batched_args) > 1 and _axis(arg, "b") is not None and not arg.broadcasts:
            axis = _axis(arg, "b")  # a mismatch may be reported by either side
            yield raises(name, "batch", with_arg(name, lambda v, a=axis: _on(
                v, lambda t: t.narrow(a, 0, t.shape[a] - 1), lambda m: m[:-1])), *batch_names)
        for dtype in arg.dtypes():
            yield _case(RAISES, subject, f"{name}-dtype-{str(dtype)[6:]}", lambda name=name,
                        dtype=dtype, called=called: _expect_error(
                            subject, with_arg(name, lambda v: _on(v, lambda t: t.to(dtype)))(),
                            called))
        if arg.device:
            yield raises(name, "device-meta", with_arg(name, lambda v: _on(
                v, lambda t: t.to("meta"), lambda m: m.to("meta"))), called)
        # NaN / Inf at padded positions never reach a real output
        if arg.kind in ("float", "tokens") and (tokens or arg.pad is not None):
            for fill, label in ((NAN, "nan"), (INF, "inf"), (-INF, "-inf")):
                def padded(fill: float = fill, name: str = name, arg: Arg = arg) -> dict:
                    kwargs = subject.make(sizes)
                    return {**kwargs, name: _fill(kwargs[name], _pad_of(arg, kwargs, name), fill)}

                yield matches(f"{name}-{label}-at-padding", padded,
                              lambda kw: subject.make(sizes), subject.real_out)
        # NaN at the real positions of sample 0 stays in sample 0
        if arg.kind in ("float", "tokens") and subject.batched and _axis(arg, "b") == 0:
            def nan_real(name: str = name, arg: Arg = arg) -> None:
                fn = subject.callee()
                kwargs = subject.make(sizes)
                value = kwargs[name]
                pad = _pad_of(arg, kwargs, name)
                x = value.x if isinstance(value, Tokens) else value
                first = torch.zeros(x.shape, dtype=torch.bool)
                first[0] = True
                where = first if pad is None else first & ~pad
                out = subject.call(fn, {**kwargs, name: _fill(value, where, NAN)})
                ref = subject.call(fn, kwargs)
                assert out[0].isnan().any(), "the NaN vanished instead of staying in sample 0"
                rest, ref_rest = out[1:], ref[1:]
                if subject.real_out is not None:
                    keep = subject.real_out(kwargs, ref).expand_as(ref)[1:]
                    rest, ref_rest = rest[keep], ref_rest[keep]
                assert rest.isfinite().all(), "NaN in sample 0 reached another sample"
                torch.testing.assert_close(rest, ref_rest, rtol=1e-4, atol=1e-5)

            yield _case(CONFINED, subject, f"{name}-nan-in-sample-0", nan_real)
        # layouts: same numbers as the contiguous input
        if rank >= 2:
            def contiguous(kw: dict, name: str = name) -> dict:
                value = _on(kw[name], lambda t: t.contiguous(), lambda m: m.contiguous())
                return {**kw, name: value}

            yield matches(f"{name}-non-contiguous", with_arg(name, lambda v: _on(
                v, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))), contiguous)
            if _axis(arg, "b") == 0 and sizes["b"] > 1:
                yield matches(f"{name}-expanded", with_arg(name, lambda v: _on(
                    v, lambda t: t[:1].expand_as(t), lambda m: m[:1].expand_as(m))), contiguous)
            if rank == 4 and arg.kind == "float":
                yield matches(f"{name}-channels-last", with_arg(name, lambda v: v.contiguous(
                    memory_format=torch.channels_last)), contiguous)
    for name, bad in subject.oob:
        called = subject.args[name].called or name

        def out_of_range(name: str = name, bad: Callable = bad, called: str = called) -> None:
            kwargs = subject.make(sizes)
            _expect_error(subject, {**kwargs, name: bad(kwargs)}, called)

        yield _case(RAISES, subject, f"{name}-out-of-range-{subject.oob.index((name, bad))}",
                    out_of_range)
    for name, label, called, bad in subject.wrong:
        def wrong(name: str = name, bad: Callable = bad, called: str = called) -> None:
            kwargs = subject.make(sizes)
            _expect_error(subject, {**kwargs, name: bad(kwargs)}, called)

        yield _case(RAISES, subject, f"{name}-{label}", wrong)
    for axis in subject.empty_ok:
        def empty(axis: str = axis) -> None:
            fn = subject.callee()
            small = subject.all_sizes(**{axis: 0})
            out = subject.call(fn, subject.make(small))
            assert tuple(out.shape) == subject.shape(small)
            assert not out.is_floating_point() or out.isfinite().all()

        yield _case(MATCHES, subject, f"empty-{axis}", empty)
    for axis, called in subject.empty_error.items():
        yield _case(RAISES, subject, f"empty-{axis}", lambda axis=axis, called=called:
                    _expect_error(subject, subject.make(subject.all_sizes(**{axis: 0})), called))



@pytest.fixture(scope="module")
def one_thread():
    """The matrix's tensors are tiny: one intra-op thread avoids thread start-up and contention
    costs that dominate such calls (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
