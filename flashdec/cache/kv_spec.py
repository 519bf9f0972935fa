"""KV layer-group shapes and their one-line text form (SPEC §8.2).

A model's layers are partitioned into groups that share one KV geometry; ``KVGroupSpec`` is one
group's shape and ``parse_kv_spec`` / ``format_kv_spec`` convert a list of them to and from::

    spec  := group (";" group)*
    group := "(" kv_size "," num_blocks "," block_size "," num_kv_heads "," head_dim ")"
             ":" dtype ":" layer_count [":window=" window]

e.g. ``(2,1024,16,8,128):bfloat16:30;(2,1024,16,2,64):bfloat16:2:window=4096``. Input may carry
spaces around tokens and any dtype case; the formatter writes the canonical form (no spaces,
lowercase dtype, ``:window=`` only when set), and the two round-trip exactly.

The parser checks the syntax; ``KVGroupSpec`` checks the values, so each rule lives in one place;
``check_storable`` adds what the paged cache can store (``PagedKVCache`` and ``flashdec spec``
both call it, so a spec the command prints is one the cache accepts).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdec._checks import FLOAT_DTYPES, INT32_MAX, check_positive_int

KV_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.float8_e4m3fn)
# spec names are the torch attribute names: float16, bfloat16, float32, float8_e4m3fn
_DTYPE_BY_NAME = {str(dtype).removeprefix("torch."): dtype for dtype in KV_DTYPES}
_NAME_BY_DTYPE = {dtype: name for name, dtype in _DTYPE_BY_NAME.items()}

_SHAPE_FIELDS = ("kv_size", "num_blocks", "block_size", "num_kv_heads", "head_dim")
_GROUP_FORM = "(kv_size,num_blocks,block_size,num_kv_heads,head_dim):dtype:layer_count[:window=N]"
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() would also take '²' and '٣'


@dataclass(frozen=True)
class KVGroupSpec:
    """The shape of one KV layer group: ``layer_count`` layers with the same geometry.

    Raises TypeError for a field of the wrong type (or a dtype outside ``KV_DTYPES``) and
    ValueError for a wrong value.
    """

    kv_size: int  # tensors per layer: 2 for K and V, 1 for a single shared tensor
    num_blocks: int  # blocks in the group's pool
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # one of KV_DTYPES
    layer_count: int
    window: int | None = None  # sliding window in tokens; None for full attention

    def __post_init__(self) -> None:
        for name in (*_SHAPE_FIELDS, "layer_count"):
            check_positive_int(name, getattr(self, name))
        if self.kv_size not in (1, 2):
            raise ValueError(f"kv_size must be 1 (one tensor) or 2 (K and V), got {self.kv_size}")
        if self.num_blocks > INT32_MAX:
            raise ValueError(
                f"num_blocks must be <= {INT32_MAX} (block ids are int32), got {self.num_blocks}"
            )
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in KV_DTYPES:
            names = ", ".join(_DTYPE_BY_NAME)
            raise TypeError(f"dtype must be one of ({names}), got {self.dtype!r}")
        if self.window is not None:
            check_positive_int("window", self.window)

    @property
    def geometry(self) -> tuple[int, int, int, int, torch.dtype, int | None]:
        """The identity layers are grouped by: (kv_size, num_kv_heads, head_dim, block_size,
        dtype, window). Groups with the same geometry can share storage and kernels."""
        return (
            self.kv_size,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.window,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes one block id holds across every layer and tensor of the group."""
        per_layer = self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize
        return self.kv_size * self.layer_count * per_layer

    @property
    def nbytes(self) -> int:
        """Bytes of the group's whole pool."""
        return self.num_blocks * self.block_bytes


def check_storable(groups: Sequence[KVGroupSpec]) -> None:
    """Refuse groups the paged cache cannot store: it keeps K and V apart (``kv_size`` 2), and
    RoPE rotates pairs of dims (an even ``head_dim``). ValueError naming the group."""
    for index, group in enumerate(groups):
        if group.kv_size != 2:
            raise ValueError(
                f"KV group {index}: kv_size {group.kv_size} is not supported (the cache "
                "stores K and V: kv_size 2)"
            )
        if group.head_dim % 2:
            raise ValueError(
                f"KV group {index}: head_dim must be even (RoPE rotates pairs of dims), "
                f"got {group.head_dim}"
            )


def format_kv_spec(groups: Sequence[KVGroupSpec]) -> str:
    """The canonical spec text of a non-empty sequence of groups (parses back to ``groups``)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups must be a sequence of KVGroupSpec, got {type(groups).__name__}")
    if not groups:
        raise ValueError("groups must hold at least one KVGroupSpec, got an empty sequence")
    for index, group in enumerate(groups):
        if not isinstance(group, KVGroupSpec):
            raise TypeError(f"groups[{index}] must be a KVGroupSpec, got {type(group).__name__}")
    return ";".join(_format_group(group) for group in groups)


def _format_group(group: KVGroupSpec) -> str:
    shape = ",".join(str(getattr(group, name)) for name in _SHAPE_FIELDS)
    text = f"({shape}):{_NAME_BY_DTYPE[group.dtype]}:{group.layer_count}"
    return text if group.window is None else f"{text}:window={group.window}"


def parse_kv_spec(spec: str) -> tuple[KVGroupSpec, ...]:
    """Parse spec text into its groups, in order.

    Raises TypeError unless ``spec`` is a str, and ValueError naming the 0-based group index and
    the group's text for any malformed or invalid group (nothing is returned on error).
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError(
            "KV spec group 0 '': the spec is empty; expected groups of the form "
            f"{_GROUP_FORM} separated by ';'"
        )
    texts = spec.split(";")
    return tuple(_parse_group(index, text, len(texts)) for index, text in enumerate(texts))


def _parse_group(index: int, text: str, num_groups: int) -> KVGroupSpec:
    stripped = text.strip()
    try:
        if not stripped:
            where = "a trailing ';'" if index == num_groups - 1 else "an extra ';'"
            raise ValueError(f"the group is empty ({where}); expected {_GROUP_FORM}")
        return _parse_group_text(stripped)
    except ValueError as err:  # from the syntax checks below or from KVGroupSpec's values
        raise ValueError(f"KV spec group {index} {stripped!r}: {err}") from None


def _parse_group_text(text: str) -> KVGroupSpec:
    if not text.startswith("("):
        raise ValueError(f"expected '(' to open the group, as in {_GROUP_FORM}")
    close = text.find(")")
    if close < 0:
        raise ValueError(f"missing ')' after the shape, as in {_GROUP_FORM}")
    fields = text[1:close].split(",")
    if len(fields) != len(_SHAPE_FIELDS):
        raise ValueError(
            f"expected {len(_SHAPE_FIELDS)} comma-separated shape fields "
            f"({','.join(_SHAPE_FIELDS)}), got {len(fields)}"
        )
    shape = [_parse_int(name, field) for name, field in zip(_SHAPE_FIELDS, fields, strict=True)]
    # after ')': ":" dtype ":" layer_count [":" "window=" window]
    tail = text[close + 1 :]
    head, *parts = tail.split(":")
    if head.strip():
        raise ValueError(f"unexpected {head.strip()!r} after ')'; expected ':' and the dtype")
    if len(parts) not in (2, 3):
        raise ValueError(
            f"expected ':dtype:layer_count[:window=N]' after ')', got {tail.strip()!r}"
        )
    dtype_text = parts[0].strip()
    dtype = _DTYPE_BY_NAME.get(dtype_text.lower())
    if dtype is None:
        raise ValueError(
            f"unknown dtype {dtype_text!r}; expected one of {', '.join(_DTYPE_BY_NAME)}"
        )
    layer_count = _parse_int("layer_count", parts[1])
    window = _parse_window(parts[2]) if len(parts) == 3 else None
    return KVGroupSpec(*shape, dtype=dtype, layer_count=layer_count, window=window)


def _parse_window(text: str) -> int:
    key, equals, value = text.partition("=")
    if key.strip() != "window" or not equals:
        raise ValueError(f"expected 'window=N' after the layer count, got {text.strip()!r}")
    return _parse_int("window", value)


def _parse_int(name: str, text: str) -> int:
    field = text.strip()
    if not _DIGITS.fullmatch(field):
        raise ValueError(f"{name} must be a positive decimal integer, got {field!r}")
    return int(field)  # 0 passes here and is refused by KVGroupSpec, with the field's name
