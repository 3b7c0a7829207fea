"""Text: ``ByteTokenizer`` (UTF-8 bytes as ids) and ``TextTokenEmbedder`` (ids to Tokens).

Axis key: ``b`` batch, ``l`` token length, ``d`` model width (``embed_dim``), ``v`` vocab.

    texts ──ByteTokenizer.encode──▶ ids (b, l) ──TextTokenEmbedder──▶ Tokens(x (b, l, d),
                                                                            mask = ids != pad_id)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from adapters._packing import add_positions, packed_from_mask
from adapters.base import ModalityAdapter
from mmattn._checks import (
    check_bool,
    check_choice,
    check_factory_dtype,
    check_has_data,
    check_integer_dtype,
    check_positive_int,
    check_range,
    check_rank,
)
from mmattn.position import POSITIONAL_1D, position_1d
from mmattn.tokens import Tokens

__all__ = ["ByteTokenizer", "TextTokenEmbedder"]


def _is_continuation(byte: int) -> bool:
    return byte & 0b1100_0000 == 0b1000_0000


class ByteTokenizer:
    """UTF-8 bytes as token ids: any language, nothing to download.

    Ids: ``pad_id=0``, ``bos_id=1``, ``eos_id=2``, and byte ``b`` is ``b + 3``; so
    ``vocab_size == 259``.

    Args:
        add_bos: put ``bos_id`` in front of every text.
        add_eos: put ``eos_id`` after every text.

    Examples:
        >>> tok = ByteTokenizer()
        >>> ids = tok.encode(["I love AI", "我爱AI"])
        >>> ids.shape, tok.decode(ids)
        (torch.Size([2, 9]), ['I love AI', '我爱AI'])
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + offset

    def __init__(self, *, add_bos: bool = False, add_eos: bool = False) -> None:
        self.add_bos = check_bool("add_bos", add_bos)
        self.add_eos = check_bool("add_eos", add_eos)

    def encode(self, texts: Sequence[str], max_len: int | None = None) -> Tensor:
        """Encode texts to a padded (B, L) LongTensor.

        Args:
            texts: the texts (a list, not a bare str).
            max_len: cut every row to at most this many ids; a cut never splits a UTF-8
                character. ``None`` keeps everything.

        Shape:
            - Output: (B, L), L = the longest encoded text (at least 1); padded with
              ``pad_id``. An empty list gives (0, 1).

        Raises:
            TypeError: ``texts`` is a bare str or holds something other than str.
            ValueError: ``max_len`` is too small for the special ids.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(
                f"texts must be a list of str (wrap a single text: [text]), got "
                f"{type(texts).__name__}"
            )
        specials = int(self.add_bos) + int(self.add_eos)
        if max_len is not None and check_positive_int("max_len", max_len) <= specials:
            raise ValueError(f"max_len must be > {specials} (the special ids), got {max_len}")
        rows = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
            data = text.encode("utf-8")
            if max_len is not None and len(data) + specials > max_len:
                cut = max_len - specials
                while cut > 0 and _is_continuation(data[cut]):
                    cut -= 1
                data = data[:cut]
            ids = [b + self.offset for b in data]
            rows.append([self.bos_id] * self.add_bos + ids + [self.eos_id] * self.add_eos)
        length = max((len(r) for r in rows), default=1) or 1
        out = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def decode(self, ids: Tensor) -> list[str]:
        """Decode (B, L) ids back to texts, dropping pad/bos/eos (invalid UTF-8 -> U+FFFD).

        A 1-D (L,) input is one text; (0, L) gives an empty list.

        Raises:
            TypeError: ``ids`` is not an integer tensor.
            ValueError: ``ids`` is not 1-D or 2-D, or holds ids outside [0, vocab_size).
        """
        check_integer_dtype("ids", ids, "token ids")
        check_rank("ids", ids, (1, 2), "(batch, length) or (length,)")
        check_range("ids", ids, 0, self.vocab_size)
        rows = ids.tolist() if ids.dim() == 2 else [ids.tolist()]
        texts = []
        for row in rows:
            data = bytes(i - self.offset for i in row if i >= self.offset)
            texts.append(data.decode("utf-8", errors="replace"))
        return texts

    def __repr__(self) -> str:
        return f"ByteTokenizer(add_bos={self.add_bos}, add_eos={self.add_eos})"


class TextTokenEmbedder(ModalityAdapter):
    r"""Token ids to Tokens: an embedding table plus a 1D position encoding.

    .. math:: x_{b,l} = E[\mathrm{ids}_{b,l}] + P_l, \qquad \mathrm{mask}_{b,l} =
        (\mathrm{ids}_{b,l} \ne \mathrm{pad\_id})

    The pad row of ``E`` is zero and receives no gradient (``nn.Embedding(padding_idx)``).

    Args:
        vocab_size: number of ids (259 for :class:`ByteTokenizer`).
        embed_dim: token width ``D``.
        pad_id: the padding id; its positions get ``mask=False``.
        max_len: longest sequence; required by ``positional="learned"``, checked always.
        positional: "sinusoidal" (fixed), "learned", or None (no positions).
        device: parameter device.
        dtype: parameter dtype; the tokens come out in it.

    Shape:
        - ids: (B, L), any integer dtype (uint8 ... int64); B and L may be 0
        - Output: ``Tokens`` with x (B, L, D) and mask (B, L)

    Raises:
        TypeError: ``ids`` is not an integer tensor.
        ValueError: ``ids`` is not 2-D, longer than ``max_len``, or holds ids outside
            [0, vocab_size).

    Examples:
        >>> tok = ByteTokenizer()
        >>> emb = TextTokenEmbedder(tok.vocab_size, 16)
        >>> out = emb(tok.encode(["I love AI", "hi"]))
        >>> out.x.shape, out.lengths.tolist()
        (torch.Size([2, 9, 16]), [9, 2])
    """

    modality = "text"

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Two byte-encoded sentences (see :meth:`ModalityAdapter.example`)."""
        ids = ByteTokenizer().encode(["I love AI", "我爱AI"])
        return dict(vocab_size=259, embed_dim=16, positional="learned", max_len=32), (ids,)

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        pad_id: int = 0,
        max_len: int = 2048,
        positional: str | None = "sinusoidal",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embed_dim)
        dtype = check_factory_dtype("dtype", dtype)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.max_len = check_positive_int("max_len", max_len)
        check_positive_int("pad_id", pad_id, minimum=0)
        check_choice("positional", positional, POSITIONAL_1D)
        if pad_id >= vocab_size:
            raise ValueError(f"pad_id must be < vocab_size={vocab_size}, got {pad_id}")
        self.pad_id = pad_id
        self.positional = positional
        self.embedding = nn.Embedding(
            vocab_size, embed_dim, padding_idx=pad_id, device=device, dtype=dtype
        )
        self.position = position_1d(positional, embed_dim, max_len, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Unit variance, like nn.Embedding's own default: on the scale of the sinusoidal
        # positions (|P| <= 1), so the position signal does not drown the token identity.
        nn.init.normal_(self.embedding.weight, std=1.0)
        with torch.no_grad():
            self.embedding.weight[self.pad_id].zero_()
        if hasattr(self.position, "reset_parameters"):
            self.position.reset_parameters()

    def forward(self, ids: Tensor | Sequence[Sequence[int]], *, packed: bool = False) -> Tokens:
        """Embed token ids.

        Args:
            ids: a padded (B, L) id tensor, or (with ``packed=True``) a list of B id
                sequences (lists or 1-D tensors) of any lengths.
            packed: return packed Tokens (a jagged (B, l*, D) ``x``, no mask): only the real
                ids are embedded, each sequence with its own positions 0, 1, ...
        """
        if not isinstance(ids, Tensor):
            if not packed:
                raise TypeError(
                    f"ids must be a torch.Tensor, got {type(ids).__name__}; a list of id "
                    "sequences of different lengths needs packed=True"
                )
            values, offsets = _ragged_ids(ids)
        elif packed:
            self._check_ids(ids)
            values, offsets = packed_from_mask(ids, ids != self.pad_id)
        if packed:
            return self._packed(values, offsets)
        self._check_ids(ids)
        ids = ids.to(self.embedding.weight.device)  # moved like every adapter's input
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()  # nn.Embedding takes only int32 / int64 indices
        x = self.position(self.embedding(ids))
        return Tokens(x, ids != self.pad_id, {"modality": self.modality})

    def _check_ids(self, ids: Tensor) -> None:
        check_integer_dtype("ids", ids, "token ids")
        check_rank("ids", ids, (2,), "(batch, length)")
        if ids.shape[1] > self.max_len:
            raise ValueError(f"ids has length {ids.shape[1]}, longer than max_len={self.max_len}")
        check_has_data("ids", ids)
        check_range("ids", ids, 0, self.vocab_size, "vocab_size")

    def _packed(self, values: Tensor, offsets: Tensor) -> Tokens:
        """Embed packed ids (t,) with item boundaries ``offsets`` (B + 1,)."""
        check_range("ids", values, 0, self.vocab_size, "vocab_size")
        device = self.embedding.weight.device
        values, offsets = values.to(device).long(), offsets.to(device)
        lengths = offsets.diff()
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > self.max_len:
            raise ValueError(f"ids has length {longest}, longer than max_len={self.max_len}")
        x = add_positions(self.position, self.embedding(values), offsets)
        return Tokens.from_packed(x, offsets, {"modality": self.modality})

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, embed_dim={self.embed_dim}, pad_id={self.pad_id}, "
            f"max_len={self.max_len}, positional={self.positional!r}"
        )


def _ragged_ids(sequences: object) -> tuple[Tensor, Tensor]:
    """A list of id sequences to packed ids (t,) and offsets (B + 1,)."""
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise TypeError(
            f"ids must be a (batch, length) tensor or a list of id sequences, got "
            f"{type(sequences).__name__}"
        )
    if len(sequences) == 0:
        raise ValueError("ids must hold at least one sequence, got an empty list")
    rows = []
    for i, seq in enumerate(sequences):
        row = torch.as_tensor(seq)
        if row.dim() != 1 or (row.numel() and (row.is_floating_point() or row.dtype == torch.bool)):
            raise TypeError(
                f"ids[{i}] must be a 1-D sequence of integer ids, got shape {tuple(row.shape)} "
                f"and dtype {row.dtype}"
            )
        rows.append(row.long())
    lengths = torch.tensor([len(r) for r in rows])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return torch.cat(rows), offsets
