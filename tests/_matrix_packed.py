"""Bad-input matrix subjects on packed input, listed in ``tests/test_bad_inputs.py``.

A packed subject is a public callable that is also a padded subject (the same name), called
with jagged ``(B, l*, D)`` tensors (the attention modules) or packed ``Tokens`` (blocks, pools,
``Tokens.cat``, ``Tokens``). Lengths hold an empty item and a single token. Its cases assert
the matrix's three outcomes:

- ``matches``: the packed call equals the padded call (``key_padding_mask`` / a Tokens mask)
  on the real tokens; a non-contiguous values buffer equals the contiguous one;
- ``confined``: NaN in item 0's tokens stays in item 0's outputs;
- ``raises``: a named error for a packed argument of another dtype, width or device (meta),
  with another number of items, next to a padded one, or a strided nested ``Tokens.x``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor

import mmattn
from mmattn import functional as MF
from mmattn.kernels.packed import is_jagged, jagged
from mmattn.tokens import Tokens
from tests._matrix import CONFINED, MATCHES, NAN, RAISES, SIZES, _expect_error, module

LENS = (3, 0, 1, 5)  # items of a query / tokens argument: an empty one, a single token
CTX = (2, 4, 0, 3)  # items of a context argument (an empty context for item 2)


@dataclass
class Packed:
    """One packed argument: its width, its item lengths, and the name errors must use."""

    width: int
    lens: tuple[int, ...] = LENS
    called: str = ""
    fixed_width: bool = True  # the callee fixes the width (one more column must raise)
    bad_dtypes: tuple[torch.dtype, ...] = (torch.long, torch.float64)


@dataclass
class PackedSubject:
    """A callable on packed arguments; ``run(fn, **args)`` returns its output item by item.

    Each argument arrives either jagged (the packed call) or as padded ``Tokens`` (the
    reference), and ``run`` calls ``fn`` accordingly.
    """

    name: str
    build: Callable[[], Callable]
    args: dict[str, Packed]
    run: Callable[..., list[Tensor]]
    path: str | None = None
    mixed: bool = False  # a padded argument next to a packed one must raise
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def callee(self) -> Callable:
        if "callee" not in self.cache:
            self.cache["callee"] = self.build()
        return self.cache["callee"]

    def call(self, kwargs: dict) -> list[Tensor]:
        context = MF.fused_attn(self.path == "fused") if self.path else nullcontext()
        with context, torch.no_grad():
            return self.run(self.callee(), **kwargs)


# --------------------------------------------------------------------------- inputs


def _values(arg: Packed, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(arg.lens), arg.width, generator=generator)
    offsets = torch.tensor([0, *arg.lens]).cumsum(0)
    return values, offsets


def packed_inputs(subject: PackedSubject) -> dict[str, Tensor]:
    return {name: jagged(*_values(arg, seed)) for seed, (name, arg) in
            enumerate(subject.args.items())}


def padded_inputs(subject: PackedSubject) -> dict[str, Tokens]:
    return {name: Tokens(x).unpack() for name, x in packed_inputs(subject).items()}


def _items(out: Any, mask: Tensor | None = None) -> list[Tensor]:
    """An output item by item: rows of a jagged / packed output, the real rows of a padded
    one (``mask``: its Tokens' real positions), or the rows of a pooled (B, D) one."""
    if isinstance(out, Tokens):
        mask, out = (out.full_mask() if not out.is_packed else None), out.x
    if is_jagged(out):
        return list(out.unbind())
    if mask is not None:
        return [row[keep] for row, keep in zip(out, mask)]
    return list(out)


def _tokens(value: Tensor | Tokens) -> Tokens:
    return value if isinstance(value, Tokens) else Tokens(value)


# --------------------------------------------------------------------------- runs


def _attention_run(fn: Callable, query: Any, context: Any = None) -> list[Tensor]:
    if isinstance(query, Tokens):  # the padded reference
        ctx = query if context is None else context
        out = fn(query.x, ctx.x, ctx.x, key_padding_mask=ctx.key_padding_mask)[0]
        return _items(out, query.full_mask())
    out = fn(query)[0] if context is None else fn(query, context, context)[0]
    return _items(out)


def _tokens_run(fn: Callable, tokens: Any) -> list[Tensor]:
    return _items(fn(_tokens(tokens)))


def _cross_block_run(fn: Callable, query: Any, context: Any) -> list[Tensor]:
    return _items(fn(_tokens(query), _tokens(context)))


def _cat_run(fn: Callable, first: Any, second: Any) -> list[Tensor]:
    return _items(fn([_tokens(first), _tokens(second)]))


def _attention_subjects() -> list[PackedSubject]:
    d = SIZES["d"]
    subjects = []
    for path in ("fused", "explicit"):
        for name, cls, extra in (
            ("MultiHeadAttention", mmattn.MultiHeadAttention, {}),
            ("AdditiveAttention", mmattn.AdditiveAttention, {}),
            ("LinformerAttention", mmattn.LinformerAttention, {"seq_len": 8, "proj_len": 4}),
            ("LocalAttention", mmattn.LocalAttention, {"window_size": 1}),
        ):
            subjects.append(PackedSubject(
                name=f"{name}[packed-{path}]",
                build=lambda cls=cls, extra=extra, path=path: partial(
                    module(cls, d, 2, **extra)(), need_weights=path == "explicit"),
                args={"query": Packed(d, called="query")}, run=_attention_run, path=path,
                mixed=False,
            ))
        subjects.append(PackedSubject(
            name=f"CrossAttention[packed-{path}]",
            build=lambda path=path: partial(module(mmattn.CrossAttention, d, 2, kdim=6, vdim=6)(),
                                            need_weights=path == "explicit"),
            args={"query": Packed(d, called="query"),
                  "context": Packed(6, CTX, called="key")},
            run=_attention_run, path=path, mixed=True,
        ))
    return subjects


def _token_subjects() -> list[PackedSubject]:
    d = SIZES["d"]
    tokens = Packed(d, called="tokens", bad_dtypes=(torch.float64,))
    free = Packed(d, called="tokens", fixed_width=False, bad_dtypes=())

    def one(name: str, build: Callable, arg: Packed = tokens) -> PackedSubject:
        return PackedSubject(name=f"{name}[packed]", build=build, args={"tokens": arg},
                             run=_tokens_run)

    return [
        one("TransformerBlock", module(mmattn.TransformerBlock, d, 2)),
        one("TransformerBlock[local]", module(mmattn.TransformerBlock, d, 2,
                                              attention="local", window_size=1)),
        one("TransformerBlock[causal]", module(mmattn.TransformerBlock, d, 2, causal=True)),
        one("Encoder", module(mmattn.Encoder, d, 1, 2)),
        one("AttentionPool", module(mmattn.AttentionPool, d, 2)),
        one("masked_mean", lambda: mmattn.masked_mean, free),
        one("masked_max", lambda: mmattn.masked_max, free),
        one("MaskedPool[first]", module(mmattn.MaskedPool, "first"), free),
        PackedSubject(
            name="CrossAttentionBlock[packed]", build=module(mmattn.CrossAttentionBlock, d, 2,
                                                             kdim=6),
            args={"query": Packed(d, called="query", bad_dtypes=(torch.float64,)),
                  "context": Packed(6, CTX, called="context", bad_dtypes=(torch.float64,))},
            run=_cross_block_run,
        ),
        PackedSubject(
            name="Tokens[cat-packed]", build=lambda: Tokens.cat,
            args={"first": Packed(d, called="Tokens.cat part", fixed_width=False,
                                  bad_dtypes=()),
                  "second": Packed(d, CTX, called="part 1", bad_dtypes=(torch.float64,))},
            run=_cat_run,
        ),
    ]


PACKED_SUBJECTS: list[PackedSubject] = [*_attention_subjects(), *_token_subjects()]


# --------------------------------------------------------------------------- cases


def _close(out: list[Tensor], ref: list[Tensor]) -> None:
    assert [o.shape for o in out] == [r.shape for r in ref]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def _with(subject: PackedSubject, name: str, change: Callable[[Tensor, Tensor], Tensor]) -> dict:
    """The packed inputs with argument ``name`` rebuilt from ``change(values, offsets)``."""
    kwargs = packed_inputs(subject)
    x = kwargs[name]
    kwargs[name] = change(x.values(), x.offsets())
    return kwargs


def _raises(subject: PackedSubject, label: str, make: Callable[[], dict], *called: str):
    def run() -> None:
        _expect_error(_Adapter(subject), make(), *called)

    return pytest.param(RAISES, run, id=f"{subject.name}-{label}")


class _Adapter:
    """What :func:`tests._matrix._expect_error` needs of a subject."""

    def __init__(self, subject: PackedSubject) -> None:
        self.subject = subject

    def callee(self) -> Callable:
        return self.subject.callee()

    def call(self, fn: Callable, kwargs: dict) -> list[Tensor]:
        return self.subject.call(kwargs)


def packed_cases(subject: PackedSubject):
    def equals_padded() -> None:
        _close(subject.call(packed_inputs(subject)), subject.call(padded_inputs(subject)))

    yield pytest.param(MATCHES, equals_padded, id=f"{subject.name}-equals-padded")
    names = list(subject.args)
    for name, arg in subject.args.items():
        def non_contiguous(name: str = name) -> None:
            kwargs = _with(subject, name, lambda v, o: jagged(v.t().contiguous().t(), o))
            assert not kwargs[name].values().is_contiguous()
            _close(subject.call(kwargs), subject.call(packed_inputs(subject)))

        yield pytest.param(MATCHES, non_contiguous,
                           id=f"{subject.name}-{name}-non-contiguous-values")

        def nan_item_0(name: str = name, arg: Packed = arg) -> None:
            def poison(values: Tensor, offsets: Tensor) -> Tensor:
                values = values.clone()
                values[: arg.lens[0]] = NAN
                return jagged(values, offsets)

            out = subject.call(_with(subject, name, poison))
            ref = subject.call(packed_inputs(subject))
            assert out[0].isnan().any(), "the NaN vanished instead of staying in item 0"
            for o, r in zip(out[1:], ref[1:]):
                assert o.isfinite().all(), "NaN in item 0 reached another item"
                torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)

        yield pytest.param(CONFINED, nan_item_0, id=f"{subject.name}-{name}-nan-in-item-0")
        called = arg.called or name
        for dtype in arg.bad_dtypes:
            yield _raises(subject, f"{name}-dtype-{str(dtype)[6:]}", lambda name=name,
                          dtype=dtype: _with(subject, name, lambda v, o: jagged(v.to(dtype), o)),
                          called)
        if arg.fixed_width:
            yield _raises(subject, f"{name}-width", lambda name=name: _with(
                subject, name, lambda v, o: jagged(torch.cat([v, v[:, :1]], 1), o)), called)
        yield _raises(subject, f"{name}-device-meta", lambda name=name: _with(
            subject, name, lambda v, o: jagged(v.to("meta"), o.to("meta"))), called)
        if len(names) > 1:
            others = [subject.args[n].called or n for n in names]
            yield _raises(subject, f"{name}-one-item-fewer", lambda name=name: _with(
                subject, name, lambda v, o: jagged(v[: int(o[-2])], o[:-1])), *others)
            if subject.mixed:
                def mixed(name: str = name) -> dict:
                    kwargs = packed_inputs(subject)
                    kwargs[name] = Tokens(kwargs[name]).unpack().x
                    return kwargs

                yield _raises(subject, f"{name}-padded-among-packed", mixed, *others)


def strided_nested_tokens() -> None:
    """A strided nested Tokens.x (torch.nested's default layout) is refused, named."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "the strided layout is in prototype stage"
        x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(ValueError, match=r"Tokens.x must be .* jagged .*torch.strided"):
        Tokens(x)


PACKED = [
    *(case for subject in PACKED_SUBJECTS for case in packed_cases(subject)),
    pytest.param(RAISES, strided_nested_tokens, id="Tokens-strided-nested-x"),
]
