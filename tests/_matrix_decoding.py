"""Bad-input matrix subjects of rotary positions and decoding caches (``mmattn.rotary``,
``mmattn.cache``), listed in ``tests/test_bad_inputs.py``'s ``SUBJECTS``.

A cache is not a tensor, so the matrix cannot perturb it axis by axis. Each cache subject is
one decoding step ``module(query, is_causal=True, cache=cache)`` on a cache that already
holds a prefix of ``p`` tokens (a cross-attention cache: an empty one, filled by the step),
and its ``wrong`` cases hand the step a cache that does not fit: made for another batch,
dtype, device, number of key/value heads, head width or window, of another kind, full, or
no cache at all. Each step works on a copy, so every call starts from the same cache. The
chunk cache's subject streams one chunk ``module(query, key_padding_mask=..., cache=cache)``
after a first full chunk; its wrong caches also include one whose stream has ended (a short
chunk came last) and one of smaller chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import mmattn
from mmattn import rotary
from tests._matrix import SIZES, Arg, Subject, module, pad_mask

MAX_LEN = 16  # of the caches; the prefix (p) and the step (i) fit
PREFIX = 3  # p: tokens decoded before the step


# --------------------------------------------------------------------------- rotary


def _rotary_pad(kwargs: dict) -> Tensor:
    """(b, 1, l, 1), True at the padded positions of a (b, h, l, e) ``x``."""
    x = kwargs["x"]
    return pad_mask(x.shape[0], x.shape[2])[:, None, :, None]


def _rotary_x(device: bool) -> Arg:
    # (..., L, e): ranks 2, 3 and 5 are valid too; an integer x would rotate into integers
    return Arg("b h l e", width="e", ranks=(2, 3, 5), bad_dtypes=(torch.long,),
               pad=_rotary_pad, device=device)


def rotary_subjects() -> list[Subject]:
    e = SIZES["e"]
    real = lambda kw, out: ~_rotary_pad(kw)  # noqa: E731 - rotation is position-wise
    table = Arg("l e", width="e", bad_dtypes=(torch.long, torch.bool))
    return [
        Subject(
            name="rotary.RotaryEmbedding", build=module(rotary.RotaryEmbedding, e),
            inputs=lambda s: {"x": torch.randn(s["b"], s["h"], s["l"], s["e"]),
                              "offset": torch.tensor(3)},
            # x: the rotation follows x's device (a CPU 0-D offset goes with any device)
            args={"x": _rotary_x(device=False), "offset": Arg("", kind="index")},
            out="b h l e", real_out=real, empty_ok=("b", "h", "l"),
            oob=(("offset", lambda kw: -1),),
        ),
        Subject(
            name="rotary.MultiAxisRotary", build=module(rotary.MultiAxisRotary, e, (1, 1)),
            inputs=lambda s: {"x": torch.randn(s["b"], s["h"], s["l"], s["e"]),
                              "positions": torch.randint(0, 9, (s["b"], s["l"], s["a"]))},
            # positions may be integer or floating (a bool is refused), (l, a) for every item
            args={"x": _rotary_x(device=True),
                  "positions": Arg("b l a", kind="index", width="a", ranks=(2,),
                                   bad_dtypes=(torch.bool,))},
            out="b h l e", real_out=real, empty_ok=("b", "h", "l"),
            empty_error={"a": "positions", "e": "x"}, sizes={"a": 2},
        ),
        Subject(
            name="rotary.apply_rotary", build=lambda: rotary.apply_rotary,
            inputs=lambda s: {"x": torch.randn(s["b"], s["h"], s["l"], s["e"]),
                              **dict(zip(("cos", "sin"), rotary.rotary_cos_sin(
                                  s["l"], s["e"], offset=2)))},
            args={"x": _rotary_x(device=True), "cos": table, "sin": table},
            out="b h l e", real_out=real, empty_ok=("b", "h", "l"),
        ),
        Subject(
            name="rotary.rotary_cos_sin", build=lambda: rotary.rotary_cos_sin,
            inputs=lambda s: {"length": s["l"], "dim": s["e"], "offset": torch.tensor(2),
                              "device": "cpu"},
            args={"offset": Arg("", kind="index")},
            out=lambda s: (s["l"], 2 * s["e"]), pick=lambda r: torch.cat(r, -1),
            batched=False, empty_ok=("l",),
            oob=(("offset", lambda kw: -1),),
            wrong=(("length", "negative", "length", lambda kw: -1),
                   ("length", "float", "length", lambda kw: 2.0),
                   ("dim", "odd", "dim", lambda kw: 5)),
        ),
    ]


# --------------------------------------------------------------------------- caches


def _step(attn: nn.Module, self_attention: bool) -> Callable[..., Any]:
    def step(query: Tensor, cache: Any, **context: Tensor) -> Any:
        cache = copy.deepcopy(cache)  # every call starts from the same cache
        if self_attention:
            return attn(query, is_causal=True, cache=cache)
        return attn(query, context["key"], key_padding_mask=context["key_padding_mask"],
                    cache=cache)

    return step


def _prefilled(attn: nn.Module, batch: int, prefix: int, **kw: Any) -> Any:
    """A cache holding ``prefix`` decoded tokens (none when made for another dtype or
    device: the module could not fill it)."""
    fits = "dtype" not in kw and "device" not in kw
    cache = attn.make_cache(batch, kw.pop("max_len", MAX_LEN), **kw)
    if fits:
        with torch.no_grad():
            attn(torch.randn(batch, prefix, SIZES["d"]), is_causal=True, cache=cache)
    return cache


def _filled_context(cross: nn.Module, batch: int) -> Any:
    cache = cross.make_cache(batch, MAX_LEN)
    with torch.no_grad():
        cross(torch.randn(batch, 1, SIZES["d"]), torch.randn(batch, 4, 6), cache=cache)
    return cache


def _wrong_caches(make: Callable[..., Any], others: dict[str, Callable[[], Any]],
                  full_len: Callable[[dict], int]) -> tuple:
    """The caches that do not fit a step: ``make(batch, **make_cache kwargs)`` builds one
    like the valid call's; ``others`` are caches of other modules."""
    b = SIZES["b"]
    return (
        ("cache", "batch", "batch_size", lambda kw: make(b - 1)),
        ("cache", "dtype-float64", "cache", lambda kw: make(b, dtype=torch.float64)),
        ("cache", "device-meta", "cache", lambda kw: make(b, device="meta")),
        ("cache", "full", "cache", lambda kw: make(b, max_len=full_len(kw))),
        ("cache", "not-a-cache", "cache", lambda kw: {}),
        *(("cache", label, "cache", lambda kw, other=other: other())
          for label, other in others.items()),
    )


def cache_subjects() -> list[Subject]:
    d, b = SIZES["d"], SIZES["b"]
    query = Arg("b i d", width="d", bad_dtypes=(torch.long, torch.float64))
    subjects = []
    for kind, cls, extra, others in (
        ("KVCache", mmattn.MultiHeadAttention, {"position": "rotary", "num_kv_heads": 1}, {
            "kind-LocalKVCache": lambda: mmattn.LocalAttention(d, 2, 1, num_kv_heads=1)
            .make_cache(b, MAX_LEN),
            "num_kv_heads": lambda: mmattn.MultiHeadAttention(d, 2).make_cache(b, MAX_LEN),
            "head-width": lambda: mmattn.MultiHeadAttention(2 * d, 2, num_kv_heads=1)
            .make_cache(b, MAX_LEN)}),
        ("KVCache", mmattn.AdditiveAttention, {}, {
            "kind-ContextCache-causal": lambda: mmattn.CrossAttention(d, 2).make_cache(
                b, MAX_LEN)}),
        ("LocalKVCache", mmattn.LocalAttention, {"window_size": 2, "position": "rotary"}, {
            "kind-KVCache": lambda: mmattn.MultiHeadAttention(d, 2).make_cache(b, MAX_LEN),
            "window_size": lambda: mmattn.LocalAttention(d, 2, 1).make_cache(b, MAX_LEN)}),
    ):
        attn = module(cls, d, 2, **extra)()

        def inputs(s: dict, attn: nn.Module = attn) -> dict:
            cache = _prefilled(attn, s["b"], s["p"])
            return {"query": torch.randn(s["b"], s["i"], d), "cache": cache}

        def make(batch: int, attn: nn.Module = attn, **kw: Any) -> Any:
            return _prefilled(attn, batch, PREFIX, **kw)

        subjects.append(Subject(
            name=f"cache.{kind}[{cls.__name__}]", build=lambda attn=attn: _step(attn, True),
            inputs=inputs, args={"query": query}, out="b i d", pick=lambda r: r[0],
            empty_ok=("b", "i", "p"),
            wrong=_wrong_caches(make, others, lambda kw: PREFIX + SIZES["i"] - 1),
        ))
    cross = module(mmattn.CrossAttention, d, 2, kdim=6, vdim=6)()
    subjects.append(Subject(
        name="cache.ContextCache[CrossAttention]", build=lambda: _step(cross, False),
        inputs=lambda s: {"query": torch.randn(s["b"], s["i"], d),
                          "key": torch.randn(s["b"], s["j"], 6),
                          "key_padding_mask": pad_mask(s["b"], s["j"]),
                          "cache": cross.make_cache(s["b"], MAX_LEN)},
        args={"query": query,
              "key": Arg("b j k", width="k", bad_dtypes=(torch.long, torch.float64),
                         pad=lambda kw: kw["key_padding_mask"][..., None]),
              "key_padding_mask": Arg("b j", kind="mask", width="j")},
        out="b i d", pick=lambda r: r[0], empty_ok=("b", "i", "j"),
        wrong=_wrong_caches(
            lambda batch, **kw: cross.make_cache(batch, kw.pop("max_len", MAX_LEN), **kw),
            {"kind-KVCache": lambda: mmattn.MultiHeadAttention(d, 2).make_cache(b, MAX_LEN),
             "num_kv_heads": lambda: mmattn.CrossAttention(d, 2, kdim=6, num_kv_heads=1)
             .make_cache(b, MAX_LEN),
             # filled by a batch of 1: a batch of 2 queries would broadcast over it
             "filled-for-batch-1": lambda: _filled_context(cross, b - 1)},
            lambda kw: SIZES["j"] - 1),
    ))
    for subject in subjects:
        subject.sizes = {"p": PREFIX, "k": 6}
    return subjects


def chunk_subjects() -> list[Subject]:
    """``cache.ChunkCache[MultiHeadAttention]``: one chunk of ``i`` tokens after a full one."""
    d, b, chunk = SIZES["d"], SIZES["b"], SIZES["i"]
    attn = module(mmattn.MultiHeadAttention, d, 2, position="rotary", num_kv_heads=1)()

    def make(batch: int, prefix: int = chunk, **kw: Any) -> Any:
        fits = "dtype" not in kw and "device" not in kw
        cache = attn.make_cache(batch, chunk=kw.pop("chunk", chunk), left=1, **kw)
        if fits:
            with torch.no_grad():
                attn(torch.randn(batch, prefix, d), cache=cache)
        return cache

    def step(query: Tensor, cache: Any, key_padding_mask: Tensor) -> Any:
        cache = copy.deepcopy(cache)  # every call starts from the same cache (same owner)
        return attn(query, key_padding_mask=key_padding_mask, cache=cache)

    return [Subject(
        name="cache.ChunkCache[MultiHeadAttention]", build=lambda: step,
        inputs=lambda s: {"query": torch.randn(s["b"], s["i"], d),
                          "key_padding_mask": pad_mask(s["b"], s["i"]), "cache": make(s["b"])},
        # an unbatched query (rank - 1) is reported as its mask's mismatch
        args={"query": Arg("b i d", width="d", bad_dtypes=(torch.long, torch.float64),
                           called="query|key_padding_mask",
                           pad=lambda kw: kw["key_padding_mask"][..., None]),
              "key_padding_mask": Arg("b i", kind="mask", width="i")},
        out="b i d", pick=lambda r: r[0], empty_ok=("b", "i"),
        real_out=lambda kw, out: ~kw["key_padding_mask"][..., None],
        wrong=(
            ("cache", "batch", "batch_size", lambda kw: make(b - 1)),
            ("cache", "dtype-float64", "cache", lambda kw: make(b, dtype=torch.float64)),
            ("cache", "device-meta", "cache", lambda kw: make(b, device="meta")),
            ("cache", "ended", "cache", lambda kw: make(b, prefix=chunk - 2)),
            ("cache", "smaller-chunk", "chunk", lambda kw: make(b, chunk=chunk - 1,
                                                                prefix=chunk - 1)),
            ("cache", "not-a-cache", "cache", lambda kw: {}),
            ("cache", "another-module", "cache", lambda kw: mmattn.MultiHeadAttention(
                d, 2, num_kv_heads=1).make_cache(b, chunk=chunk)),
            ("cache", "kind-LocalKVCache", "cache", lambda kw: mmattn.LocalAttention(
                d, 2, 1, num_kv_heads=1).make_cache(b, 16)),
        ),
    )]
