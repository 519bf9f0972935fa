"""FP8 KV-cache scales per layer and KV head: where they come from and how they are kept.

An FP8 (e4m3) cache stores ``value / scale`` saturated to +-FP8_MAX, and reads ``stored * scale``
back: the same convention as vLLM's ``k_scale`` / ``v_scale``. One fixed scale for every head
wastes range on heads whose keys are small and clips heads whose keys are large, so each layer
and KV head gets its own K and V scale.

They come from three places: a fixed value (:func:`static_kv_scales`), a checkpoint that ships
them (:func:`load_kv_scales`, the fields llm-compressor / vLLM checkpoints use) or calibration
(:func:`calibrate_kv_scales`). Calibration runs the model's own forward on a prompt and reads
the keys and values its attention cache holds: post-RoPE and post k-norm, exactly what the FP8
cache will store, so no re-implementation of a family's attention can drift from it. A head's
scale maps its max-abs to ``FP8_MAX / margin``: max-abs because e4m3 has no headroom beyond
FP8_MAX (saturation is the error that matters, rounding error is relative anyway), and the
margin because later tokens may exceed the few the calibration saw.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdec._checks import FP8_MAX, check_positive_int, check_token_ids, type_name

# calibrated max-abs maps to FP8_MAX / margin: later tokens may be up to 2x larger before saturating
DYNAMIC_MARGIN = 2.0
# at most this many of the first prompt's tokens calibrate (one forward, bounded cost)
CALIBRATION_TOKENS = 512

SAVE_FORMAT = "flashdec-kv-scales"

# checkpoint fields under any prefix ending in ``layers.{i}.self_attn.``, in order of preference
_K_FIELDS = ("k_scale", "k_proj.output_scale", "kv_scale")
_V_FIELDS = ("v_scale", "v_proj.output_scale", "kv_scale")
_FIELDS = ("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale", "kv_scale")
_FIELD_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(" + "|".join(re.escape(f) for f in _FIELDS) + r")$"
)

__all__ = [
    "CALIBRATION_TOKENS",
    "DYNAMIC_MARGIN",
    "KVScales",
    "calibrate_kv_scales",
    "load_kv_scales",
    "save_kv_scales",
    "static_kv_scales",
]


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean ==
class KVScales:
    """FP8 scales of every layer and KV head (stored = value / scale)."""

    k: torch.Tensor  # float32 [num_layers, num_kv_heads], CPU, finite and > 0
    v: torch.Tensor  # same
    source: str  # "static", "dynamic" or the path the scales came from

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            _check_scale_table(name, getattr(self, name))
        if self.k.shape != self.v.shape:
            raise ValueError(
                f"KVScales k and v must have the same shape, got {tuple(self.k.shape)} "
                f"and {tuple(self.v.shape)}"
            )
        if not isinstance(self.source, str):
            raise TypeError(f"KVScales source must be a str, got {type_name(self.source)}")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]


def _check_scale_table(name: str, table: object) -> None:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"KVScales {name} must be a torch.Tensor, got {type_name(table)}")
    if table.dtype != torch.float32:
        raise TypeError(f"KVScales {name} must be float32, got {table.dtype}")
    if table.device.type != "cpu":
        raise TypeError(f"KVScales {name} must be on the CPU, got {table.device}")
    if table.dim() != 2 or 0 in table.shape:
        raise ValueError(
            f"KVScales {name} must be 2-D [num_layers, num_kv_heads] with both >= 1, "
            f"got shape {tuple(table.shape)}"
        )
    bad = ~(torch.isfinite(table) & (table > 0))
    if bad.any():
        layer, head = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"KVScales {name} must be finite and > 0; layer {layer}, head {head} is "
            f"{table[layer, head].item()!r}"
        )


def static_kv_scales(num_layers: int, num_kv_heads: int, scale: float = 1.0) -> KVScales:
    """One fixed ``scale`` for every layer and head (no calibration data needed)."""
    check_positive_int("num_layers", num_layers)
    check_positive_int("num_kv_heads", num_kv_heads)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type_name(scale)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    table = torch.full((num_layers, num_kv_heads), float(scale), dtype=torch.float32)
    return KVScales(table, table.clone(), "static")


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
def calibrate_kv_scales(
    model: torch.nn.Module,
    token_ids: object,
    *,
    margin: float = DYNAMIC_MARGIN,
    max_tokens: int = CALIBRATION_TOKENS,
) -> KVScales:
    """Scales from the K/V ``model`` (a transformers causal LM) caches for the first
    ``max_tokens`` of ``token_ids``: per layer and head ``max|x| * margin / FP8_MAX`` (1.0 for an
    all-zero head, which any scale stores exactly). The model's weights and modes are kept."""
    num_layers = _check_causal_lm(model)
    ids = check_token_ids("token_ids", token_ids)
    if not ids:
        raise ValueError("token_ids must hold at least one token")
    vocab = getattr(model.config, "vocab_size", None)
    if isinstance(vocab, int) and not all(0 <= t < vocab for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token_ids must lie in [0, vocab_size={vocab}), got {bad}")
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
        raise TypeError(f"margin must be a float, got {type_name(margin)}")
    if not (math.isfinite(margin) and margin >= 1):
        raise ValueError(f"margin must be finite and >= 1, got {margin!r}")
    check_positive_int("max_tokens", max_tokens)
    ids = ids[:max_tokens]

    cache = _prefill_cache(model, ids)
    k_amax, v_amax = [], []
    for layer in range(num_layers):
        keys, values = _cached_kv(cache, layer, len(ids))
        k_amax.append(_head_amax(f"layer {layer}'s keys", keys))
        v_amax.append(_head_amax(f"layer {layer}'s values", values))
    heads = {a.shape[0] for a in k_amax + v_amax}
    if len(heads) != 1:
        raise ValueError(f"the cache's layers have different KV head counts {sorted(heads)}")
    k, v = (torch.stack(a) for a in (k_amax, v_amax))
    return KVScales(_to_scale(k, float(margin)), _to_scale(v, float(margin)), "dynamic")


def _check_causal_lm(model: object) -> int:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a transformers causal LM, got {type_name(model)}")
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise TypeError(
            "model must be a transformers causal LM whose config has num_hidden_layers >= 1, "
            f"got {type_name(model)} (num_hidden_layers={num_layers!r})"
        )
    return num_layers


def _prefill_cache(model: torch.nn.Module, ids: list[int]):
    """Run the model's forward once on ``ids`` in eval mode; the filled cache."""
    from transformers import DynamicCache  # only calibration needs transformers' cache

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    # a config-less DynamicCache keeps every token in every layer; DynamicCache(config) (what
    # the model builds itself) keeps only the last window - 1 tokens of sliding-window layers
    cache = DynamicCache()
    kwargs = {"use_cache": True, "past_key_values": cache}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # only the cache matters: skip [T, vocab] logits
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()  # dropout off: the cache must hold what inference caches
        with torch.inference_mode():
            model(torch.tensor([ids], dtype=torch.long, device=device), **kwargs)
    finally:
        for module, training in modes.items():
            module.training = training
    return cache


def _cached_kv(cache, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s cached keys and values ``[1, Hkv, T, D]``, checked to hold every token."""
    layers = getattr(cache, "layers", ())
    if layer >= len(layers):
        raise ValueError(
            f"the model's forward filled {len(layers)} cache layers, its config names more "
            f"(num_hidden_layers); layer {layer} has no cached keys"
        )
    keys, values = layers[layer].keys, layers[layer].values
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type_name(x)
            raise ValueError(f"layer {layer}'s cached {name} must be [1, Hkv, T, D], got {shape}")
        if x.shape[2] != num_tokens:
            raise ValueError(
                f"layer {layer} cached {x.shape[2]} of the {num_tokens} calibration tokens' "
                f"{name}; calibration needs all of them"
            )
    return keys, values


def _head_amax(name: str, x: torch.Tensor) -> torch.Tensor:
    """max |x| per KV head over tokens and head_dim, float32 on the CPU (abs/max are exact)."""
    amax = x.abs().amax(dim=(0, 2, 3)).to(device="cpu", dtype=torch.float32)
    if not torch.isfinite(amax).all():
        raise ValueError(f"{name} hold non-finite values; no FP8 scale can store them")
    return amax


def _to_scale(amax: torch.Tensor, margin: float) -> torch.Tensor:
    """amax lands at FP8_MAX / margin; a zero head's 1.0 is arbitrary (zeros store exactly)."""
    return torch.where(amax > 0, amax * margin / FP8_MAX, torch.ones_like(amax))


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def load_kv_scales(path: str | os.PathLike, num_layers: int, num_kv_heads: int) -> KVScales:
    """The scales a checkpoint ships (a .safetensors file or a directory of them): per layer
    ``self_attn.k_scale`` / ``v_scale``, else ``k_proj`` / ``v_proj.output_scale``, else
    ``kv_scale`` (both K and V). A scalar applies to every head; ``[num_kv_heads]`` is per head."""
    from safetensors import safe_open

    check_positive_int("num_layers", num_layers)
    check_positive_int("num_kv_heads", num_kv_heads)
    files = _safetensors_files(path)
    found: dict[tuple[int, str], tuple[Path, str]] = {}  # (layer, field) -> (file, key)
    for file in files:
        for key in _keys_of(file):
            match = _FIELD_KEY.match(key)
            if match is None:
                continue
            layer, field = int(match.group(1)), match.group(2)
            if layer >= num_layers:
                raise ValueError(
                    f"{file}: {key} names layer {layer}, but the model has {num_layers} layers"
                )
            if (layer, field) in found:
                other = found[layer, field][1]
                raise ValueError(f"{file}: {key} and {other} both give layer {layer}'s {field}")
            found[layer, field] = (file, key)
    if not found:
        raise ValueError(
            f"{path} holds no FP8 KV scales: no key ending in "
            f"layers.<i>.self_attn.{{{','.join(_FIELDS)}}}"
        )

    picks = {}  # kind -> one (file, key) per layer
    for kind, fields in (("K", _K_FIELDS), ("V", _V_FIELDS)):
        picks[kind] = [_first_field(found, i, fields) for i in range(num_layers)]
        missing = [i for i, pick in enumerate(picks[kind]) if pick is None]
        if missing:
            raise ValueError(
                f"{path}: no {kind} scale ({' / '.join(fields)}) for layers "
                f"{', '.join(map(str, missing))} of {num_layers}"
            )
    wanted: dict[Path, dict[str, None]] = {}  # ordered: the first bad value is reported
    for file, key in picks["K"] + picks["V"]:
        wanted.setdefault(file, {})[key] = None
    values = {}  # read only the chosen keys, each file opened once
    for file, keys in wanted.items():
        with safe_open(str(file), framework="pt") as handle:
            for key in keys:
                values[file, key] = _per_head(
                    f"{file}: {key}", handle.get_tensor(key), num_kv_heads
                )
    k, v = (torch.stack([values[pick] for pick in picks[kind]]) for kind in ("K", "V"))
    return KVScales(k, v, str(path))


def _first_field(
    found: dict[tuple[int, str], tuple[Path, str]], layer: int, fields: tuple[str, ...]
) -> tuple[Path, str] | None:
    """The (file, key) of ``layer``'s first field in preference order that the checkpoint has."""
    return next((found[layer, f] for f in fields if (layer, f) in found), None)


def _safetensors_files(path: object) -> list[Path]:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type_name(path)}")
    root = Path(path)
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"directory {root} holds no *.safetensors files")
        return files
    if not root.is_file():
        raise ValueError(f"KV scales path {root} does not exist")
    return [root]


def _keys_of(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{file} is not a readable safetensors file: {err}") from err


def _per_head(name: str, value: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint scale as float32 ``[num_kv_heads]``: a scalar broadcasts, a vector is per
    head."""
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point scale, got dtype {value.dtype}")
    if value.dim() <= 1 and value.numel() == 1:
        value = value.reshape(1).expand(num_kv_heads)
    elif tuple(value.shape) != (num_kv_heads,):
        raise ValueError(
            f"{name} must be a scalar or [num_kv_heads={num_kv_heads}], "
            f"got shape {tuple(value.shape)}"
        )
    value = value.to(device="cpu", dtype=torch.float32).contiguous()
    bad = ~(torch.isfinite(value) & (value > 0))
    if bad.any():
        raise ValueError(f"{name} must be finite and > 0, got {value[bad][0].item()!r}")
    return value


def save_kv_scales(scales: KVScales, path: str | os.PathLike) -> None:
    """Write ``scales`` as one safetensors file in the llm-compressor / vLLM naming
    (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``, float32 ``[Hkv]``)."""
    from safetensors.torch import save_file

    if not isinstance(scales, KVScales):
        raise TypeError(f"scales must be a KVScales, got {type_name(scales)}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type_name(path)}")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"path {target} is a directory; name the .safetensors file to write")
    if not target.parent.is_dir():
        raise ValueError(f"the directory of {target} does not exist")
    tensors = {}
    for i in range(scales.num_layers):
        # clone: rows of one table share storage, which save_file refuses
        tensors[f"model.layers.{i}.self_attn.k_scale"] = scales.k[i].clone()
        tensors[f"model.layers.{i}.self_attn.v_scale"] = scales.v[i].clone()
    save_file(tensors, str(target), metadata={"format": SAVE_FORMAT, "source": scales.source})
