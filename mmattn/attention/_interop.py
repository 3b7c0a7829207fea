"""Interop with ``torch.nn.MultiheadAttention`` inside models that somebody else wrote.

Axis key: ``b`` batch, ``i`` query length, ``j`` key length, ``d`` model width.

- :func:`mmattn.integrations.torch.replace_attention` (its own module, which imports the attention
  class) swaps every ``nn.MultiheadAttention`` of a model for ours.
- The helpers here serve :class:`mmattn.MultiHeadAttention`: reading an
  ``nn.MultiheadAttention``'s settings and weights (``from_torch``), rewriting its
  ``state_dict`` keys on load, and running on the NestedTensor that
  ``nn.TransformerEncoder``'s fast path hands its layers.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from mmattn.attention import _in_proj
from mmattn.attention._init import draw_like_torch
from mmattn.attention._modifiers import check_no_modifiers, modifier_settings

__all__: list[str] = []

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


# ---------------------------------------------------------------------- from_torch


def constructor_kwargs(cls: type, module: nn.MultiheadAttention, extra: dict[str, Any]) -> dict:
    """The keyword arguments that build a ``cls`` with ``module``'s settings.

    ``extra`` holds ``cls``'s own arguments (``window_size`` ...). A setting ``cls`` does not
    take is dropped when the source uses torch's default, else it is an error. The settings
    read from ``module`` include those its weights fix (``num_kv_heads``: one key/value head
    per query head for torch's module) and, for an mmattn source, its ``position`` module.

    Raises:
        TypeError: ``extra`` repeats a setting taken from ``module`` (``num_kv_heads``
            included: the copied key/value weights fix it), names an argument ``cls`` does
            not have, or misses one that ``cls`` requires.
        ValueError: ``module`` uses a setting that ``cls`` does not have.
    """
    weight = module.out_proj.weight
    settings = {
        "embed_dim": module.embed_dim,
        "num_heads": module.num_heads,
        "dropout": module.dropout,
        "bias": module.out_proj.bias is not None,
        "add_bias_kv": module.bias_k is not None,
        "add_zero_attn": bool(module.add_zero_attn),
        "kdim": module.kdim,
        "vdim": module.vdim,
        "batch_first": module.batch_first,
        "device": weight.device,
        "dtype": weight.dtype,
        # fixed by the key/value weights: torch's module has one key/value head per head
        "num_kv_heads": getattr(module, "num_kv_heads", module.num_heads),
    }
    if getattr(module, "position", None) is not None:  # an mmattn source's positions
        settings["position"] = module.position
    settings.update(modifier_settings(module))  # and its sinks, softcap, ALiBi
    taken = sorted(set(extra) & set(settings))
    if taken:
        shown = ", ".join(f"{name}={settings[name]!r}" for name in taken)
        hint = (
            "; grouped-query attention needs key/value projections of another shape than "
            "the source's, so it cannot take over its weights"
            if "num_kv_heads" in taken else ""
        )
        raise TypeError(
            f"{cls.__name__}.from_torch takes {', '.join(taken)} from the source module "
            f"({shown}){hint}; pass only the class's own arguments as keywords"
        )
    neutral = {
        "dropout": 0.0, "bias": True, "add_bias_kv": False, "add_zero_attn": False,
        "kdim": module.embed_dim, "vdim": module.embed_dim, "num_kv_heads": module.num_heads,
    }
    params = inspect.signature(cls.__init__).parameters
    own = [name for name in params if name != "self" and name not in settings]
    unknown = sorted(set(extra) - set(params))
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"{cls.__name__}.from_torch got {', '.join(unknown)}, which {cls.__name__} does "
            f"not take; its own arguments are {', '.join(own) or 'none'}"
        )
    kwargs = dict(extra)
    for name, value in settings.items():
        if name in params:
            kwargs[name] = value
        elif name not in neutral or value != neutral[name]:
            raise ValueError(
                f"{cls.__name__} has no {name} argument, but the source module has "
                f"{name}={value!r}"
            )
    required = [
        name for name, p in params.items()
        if name != "self" and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in kwargs
    ]
    if required:
        raise TypeError(
            f"{cls.__name__}.from_torch needs {', '.join(required)} as keyword argument(s), "
            f"e.g. {cls.__name__}.from_torch(m, {required[0]}=...)"
        )
    return kwargs


def copy_weights(source: nn.MultiheadAttention, target: nn.Module) -> None:
    """Copy the q/k/v/out projections (and ``bias_k``/``bias_v``) of ``source`` into ours.

    ``source`` is an ``nn.MultiheadAttention`` (packed or separate layout) or an mmattn
    module; ``target`` an mmattn module of the same sizes. ``requires_grad`` travels along.
    """
    weights, biases = _projections(source)
    pairs = [(getattr(target, n).weight, w) for n, w in zip(_PROJECTIONS, weights)]
    pairs += [
        (getattr(target, n).bias, b) for n, b in zip(_PROJECTIONS, biases) if b is not None
    ]
    pairs.append((target.out_proj.weight, source.out_proj.weight))
    if source.out_proj.bias is not None:
        pairs.append((target.out_proj.bias, source.out_proj.bias))
    if source.bias_k is not None:
        pairs += [(target.bias_k, source.bias_k), (target.bias_v, source.bias_v)]
    if getattr(source, "sinks", None) is not None:
        pairs.append((target.sinks, source.sinks))
    with torch.no_grad():
        for param, value in pairs:
            param.copy_(value)
    for param, value in pairs:
        param.requires_grad_(value.requires_grad)


def _projections(
    module: nn.MultiheadAttention,
) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    """(q, k, v) weights and biases of torch's module (either layout) or of ours."""
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in _PROJECTIONS):
        linears = [getattr(module, n) for n in _PROJECTIONS]
        return tuple(p.weight for p in linears), tuple(p.bias for p in linears)
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    bias = module.in_proj_bias
    return tuple(weights), (bias.chunk(3) if bias is not None else (None,) * 3)


def copy_into_torch(source: nn.Module, target: nn.MultiheadAttention) -> None:
    """Copy our projections into an ``nn.MultiheadAttention`` of the same settings."""
    projections = [getattr(source, n) for n in _PROJECTIONS]
    if target._qkv_same_embed_dim:
        pairs = [(target.in_proj_weight, torch.cat([p.weight for p in projections]))]
        grads = [source.q_proj.weight.requires_grad]
    else:
        pairs = [
            (getattr(target, f"{n}_weight"), p.weight) for n, p in zip(_PROJECTIONS, projections)
        ]
        grads = [p.weight.requires_grad for p in projections]
    if target.in_proj_bias is not None:
        pairs += [
            (target.in_proj_bias, torch.cat([p.bias for p in projections])),
            (target.out_proj.bias, source.out_proj.bias),
        ]
        grads += [source.q_proj.bias.requires_grad, source.out_proj.bias.requires_grad]
    pairs.append((target.out_proj.weight, source.out_proj.weight))
    grads.append(source.out_proj.weight.requires_grad)
    if source.bias_k is not None:
        pairs += [(target.bias_k, source.bias_k), (target.bias_v, source.bias_v)]
        grads += [source.bias_k.requires_grad, source.bias_v.requires_grad]
    with torch.no_grad():
        for param, value in pairs:
            param.copy_(value)
    for (param, _), grad in zip(pairs, grads):
        param.requires_grad_(grad)


# ---------------------------------------------------------------------- state_dict keys


def convert_torch_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
) -> None:
    """Rewrite ``nn.MultiheadAttention``'s keys under ``prefix`` into ours, in place.

    ``in_proj_weight`` (3D, D) and ``in_proj_bias`` (3D,) are cut into ``q_proj``/``k_proj``/
    ``v_proj``; ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` are renamed. A wrong
    shape is reported as ``nn.Module.load_state_dict`` does, naming the checkpoint's key.
    ``out_proj.*`` and ``bias_k``/``bias_v`` (1, 1, D) share torch's names already. A bias
    key for a module without biases is left alone, so it is reported as unexpected.
    """
    linears = [getattr(module, n) for n in _PROJECTIONS]
    for attr in ("weight", "bias"):
        key = f"{prefix}in_proj_{attr}"
        if key not in state_dict or getattr(linears[0], attr) is None:
            continue
        value = state_dict.pop(key)
        parts = [getattr(p, attr) for p in linears]
        if any(p.shape != parts[0].shape for p in parts):  # kdim / vdim differ: never packed
            shape = " / ".join(str(tuple(p.shape)) for p in parts) + " (q_proj / k_proj / v_proj)"
        else:
            shape = torch.Size([3 * parts[0].shape[0], *parts[0].shape[1:]])
        if value.shape != shape:
            _size_mismatch(state_dict, error_msgs, key, value, shape, prefix, attr, linears)
            continue
        for proj, part in zip(_PROJECTIONS, value.chunk(3)):
            state_dict[f"{prefix}{proj}.{attr}"] = part
    for proj, linear in zip(_PROJECTIONS, linears):
        key = f"{prefix}{proj}_weight"
        if key not in state_dict:
            continue
        value = state_dict.pop(key)
        if value.shape != linear.weight.shape:
            _size_mismatch(state_dict, error_msgs, key, value, linear.weight.shape, prefix,
                           "weight", [linear], (proj,))
            continue
        state_dict[f"{prefix}{proj}.weight"] = value


def _size_mismatch(
    state_dict: dict[str, Any], error_msgs: list[str], key: str, value: Tensor,
    shape: object, prefix: str, attr: str, linears: list[nn.Linear],
    names: tuple[str, ...] = _PROJECTIONS,
) -> None:
    """Report a wrong shape in torch's words; the current values stand in for the key's
    targets, so they are not also reported as missing."""
    error_msgs.append(
        f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
        f"the shape in current model is {shape}."
    )
    for name, linear in zip(names, linears):
        state_dict.setdefault(f"{prefix}{name}.{attr}", getattr(linear, attr).detach())


# ---------------------------------------------------------------------- the mixin

_Self = TypeVar("_Self", bound="TorchInterop")


class TorchInterop:
    """What makes :class:`~mmattn.MultiHeadAttention` pass for an ``nn.MultiheadAttention``.

    ``nn.MultiheadAttention``'s names for the separate projection weights, its state-dict
    keys on load, its private ``_reset_parameters``, pickling without its fast-path flag, and
    the two conversions :meth:`from_torch` / :meth:`to_torch`. Mixed into the core class, so
    the core file holds attention and this one holds the compatibility surface.
    """

    #: Why :meth:`to_torch` does not apply to a variant (None: it does). Every class takes
    #: over an ``nn.MultiheadAttention``'s weights with :meth:`from_torch`.
    no_torch_twin: ClassVar[str | None] = None

    @property
    def in_proj_weight(self) -> Tensor | None:
        """``cat(q_proj.weight, k_proj.weight, v_proj.weight)`` (3D, D), as torch packs it.

        None where torch's is None: ``kdim`` or ``vdim`` differ from ``embed_dim`` (torch then
        has ``q_proj_weight`` ...), and with grouped-query heads (no torch layout). It views
        the three weights' memory (:mod:`mmattn.attention._in_proj`): in-place writes through
        it change them, and gradients through it reach them. Assigning an ``nn.Parameter``
        copies it into them.
        """
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim or self._grouped():
            return None
        return _in_proj.read(self, "weight")

    @property
    def in_proj_bias(self) -> Tensor | None:
        """``cat(q_proj.bias, k_proj.bias, v_proj.bias)`` (3D,): torch keeps it whenever
        ``bias=True``, for any widths. None for ``bias=False`` (as torch) and with
        grouped-query heads. A view that writes through, like :attr:`in_proj_weight`."""
        if self.q_proj.bias is None or self._grouped():
            return None
        return _in_proj.read(self, "bias")

    def __setattr__(self, name: str, value: Any) -> None:
        # torch's names of the in-projection: nn.Module would try to register a new
        # parameter under a name our property already holds (KeyError)
        if name in _in_proj.ASSIGNABLE:
            _in_proj.assign(self, name, value)
        else:
            super().__setattr__(name, value)

    def _grouped(self) -> bool:
        return self.num_kv_heads != self.num_heads

    @property
    def q_proj_weight(self) -> Tensor:
        """``q_proj.weight``, under ``nn.MultiheadAttention``'s name for the separate layout."""
        return self.q_proj.weight

    @property
    def k_proj_weight(self) -> Tensor:
        """``k_proj.weight``, under ``nn.MultiheadAttention``'s name for the separate layout."""
        return self.k_proj.weight

    @property
    def v_proj_weight(self) -> Tensor:
        """``v_proj.weight``, under ``nn.MultiheadAttention``'s name for the separate layout."""
        return self.v_proj.weight

    def __setstate__(self, state: dict[str, Any]) -> None:
        # nn.MultiheadAttention.__setstate__ would add _qkv_same_embed_dim=True (for v1.1
        # checkpoints) and turn PyTorch's packed fast paths on for an unpickled copy.
        state.pop("_qkv_same_embed_dim", None)
        nn.Module.__setstate__(self, state)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        # nn.MultiheadAttention's keys (in_proj_weight, q_proj_weight, ...) become ours.
        convert_torch_keys(self, state_dict, prefix, error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs,
        )

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's private name, called by client code (PyG's GPSConv), with
        # its draws: in-projection, zero biases, bias_k/bias_v; out_proj.weight (and a
        # variant's own parameters) are kept, as torch keeps out_proj.weight.
        draw_like_torch(self, out_proj=False)

    def __prepare_scriptable__(self) -> nn.MultiheadAttention:
        """``torch.jit.script`` compiles the torch twin (:meth:`to_torch`) in our place.

        Our ``forward`` cannot be scripted (keyword-only ``cache=``, einops, unions); the
        twin computes the same with copies of the weights. torch's protocol also puts the
        twin into the *eager* model passed to ``torch.jit.script`` (its ``_modules`` are
        rewritten in place): script a ``copy.deepcopy(model)`` to keep that one as it was.
        With ``bias=False`` the twin gets frozen zero biases (torch's own ``bias=False``
        module fails to script).

        Raises:
            NotImplementedError: a variant without a torch twin, grouped-query attention or
                a ``position`` module; the message names the module.
        """
        try:
            twin = self.to_torch()
        except NotImplementedError as error:
            raise NotImplementedError(
                f"torch.jit.script cannot compile {type(self).__name__}({self.extra_repr()}): "
                f"{error}. Use torch.compile or torch.export for this module instead"
            ) from None
        if twin.in_proj_bias is None:  # torch's bias=False module does not script (2.14):
            weight = twin.out_proj.weight  # frozen zero biases compute the same
            zeros = {"device": weight.device, "dtype": weight.dtype}
            twin.in_proj_bias = nn.Parameter(torch.zeros(3 * self.embed_dim, **zeros), False)
            twin.out_proj.bias = nn.Parameter(torch.zeros(self.embed_dim, **zeros), False)
        separate_projections(twin)
        # torch.jit.script memoises prepared modules by id(); once the model drops us, a
        # later twin's submodule could reuse our id and be swapped for our twin. So we live
        # as long as the twin does.
        _SCRIPT_SOURCES[twin] = self
        return twin

    @classmethod
    def from_torch(cls: type[_Self], module: nn.MultiheadAttention, **kwargs: Any) -> _Self:
        """Build one with the same weights and settings as an ``nn.MultiheadAttention``.

        Packed (``in_proj_weight``) and separate (``q_proj_weight`` ...) layouts are both
        read. The result keeps the source's ``batch_first``, dropout, device, dtype,
        train/eval mode and each parameter's ``requires_grad``, and gives identical outputs.

        A variant takes over the projection weights the same way; its own arguments come as
        keywords, e.g. ``LocalAttention.from_torch(m, window_size=64)``, and its own extra
        parameters (``AdditiveAttention.score_weight`` ...) keep their fresh initialisation.
        ``module`` may also be an mmattn attention module (its projections are copied, with
        its ``num_kv_heads`` and ``position``).

        ``num_kv_heads`` is read from the source, never given: its key/value weights fix it
        (one key/value head per head for torch's module). ``position=`` may be given for a
        torch source, which has none; the copy then rotates queries and keys, so its
        outputs differ from the source's.

        Args:
            module: the ``nn.MultiheadAttention`` to copy.
            **kwargs: arguments of ``cls`` that ``nn.MultiheadAttention`` does not have.

        Raises:
            TypeError: ``module`` is not an ``nn.MultiheadAttention``; ``kwargs`` repeats a
                setting read from ``module`` (``num_kv_heads`` included), names an argument
                ``cls`` does not take, or misses one ``cls`` requires.
            ValueError: ``module`` uses a setting ``cls`` does not have (e.g.
                ``add_bias_kv=True`` for ``LocalAttention``).

        Examples:
            >>> torch_mha = nn.MultiheadAttention(16, 4, batch_first=True)
            >>> from mmattn import MultiHeadAttention
            >>> mha = MultiHeadAttention.from_torch(torch_mha)
            >>> x = torch.randn(2, 5, 16)
            >>> torch.allclose(mha(x)[0], torch_mha(x, x, x)[0], atol=1e-6)
            True
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}"
            )
        new = cls(**constructor_kwargs(cls, module, kwargs))
        copy_weights(module, new)
        return new.train(module.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with the same weights and settings (the inverse).

        Raises:
            NotImplementedError: a variant with no torch equivalent (see ``no_torch_twin``),
                or grouped-query attention / a ``position`` module (torch has neither).
        """
        _check_torch_twin(type(self), "to_torch")
        check_no_modifiers(self, "to_torch")
        if self.num_kv_heads != self.num_heads or self.position is not None:
            raise NotImplementedError(
                f"to_torch is not available with num_kv_heads={self.num_kv_heads} (of "
                f"num_heads={self.num_heads}) or position={self.position!r}: "
                "nn.MultiheadAttention has neither grouped-query attention nor positions"
            )
        weight = self.out_proj.weight
        module = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.q_proj.bias is not None,
            add_bias_kv=self.bias_k is not None,
            add_zero_attn=self.add_zero_attn,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=self.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        copy_into_torch(self, module)
        return module.train(self.training)


def separate_projections(module: nn.MultiheadAttention) -> None:
    """Put ``module``'s packed ``in_proj_weight`` into torch's separate layout
    (``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``), in place.

    torch then projects q, k and v with one ``F.linear`` each, as our three ``nn.Linear``
    do, where the packed layout makes one (3d, d) product for self-attention and one
    (2d, d) for a shared key and value: a product over more output columns can round
    differently on the CPU (another GEMM blocking), and the scripted twin would differ
    from our eager forward in the last bits. With one product each, and torch's SDPA on the
    same q, k, v and mask, the twin gives our numbers bit for bit (the separate layout also
    keeps torch's eval fast path, a kernel of its own, out).
    """
    if not module._qkv_same_embed_dim:
        return
    packed = module.in_proj_weight
    for name, part in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"),
                          packed.detach().chunk(3)):
        setattr(module, name, nn.Parameter(part.clone(), packed.requires_grad))
    module.register_parameter("in_proj_weight", None)
    module._qkv_same_embed_dim = False


#: twin -> the module it stands in for under torch.jit.script (see __prepare_scriptable__).
_SCRIPT_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_torch_twin(cls: type, method: str) -> None:
    if cls.no_torch_twin is not None:
        raise NotImplementedError(f"{cls.__name__}.{method} is not available: {cls.no_torch_twin}")
