"""The bad-input matrix: every public class and function against wrong and edge-case input.

Each public callable is listed once, as a :class:`Subject`: how to build it, how to make a
valid call from a few named sizes, and what each tensor argument is (its axes, the width the
callee fixes, where its padding is). The matrix then derives the cases systematically:

- wrong rank (one more, one fewer), width, batch size, dtype and device (``meta``);
- every axis set to 0 (empty batch, empty sequence, no pixels, no samples ...);
- NaN and Inf at padded positions, NaN at the real positions of one sample;
- non-contiguous, expanded (stride 0) and channels-last inputs;
- out-of-range ids, lengths and edges.

Every case asserts one of three outcomes:

- ``raises``: a ValueError / TypeError whose message names the argument;
- ``matches``: a correct result, checked against a reference (the clean call at the real
  positions, the contiguous call, or the expected empty shape);
- ``confined``: NaN at the real positions of sample 0 leaves every other sample unchanged.

Items of the hardening issue that no generic rule reaches are the explicit cases at the end
(:data:`EXTRA`), with the same three outcomes. ``python -m tests.test_bad_inputs`` prints
how many cases each outcome class holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import adapters
import mmattn
from mmattn import functional as MF
from mmattn import masks, position
from mmattn.tokens import Tokens

RAISES, MATCHES, CONFINED = "raises", "matches", "confined"
NAN, INF = float("nan"), float("inf")

#: The sizes every subject starts from; a subject may override some.
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
    sizes: dict[str, int] = field(default_factory=dict)

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


def _pad(b: int, n: int) -> Tensor:
    """(b, n) bool, True at padding: the last PADDED positions of sample 0."""
    pad = torch.zeros(b, n, dtype=torch.bool)
    if b and n > PADDED:
        pad[0, -PADDED:] = True
    return pad


def _tokens(b: int, n: int, d: int) -> Tokens:
    return Tokens(torch.randn(b, n, d), ~_pad(b, n))


def _rows(name: str) -> Callable[[dict, Tensor], Tensor]:
    """real_out for an output whose rows follow the Tokens (or padding) of ``name``."""

    def real(kwargs: dict, out: Tensor) -> Tensor:
        value = kwargs[name]
        mask = value.full_mask() if isinstance(value, Tokens) else ~value
        return mask.reshape(*mask.shape, *(1,) * (out.dim() - mask.dim()))

    return real


def _module(cls: Callable, *args: Any, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls(*args, **kwargs).eval()

    return build


def _qkv_heads(s: dict, key_len: str) -> dict:
    b, h, e = s["b"], s["h"], s["e"]
    return {
        "query": torch.randn(b, h, s["i"] if key_len == "j" else s["l"], e),
        "key": torch.randn(b, h, s[key_len], e),
        "value": torch.randn(b, h, s[key_len], e),
    }


def _key_pad_heads(name: str) -> Callable[[dict], Tensor]:
    """Padding of a (b, h, j, e) key from the mask argument ``name`` (True = real key)."""

    def pad(kwargs: dict) -> Tensor:
        mask = kwargs[name]
        real = mask.reshape(mask.shape[0], -1)[:, -kwargs["key"].shape[2] :]
        return ~real[:, None, :, None]

    return pad


def _mha_inputs(s: dict, kdim: int | None = None, self_attention: bool = False) -> dict:
    b, d = s["b"], s["d"]
    q_len = s["l"] if self_attention else s["i"]
    k_len = s["l"] if self_attention else s["j"]
    width = kdim or d
    return {
        "query": torch.randn(b, q_len, d),
        "key": torch.randn(b, k_len, width),
        "value": torch.randn(b, k_len, width),
        "key_padding_mask": _pad(b, k_len),
    }


def _kpm_pad(kwargs: dict) -> Tensor:
    return kwargs["key_padding_mask"][..., None]


def _attention_subjects() -> list[Subject]:
    subjects = []
    for path in ("fused", "explicit"):
        weights = path == "explicit"
        kw = {"need_weights": weights}
        for name, cls, extra, kdim, self_attn in (
            ("MultiHeadAttention", mmattn.MultiHeadAttention, {}, None, False),
            ("CrossAttention", mmattn.CrossAttention, {"kdim": 6, "vdim": 6}, 6, False),
            ("AdditiveAttention", mmattn.AdditiveAttention, {}, None, False),
            ("LinformerAttention", mmattn.LinformerAttention,
             {"seq_len": 8, "proj_len": 4}, None, False),
            ("LocalAttention", mmattn.LocalAttention, {"window_size": 1}, None, True),
        ):
            seq = "l" if self_attn else "j"
            key_axes = f"b {seq} {'k' if kdim else 'd'}"
            args = {
                "query": Arg(f"b {'l' if self_attn else 'i'} d", width="d",
                             bad_dtypes=(torch.long, torch.float64),
                             pad=_kpm_pad if self_attn else None),
                "key": Arg(key_axes, width=key_axes.split()[-1], pad=_kpm_pad,
                           bad_dtypes=(torch.long, torch.float64)),
                "value": Arg(key_axes, width=key_axes.split()[-1], pad=_kpm_pad,
                             bad_dtypes=(torch.long, torch.float64)),
                "key_padding_mask": Arg(f"b {seq}", kind="mask", width=seq),
            }
            subjects.append(Subject(
                name=f"{name}[{path}]",
                build=(lambda cls=cls, extra=extra, kw=kw: partial(
                    _module(cls, SIZES["d"], 2, **extra)(), **kw)),
                inputs=partial(_mha_inputs, kdim=kdim, self_attention=self_attn),
                args=args,
                out=f"b {'l' if self_attn else 'i'} d",
                pick=lambda r: r[0],
                real_out=_rows("key_padding_mask") if self_attn else None,
                empty_ok=("b", "l") if self_attn else ("b", "i", "j"),
                path=path,
                sizes={"k": 6},
            ))
    return subjects


def _sdpa_subjects() -> list[Subject]:
    subjects = []
    for path in ("fused", "explicit"):
        weights = path == "explicit"
        pick = (lambda r: r[0]) if weights else (lambda r: r)
        subjects.append(Subject(
            name=f"functional.scaled_dot_product_attention[{path}]",
            build=lambda weights=weights: partial(
                MF.scaled_dot_product_attention, need_weights=weights
            ),
            inputs=lambda s: {
                **_qkv_heads(s, "j"),
                "attn_mask": ~_pad(s["b"], s["j"])[:, None, None, :],
            },
            args={
                "query": Arg("b h i e", width="e"),
                "key": Arg("b h j e", width="e", pad=_key_pad_heads("attn_mask")),
                "value": Arg("b h j e", pad=_key_pad_heads("attn_mask")),
                "attn_mask": Arg("b h i j", kind="mask", width="j", ranks=(1, 2, 3),
                                 broadcasts=True),
            },
            out="b h i e",
            pick=pick,
            empty_ok=("b", "h", "i", "j"),
            path=path,
        ))
        subjects.append(Subject(
            name=f"functional.local_attention[{path}]",
            build=lambda: partial(MF.local_attention, window_size=1),
            inputs=lambda s: {**_qkv_heads(s, "l"), "key_mask": ~_pad(s["b"], s["l"])},
            args={
                "query": Arg("b h l e", width="e", pad=_key_pad_heads("key_mask")),
                "key": Arg("b h l e", width="e", pad=_key_pad_heads("key_mask")),
                "value": Arg("b h l e", pad=_key_pad_heads("key_mask")),
                "key_mask": Arg("b l", kind="mask", width="l",
                                bad_dtypes=(torch.int32, torch.float32)),
            },
            out="b h l e",
            real_out=lambda kw, out: kw["key_mask"][:, None, :, None],
            empty_ok=("b", "h", "l"),
            path=path,
        ))
    return subjects


def _tokens_subjects() -> list[Subject]:
    def one(name: str, build: Callable, out: str, *, params: bool, rows: bool,
            cross: bool = False) -> Subject:
        args = {"tokens": Arg("b l d", kind="tokens", width="d" if params else None,
                              bad_dtypes=(torch.float64,) if params else (), device=params)}
        def inputs(s: dict) -> dict:
            return {"tokens": _tokens(s["b"], s["l"], s["d"])}

        empty = ("b", "l")
        if cross:
            args = {"query": Arg("b l d", kind="tokens", width="d"),
                    "context": Arg("b j k", kind="tokens", width="k")}
            def inputs(s: dict) -> dict:
                return {"query": _tokens(s["b"], s["l"], s["d"]),
                        "context": _tokens(s["b"], s["j"], s["k"])}

            empty = ("b", "l", "j")
        return Subject(
            name=name, build=build, inputs=inputs, args=args, out=out,
            pick=lambda r: r.x if isinstance(r, Tokens) else r,
            real_out=_rows("query" if cross else "tokens") if rows else None,
            empty_ok=empty, sizes={"k": 6},
        )

    d = SIZES["d"]
    return [
        one("masked_mean", lambda: mmattn.masked_mean, "b d", params=False, rows=False),
        one("masked_max", lambda: mmattn.masked_max, "b d", params=False, rows=False),
        one("MaskedPool[first]", _module(mmattn.MaskedPool, "first"), "b d", params=False,
            rows=False),
        one("MaskedPool[mean]", _module(mmattn.MaskedPool, "mean"), "b d", params=False,
            rows=False),
        one("AttentionPool", _module(mmattn.AttentionPool, d, 2), "b d", params=True,
            rows=False),
        one("TransformerBlock[full]", _module(mmattn.TransformerBlock, d, 2), "b l d",
            params=True, rows=True),
        one("TransformerBlock[local]", _module(
            mmattn.TransformerBlock, d, 2, attention="local", window_size=1), "b l d",
            params=True, rows=True),
        one("TransformerBlock[causal]", _module(mmattn.TransformerBlock, d, 2, causal=True),
            "b l d", params=True, rows=True),
        one("Encoder", _module(mmattn.Encoder, d, 1, 2), "b l d", params=True, rows=True),
        one("Encoder[local]", _module(
            mmattn.Encoder, d, 1, 2, attention="local", window_size=1), "b l d",
            params=True, rows=True),
        one("CrossAttentionBlock", _module(mmattn.CrossAttentionBlock, d, 2, kdim=6),
            "b l d", params=True, rows=True, cross=True),
        Subject(
            name="Tokens", build=lambda: Tokens,
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"]),
                              "mask": ~_pad(s["b"], s["l"])},
            args={"x": Arg("b l d", called="Tokens.x", bad_dtypes=(torch.long,),
                           pad=lambda kw: ~kw["mask"][..., None]),
                  "mask": Arg("b l", kind="mask", called="Tokens.mask", width="l",
                              bad_dtypes=(torch.int32, torch.float32))},
            out="b l d", pick=lambda t: t.x, real_out=lambda kw, out: kw["mask"][..., None],
            empty_ok=("b", "l", "d"),
        ),
        Subject(
            name="Tokens.cat", build=lambda: lambda first, second: Tokens.cat([first, second]),
            inputs=lambda s: {"first": _tokens(s["b"], s["l"], s["d"]),
                              "second": _tokens(s["b"], s["j"], s["d"])},
            args={"first": Arg("b l d", kind="tokens", device=False, bad_dtypes=(),
                                called="Tokens.cat part"),
                  "second": Arg("b j d", kind="tokens", width="d", called="part 1")},
            out=lambda s: (s["b"], s["l"] + s["j"], s["d"]), pick=lambda t: t.x,
            real_out=lambda kw, out: Tokens.cat([kw["first"], kw["second"]]).mask[..., None],
            empty_ok=("b", "l", "j"),
        ),
    ]


def _position_subjects() -> list[Subject]:
    d = SIZES["d"]
    x_arg = Arg("b l d", width="d", device=False)
    return [
        Subject(
            name="SinusoidalPositionalEncoding",
            build=_module(position.SinusoidalPositionalEncoding, d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": x_arg}, out="b l d", empty_ok=("b", "l"),
        ),
        Subject(
            name="LearnedPositionalEmbedding",
            build=_module(position.LearnedPositionalEmbedding, 16, d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": Arg("b l d", width="d")}, out="b l d", empty_ok=("b", "l"),
        ),
        Subject(
            name="LearnedPositionalEmbedding2d",
            build=_module(position.LearnedPositionalEmbedding2d, (2, 3), d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": Arg("b l d", width="d")}, out="b l d", empty_ok=("b",),
            empty_error={"l": "x"},
        ),
        Subject(
            name="resample_2d",
            build=lambda: partial(position.resample_2d, old_grid=(2, 3), new_grid=(3, 3)),
            inputs=lambda s: {"table": torch.randn(s["l"], s["d"])},
            args={"table": Arg("l d", device=False)},
            out=lambda s: (9, s["d"]), batched=False, empty_error={"l": "table"},
        ),
    ]


def _mask_subjects() -> list[Subject]:
    any_rank = tuple(range(8))
    bool_arg = Arg("b l", kind="mask", ranks=any_rank, bad_dtypes=(torch.int32, torch.float32),
                   device=False, called="mask")
    return [
        Subject(
            name="masks.padding_mask", build=lambda: partial(masks.padding_mask, max_len=6),
            inputs=lambda s: {"lengths": torch.tensor([4, 6, 0, 1])[: s["b"]]},
            args={"lengths": Arg("b", kind="index", device=False)},
            out=lambda s: (s["b"], 6), batched=False, empty_ok=("b",),
            oob=(("lengths", lambda kw: torch.tensor([7, 1])),
                 ("lengths", lambda kw: torch.tensor([-1, 1]))),
        ),
        Subject(name="masks.invert", build=lambda: masks.invert,
                inputs=lambda s: {"mask": _pad(s["b"], s["l"])}, args={"mask": bool_arg},
                out="b l", batched=False, empty_ok=("b", "l")),
        Subject(name="masks.to_additive", build=lambda: masks.to_additive,
                inputs=lambda s: {"mask": _pad(s["b"], s["l"])}, args={"mask": bool_arg},
                out="b l", batched=False, empty_ok=("b", "l")),
        Subject(name="masks.to_bool", build=lambda: masks.to_bool,
                inputs=lambda s: {"mask": masks.to_additive(_pad(s["b"], s["l"]))},
                args={"mask": Arg("b l", kind="mask", ranks=any_rank, device=False,
                                  bad_dtypes=(torch.bool, torch.long))},
                out="b l", batched=False, empty_ok=("b", "l"),
                oob=(("mask", lambda kw: torch.full((2, 3), NAN)),
                     ("mask", lambda kw: torch.full((2, 3), 1.0)))),
        Subject(name="masks.expand_heads", build=lambda: partial(masks.expand_heads, num_heads=2),
                inputs=lambda s: {"mask": torch.rand(s["b"], s["i"], s["j"]) > 0.5},
                args={"mask": Arg("b i j", kind="mask", device=False, bad_dtypes=())},
                out=lambda s: (2 * s["b"], s["i"], s["j"]), batched=False,
                empty_ok=("b", "i", "j")),
    ]


# ------------------------------------------------------------------------ adapters


def _frames(s: dict) -> int:
    return 1 + s["t"] // 8


def _audio_inputs(s: dict) -> dict:
    b, t = s["b"], s["t"]
    lengths = torch.tensor([t - 20, t, t // 2, 1])[:b] if t > 20 else torch.full((b,), t)
    return {"waveform": torch.randn(b, t), "lengths": lengths}


def _past_lengths(kwargs: dict) -> Tensor:
    return torch.arange(kwargs["waveform"].shape[1]) >= kwargs["lengths"][:, None]


def _adapter_subjects() -> list[Subject]:
    d = SIZES["d"]
    text = _module(adapters.TextTokenEmbedder, 20, d, max_len=8)
    subjects = [
        Subject(
            name="TextTokenEmbedder", build=text,
            inputs=lambda s: {"ids": torch.randint(1, 20, (s["b"], s["l"]))},
            args={"ids": Arg("b l", kind="index")}, out="b l d", pick=lambda t: t.x,
            empty_ok=("b", "l"),
            oob=(("ids", lambda kw: torch.full((2, 3), 20)),
                 ("ids", lambda kw: torch.full((2, 3), -1))),
        ),
        Subject(
            name="ByteTokenizer.decode", build=lambda: adapters.ByteTokenizer().decode,
            inputs=lambda s: {"ids": torch.randint(3, 120, (s["b"], s["l"]))},
            args={"ids": Arg("b l", kind="index", ranks=(1,), device=False)},
            out="b", pick=lambda texts: torch.tensor([len(t) for t in texts]),
            batched=False, empty_ok=("b",),
            oob=(("ids", lambda kw: torch.full((2, 3), 259)),
                 ("ids", lambda kw: torch.full((2, 3), -1))),
        ),
    ]
    for fused in (True, False):
        def patcher(fused: bool = fused) -> nn.Module:
            module = _module(adapters.ImagePatcher, d, patch_size=2, img_size=4)()
            module.fused = fused
            return module

        subjects.append(Subject(
            name=f"ImagePatcher[{'fused' if fused else 'unfold'}]", build=patcher,
            inputs=lambda s: {"images": torch.randn(s["b"], s["c"], s["y"], s["x"])},
            args={"images": Arg("b c y x", width="c")},
            out=lambda s: (s["b"], 4, SIZES["d"]), pick=lambda t: t.x,
            empty_ok=("b",), empty_error={"y": "images", "x": "images", "c": "images"},
        ))
    for frontend in ("mel", "raw"):
        subjects.append(Subject(
            name=f"AudioFrameEmbedder[{frontend}]",
            build=_module(adapters.AudioFrameEmbedder, d, n_mels=4, n_fft=32, hop_length=8,
                          frontend=frontend),
            inputs=_audio_inputs,
            args={"waveform": Arg("b t", ranks=(3,), pad=_past_lengths),
                  "lengths": Arg("b", kind="index")},
            out=lambda s: (s["b"], _frames(s), SIZES["d"]), pick=lambda t: t.x,
            real_out=lambda kw, out: (torch.arange(out.shape[1])
                                      < 1 + kw["lengths"][:, None] // 8)[..., None],
            empty_ok=("b",), empty_error={"t": "waveform"},
            oob=(("lengths", lambda kw: torch.tensor([0, 10])),
                 ("lengths", lambda kw: torch.tensor([10, kw["waveform"].shape[1] + 1]))),
            sizes={"t": 64},
        ))
    graph_sizes = {"n": 5, "g": 2}

    def graph_inputs(s: dict) -> dict:
        edges = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 4]])
        return {"edge_index": edges[:, : s.get("edges", 5)],
                "batch": torch.tensor([0, 0, 0, 1, 1])}

    for name, fn in (
        ("neighbourhood_mask", adapters.neighbourhood_mask),
        ("laplacian_eigenvectors", partial(adapters.laplacian_eigenvectors, k=2)),
    ):
        subjects.append(Subject(
            name=name, build=lambda fn=fn: fn, inputs=graph_inputs,
            args={"edge_index": Arg("two edges", kind="index"),
                  "batch": Arg("n", kind="index")},
            out=(lambda s: (2, 3, 3)) if name == "neighbourhood_mask" else (lambda s: (2, 3, 2)),
            batched=False, empty_ok=("edges",), sizes={**graph_sizes, "two": 2, "edges": 5},
            oob=(("edge_index", lambda kw: torch.tensor([[0, 5], [1, 0]])),
                 ("edge_index", lambda kw: torch.tensor([[0, -1], [1, 0]])),
                 ("edge_index", lambda kw: torch.tensor([[0, 2], [1, 3]]))),  # joins graphs
        ))
    return subjects


def _fusion_subjects() -> list[Subject]:
    d = SIZES["d"]

    def build(fusion: str) -> Callable:
        def make() -> Callable:
            torch.manual_seed(0)
            enc = mmattn.MultiModalEncoder(
                {"text": adapters.TextTokenEmbedder(20, d, max_len=8),
                 "image": adapters.ImagePatcher(d, patch_size=2, img_size=4)},
                d, 1, 2, fusion=fusion, num_latents=3,
            ).eval()
            return lambda ids, images: enc({"text": ids, "image": images})

        return make

    return [
        Subject(
            name=f"MultiModalEncoder[{fusion}]", build=build(fusion),
            inputs=lambda s: {"ids": torch.randint(1, 20, (s["b"], s["l"])),
                              "images": torch.randn(s["b"], 3, s["y"], s["x"])},
            args={"ids": Arg("b l", kind="index", called="ids|text"),
                  "images": Arg("b c y x", width="c", called="images|image")},
            out=(lambda s: (s["b"], s["l"] + 4, d)) if fusion == "concat"
            else (lambda s: (s["b"], 3, d)),
            pick=lambda t: t.x, empty_ok=("b", "l"), empty_error={"y": "images"},
            oob=(("ids", lambda kw: torch.full((2, 3), 20)),),
        )
        for fusion in ("concat", "latent")
    ]


SUBJECTS: list[Subject] = [
    *_sdpa_subjects(),
    *_attention_subjects(),
    *_tokens_subjects(),
    *_position_subjects(),
    *_mask_subjects(),
    *_adapter_subjects(),
    *_fusion_subjects(),
]


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
    fn = subject.build()
    with pytest.raises((ValueError, TypeError)) as info:
        subject.call(fn, kwargs)
    message = str(info.value)
    names = [alias for name in called for alias in name.split("|")]
    assert any(name in message for name in names), f"{message!r} does not name {names}"


def _expect_same(subject: Subject, kwargs: dict, reference: dict,
                 real: Callable[[dict, Tensor], Tensor] | None = None) -> None:
    fn = subject.build()
    out, ref = subject.call(fn, kwargs), subject.call(fn, reference)
    assert out.shape == ref.shape
    if real is not None:
        keep = real(reference, ref).expand_as(ref)
        out, ref = out[keep], ref[keep]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _case(outcome: str, subject: Subject, label: str, run: Callable[[], None]):
    return pytest.param(outcome, run, id=f"{subject.name}-{label}")


def _cases(subject: Subject):  # noqa: C901 - one branch per kind of perturbation
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
                fn = subject.build()
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
        if rank >= 2 and arg.kind != "mask":
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
    for axis in subject.empty_ok:
        def empty(axis: str = axis) -> None:
            fn = subject.build()
            small = subject.all_sizes(**{axis: 0})
            out = subject.call(fn, subject.make(small))
            assert tuple(out.shape) == subject.shape(small)
            assert not out.is_floating_point() or out.isfinite().all()

        yield _case(MATCHES, subject, f"empty-{axis}", empty)
    for axis, called in subject.empty_error.items():
        yield _case(RAISES, subject, f"empty-{axis}", lambda axis=axis, called=called:
                    _expect_error(subject, subject.make(subject.all_sizes(**{axis: 0})), called))


MATRIX = [case for subject in SUBJECTS for case in _cases(subject)]


# --------------------------------------------------------------------------- explicit cases
# Items of the hardening issue that no generic rule reaches, each a named case.


def _raises(error: type, *names: str) -> Callable[[Callable[[], Any]], Callable[[], None]]:
    """A case that must raise ``error`` whose message names one of ``names``."""

    def wrap(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(error) as info:
                call()
            assert any(n in str(info.value) for n in names), f"{info.value} names none of {names}"

        return run

    return wrap


def _close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _sdpa_1d_mask() -> None:
    q, (k, v) = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 2, 5, 8).unbind(0)
    keep = torch.tensor([True, False, True, True, False])
    for fused in (True, False):
        with MF.fused_attn(fused):
            _close(MF.scaled_dot_product_attention(q, k, v, keep),
                   MF.scaled_dot_product_attention(q, k, v, keep.expand(4, 5)))
            _close(MF.scaled_dot_product_attention(q, k, v, torch.tensor(True)),
                   MF.scaled_dot_product_attention(q, k, v))


def _sdpa_float_mask_dtype() -> None:
    q = k = v = torch.randn(1, 2, 3, 4)
    for fused in (True, False):
        with MF.fused_attn(fused), pytest.raises(TypeError, match="attn_mask must be bool or"):
            MF.scaled_dot_product_attention(q, k, v, torch.zeros(3, 3, dtype=torch.float64))


def _paths_agree() -> None:
    """Fused and explicit give the same numbers: NaN at padded keys, dead rows, float masks."""
    q, (k, v) = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 2, 6, 8).unbind(0)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[0, ..., -2:] = False
    dead = pad.expand(2, 2, 4, 6).clone()
    dead[1, 0, 2] = False  # a query row with no key
    k_nan = k.clone()
    k_nan[0, :, -2:] = NAN  # padded keys holding NaN
    for mask in (pad, dead, masks.to_additive(dead)):
        with MF.fused_attn(True):
            fused = MF.scaled_dot_product_attention(q, k_nan, v, mask, scale=0.3)
            clean = MF.scaled_dot_product_attention(q, k, v, mask, scale=0.3)
        explicit, _ = MF.scaled_dot_product_attention(
            q, k_nan, v, mask, scale=0.3, need_weights=True
        )
        _close(fused, explicit)
        _close(fused, clean)


def _inf_in_float_mask_confined() -> None:
    """+inf / NaN in a float mask behave as in torch: NaN in the rows they touch, only there."""
    q, (k, v) = torch.randn(1, 2, 4, 8), torch.randn(2, 1, 2, 5, 8).unbind(0)
    for bad in (INF, NAN):
        mask = torch.zeros(4, 5)
        mask[1, 2] = bad
        for need in (False, True):
            out = MF.scaled_dot_product_attention(q, k, v, mask, need_weights=need)
            out = out[0] if need else out
            assert out[:, :, 1].isnan().all()
            rows = [0, 2, 3]
            _close(out[:, :, rows], MF.scaled_dot_product_attention(q, k, v)[:, :, rows])


def _linformer_nan_padding() -> None:
    attn = mmattn.LinformerAttention(8, 2, seq_len=6, proj_len=3).eval()
    x = torch.randn(2, 6, 8)
    pad = _pad(2, 6)
    clean, _ = attn(x, key_padding_mask=pad)
    out, _ = attn(x, torch.where(pad[..., None], NAN, x), key_padding_mask=pad)
    _close(out, clean)


def _audio_short_clip() -> None:
    audio = adapters.AudioFrameEmbedder(8, n_mels=8, n_fft=64, hop_length=16).eval()
    clip = torch.randn(1, 20)  # <= n_fft // 2: too short for reflect padding
    alone = audio(clip)
    batch = audio(torch.cat([clip, torch.zeros(1, 60)], 1).expand(2, 80).contiguous(),
                  lengths=torch.tensor([20, 80]))
    assert alone.length == 1 + 20 // 16
    torch.testing.assert_close(alone.x[0], batch.x[0, : alone.length], rtol=1e-3, atol=1e-4)
    assert audio(torch.randn(2, 1)).x.shape == (2, 1, 8)


def _text_small_int_ids() -> None:
    emb = adapters.TextTokenEmbedder(20, 8)
    ids = torch.randint(0, 20, (2, 5))
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        out = emb(ids.to(dtype))
        _close(out.x, emb(ids).x)
        assert torch.equal(out.mask, ids != 0)


def _learned_keeps_dtype() -> None:
    pos = position.LearnedPositionalEmbedding(8, 4)
    x = torch.randn(2, 3, 4, dtype=torch.float16)
    out = pos(x)
    assert out.dtype == torch.float16
    _close(out, x + pos.weight[:3].half())
    pos2d = position.LearnedPositionalEmbedding2d(2, 4)
    assert pos2d(torch.randn(1, 4, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _state_dict_by_name() -> None:
    def encoder(order: tuple[str, ...]) -> mmattn.MultiModalEncoder:
        parts = {"a": nn.Linear(3, 8), "b": nn.Linear(3, 8)}
        wrapped = {n: _TokensOf(parts[n]) for n in order}
        return mmattn.MultiModalEncoder(wrapped, 8, 1, 2)

    first, second = encoder(("a", "b")), encoder(("b", "a"))
    second.load_state_dict(first.state_dict())
    inputs = {"a": torch.randn(2, 3, 3), "b": torch.randn(2, 4, 3)}
    out1, out2 = first(inputs), second(inputs)
    for name in "ab":
        start1, stop1 = out1.meta["spans"][name]
        start2, stop2 = out2.meta["spans"][name]
        _close(first.embed(inputs).x[:, start1:stop1], second.embed(inputs).x[:, start2:stop2])


class _TokensOf(nn.Module):
    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj
        self.embed_dim = 8

    def forward(self, v: Tensor) -> Tokens:
        return Tokens(self.proj(v))


class _NoParams(adapters.ModalityAdapter, register=False):
    def forward(self, values: Tensor) -> Tokens:
        dtype, _ = self._param_dtype_device()
        return Tokens(values.to(dtype))


def _graph(edges: list[list[int]], sizes: tuple[int, ...] = (3, 2)) -> Any:
    from torch_geometric.data import Batch, Data

    graphs = [Data(x=torch.randn(n, 4), edge_index=torch.empty(2, 0, dtype=torch.long))
              for n in sizes]
    batch = Batch.from_data_list(graphs)
    batch.edge_index = torch.tensor(edges, dtype=torch.long).reshape(2, -1)
    return batch


def _zero_node_laplacian() -> None:
    seq = adapters.GraphNodeSequencer(4, 8, structural=("laplacian", "degree"))
    from torch_geometric.data import Data

    out = seq(Data(x=torch.randn(0, 4), edge_index=torch.empty(2, 0, dtype=torch.long)))
    assert out.x.shape == (1, 0, 8)
    empty = torch.empty(2, 0, dtype=torch.long)
    assert adapters.laplacian_eigenvectors(empty, None, 2).shape == (1, 0, 2)
    with_empty = seq(_graph([], (0, 3)))
    assert with_empty.x.shape == (2, 3, 8) and with_empty.lengths.tolist() == [0, 3]


def _tokens_cat_dtype() -> Any:
    return Tokens.cat([Tokens(torch.randn(1, 2, 4)), Tokens(torch.randn(1, 2, 4).double())])


def _empty_pools() -> None:
    for mask in (None, torch.zeros(2, 0, dtype=torch.bool)):
        tokens = Tokens(torch.randn(2, 0, 4), mask)
        for pool in (mmattn.masked_mean, mmattn.masked_max, mmattn.MaskedPool("first"),
                     mmattn.AttentionPool(4)):
            out = pool(tokens)
            assert out.shape == (2, 4) and out.isfinite().all()
    assert mmattn.masked_mean(Tokens(torch.randn(2, 0, 4))).abs().sum() == 0


def _explicit_empty_lengths() -> None:
    mha = mmattn.MultiHeadAttention(8, 2)
    for q_len, k_len in ((0, 4), (4, 0), (0, 0)):
        out, weights = mha(torch.randn(2, q_len, 8), torch.randn(2, k_len, 8),
                           need_weights=True)
        assert out.shape == (2, q_len, 8) and weights.shape == (2, q_len, k_len)
        _close(out, mha.out_proj.bias.expand(2, q_len, 8))


def _dropout_names() -> None:
    q = torch.randn(1, 1, 2, 4)
    for bad, error in (("0.1", TypeError), (None, TypeError), (1.5, ValueError),
                       (NAN, ValueError)):
        with pytest.raises(error, match="dropout_p"):
            MF.scaled_dot_product_attention(q, q, q, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout"):
        mmattn.MultiHeadAttention(8, 2, dropout="0.1")


def _factory_dtypes() -> None:
    for build in (
        lambda: mmattn.MultiHeadAttention(8, 2, dtype=torch.long),
        lambda: mmattn.TransformerBlock(8, 2, dtype=torch.int32),
        lambda: mmattn.AttentionPool(8, dtype=torch.long),
        lambda: mmattn.MultiModalEncoder({"a": _TokensOf(nn.Linear(3, 8))}, 8, 1, 2,
                                         dtype=torch.long),
        lambda: position.LearnedPositionalEmbedding(4, 8, dtype=torch.long),
        lambda: adapters.ImagePatcher(8, dtype=torch.uint8),
        lambda: adapters.TextTokenEmbedder(20, 8, dtype=torch.long),
        lambda: adapters.AudioFrameEmbedder(8, frontend="raw", dtype=torch.int16),
    ):
        with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
            build()


EXTRA = [
    # 1. padding never leaks
    pytest.param(MATCHES, _linformer_nan_padding, id="LinformerAttention-nan-keys-past-padding"),
    pytest.param(CONFINED, _inf_in_float_mask_confined, id="sdpa-inf-or-nan-in-float-mask"),
    # 2. empty sizes
    pytest.param(MATCHES, _explicit_empty_lengths, id="MultiHeadAttention-explicit-L0-S0"),
    pytest.param(MATCHES, _empty_pools, id="pools-length-0"),
    pytest.param(MATCHES, lambda: adapters.ByteTokenizer().decode(
        torch.zeros(0, 0, dtype=torch.long)) == [], id="ByteTokenizer-decode-0x0"),
    pytest.param(MATCHES, lambda: position.sinusoidal_1d(0, 8).shape == (0, 8),
                 id="sinusoidal_1d-length-0"),
    # 3. adapters' edges
    pytest.param(MATCHES, _audio_short_clip, id="AudioFrameEmbedder-short-clip"),
    pytest.param(RAISES, _raises(ValueError, "waveform")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw")(torch.randn(2, 0, 50))), id="AudioFrameEmbedder-no-channels"),
    pytest.param(RAISES, _raises(ValueError, "waveform")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw")(torch.randn(2, 0))), id="AudioFrameEmbedder-raw-T0"),
    pytest.param(MATCHES, _text_small_int_ids, id="TextTokenEmbedder-small-int-ids"),
    # 4. graphs
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8, structural="degree")(_graph([[0, 7], [1, 0]]))), id="Graph-edge-out-of-range"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8)(_graph([[0, -1], [1, 0]]))), id="Graph-negative-edge"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.GraphNodeSequencer(
        4, 8).neighbourhood_mask(_graph([[0, 3], [1, 1]]))), id="Graph-edge-between-graphs"),
    pytest.param(RAISES, _raises(ValueError, "edge_index")(lambda: adapters.neighbourhood_mask(
        torch.tensor([[0], [1]], device="meta"), torch.zeros(2, dtype=torch.long))),
        id="neighbourhood_mask-edge-index-on-other-device"),
    pytest.param(MATCHES, _zero_node_laplacian, id="Graph-zero-node-laplacian"),
    # 5. checks that pass and then the kernel fails; paths that disagree
    pytest.param(MATCHES, _sdpa_1d_mask, id="sdpa-1d-and-0d-bool-mask"),
    pytest.param(RAISES, _sdpa_float_mask_dtype, id="sdpa-float-mask-of-other-dtype"),
    pytest.param(RAISES, _raises(ValueError, "scale")(lambda: MF.scaled_dot_product_attention(
        *torch.randn(3, 1, 2, 4), scale=NAN)), id="sdpa-scale-nan"),
    pytest.param(MATCHES, _paths_agree, id="sdpa-fused-equals-explicit"),
    # 6. dtype and state
    pytest.param(RAISES, _raises(TypeError, "dtype")(_tokens_cat_dtype), id="Tokens.cat-dtypes"),
    pytest.param(MATCHES, _learned_keeps_dtype, id="LearnedPositionalEmbedding-keeps-fp16"),
    pytest.param(MATCHES, _state_dict_by_name, id="MultiModalEncoder-state-dict-by-name"),
    pytest.param(RAISES, _raises(TypeError, "tokens")(lambda: mmattn.AttentionPool(4)(
        Tokens(torch.randn(1, 2, 4).double()))), id="AttentionPool-names-tokens"),
    # 7. arguments never validated
    pytest.param(RAISES, _raises(TypeError, "meta")(lambda: Tokens(torch.randn(1, 2, 4),
                                                                   meta=[1])), id="Tokens-meta"),
    pytest.param(RAISES, _raises(TypeError, "parts")(lambda: Tokens.cat(Tokens(
        torch.randn(1, 2, 4)))), id="Tokens.cat-single-Tokens"),
    pytest.param(MATCHES, lambda: _close(masks.to_additive(torch.tensor([True, False]),
                                                         "float16"),
                                         torch.tensor([0.0, -INF], dtype=torch.float16)),
                 id="to_additive-dtype-by-name"),
    pytest.param(RAISES, _raises(TypeError, "dtype")(lambda: masks.to_additive(
        torch.tensor([True]), "nope")), id="to_additive-bad-dtype-name"),
    pytest.param(RAISES, _raises(TypeError, "name")(lambda: adapters.create(["text"])),
                 id="create-list"),
    pytest.param(RAISES, _dropout_names, id="dropout-str-None-nan"),
    pytest.param(RAISES, _factory_dtypes, id="integer-parameter-dtype"),
    pytest.param(RAISES, _raises(ValueError, "offset")(
        lambda: position.LearnedPositionalEmbedding(8, 4)(torch.randn(1, 2, 4), offset=-1)),
        id="learned-negative-offset"),
    pytest.param(RAISES, _raises(ValueError, "offset")(
        lambda: position.SinusoidalPositionalEncoding(4)(torch.randn(1, 2, 4), offset=-3)),
        id="sinusoidal-negative-offset"),
    pytest.param(RAISES, _raises(TypeError, "offset")(lambda: position.sinusoidal_1d(
        2, 4, offset=0.5)), id="sinusoidal-offset-0.5"),
    pytest.param(RAISES, _raises(ValueError, "base")(lambda: position.sinusoidal_1d(
        2, 4, base=0)), id="sinusoidal-base-0"),
    pytest.param(RAISES, _raises(ValueError, "mode")(lambda: position.resample_2d(
        torch.randn(4, 2), (2, 2), (3, 3), mode="cubic")), id="resample_2d-mode"),
    pytest.param(RAISES, _raises(ValueError, "rows")(lambda: position.sinusoidal_2d(-1, 2, 8)),
                 id="sinusoidal_2d-names-rows"),
    pytest.param(RAISES, _raises(ValueError, "max_frames")(lambda: adapters.AudioFrameEmbedder(
        8, frontend="raw", positional="learned", max_frames=3)(torch.randn(1, 1600))),
        id="audio-learned-names-max_frames"),
    pytest.param(RAISES, _raises(TypeError, "batch_first")(lambda: mmattn.MultiHeadAttention(
        8, 2, batch_first="no")), id="batch_first-no"),
    pytest.param(RAISES, _raises(ValueError, "norm_eps")(lambda: mmattn.TransformerBlock(
        8, 2, norm_eps=-1)), id="norm_eps-negative"),
    # issue 9, item 8
    pytest.param(RAISES, _raises(ValueError, "spans", "context")(lambda: mmattn.MultiModalEncoder(
        {"spans": _TokensOf(nn.Linear(3, 8))}, 8, 1, 2)), id="MultiModalEncoder-reserved-name"),
    pytest.param(MATCHES, lambda: _close(_NoParams(4)(torch.ones(1, 2, 4)).x,
                                         torch.ones(1, 2, 4)), id="adapter-without-parameters"),
]


@pytest.mark.parametrize("outcome, run", MATRIX + EXTRA)
def test_bad_input(outcome: str, run: Callable[[], Any]) -> None:
    result = run()
    assert result is None or result is True


def test_the_matrix_is_large_and_every_outcome_occurs() -> None:
    counts = Counter(case.values[0] for case in MATRIX + EXTRA)
    assert sum(counts.values()) >= 500 and set(counts) == {RAISES, MATCHES, CONFINED}


if __name__ == "__main__":  # how many cases each outcome class holds
    counts = Counter(case.values[0] for case in MATRIX + EXTRA)
    print(f"{len(SUBJECTS)} subjects, {sum(counts.values())} cases:", dict(counts))
