"""Each example's ``--quick`` run works and writes its outputs; the demo runner's table and
results.json have the promised layout."""

from __future__ import annotations

import importlib
import json
import math

import pytest

from examples import demo

pytest.importorskip("adapters")
pytest.importorskip("torchaudio")
pytest.importorskip("torch_geometric")
pytest.importorskip("sklearn")

PICTURES = {
    "image_digits": ["image_digits_attention.png"],
    "image_canvas": ["image_canvas_window.png"],
    "audio_dtmf": ["audio_dtmf_attention.png"],
    "graph_sbm": ["graph_sbm_attention.png"],
    "text_recall": ["text_recall_attention.png"],
    "multimodal_match": ["multimodal_match_mass.png"],
    "video_digits": ["video_digits_frame.png"],
}


@pytest.mark.parametrize("name", demo.EXAMPLES)
def test_quick_run_writes_results(name, tmp_path, capsys):
    module = importlib.import_module(f"examples.{name}")
    results = module.main(["--quick", "--device", "cpu", "--out", str(tmp_path),
                           "--no-progress"])
    assert results and all(r.example.split("/")[0] == name for r in results)
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(saved) == {r.example for r in results}
    for entry in saved.values():
        assert {"metric", "value", "baseline", "seconds", "task"} <= set(entry)
        assert math.isfinite(entry["value"]) and math.isfinite(entry["baseline"])
        assert entry["seconds"] >= 0
    for picture in PICTURES.get(name, []):
        assert (tmp_path / picture).stat().st_size > 1000
    out = capsys.readouterr().out
    assert f"[{name}]" in out  # the line of results at the end


def test_walkthrough_matches_torch_within_tolerance(tmp_path, capsys):
    from examples import qkv_walkthrough

    (result,) = qkv_walkthrough.run(quick=True, out_dir=tmp_path, show_progress=False)
    assert result.value <= 1e-6
    out = capsys.readouterr().out
    for step in ("Q shape: torch.Size([3, 4])", "attention weights", "two heads, einops",
                 "torch.baddbmm", "Q gradient norm:"):
        assert step in out


def test_demo_runner_writes_table_and_results_json(tmp_path, capsys):
    summary = demo.main(["--quick", "--jobs", "1", "--out", str(tmp_path),
                         "--only", "qkv_walkthrough", "custom_adapter"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == summary
    assert set(saved) == {"qkv_walkthrough", "custom_adapter"}
    for entry in saved.values():
        assert set(entry) == {"metric", "value", "baseline", "seconds"}
        assert isinstance(entry["metric"], str) and math.isfinite(entry["value"])
    out = capsys.readouterr().out
    assert "| example" in out and "| custom_adapter" in out


def test_caption_decoder_cached_steps_equal_the_whole_sequence(tmp_path, capsys):
    from examples import caption_decoder

    results = caption_decoder.run(quick=True, out_dir=tmp_path, show_progress=False)
    check = {r.example: r for r in results}["caption_decoder/cache"]
    assert check.value == 1.0  # every step's logits within 1e-4 (of their size) of one call
    out = capsys.readouterr().out
    diff = float(out.split("max relative |logit diff| = ")[1].split()[0])
    assert diff <= 1e-4


def test_audio_stream_streams_the_offline_numbers(tmp_path, capsys):
    from examples import audio_stream

    results = audio_stream.run(quick=True, out_dir=tmp_path, show_progress=False)
    check = {r.example: r for r in results}
    assert check["audio_stream/equal"].value == 1.0  # logits within 1e-4 of their size
    out = capsys.readouterr().out
    diff = float(out.split("max |streamed - offline logit| / max(1, max |logit|) = ")[1]
                 .split()[0])
    assert diff <= 1e-4
    assert "latency per 80 ms chunk: median" in out
    assert check["audio_stream/latency"].baseline == 80.0

def test_interleaved_digits_pattern_keeps_documents_apart_and_captions_causal():
    """What the example's decoding relies on: with the pattern, a caption byte never sees a
    later byte or another document (so writing all of a row's captions at once is writing
    each alone); with full attention it sees both."""
    import torch

    from examples import interleaved_digits as ex

    torch.manual_seed(0)
    images = torch.rand(ex.PER_ROW, 1, 8, 8)
    text = ex.captions(torch.randint(0, 10, (ex.PER_ROW,)))
    later = text.clone()
    later[:, 4:] = text[0, 0]  # bytes 4.. changed
    other = images.clone()
    other[1] = 1.0 - other[1]  # document 1's image changed
    for pattern in (ex.PATTERN, None):
        model = ex.CaptionModel(pattern=pattern).eval()
        with torch.no_grad():
            base, moved, elsewhere = (model(i, t) for i, t in
                                      ((images, text), (images, later), (other, text)))
        rest = [0] + list(range(2, ex.PER_ROW))
        kept = (torch.allclose(moved[:, :, :4], base[:, :, :4], atol=1e-5)
                and torch.allclose(elsewhere[:, rest], base[:, rest], atol=1e-5))
        assert kept == (pattern is not None)
        assert not torch.allclose(elsewhere[:, 1], base[:, 1], atol=1e-5)


def test_pattern_pictures_draw_every_primitive_and_recipe(tmp_path, capsys):
    from examples import pattern_pictures

    made = pattern_pictures.main(["--out", str(tmp_path)])
    assert [p.name for p in made] == ["patterns_primitives.png", "patterns_recipes.png"]
    assert all(p.stat().st_size > 5000 for p in made)
    names = {label.split("\n")[-1].split("(")[0] for label, _, _ in pattern_pictures.PRIMITIVES}
    assert {"P.full", "P.causal", "P.window", "P.chunked", "P.same", "P.modality",
            "P.neighborhood", "P.edges"} == names


def test_video_digits_is_frame_causal_and_places_tokens_in_space_and_time():
    """What the example relies on: M-RoPE positions from the clip's grid, no video token
    sees a later time step, the caption reads the whole clip but no later byte."""
    import torch

    from examples import video_digits as ex

    torch.manual_seed(0)
    images, labels = torch.rand(3, 1, 8, 8), torch.tensor([3, 1, 4])
    video, text, _ = ex.make_clips(images, labels, torch.Generator().manual_seed(0))
    model = ex.VideoCaptioner().eval()
    tokens = model.tokens(video, text)
    steps, rows, cols = ex.GRID
    cells = steps * rows * cols
    pos = tokens.meta["positions"][0]
    assert pos[rows * cols + cols + 2].tolist() == [1, 1, 2]  # step 1, row 1, column 2
    assert pos[cells].tolist() == [max(rows, cols)] * 3  # the caption starts after the clip
    assert torch.equal(tokens.meta["frames"][0, :cells],
                       torch.arange(steps).repeat_interleave(rows * cols))

    def encode(clip, caption):
        t = model.tokens(clip, caption)
        return model.fusion.encoder(t, attn_mask=model.attn_mask(t)).x

    with torch.no_grad():
        base = encode(video, text)
        last = video.clone()
        last[:, :, -ex.TUBELET[0]:] = 0.0  # the last time step changed
        moved = encode(last, text)
        later = text.clone()
        later[:, 5:] = text[0, 0]
        rewritten = encode(video, later)
    earlier = (steps - 1) * rows * cols
    assert torch.allclose(moved[:, :earlier], base[:, :earlier], atol=1e-5)
    assert not torch.allclose(moved[:, cells:], base[:, cells:], atol=1e-5)  # caption reads it
    assert torch.allclose(rewritten[:, : cells + 5], base[:, : cells + 5], atol=1e-5)
