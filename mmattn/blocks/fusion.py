"""``MultiModalEncoder``: several modality adapters, one fused token sequence.

Axis key: ``b`` batch, ``l`` fused length (the sum of every modality's length), ``n``
latents, ``d`` model width, ``m`` modalities.

Data flow::

    {name: input} ──adapters[name]──▶ Tokens_name + modality_embedding[name]
        ──Tokens.cat──▶ (b, l, d) with mask and meta["spans"][name] = (start, stop)
        ──fusion="concat"──▶ Encoder (self-attention over all modalities) ──▶ (b, l, d)
        ──fusion="latent"──▶ n learned latents cross-attend all tokens, then self-attend
                             (Perceiver-style), ``depth`` times ──▶ (b, n, d)

``mmattn`` never imports ``adapters``: an adapter here is any ``nn.Module`` whose
``forward`` returns :class:`~mmattn.tokens.Tokens` of width ``embed_dim`` (every
``adapters.ModalityAdapter`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from einops import repeat
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.blocks._geometry import fused_edges
from mmattn.blocks._packed import map_packed
from mmattn.blocks._pattern import check_pattern
from mmattn.blocks.transformer import CrossAttentionBlock, Encoder, TransformerBlock
from mmattn.patterns import Pattern
from mmattn.registry import AttentionSpec
from mmattn.tokens import RESERVED_NAMES, Tokens

#: meta keys the encoder writes itself; no modality may be named so.
RESERVED_MODALITIES = (
    *RESERVED_NAMES, "modalities", "fusion", "context", "edge_index", "edge_bias", "positions"
)

__all__ = ["MultiModalEncoder"]

_FUSIONS = ("concat", "latent")


class MultiModalEncoder(nn.Module):
    r"""Fuse several modalities into one sequence of Tokens with attention across them.

    Each input goes through its adapter, gets its modality's learned embedding added
    (:math:`x + e_m`), and the token sequences are concatenated along the length with their
    masks. With ``fusion="concat"`` an :class:`~mmattn.blocks.Encoder` self-attends over
    the whole sequence, so every token can attend every real token of every modality;
    the output has the fused length. With ``fusion="latent"`` (Perceiver-style)
    ``num_latents`` learned latent tokens cross-attend all real tokens, then self-attend,
    ``depth`` times; the output is the latents, whose size does not depend on the input
    lengths.

    Modalities may be left out of a call; they are fused in the order of ``adapters``. The
    learned modality embeddings are keyed by name (``modality_embedding[name]``, state_dict
    key ``modality_embedding.<name>``), so a state_dict loads into an encoder whose adapters
    are listed in another order without swapping them.
    The result's ``meta`` holds ``"spans"`` (``{name: (start, stop)}`` on the fused input
    sequence), each adapter's own meta under its name, ``"modalities"`` (the names in
    order) and ``"fusion"``. For "latent" the spans refer to ``meta["context"]``, the
    fused input Tokens the latents attended. The ``meta["edge_index"]`` of graph parts is
    re-indexed into the fused sequence (``meta["edge_index"]``), and their
    ``meta["edge_bias"]`` follows those edges (``meta["edge_bias"]``; zeros for a graph
    part without one), so ``attention="edge"`` works with no extra argument: graph nodes
    attend along their edges, and the tokens of modalities without edges attend only
    themselves (their self loop).

    Args:
        adapters: ``{name: adapter}``; each adapter maps its input to Tokens of width
            ``embed_dim``.
        embed_dim: model width D.
        depth: number of blocks ("concat") or cross + self-attention rounds ("latent").
        num_heads: attention heads in every block.
        fusion: "concat" or "latent".
        num_latents: number of latent tokens for "latent".
        dropout: dropout in every block.
        mlp_ratio: MLP width of every block, as a multiple of ``embed_dim``.
        attention, attention_kwargs: the self-attention of every block, as in
            :class:`~mmattn.blocks.TransformerBlock` (the latents' cross-attention stays
            :class:`~mmattn.CrossAttention`).
        pattern: a :mod:`mmattn.patterns` Pattern ("concat" only), compiled once per
            forward on the fused Tokens, whose meta holds the spans, each modality's grid
            and the fused ``edge_index``: e.g. ``P.per_modality(within={"text": P.causal(),
            "image": P.neighborhood(7), "graph": P.edges()}, across=P.full())``.
        positions: a function of the fused Tokens giving their ``meta["positions"]``, e.g.
            :func:`mmattn.rotary.mrope_positions` (time, row, column per token) for
            ``attention_kwargs={"position": MultiAxisRotary(head_dim, sections)}``; the
            blocks hand them to their attention ("concat"). None: no positions.
        device, dtype: factory arguments for the encoder's own parameters (adapters keep
            theirs).

    Shape:
        - inputs: ``{name: input}``; an input is passed to its adapter as
          ``adapter(*input)`` when it is a tuple, ``adapter(**input)`` when it is a dict,
          else ``adapter(input)``
        - returns: Tokens with x (B, L_total, D) and the fused mask ("concat"), or
          x (B, num_latents, D) and no mask ("latent")

    Raises:
        TypeError: ``adapters`` or ``inputs`` is not a mapping; an adapter is not a module
            or does not return Tokens.
        ValueError: no adapters or inputs; an unknown modality name, or a reserved one
            ("spans", "modalities", "fusion", "context", "edge_index", "edge_bias",
            "positions": the meta keys the encoder writes); a part's ``meta["edge_bias"]``
            that does not fit its edges;
            an adapter of another width; modalities with different batch sizes; unknown
            ``fusion``; ``pattern`` with ``fusion="latent"``.

    Examples:
        >>> class Vectors(nn.Module):
        ...     def __init__(self, d): super().__init__(); self.proj = nn.Linear(3, d)
        ...     def forward(self, v): return Tokens(self.proj(v))
        >>> enc = MultiModalEncoder({"a": Vectors(16), "b": Vectors(16)}, 16, 1, 2)
        >>> out = enc({"a": torch.randn(2, 4, 3), "b": torch.randn(2, 6, 3)})
        >>> out.x.shape, out.meta["spans"]
        (torch.Size([2, 10, 16]), {'a': (0, 4), 'b': (4, 10)})
    """

    def __init__(
        self,
        adapters: Mapping[str, nn.Module],
        embed_dim: int,
        depth: int,
        num_heads: int,
        fusion: str = "concat",
        *,
        num_latents: int = 16,
        dropout: float = 0.0,
        mlp_ratio: float = 4.0,
        attention: AttentionSpec = "full",
        attention_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        pattern: Pattern | None = None,
        positions: Callable[[Tokens], Tensor] | None = None,
    ) -> None:
        super().__init__()
        if positions is not None and not callable(positions):
            raise TypeError(
                "positions must be a function of the fused Tokens (e.g. "
                f"mmattn.rotary.mrope_positions) or None, got {type(positions).__name__}"
            )
        self.positions = positions
        if not isinstance(adapters, Mapping):
            raise TypeError(
                f"adapters must be a mapping {{name: adapter}}, got {type(adapters).__name__}"
            )
        if not adapters:
            raise ValueError("adapters must hold at least one adapter, got an empty mapping")
        checks.check_positive_int("embed_dim", embed_dim)
        checks.check_positive_int("depth", depth)
        for name, adapter in adapters.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"adapters keys must be non-empty names without '.', got {name!r}")
            if name in RESERVED_MODALITIES:
                raise ValueError(
                    f"adapters keys must not be one of {RESERVED_MODALITIES} (meta keys of the "
                    f"fused Tokens), got {name!r}"
                )
            if not isinstance(adapter, nn.Module):
                raise TypeError(
                    f"adapters[{name!r}] must be an nn.Module, got {type(adapter).__name__}"
                )
            width = getattr(adapter, "embed_dim", embed_dim)
            if width != embed_dim:
                raise ValueError(
                    f"adapters[{name!r}] has embed_dim={width}, expected embed_dim={embed_dim}"
                )
        checks.check_choice("fusion", fusion, _FUSIONS)
        if check_pattern(pattern) is not None and fusion != "concat":
            raise ValueError(
                'pattern= needs fusion="concat" (the latents have no spans to pattern), got '
                f"fusion={fusion!r}"
            )
        factory = checks.check_factory(device, dtype)
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.fusion = fusion
        self.adapters = nn.ModuleDict(dict(adapters))
        self.modality_embedding = nn.ParameterDict(
            {name: nn.Parameter(torch.empty(embed_dim, **factory)) for name in adapters}
        )
        block_kw = {"dropout": dropout, "mlp_ratio": mlp_ratio, **factory}
        attention_kw = {"attention": attention, "attention_kwargs": attention_kwargs}
        if fusion == "concat":
            self.num_latents = None
            self.encoder = Encoder(
                embed_dim, depth, num_heads, **block_kw, **attention_kw, pattern=pattern
            )
        else:
            self.num_latents = checks.check_positive_int("num_latents", num_latents)
            self.latents = nn.Parameter(torch.empty(num_latents, embed_dim, **factory))
            self.cross_blocks = nn.ModuleList(
                CrossAttentionBlock(embed_dim, num_heads, **block_kw) for _ in range(depth)
            )
            self.self_blocks = nn.ModuleList(
                TransformerBlock(embed_dim, num_heads, **block_kw, **attention_kw)
                for _ in range(depth)
            )
            self.norm = nn.LayerNorm(embed_dim, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Modality embeddings and latents ~ N(0, 0.02²); blocks reset; adapters untouched."""
        for embedding in self.modality_embedding.values():
            nn.init.normal_(embedding, std=0.02)
        if self.fusion == "concat":
            self.encoder.reset_parameters()
        else:
            nn.init.normal_(self.latents, std=0.02)
            for block in (*self.cross_blocks, *self.self_blocks):
                block.reset_parameters()
            self.norm.reset_parameters()

    def extra_repr(self) -> str:
        parts = [
            f"modalities={list(self.adapters)}",
            f"embed_dim={self.embed_dim}",
            f"depth={self.depth}",
            f"num_heads={self.num_heads}",
            f"fusion={self.fusion!r}",
        ]
        if self.num_latents is not None:
            parts.append(f"num_latents={self.num_latents}")
        return ", ".join(parts)

    def embed(self, inputs: Mapping[str, Any]) -> Tokens:
        """Run the adapters, add modality embeddings and concatenate (no attention yet).

        Returns:
            The fused input Tokens (B, L_total, D) with ``meta["spans"]``.
        """
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"inputs must be a mapping {{modality: input}}, got {type(inputs).__name__}"
            )
        unknown = [name for name in inputs if name not in self.adapters]
        if unknown:
            raise ValueError(
                f"inputs has unknown modalities {unknown}; this encoder has {list(self.adapters)}"
            )
        if not inputs:
            raise ValueError(f"inputs must hold at least one of {list(self.adapters)}, got none")
        parts: dict[str, Tokens] = {}
        for name, adapter in self.adapters.items():
            if name not in inputs:
                continue
            tokens = _call(adapter, inputs[name])
            if not isinstance(tokens, Tokens):
                raise TypeError(
                    f"adapters[{name!r}] must return mmattn.Tokens, got {type(tokens).__name__}"
                )
            if tokens.dim != self.embed_dim:
                raise ValueError(
                    f"adapters[{name!r}] returned width {tokens.dim}, expected "
                    f"embed_dim={self.embed_dim}"
                )
            embedding = self.modality_embedding[name]
            checks.check_matches_params(f"adapters[{name!r}]'s output", tokens.x, embedding)
            if tokens.is_packed:
                parts[name] = map_packed(tokens, lambda values, e=embedding: values + e)
            else:
                parts[name] = tokens.replace(tokens.x + embedding)
        sizes = {name: t.batch_size for name, t in parts.items()}
        first = next(iter(sizes.values()))
        if any(size != first for size in sizes.values()):  # no set(): SymInts do not hash
            raise ValueError(f"inputs must share one batch size, got {sizes}")
        fused = Tokens.cat(parts)
        fused.meta["modalities"] = list(parts)
        edges, bias = fused_edges(parts, fused)  # graph edges in the fused order (EdgeAttention)
        if edges is not None:
            fused.meta["edge_index"] = edges
        if bias is not None:
            fused.meta["edge_bias"] = bias
        if self.positions is not None:  # e.g. mrope_positions: read by the blocks' attention
            fused.meta["positions"] = self.positions(fused)
        if fused.is_packed:
            return fused
        return fused.replace(fused.zero_padding())

    def forward(self, inputs: Mapping[str, Any]) -> Tokens:
        """Encode and fuse ``inputs``; see the class docstring."""
        fused = self.embed(inputs)
        if self.fusion == "concat":
            return self.encoder(fused).replace(fusion="concat")
        latents = Tokens(repeat(self.latents, "n d -> b n d", b=fused.batch_size))
        if fused.is_packed:  # packed in, packed out: every item has num_latents latents
            latents = latents.pack()
        for cross, block in zip(self.cross_blocks, self.self_blocks):
            latents = block(cross(latents, fused))
        meta = {**fused.meta, "fusion": "latent", "context": fused}
        if latents.is_packed:
            return map_packed(latents, self.norm).replace(**meta)
        return Tokens(self.norm(latents.x), None, meta)


def _call(adapter: nn.Module, value: Any) -> Any:
    if isinstance(value, tuple):
        return adapter(*value)
    if isinstance(value, dict):
        return adapter(**value)
    return adapter(value)
