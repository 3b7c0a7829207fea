"""mmattn.viz: every picture is written, has its size, is not blank; CJK labels have glyphs."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

pytest.importorskip("matplotlib")

import matplotlib.image  # noqa: E402

import mmattn.viz as viz  # noqa: E402
from mmattn import MultiHeadAttention, Tokens  # noqa: E402

DPI = 110
RING = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])


def check_picture(fig, path) -> None:
    """The file exists, has the figure's size in pixels, and is not one flat colour."""
    assert path.exists() and path.stat().st_size > 2000
    pixels = matplotlib.image.imread(path)
    width, height = fig.get_size_inches() * DPI
    assert abs(pixels.shape[0] - height) <= 1 and abs(pixels.shape[1] - width) <= 1
    assert pixels[..., :3].var() > 1e-3


def test_heatmap_from_a_real_module(tmp_path):
    mha = MultiHeadAttention(16, 4)
    _, weights = mha(torch.randn(1, 5, 16), need_weights=True)
    path = tmp_path / "sub" / "heat.png"
    fig = viz.attention_heatmap(weights[0], list("abcde"), title="self-attention", path=path)
    check_picture(fig, path)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")
    assert ax.get_images()[0].get_array().shape == (5, 5)


def test_head_grid(tmp_path):
    mha = MultiHeadAttention(16, 4)
    _, weights = mha(torch.randn(1, 6, 16), need_weights=True, average_attn_weights=False)
    path = tmp_path / "heads.png"
    fig = viz.head_grid(weights[0], ncols=3, path=path)
    check_picture(fig, path)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(4)]
    for h, ax in enumerate(panels):
        torch.testing.assert_close(torch.as_tensor(ax.get_images()[0].get_array()),
                                   weights[0, h].detach())


def test_image_attention_uses_the_patch_grid(tmp_path):
    image = torch.zeros(3, 24, 16)
    image[:, :12] = 1.0  # top half white
    tokens = Tokens(torch.zeros(1, 6, 8), meta={"grid": (3, 2), "patch_size": 8, "stride": 8})
    attention = torch.arange(6.0)
    path = tmp_path / "image.png"
    fig = viz.image_attention(attention, image, tokens, path=path)
    check_picture(fig, path)
    overlay = fig.axes[1].get_images()[1]
    torch.testing.assert_close(torch.as_tensor(overlay.get_array()),
                               attention.reshape(3, 2))
    assert overlay.get_extent() == [-0.5, 15.5, 23.5, -0.5]


def test_video_attention_draws_each_time_step_and_greys_what_is_not_allowed(tmp_path):
    import adapters

    patcher = adapters.VideoPatcher(8, tubelet=(2, 4, 4), in_channels=1, positional=None)
    video = torch.rand(1, 8, 12, 16)  # (C, F, H, W)
    tokens = patcher(video[None])  # grid (4, 3, 4), tubelet (2, 4, 4)
    attention = torch.rand(48)
    allowed = torch.arange(48) >= 12  # nothing in step 0
    path = tmp_path / "video.png"
    fig = viz.video_attention(attention, video, tokens, query=47, allowed=allowed, path=path)
    check_picture(fig, path)
    top, bottom = fig.axes[:4], fig.axes[4:8]
    assert [ax.get_title() for ax in top] == ["frame 1", "frame 3", "frame 5", "frame 7"]
    assert [ax.get_title() for ax in bottom] == [f"step {t}: {0 if t == 0 else 12} keys"
                                                 for t in range(4)]
    grid = torch.as_tensor(bottom[1].get_images()[0].get_array().filled(float("nan")))
    torch.testing.assert_close(grid, attention[12:24].reshape(3, 4))
    assert torch.as_tensor(bottom[0].get_images()[0].get_array().mask).all()  # grey
    assert len(bottom[3].lines) == 1 and not bottom[2].lines  # the query's cross


def test_audio_attention(tmp_path):
    spec = torch.randn(50, 20)
    path = tmp_path / "audio.png"
    fig = viz.audio_attention(torch.rand(50).softmax(0), spec, frame_rate=100.0, path=path)
    check_picture(fig, path)
    assert fig.axes[1].get_xlabel() == "time (s)"


def test_graph_attention(tmp_path):
    path = tmp_path / "graph.png"
    attention = torch.tensor([0.05, 0.1, 0.4, 0.2, 0.15, 0.1])
    fig = viz.graph_attention(attention, RING, query=2, node_labels=list("012345"), path=path)
    check_picture(fig, path)
    dots = fig.axes[0].collections[0]
    torch.testing.assert_close(torch.as_tensor(dots.get_array()).float(), attention)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: viz.image_attention(torch.rand(15), torch.rand(3, 8, 8), (4, 4)),
         r"\(15,\).*\(4, 4\)"),
        (lambda: viz.image_attention(torch.rand(2, 8), torch.rand(3, 8, 8), (4, 4)),
         r"\(2, 8\).*\(4, 4\)"),
        (lambda: viz.audio_attention(torch.rand(9), torch.rand(10, 4)),
         r"\(9,\).*\(10, 4\)"),
        (lambda: viz.video_attention(torch.rand(17), torch.rand(4, 8, 8), (2, 3, 3)),
         r"\(17,\).*\(2, 3, 3\) \(18 tubelets\)"),
        (lambda: viz.video_attention(torch.rand(18), torch.rand(1, 8, 8), (2, 3, 3)),
         r"one frame per time step \(2\)"),
        # found by fuzz_sixth_wave.py: a query outside the grid drew no cross, silently
        (lambda: viz.video_attention(torch.rand(18), torch.rand(4, 8, 8), (2, 3, 3),
                                     query=18), r"query .* \[0, 18\) .* \(2, 3, 3\), got 18"),
        (lambda: viz.video_attention(torch.rand(18), torch.rand(4, 8, 8), (2, 3, 3),
                                     query=-1), r"query must be >= 0, got -1"),
        (lambda: viz.graph_attention(torch.rand(5), RING, num_nodes=6),
         r"\(5,\).*6 nodes"),
        (lambda: viz.graph_attention(torch.rand(5), RING), r"node 5 .* 5 nodes"),
        (lambda: viz.attention_heatmap(torch.rand(3, 4), ["a", "b"]), r"2 labels .* 3 query"),
        (lambda: viz.attention_heatmap(torch.rand(3), None), r"2-D, got shape \(3,\)"),
    ],
)
def test_bad_shapes_name_both_sides(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_video_query_must_be_an_int():
    with pytest.raises(TypeError, match=r"query must be an int, got float \(1.0\)"):
        viz.video_attention(torch.rand(18), torch.rand(4, 8, 8), (2, 3, 3), query=1.0)


@pytest.mark.skipif(not viz.label_font()[1:], reason="no CJK font installed (e.g. apt-get "
                    "install fonts-noto-cjk, or pip install mplfonts && mplfonts init)")
def test_cjk_labels_have_glyphs(tmp_path):
    labels = ["注意力", "查询", "キー", "값", "mix 中文"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)"
        fig = viz.attention_heatmap(torch.rand(5, 5), labels, title="中文标题",
                                    path=tmp_path / "cjk.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == labels


@pytest.mark.parametrize(
    "installed, chosen",
    [
        (["DejaVu Sans", "WenQuanYi Zen Hei", "Noto Sans CJK JP"], "Noto Sans CJK JP"),
        (["DejaVu Sans", "WenQuanYi Micro Hei", "Microsoft YaHei"], "WenQuanYi Micro Hei"),
        (["DejaVu Sans", "PingFang SC"], "PingFang SC"),
        (["DejaVu Sans", "Source Han Serif SC", "cmr10"], "Source Han Serif SC"),  # by name
        (["DejaVu Sans", "Noto Serif KR"], "Noto Serif KR"),
        (["DejaVu Sans", "Noto Sans", "Noto Serif Display", "STIXGeneral"], None),
        ([], None),
    ],
)
def test_font_selection_takes_any_installed_cjk_family(installed, chosen, monkeypatch):
    from matplotlib import font_manager

    from mmattn.viz import _common

    entries = [font_manager.FontEntry(fname=f"/fonts/{n}.ttf", name=n) for n in installed]
    monkeypatch.setattr(font_manager.fontManager, "ttflist", entries)
    _common._cjk_family.cache_clear()
    try:
        assert _common.pick_cjk_family(installed) == chosen
        assert _common.label_font() == ["DejaVu Sans", *([chosen] if chosen else [])]
    finally:
        monkeypatch.undo()
        _common._cjk_family.cache_clear()


def test_without_a_cjk_font_labels_are_escaped_not_tofu_and_it_warns_once(tmp_path,
                                                                         monkeypatch):
    from mmattn.viz import _common

    monkeypatch.setattr(_common, "label_font", lambda: ["DejaVu Sans"])
    monkeypatch.setattr(_common, "_warned", [])
    with pytest.warns(UserWarning, match="no CJK font.*fonts-noto-cjk.*debugging.md"):
        fig = viz.attention_heatmap(torch.rand(2, 2), ["中", "ab"], path=tmp_path / "x.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["\\u4e2d", "ab"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: neither we nor matplotlib warn again
        viz.attention_heatmap(torch.rand(2, 2), ["字", "ab"], title="标题")


def test_import_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "mmattn.viz")
    with pytest.raises(ImportError, match=r"mmattn\[examples\]"):
        importlib.import_module("mmattn.viz")
    monkeypatch.undo()
    importlib.import_module("mmattn.viz")


def test_import_mmattn_does_not_import_viz():
    import subprocess

    code = "import sys, mmattn; print('mmattn.viz' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_neighborhood_window_picture(tmp_path):
    from mmattn import NeighborhoodAttention

    attn = NeighborhoodAttention(8, 2, 3)
    x = torch.randn(1, 5 * 6, 8)
    _, weights = attn(x, grid=(5, 6), need_weights=True)
    path = tmp_path / "window.png"
    fig = viz.neighborhood_attention(weights[0, 6], torch.rand(1, 10, 12), (5, 6), (1, 0),
                                     kernel_size=3, path=path)
    check_picture(fig, path)
    assert fig.axes[1].get_title() == "its weights (9 patches)"  # shifted inward, still 9
    with pytest.raises(ValueError, match=r"query must be a patch of the \(5, 6\) grid"):
        viz.neighborhood_attention(weights[0, 0], torch.rand(10, 12), (5, 6), 30)
    with pytest.raises(ValueError, match="do not fit the patch grid"):
        viz.neighborhood_attention(torch.rand(7), torch.rand(10, 12), (5, 6), 0)


def test_modality_mass_picture_has_a_panel_per_layer_named_by_modality(tmp_path):
    from mmattn import Encoder
    from mmattn.debug import attention_mass
    from mmattn.viz._common import _drawable

    parts = {name: Tokens(torch.randn(2, n, 16)) for name, n in
             (("text", 5), ("image", 4), ("音频", 3))}
    mass = attention_mass(Encoder(16, depth=3, num_heads=2).eval(), Tokens.cat(parts))
    path = tmp_path / "mass.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-a-process "no CJK font" warning
        fig = viz.modality_mass(mass, path=path)
        names = ["text", "image", _drawable("音频")]
    check_picture(fig, path)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == [f"blocks.{c}.attn" for c in range(3)]
    for c, ax in enumerate(panels):
        assert [t.get_text() for t in ax.get_xticklabels()] == names
        assert [t.get_text() for t in ax.get_yticklabels()] == names
        image = torch.as_tensor(ax.get_images()[0].get_array())
        torch.testing.assert_close(image, mass.table[c].mean(0))
        assert ax.get_images()[0].get_clim() == (0.0, 1.0)  # one scale for every layer
    one_head = viz.modality_mass(mass.table, ["a", "b", "c"], head=1)
    image = torch.as_tensor(one_head.axes[0].get_images()[0].get_array())
    torch.testing.assert_close(image, mass.table[0, 1])
    with pytest.raises(ValueError, match="modalities has 2 labels but the map has 3 groups"):
        viz.modality_mass(mass.table, ["a", "b"])
    with pytest.raises(ValueError, match=r"head must be in \[0, 2\), got 2"):
        viz.modality_mass(mass, head=2)
