"""ByteTokenizer and TextTokenEmbedder against bytes and tables written out by hand."""

from __future__ import annotations

import pytest
import torch

from adapters import ByteTokenizer, TextTokenEmbedder
from mmattn.position import sinusoidal_1d

TEXTS = ["I love AI", "我爱人工智能", "", "Ünïcödé 🙂 ok"]


def test_ids_are_utf8_bytes_shifted_and_padded():
    tok = ByteTokenizer()
    ids = tok.encode(TEXTS)
    raw = [list(t.encode("utf-8")) for t in TEXTS]
    assert ids.dtype == torch.long and ids.shape == (4, max(len(r) for r in raw))
    for row, data in zip(ids.tolist(), raw):
        assert row[: len(data)] == [b + 3 for b in data]
        assert row[len(data) :] == [tok.pad_id] * (ids.shape[1] - len(data))


def test_round_trip_any_language():
    tok = ByteTokenizer(add_bos=True, add_eos=True)
    ids = tok.encode(TEXTS)
    assert tok.decode(ids) == TEXTS
    assert ids[0, 0] == tok.bos_id and ids[0, len("I love AI") + 1] == tok.eos_id
    assert tok.decode(ids[1]) == ["我爱人工智能"]


def test_max_len_never_splits_a_character():
    tok = ByteTokenizer()
    ids = tok.encode(["我爱AI", "abcdef"], max_len=5)  # 我 and 爱 are 3 bytes each
    assert ids.shape == (2, 5)
    assert tok.decode(ids) == ["我", "abcde"]


def test_tokenizer_bad_inputs():
    tok = ByteTokenizer()
    with pytest.raises(TypeError, match=r"texts must be a list of str .*got str"):
        tok.encode("I love AI")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        tok.encode(["a", 3])
    assert tok.encode([]).shape == (0, 1)  # an empty batch is empty, not an error
    assert tok.decode(tok.encode([])) == []
    with pytest.raises(TypeError, match="ids must have an integer dtype"):
        tok.decode(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 259\)"):
        tok.decode(torch.tensor([[300]]))


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", None])
def test_embedder_is_table_lookup_plus_positions(positional):
    tok = ByteTokenizer()
    emb = TextTokenEmbedder(tok.vocab_size, 16, max_len=32, positional=positional)
    ids = tok.encode(TEXTS)
    out = emb(ids)
    lookup = emb.embedding.weight[ids]
    pos = {
        "sinusoidal": sinusoidal_1d(ids.shape[1], 16),
        "learned": emb.position.weight[: ids.shape[1]] if positional == "learned" else None,
        None: torch.zeros(ids.shape[1], 16),
    }[positional]
    torch.testing.assert_close(out.x, lookup + pos)
    assert torch.equal(out.mask, ids != 0)
    assert out.lengths.tolist() == [len(t.encode()) for t in TEXTS]
    assert out.meta["modality"] == "text"


def test_pad_row_is_zero_and_gets_no_gradient():
    emb = TextTokenEmbedder(20, 8, pad_id=0, positional=None)
    assert torch.equal(emb.embedding.weight[0], torch.zeros(8))
    emb(torch.tensor([[5, 6, 0, 0]])).x.sum().backward()
    assert torch.equal(emb.embedding.weight.grad[0], torch.zeros(8))
    assert emb.embedding.weight.grad[5].abs().sum() > 0


def test_other_pad_id_gives_mask():
    emb = TextTokenEmbedder(20, 8, pad_id=19)
    assert emb(torch.tensor([[1, 0, 19]])).mask.tolist() == [[True, True, False]]


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.zeros(2, 3), TypeError, "ids must have an integer dtype.*float32"),
        (torch.tensor([1, 2, 3]), ValueError, r"ids must be a 2-D tensor.*got 1-D"),
        (torch.tensor([[1, 20]]), ValueError, r"ids must lie in \[0, vocab_size=20\).*\[1, 20\]"),
        (torch.tensor([[-1, 2]]), ValueError, r"ids must lie in \[0, vocab_size=20\)"),
        (torch.ones(1, 9, dtype=torch.long), ValueError, "longer than max_len=8"),
        ([[1, 2]], TypeError, "ids must be a torch.Tensor, got list"),
    ],
)
def test_embedder_bad_inputs(ids, error, match):
    emb = TextTokenEmbedder(20, 8, max_len=8)
    with pytest.raises(error, match=match):
        emb(ids)


def test_embedder_bad_constructor_arguments():
    with pytest.raises(ValueError, match="pad_id must be < vocab_size=5"):
        TextTokenEmbedder(5, 8, pad_id=5)
    with pytest.raises(ValueError, match=r"positional must be one of \('sinusoidal', 'learned'"):
        TextTokenEmbedder(5, 8, positional="rotary")


def test_token_embeddings_are_on_the_scale_of_the_positions():
    """Unit-variance embeddings (nn.Embedding's default): with std 0.02 the sinusoidal
    positions (per-dimension variance 1/2) drowned the token identity and a recall model
    stalled at chance."""
    emb = TextTokenEmbedder(259, 256)
    weight = emb.embedding.weight.detach()
    real_rows = torch.cat([weight[: emb.pad_id], weight[emb.pad_id + 1 :]])
    assert 0.9 < real_rows.std().item() < 1.1
    positions = sinusoidal_1d(64, 256)
    assert real_rows.var().item() > positions.var().item()
