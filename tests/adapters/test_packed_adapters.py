"""Adapters with ``packed=True``: the same real tokens as the padded output, gradients too.

Each adapter's packed Tokens are compared with its own padded output (real tokens only, in
order) and, downstream, a TransformerBlock on the packed tokens with the block on the padded
ones. Images of different sizes have no padded twin: each is compared with the image alone.
"""

from __future__ import annotations

import pytest
import torch

from adapters import AudioFrameEmbedder, ByteTokenizer, ImagePatcher, TextTokenEmbedder
from mmattn import Tokens, TransformerBlock

D, TOL = 16, 1e-5


def same_real_tokens(packed: Tokens, padded: Tokens) -> None:
    """Packed values equal the padded real tokens, item by item; the lengths agree."""
    assert packed.is_packed and packed.mask is None
    assert packed.lengths.tolist() == padded.lengths.tolist()
    expected = padded.x[padded.full_mask()]
    torch.testing.assert_close(packed.x.values(), expected, atol=TOL, rtol=TOL)
    block = TransformerBlock(D, 2)
    out, ref = block(packed), block(padded)
    torch.testing.assert_close(out.x.values(), ref.x[padded.full_mask()], atol=TOL, rtol=TOL)


def grads_match(module: torch.nn.Module, packed_fn, padded_fn) -> None:
    """The adapter's parameters get the same gradients through either layout.

    Within 1e-5 relative to the gradient's own scale: log-mel features are in dB (tens), so
    their weight gradients are sums of large terms taken in another order.
    """
    module.zero_grad()
    out = packed_fn()
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    (padded_fn() * weight).sum().backward()
    assert grads
    for name, p in module.named_parameters():
        if name in grads:
            scale = max(1.0, float(p.grad.abs().max()))
            torch.testing.assert_close(grads[name], p.grad, atol=TOL * scale, rtol=TOL)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", None])
def test_text_packed_from_padded_ids_and_from_lists(positional):
    tok = ByteTokenizer()
    emb = TextTokenEmbedder(tok.vocab_size, D, max_len=64, positional=positional)
    texts = ["I love AI", "", "x", "a much longer sentence than the others"]
    ids = tok.encode(texts)
    padded = emb(ids)
    same_real_tokens(emb(ids, packed=True), padded)
    lists = [[i for i in row.tolist() if i != tok.pad_id] for row in ids]
    from_lists = emb(lists, packed=True)
    torch.testing.assert_close(from_lists.x.values(), emb(ids, packed=True).x.values())
    assert from_lists.lengths.tolist() == [9, 0, 1, 38]
    with pytest.raises(TypeError, match="needs packed=True"):
        emb(lists)
    grads_match(emb, lambda: emb(ids, packed=True).x.values(),
                lambda: padded_real(emb(ids)))


def padded_real(tokens: Tokens) -> torch.Tensor:
    return tokens.x[tokens.full_mask()]


def test_audio_packed_from_clips_with_lengths(clips):
    pytest.importorskip("torchaudio")
    audio = AudioFrameEmbedder(D, sample_rate=8000, n_mels=16, n_fft=128, hop_length=32)
    wave, lengths = clips(lengths=(1600, 40, 1337, 3000))
    packed, padded = audio(wave, lengths, packed=True), audio(wave, lengths)
    same_real_tokens(packed, padded)
    assert packed.meta["hop_length"] == 32
    grads_match(audio, lambda: audio(wave, lengths, packed=True).x.values(),
                lambda: padded_real(audio(wave, lengths)))


def test_graph_packed_straight_from_pyg_batch(make_graphs):
    from adapters import GraphNodeSequencer

    batch = make_graphs(sizes=(3, 7, 1, 40, 5))
    seq = GraphNodeSequencer(4, D, structural=("degree",))
    packed, padded = seq(batch, packed=True), seq(batch)
    same_real_tokens(packed, padded)
    assert torch.equal(packed.x.offsets(), batch.ptr)
    assert packed.meta["num_graphs"] == 5 and packed.meta["num_nodes"] == 56
    # to_nodes is the inverse in PyG's node order, for packed and padded alike
    torch.testing.assert_close(seq.to_nodes(packed), seq.to_nodes(padded))
    nodes = seq.to_nodes(packed)
    assert nodes.data_ptr() == packed.x.values().data_ptr()  # no copy
    grads_match(seq, lambda: seq.to_nodes(seq(batch, packed=True)),
                lambda: seq.to_nodes(seq(batch)))


def test_graph_packed_from_a_single_data(make_graphs):
    from adapters import GraphNodeSequencer

    data = make_graphs(sizes=(6,)).get_example(0)
    packed = GraphNodeSequencer(4, D)(data, packed=True)
    assert packed.lengths.tolist() == [6]


@pytest.mark.parametrize("positional", ["learned", "sincos"])
def test_image_list_of_sizes_is_patched_at_native_resolution(positional):
    patcher = ImagePatcher(D, patch_size=4, img_size=16, positional=positional)
    images = [torch.rand(3, 16, 16), torch.rand(3, 8, 20), torch.rand(3, 5, 4),
               torch.rand(3, 32, 12)]
    packed = patcher(images, packed=True)
    assert packed.meta["grids"] == [(4, 4), (2, 5), (2, 1), (8, 3)]
    assert packed.lengths.tolist() == [16, 10, 2, 24]
    for m, image in enumerate(images):  # each image as it would be alone: own grid, own 2D pos
        alone = patcher(image[None])
        torch.testing.assert_close(packed.x.unbind()[m], alone.x[0], atol=TOL, rtol=TOL)
    out = TransformerBlock(D, 2)(packed)
    assert out.is_packed and out.lengths.tolist() == [16, 10, 2, 24]
    batch = torch.rand(2, 3, 16, 16)
    same_real_tokens(patcher(batch, packed=True), patcher(batch))
    with pytest.raises(TypeError, match="needs packed=True"):
        patcher(images)
