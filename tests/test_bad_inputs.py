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

The machinery lives in ``tests/_matrix.py``; the items of the hardening issue that no
generic rule reaches are named cases in ``tests/test_bad_input_items.py``, with the same
three outcomes. ``python -m tests.test_bad_inputs`` prints how many cases each outcome
class holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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
from tests._matrix import (  # noqa: F401 - one_thread is a fixture
    CONFINED,
    MATCHES,
    NAN,
    RAISES,
    SIZES,
    Arg,
    Subject,
    cases,
    module,
    one_thread,
    pad_mask,
    padded_tokens,
    real_rows,
)
from tests._matrix_decoding import cache_subjects, chunk_subjects, rotary_subjects
from tests._matrix_packed import PACKED

# --------------------------------------------------------------------------- subjects
# New public API joins the matrix by being listed here once.


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
        "key_padding_mask": pad_mask(b, k_len),
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
                    module(cls, SIZES["d"], 2, **extra)(), **kw)),
                inputs=partial(_mha_inputs, kdim=kdim, self_attention=self_attn),
                args=args,
                out=f"b {'l' if self_attn else 'i'} d",
                pick=lambda r: r[0],
                real_out=real_rows("key_padding_mask") if self_attn else None,
                empty_ok=("b", "l") if self_attn else ("b", "i", "j"),
                path=path,
                sizes={"k": 6},
            ))
    return subjects


#: one argument of another dtype than the rest: an integer one, or a float64 among float32
MIXED = (torch.long, torch.float64)


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
                "attn_mask": ~pad_mask(s["b"], s["j"])[:, None, None, :],
            },
            args={
                "query": Arg("b h i e", width="e", bad_dtypes=MIXED),
                "key": Arg("b h j e", width="e", pad=_key_pad_heads("attn_mask"), bad_dtypes=MIXED),
                "value": Arg("b h j e", pad=_key_pad_heads("attn_mask"), bad_dtypes=MIXED),
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
            inputs=lambda s: {**_qkv_heads(s, "l"), "key_mask": ~pad_mask(s["b"], s["l"])},
            args={
                "query": Arg("b h l e", width="e", pad=_key_pad_heads("key_mask"),
                             bad_dtypes=MIXED),
                "key": Arg("b h l e", width="e", pad=_key_pad_heads("key_mask"),
                             bad_dtypes=MIXED),
                "value": Arg("b h l e", pad=_key_pad_heads("key_mask"), bad_dtypes=MIXED),
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
            return {"tokens": padded_tokens(s["b"], s["l"], s["d"])}

        empty = ("b", "l")
        if cross:
            args = {"query": Arg("b l d", kind="tokens", width="d"),
                    "context": Arg("b j k", kind="tokens", width="k")}
            def inputs(s: dict) -> dict:
                return {"query": padded_tokens(s["b"], s["l"], s["d"]),
                        "context": padded_tokens(s["b"], s["j"], s["k"])}

            empty = ("b", "l", "j")
        return Subject(
            name=name, build=build, inputs=inputs, args=args, out=out,
            pick=lambda r: r.x if isinstance(r, Tokens) else r,
            real_out=real_rows("query" if cross else "tokens") if rows else None,
            empty_ok=empty, sizes={"k": 6},
        )

    d = SIZES["d"]
    return [
        one("masked_mean", lambda: mmattn.masked_mean, "b d", params=False, rows=False),
        one("masked_max", lambda: mmattn.masked_max, "b d", params=False, rows=False),
        one("MaskedPool[first]", module(mmattn.MaskedPool, "first"), "b d", params=False,
            rows=False),
        one("MaskedPool[mean]", module(mmattn.MaskedPool, "mean"), "b d", params=False,
            rows=False),
        one("AttentionPool", module(mmattn.AttentionPool, d, 2), "b d", params=True,
            rows=False),
        one("TransformerBlock[full]", module(mmattn.TransformerBlock, d, 2), "b l d",
            params=True, rows=True),
        one("TransformerBlock[local]", module(
            mmattn.TransformerBlock, d, 2, attention="local", window_size=1), "b l d",
            params=True, rows=True),
        one("TransformerBlock[causal]", module(mmattn.TransformerBlock, d, 2, causal=True),
            "b l d", params=True, rows=True),
        one("Encoder", module(mmattn.Encoder, d, 1, 2), "b l d", params=True, rows=True),
        one("Encoder[local]", module(
            mmattn.Encoder, d, 1, 2, attention="local", window_size=1), "b l d",
            params=True, rows=True),
        one("CrossAttentionBlock", module(mmattn.CrossAttentionBlock, d, 2, kdim=6),
            "b l d", params=True, rows=True, cross=True),
        Subject(
            name="Tokens", build=lambda: Tokens,
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"]),
                              "mask": ~pad_mask(s["b"], s["l"])},
            args={"x": Arg("b l d", called="Tokens.x", bad_dtypes=(torch.long,),
                           pad=lambda kw: ~kw["mask"][..., None]),
                  "mask": Arg("b l", kind="mask", called="Tokens.mask", width="l",
                              bad_dtypes=(torch.int32, torch.float32))},
            out="b l d", pick=lambda t: t.x, real_out=lambda kw, out: kw["mask"][..., None],
            empty_ok=("b", "l", "d"),
        ),
        Subject(
            name="Tokens[cat]", build=lambda: lambda first, second: Tokens.cat([first, second]),
            inputs=lambda s: {"first": padded_tokens(s["b"], s["l"], s["d"]),
                              "second": padded_tokens(s["b"], s["j"], s["d"])},
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
            name="position.SinusoidalPositionalEncoding",
            build=module(position.SinusoidalPositionalEncoding, d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": x_arg}, out="b l d", empty_ok=("b", "l"),
        ),
        Subject(
            name="position.LearnedPositionalEmbedding",
            build=module(position.LearnedPositionalEmbedding, 16, d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": Arg("b l d", width="d")}, out="b l d", empty_ok=("b", "l"),
        ),
        Subject(
            name="position.LearnedPositionalEmbedding2d",
            build=module(position.LearnedPositionalEmbedding2d, (2, 3), d),
            inputs=lambda s: {"x": torch.randn(s["b"], s["l"], s["d"])},
            args={"x": Arg("b l d", width="d")}, out="b l d", empty_ok=("b",),
            empty_error={"l": "x"},
        ),
        Subject(
            name="position.resample_2d",
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
            # a meta lengths is refused by name: the mask's length is its values' maximum
            args={"lengths": Arg("b", kind="index")},
            out=lambda s: (s["b"], 6), batched=False, empty_ok=("b",),
            oob=(("lengths", lambda kw: torch.tensor([7, 1])),
                 ("lengths", lambda kw: torch.tensor([-1, 1]))),
        ),
        Subject(name="masks.invert", build=lambda: masks.invert,
                inputs=lambda s: {"mask": pad_mask(s["b"], s["l"])}, args={"mask": bool_arg},
                out="b l", batched=False, empty_ok=("b", "l")),
        Subject(name="masks.to_additive", build=lambda: masks.to_additive,
                inputs=lambda s: {"mask": pad_mask(s["b"], s["l"])}, args={"mask": bool_arg},
                out="b l", batched=False, empty_ok=("b", "l")),
        Subject(name="masks.to_bool", build=lambda: masks.to_bool,
                inputs=lambda s: {"mask": masks.to_additive(pad_mask(s["b"], s["l"]))},
                # a meta mask is refused by name: whether it converts depends on its values
                args={"mask": Arg("b l", kind="mask", ranks=any_rank,
                                  bad_dtypes=(torch.bool, torch.long))},
                out="b l", batched=False, empty_ok=("b", "l"),
                oob=(("mask", lambda kw: torch.full((2, 3), NAN)),
                     ("mask", lambda kw: torch.full((2, 3), 1.0)))),
        Subject(name="masks.merge_masks", build=lambda: masks.merge_masks,
                inputs=lambda s: {"key_padding_mask": pad_mask(s["b"], s["j"]),
                                  "attn_mask": torch.rand(s["b"] * s["h"], s["i"], s["j"]) > 0.8,
                                  "batch_size": s["b"], "num_heads": s["h"],
                                  "dtype": torch.float32},
                # an integer mask is refused (as additive, 0/1 would add +1 to padded keys)
                args={"key_padding_mask": Arg("b j", kind="mask", width="j",
                                              bad_dtypes=(torch.int32, torch.long)),
                      "attn_mask": Arg("n i j", kind="mask", width="j", ranks=(2,),
                                       bad_dtypes=(torch.int32, torch.long))},
                out=lambda s: (s["b"], s["h"], s["i"], s["j"]), batched=False,
                empty_ok=("b", "i", "j"),
                wrong=(("key_padding_mask", "batch", "key_padding_mask",
                        lambda kw: kw["key_padding_mask"][:-1]),
                       ("attn_mask", "batch-times-heads", "attn_mask",
                        lambda kw: kw["attn_mask"][:-1]),
                       ("key_padding_mask", "additive-long", "key_padding_mask",
                        lambda kw: kw["key_padding_mask"].long()),
                       ("dtype", "integer", "dtype", lambda kw: torch.long),
                       ("num_heads", "zero", "num_heads", lambda kw: 0))),
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


def _video_inputs(s: dict) -> dict:
    b, t = s["b"], s["t"]
    lengths = torch.tensor([t - 1, t])[:b] if t > 1 else torch.full((b,), t)
    return {"video": torch.randn(b, s["c"], t, s["y"], s["x"]), "lengths": lengths}


def _past_frames(kwargs: dict) -> Tensor:
    """(b, 1, t, 1, 1), True at the frames past each clip's length."""
    frames = torch.arange(kwargs["video"].shape[2]) >= kwargs["lengths"][:, None]
    return frames[:, None, :, None, None]


def _adapter_subjects() -> list[Subject]:
    d = SIZES["d"]
    text = module(adapters.TextTokenEmbedder, 20, d, max_len=8)
    subjects = [
        Subject(
            name="adapters.TextTokenEmbedder", build=text,
            inputs=lambda s: {"ids": torch.randint(1, 20, (s["b"], s["l"]))},
            args={"ids": Arg("b l", kind="index")}, out="b l d", pick=lambda t: t.x,
            empty_ok=("b", "l"),
            oob=(("ids", lambda kw: torch.full((2, 3), 20)),
                 ("ids", lambda kw: torch.full((2, 3), -1))),
        ),
        Subject(
            name="adapters.ByteTokenizer[decode]", build=lambda: adapters.ByteTokenizer().decode,
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
            patch = module(adapters.ImagePatcher, d, patch_size=2, img_size=4)()
            patch.fused = fused
            return patch

        subjects.append(Subject(
            name=f"adapters.ImagePatcher[{'fused' if fused else 'unfold'}]", build=patcher,
            inputs=lambda s: {"images": torch.randn(s["b"], s["c"], s["y"], s["x"])},
            args={"images": Arg("b c y x", width="c")},
            out=lambda s: (s["b"], 4, SIZES["d"]), pick=lambda t: t.x,
            empty_ok=("b",), empty_error={"y": "images", "x": "images", "c": "images"},
        ))
    for fused in (True, False):
        def video_patcher(fused=fused):
            patch = module(adapters.VideoPatcher, d, tubelet=(2, 2, 2), num_frames=4,
                           img_size=4)()
            patch.fused = fused
            return patch

        subjects.append(Subject(
            name=f"adapters.VideoPatcher[{'fused' if fused else 'linear'}]", build=video_patcher,
            inputs=_video_inputs,
            args={"video": Arg("b c t y x", width="c", pad=_past_frames),
                  "lengths": Arg("b", kind="index")},
            out=lambda s: (s["b"], 2 * 4, SIZES["d"]), pick=lambda t: t.x,
            real_out=lambda kw, out: (torch.arange(2).repeat_interleave(4) * 2
                                      < kw["lengths"][:, None])[..., None],
            empty_ok=("b",), empty_error={"y": "video", "x": "video", "c": "video",
                                          "t": "video"},
            oob=(("lengths", lambda kw: torch.tensor([0, 3])),
                 ("lengths", lambda kw: torch.tensor([3, kw["video"].shape[2] + 1]))),
            sizes={"t": 4},
        ))
    for frontend in ("mel", "raw"):
        subjects.append(Subject(
            name=f"adapters.AudioFrameEmbedder[{frontend}]",
            build=module(adapters.AudioFrameEmbedder, d, n_mels=4, n_fft=32, hop_length=8,
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
            name=f"adapters.{name}", build=lambda fn=fn: fn, inputs=graph_inputs,
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
    *rotary_subjects(),
    *cache_subjects(),
    *chunk_subjects(),
    *_mask_subjects(),
    *_adapter_subjects(),
    *_fusion_subjects(),
]


#: the dense subjects' cases, then packed input (jagged tensors, packed Tokens) of the same
#: public callables (tests/_matrix_packed.py)
MATRIX = [*(case for subject in SUBJECTS for case in cases(subject)), *PACKED]



@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("outcome, run", MATRIX)
def test_bad_input(outcome: str, run: Callable[[], Any]) -> None:
    run()


#: Public names outside the matrix, and why. Anything public that is neither a subject nor
#: listed here fails :func:`test_every_public_name_is_in_the_matrix`.
NOT_IN_MATRIX = {
    "debug.": "every name: takes a module and a call, not tensors "
              "(tests/mmattn/debug/test_hooks.py)",
    "cache.EncoderCache": "the ChunkCaches of an Encoder's blocks: named cases in "
                          "tests/mmattn/test_streaming.py (another encoder's, another batch "
                          "size, not an EncoderCache)",
    "functional.use_fused_attn": "the path switch, no input",
    "functional.set_fused_attn": "the path switch, no input",
    "functional.fused_attn": "the path switch, no input",
    "masks.causal_mask": "int arguments (tests/mmattn/test_masks.py)",
    "masks.band_mask": "int arguments (tests/mmattn/test_masks.py)",
    "masks.local_allowed": "int arguments (tests/mmattn/attention/test_local.py)",
    "masks.k_hop_edges": "integer edge lists (tests/mmattn/kernels/test_segment.py)",
    "masks.neighborhood_mask": "int arguments (tests/mmattn/kernels/test_neighborhood.py)",
    "NeighborhoodAttention": "every call needs a grid; its bad inputs are named cases in "
                             "tests/mmattn/attention/test_neighborhood.py",
    "EdgeAttention": "every call needs edge_index; its bad inputs are named cases in "
                     "tests/mmattn/attention/test_edge.py",
    "position.sinusoidal_1d": "int arguments (named cases in test_bad_input_items.py)",
    "position.sinusoidal_2d": "int arguments (named cases in test_bad_input_items.py)",
    "position.position_1d": "a factory of the position subjects (named cases)",
    "rotary.resolve_position": "the position= argument, checked by the attention modules "
                               "(tests/mmattn/test_rotary.py)",
    "rotary.mrope_positions": "reads a Tokens' spans and grids; its bad inputs are named cases "
                              "in tests/mmattn/test_mrope.py",
    "registry.build_attention": "a name or factory and sizes "
                                "(tests/mmattn/attention/test_registry.py)",
    "replace_attention": "takes a model, not tensors (tests/mmattn/integrations/test_torch.py)",
    "available_attention": "no input",
    "register_attention": "a name and a class (tests/mmattn/attention/test_registry.py)",
    "adapters.adapter_class": "a name, checked as adapters.create's (named case)",
    "adapters.GraphNodeSequencer": "takes a torch_geometric Data (named cases)",
    "adapters.ModalityAdapter": "the base class (named case: an adapter without parameters)",
    "adapters.available": "no input",
    "adapters.create": "a name (named case)",
    "adapters.image_transform": "torchvision's pipeline",
    "position.RelativePositionBias": "its forward takes a grid, not a tensor (named cases: "
                                     "tests/mmattn/test_relative_position.py)",
    "position.relative_position_index": "a window, int arguments",
    "position.relative_position_bias": "a table and an index, each checked by name (named "
                                       "cases: tests/mmattn/test_relative_position.py)",
    "adapters.num_frames": "int arguments",
    "distributed.SequenceParallel": "needs a process group of several ranks: bad input on one "
                                    "or every rank is raised on every rank, never a hang "
                                    "(2 gloo ranks, tests/mmattn/distributed/"
                                    "test_sequence_parallel.py, sp_errors)",
    "distributed.all_reduce_grads": "takes a module and a process group (a non-module is a "
                                    "TypeError: sp_errors, 2 gloo ranks)",
    "distributed.ContextParallel": "needs a process group of several ranks: bad input on any "
                                   "rank is the same error on every rank, never a hang (2 "
                                   "gloo ranks, tests/mmattn/distributed/"
                                   "test_context_parallel.py; module refusals there too)",
    "distributed.context_plan": "a SparseMask and a process group (a non-mask is a TypeError:"
                                " test_context_parallel_wraps_pattern_attention_only)",
    "distributed.ContextPlan": "made by context_plan / ContextParallel.plan, not by users",
}


def _public_names() -> dict[str, object]:
    """Every public callable by its qualified name (a re-export appears under each name)."""
    names = {}
    for prefix, package in (("", mmattn), ("functional.", MF), ("masks.", masks),
                            ("position.", position), ("rotary.", mmattn.rotary),
                            ("cache.", mmattn.cache), ("registry.", mmattn.registry),
                            ("debug.", mmattn.debug), ("distributed.", mmattn.distributed),
                            ("adapters.", adapters)):
        for name in package.__all__:
            value = getattr(package, name)
            if callable(value) and not isinstance(value, type(mmattn)):
                names[prefix + name] = value
    return names


def test_every_public_name_is_in_the_matrix() -> None:
    public = _public_names()
    covered = {subject.name.split("[")[0] for subject in SUBJECTS}
    assert covered <= set(public), f"subjects that name no public callable: {covered - set(public)}"
    exempt = {n for n in public for key in NOT_IN_MATRIX if n == key
              or (key.endswith(".") and n.startswith(key))}
    # a re-export (position.RotaryEmbedding is rotary.RotaryEmbedding) counts under any name
    done = {id(public[n]) for n in covered | exempt}
    missing = {n for n, value in public.items() if id(value) not in done}
    assert not missing, f"public names neither in the matrix nor in NOT_IN_MATRIX: {missing}"
    assert not covered & set(NOT_IN_MATRIX)


def test_the_matrix_is_large_and_every_outcome_occurs() -> None:
    counts = Counter(case.values[0] for case in MATRIX)
    assert sum(counts.values()) >= 500 and set(counts) == {RAISES, MATCHES, CONFINED}


if __name__ == "__main__":  # how many cases each outcome class holds
    from tests.test_bad_input_items import ITEMS

    counts = Counter(case.values[0] for case in MATRIX + ITEMS)
    print(f"{len(SUBJECTS)} subjects, {len(MATRIX)} matrix cases + {len(ITEMS)} item cases:",
          dict(counts))
