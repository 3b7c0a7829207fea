"""Input validation at the public boundary.

Every check raises ``ValueError`` (wrong value or shape) or ``TypeError`` (wrong type or
dtype) with a message that names the argument and gives the expected and the actual value.
Checks only look at Python-level facts (shapes, dtypes, devices), never at tensor values, so
they cost nothing at run time and do not break ``torch.compile`` graphs. The one exception is
:func:`check_range` (ids, lengths and edge indices out of range), which reads the minimum and
maximum once and is skipped while ``torch.compile`` traces.

There is one helper per kind of argument: tensors (rank, shape, width, dtype, device),
integer tensors and their range, ints, numbers, probabilities, bools, pairs, choices, dtypes
(also given by name), meta dicts, position offsets, and a module input against the module's
parameters. Modules call these; they do not spell their own checks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def check_tensor(name: str, value: object) -> Tensor:
    """Raise TypeError unless ``value`` is a tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_rank(name: str, value: Tensor, ranks: Sequence[int], layout: str = "") -> None:
    """Raise ValueError unless ``value.dim()`` is one of ``ranks``."""
    check_tensor(name, value)
    if value.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        hint = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must be a {want}-D tensor{hint}, got {value.dim()}-D with shape "
            f"{tuple(value.shape)}"
        )


def check_floating(name: str, value: Tensor) -> None:
    """Raise TypeError unless ``value`` has a floating-point dtype."""
    if not value.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")


def check_same_dtype(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise TypeError when two floating tensors disagree on dtype."""
    if value.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {value.dtype} but {ref_name} has dtype {ref.dtype}")


def check_same_device(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise ValueError when two tensors live on different devices."""
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on device {value.device} but {ref_name} is on device {ref.device}"
        )


def check_last_dim(name: str, value: Tensor, size: int, what: str = "embed_dim") -> None:
    """Raise ValueError unless ``value.shape[-1] == size``."""
    if value.shape[-1] != size:
        raise ValueError(
            f"{name} must have last dimension {what}={size}, got shape {tuple(value.shape)}"
        )


def check_shape(name: str, value: Tensor, expected: Sequence[int], layout: str = "") -> None:
    """Raise ValueError unless ``value.shape == expected``."""
    if tuple(value.shape) != tuple(expected):
        hint = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must have shape {tuple(expected)}{hint}, got {tuple(value.shape)}"
        )


def check_mask_dtype(name: str, mask: Tensor, allow_float: bool = True) -> None:
    """Raise TypeError unless ``mask`` is bool (or floating when ``allow_float``)."""
    if mask.dtype == torch.bool:
        return
    if allow_float and mask.is_floating_point():
        return
    want = "torch.bool or a floating dtype" if allow_float else "torch.bool"
    raise TypeError(f"{name} must have dtype {want}, got {mask.dtype}")


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """Raise TypeError for non-integers and ValueError for integers below ``minimum``.

    A symbolic size (``torch.SymInt``, from ``torch.export`` or a dynamic ``torch.compile``)
    is an int: it is compared only when its value is fixed, so no guard specialises it.
    """
    if isinstance(value, torch.SymInt):
        fixed = value.node.maybe_as_int()
        if fixed is None:
            return value
        value = fixed
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_probability(name: str, value: object) -> float:
    """Raise TypeError unless ``value`` is a number (not a str, None or bool), ValueError
    unless it lies in [0, 1) (NaN does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a float in [0, 1), got {type(value).__name__} ({value!r})"
        )
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


# ---------------------------------------------------------------------- one helper per kind


def check_bool(name: str, value: object) -> bool:
    """Raise TypeError unless ``value`` is a bool (a string like ``"no"`` is not one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    positive: bool = False,
) -> float:
    """Raise TypeError for non-numbers and ValueError for NaN, infinity or values too small.

    ``positive`` requires ``value > 0``; ``minimum`` requires ``value >= minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return number


def check_index(name: str, value: object) -> int | Tensor:
    """A position offset: an int >= 0, or a 0-D integer tensor (left unread for compile).

    Raises TypeError for floats, bools and other types, ValueError for negative ints (which
    would otherwise wrap around silently when used as an index).
    """
    if isinstance(value, Tensor):
        if value.dim() != 0 or not is_integer_dtype(value.dtype):
            raise TypeError(
                f"{name} must be an int or a 0-D integer tensor, got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        return value
    return check_positive_int(name, value, minimum=0)


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for the integer dtypes (bool, floating and complex are not integers)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_integer_dtype(name: str, value: Tensor, what: str = "") -> None:
    """Raise TypeError unless ``value`` holds integers (ids, lengths, edge indices)."""
    check_tensor(name, value)
    if not is_integer_dtype(value.dtype):
        hint = f" ({what})" if what else ""
        raise TypeError(f"{name} must have an integer dtype{hint}, got {value.dtype}")


def check_range(name: str, value: Tensor, low: int, high: int, high_name: str = "") -> None:
    """Raise ValueError unless every entry of an integer tensor lies in [low, high).

    ``high_name`` names the bound in the message (``"vocab_size"`` gives ``[0,
    vocab_size=259)``). Reads the values (one device sync), so it is skipped on the meta
    device and while ``torch.compile`` traces.
    """
    if value.numel() == 0 or value.device.type == "meta" or torch.compiler.is_compiling():
        return
    lo, hi = int(value.min()), int(value.max())
    if lo < low or hi >= high:
        bound = f"{high_name}={high}" if high_name else f"{high}"
        raise ValueError(f"{name} must lie in [{low}, {bound}), got values in [{lo}, {hi}]")


def check_lengths(
    name: str, lengths: Tensor, batch: int, high: int, unit: str, source: str
) -> None:
    """Per-item lengths: a (batch,) integer tensor with every value in [1, high].

    ``unit`` and ``source`` say what is counted: ``"samples"`` of ``"waveform"`` gives
    "lengths must lie in [1, T=16000] (samples of waveform), ...". The range is read once
    (skipped while ``torch.compile`` traces).
    """
    check_integer_dtype(name, lengths, f"{unit} per clip")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(
            f"{name} must have shape (batch,)=({batch},), got {tuple(lengths.shape)}"
        )
    check_has_data(name, lengths)
    if lengths.numel() and not torch.compiler.is_compiling():
        low, top = int(lengths.min()), int(lengths.max())
        if low < 1 or top > high:
            raise ValueError(
                f"{name} must lie in [1, T={high}] ({unit} of {source}), got values in "
                f"[{low}, {top}]"
            )


def check_pair(
    name: str, value: object, *, minimum: int = 1, what: str = "(height, width)"
) -> tuple[int, int]:
    """An int (used twice) or a pair of ints, each >= ``minimum``, as a tuple."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) != 2:
        raise TypeError(f"{name} must be an int or a pair {what}, got {value!r}")
    return (
        check_positive_int(f"{name}[0]", value[0], minimum=minimum),
        check_positive_int(f"{name}[1]", value[1], minimum=minimum),
    )


def check_choice(name: str, value: object, choices: Sequence[object]) -> object:
    """Raise ValueError unless ``value`` is one of ``choices`` (listed in the message)."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value against a set-like
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_dtype(name: str, value: object, *, floating: bool = False) -> torch.dtype:
    """A ``torch.dtype``, or its name as a string (``"float16"``, ``"torch.bfloat16"``).

    Raises TypeError for anything else, and for a non-floating dtype when ``floating``.
    """
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype (or its name), got {value!r}")
    if floating and not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point dtype, got {dtype}")
    return dtype


def check_factory_dtype(name: str, value: object) -> torch.dtype | None:
    """The ``dtype`` factory argument of a module: None or a floating dtype (or its name)."""
    return None if value is None else check_dtype(name, value, floating=True)


def check_device(name: str, value: object) -> torch.device | None:
    """None, a ``torch.device``, a device string (``"cpu"``, ``"cuda:0"``) or an index.

    Raises TypeError for another type and ValueError for a string torch cannot parse.
    """
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a torch.device, a device string or None, got "
                        f"{type(value).__name__} {value!r}")
    try:
        return torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{name} must name a device such as 'cpu' or 'cuda:0', got "
                         f"{value!r}") from error


def check_factory(device: object, dtype: object) -> dict:
    """A module's ``device`` and ``dtype`` factory arguments, checked, as keyword arguments."""
    return {"device": check_device("device", device),
            "dtype": check_factory_dtype("dtype", dtype)}


def check_meta(name: str, value: object) -> dict:
    """Raise TypeError unless ``value`` is None or a mapping; return a shallow dict copy."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict (or None), got {type(value).__name__}")
    return dict(value)


def check_has_data(name: str, value: Tensor) -> None:
    """Raise ValueError for a tensor on the meta device: it holds no values to move or read.

    For inputs that a module moves to its own device (the adapters do) instead of refusing.
    """
    if value.is_meta:
        raise ValueError(
            f"{name} is on the meta device and holds no data; give a tensor with values "
            f"(shape {tuple(value.shape)})"
        )


def check_packed_has_data(name: str, value: Tensor) -> None:
    """Raise ValueError for a packed (jagged) input on the meta device: the packed path plans
    its work by the lengths, which a meta tensor does not hold."""
    if value._values.is_meta:
        raise ValueError(
            f"{name} is a packed (jagged) tensor on the meta device: its lengths hold no data "
            "and the packed path plans by them; give a tensor with values, or a padded batch"
        )


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is enabled for ``device``'s type (then dtypes may legally differ)."""
    # only CPU and CUDA autocast are probed (asking about the meta device raises)
    return device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)


def check_matches_params(name: str, value: Tensor, param: Tensor | None) -> None:
    """A module input must share its parameters' device, and their dtype unless autocast.

    Raises ValueError (device) or TypeError (dtype) naming ``name`` at the boundary, instead
    of an opaque error from inside the first LayerNorm or Linear.
    """
    if param is None:
        return
    if value.device != param.device:
        raise ValueError(
            f"{name} is on device {value.device} but the module's parameters are on "
            f"{param.device}; move one of them (e.g. module.to({str(value.device)!r}))"
        )
    if value.dtype != param.dtype and not autocast_on(value.device):
        raise TypeError(
            f"{name} has dtype {value.dtype} but the module's parameters have dtype "
            f"{param.dtype}; convert one of them (e.g. module.to({value.dtype}))"
        )


def first_param(module: torch.nn.Module) -> Tensor | None:
    """The module's first parameter, else its first buffer, else None (no StopIteration)."""
    for tensor in module.parameters():
        return tensor
    for tensor in module.buffers():
        if tensor.is_floating_point():
            return tensor
    return None


#: How many axes a neighbourhood grid may have, and their names for the messages.
GRID_AXES = (1, 2, 3)
GRID_SIDES = "(length,), (rows, cols) or (frames, rows, cols)"


def check_axes(
    name: str, value: object, axes: int, *, minimum: int = 1, odd: bool = False,
    flag: bool = False, grid: object = None,
) -> tuple:
    """One value per grid axis: an int (a bool with ``flag``) applies to every axis; a tuple
    must have ``axes`` entries, each an int >= ``minimum`` (odd with ``odd``) or a bool.

    Raises:
        TypeError: neither one value nor a tuple of them; an entry of the wrong type.
        ValueError: a tuple of another length (the message names ``grid`` when given), an
            entry below ``minimum``, an even entry with ``odd``.
    """
    scalar = isinstance(value, bool) if flag else (
        isinstance(value, int) and not isinstance(value, bool))
    if scalar:
        value = (value,) * axes
    elif not isinstance(value, (tuple, list, torch.Size)):
        one = "a bool or a tuple of bools" if flag else "an int or a pair (rows, cols)"
        raise TypeError(
            f"{name} must be {one}, or one per axis of a 1-D or 3-D grid, got {value!r}"
        )
    elif len(value) != axes:
        where = "" if grid is None else f" of grid {tuple(grid)!r}"
        raise ValueError(
            f"{name} must have one entry per grid axis: expected {axes}{where}, got "
            f"{len(value)} ({tuple(value)!r})"
        )
    if flag:
        return tuple(check_bool(f"{name}[{i}]", v) for i, v in enumerate(value))
    out = tuple(check_positive_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value))
    if odd and any(v % 2 == 0 for v in out):
        raise ValueError(f"{name} must be odd (a window centred on its query), got {value!r}")
    return out


def check_kernel(name: str, value: object, axes: int = 2) -> tuple[int, ...]:
    """An odd int (used on every axis) or one odd int >= 1 per axis: a neighbourhood kernel
    size (a pair by default)."""
    return check_axes(name, value, axes, odd=True)


def check_grid(name: str, value: object, axes: Sequence[int] = (2,)) -> tuple[int, ...]:
    """A grid of ints >= 1 with one of ``axes`` sides (a (rows, cols) pair by default, any
    of :data:`GRID_AXES` for a neighbourhood), as a tuple of Python ints.

    Raises TypeError for a side that is not an int (``2.5``, ``2.0``, ``True``: nothing is
    rounded or taken as 1) or another number of sides, ValueError for a side < 1.
    """
    axes = tuple(axes)
    if axes == (2,):
        what = "a (rows, cols) pair of ints"
    elif axes == GRID_AXES:
        what = f"1 to 3 ints: {GRID_SIDES}"
    else:
        what = " or ".join(f"{n} ints" for n in axes)
    if isinstance(value, Tensor):
        if value.dim() != 1 or not is_integer_dtype(value.dtype):
            raise TypeError(
                f"{name} must be {what}, got a tensor of shape {tuple(value.shape)} and "
                f"dtype {value.dtype}"
            )
        value = value.tolist()
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) not in axes:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    sides = tuple(_grid_side(v) for v in value)
    return tuple(check_positive_int(f"{name}[{i}]", v) for i, v in enumerate(sides))


def _grid_side(value: object) -> object:
    """A grid side as a Python int: ints, 0-D integer tensors and integer scalars (NumPy's)
    pass; a float (``2.5``, or ``2.0``) or a bool stays as it is, for the check to refuse."""
    if isinstance(value, Tensor) and value.dim() == 0 and is_integer_dtype(value.dtype):
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)  # numpy.int64 and friends
    return value


def check_names(name: str, value: object) -> tuple[str, ...]:
    """A list or tuple of names (``meta["modalities"]``), as a tuple of str.

    Raises TypeError for one str (``tuple("text")`` would be four one-letter names) or any
    other non-sequence, and for a name that is not a str.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a list or tuple of names (str), got {type(value).__name__} "
            f"{value!r}; wrap a single name: [{value!r}]"
        )
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{index}] must be a str, got {type(item).__name__} {item!r}")
    return tuple(value)

