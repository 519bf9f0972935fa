"""What FlashDec needs to know about a transformers decoder, and whether it can run it.

:func:`config_problems` and :func:`module_problems` list every unsupported architecture or
feature (one readable phrase each); :func:`check_supported` raises one ``ValueError`` naming all
of them; :func:`model_spec` reads a supported model into a :class:`ModelSpec`. The config checks
run before any weight is loaded (see :mod:`flashdec.models.loading`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from flashdec._checks import FLOAT_DTYPES

# model_type -> the transformers class FlashDec decodes with
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# RoPE types whose cos/sin are fully determined by the rotary module's inv_freq (no cos/sin
# scaling, no dependence on the sequence length)
ROPE_TYPES = ("default", "linear", "llama3")
MAX_HEAD_DIM = 256  # the paged decode kernel's limit
# layer types of transformers configs (`config.layer_types`) FlashDec runs
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")  # as configs name it


@dataclass(frozen=True)
class ModelSpec:
    """Geometry and numerics of a supported decoder, read from the model itself."""

    family: str  # a key of FAMILIES
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype  # of every weight; activations and the KV cache use it too
    device: torch.device
    rotary_dim: int  # == head_dim for the supported families (checked)
    sm_scale: float  # the attention modules' own `scaling`
    rms_norm_eps: float
    qk_norm: bool  # Qwen3: RMSNorm of q and k per head, before RoPE
    eos_token_ids: tuple[int, ...]  # generation_config's, else config's; may be empty
    max_position_embeddings: int
    weight_bytes: int  # every distinct parameter once (tied embeddings count once)
    # per layer: the sliding window in tokens (the last `window` positions, the new one
    # included), or None for full causal attention - as transformers applies it
    layer_windows: tuple[int | None, ...]
    # float32 [rotary_dim // 2]: the rotary module's own inverse frequencies, as transformers
    # uses them (llama3 / linear scaling already applied); never re-derived
    inv_freq: torch.Tensor = field(repr=False, compare=False)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the model's dtype."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    return head_dim or config.hidden_size // config.num_attention_heads


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window as the family's transformers modules apply it: Mistral
    windows every layer by ``sliding_window``; Qwen2/Qwen3 the layers that ``layer_types``
    marks ``sliding_attention``; Llama none. None means full causal attention."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or config.model_type == "llama":
        return (None,) * num_layers
    if config.model_type == "mistral":
        return (window,) * num_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def config_problems(config: PretrainedConfig) -> list[str]:
    """Every architecture or feature of ``config`` that FlashDec does not implement."""
    problems: list[str] = []
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        problems.append(
            f"architecture model_type={model_type!r} (supported: {', '.join(FAMILIES)})"
        )
    else:
        archs = list(getattr(config, "architectures", None) or [])
        if archs and FAMILIES[model_type] not in archs:
            problems.append(f"architectures {archs} (supported: {FAMILIES[model_type]})")

    experts = {
        key: value
        for key, value in config.to_dict().items()
        if "expert" in key and isinstance(value, int) and not isinstance(value, bool) and value
    }
    if experts:
        listed = ", ".join(f"{key}={value}" for key, value in sorted(experts.items()))
        problems.append(f"mixture-of-experts ({listed})")

    layer_types = getattr(config, "layer_types", None) or []
    other_layers = sorted(set(layer_types) - set(_LAYER_TYPES))
    if other_layers:
        problems.append(f"layer_types {other_layers} (supported: {', '.join(_LAYER_TYPES)})")
    elif model_type in FAMILIES:
        window = getattr(config, "sliding_window", None)
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            problems.append(f"sliding_window={window!r} (must be a positive int or None)")

    rope = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(value, dict) for value in rope.values()):
        problems.append("per-layer-type RoPE parameters")
    else:
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            problems.append(
                f"rope_type {rope_type!r} (cos/sin need more than inv_freq; "
                f"supported: {', '.join(ROPE_TYPES)})"
            )
        factor = rope.get("attention_factor")
        if factor is not None and factor != 1.0:
            problems.append(f"RoPE attention_factor={factor} (cos/sin scaling; only 1.0)")
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial is not None and partial != 1.0:
            problems.append(f"partial_rotary_factor={partial} (only full-head RoPE)")

    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, name, None)
        if value is not None:
            problems.append(f"soft-capping {name}={value}")
    act = next(
        (getattr(config, name) for name in _ACTIVATION_KEYS if getattr(config, name, None)), None
    )
    if act != "silu":
        problems.append(f"MLP activation {act!r} (only silu)")
    method = quantization_method(config)
    if method is not None and method != "gguf":
        problems.append(
            f"quantized weights (quantization_config quant_method={method!r}; FlashDec runs "
            "float weights: GGUF checkpoints, which transformers dequantizes on load, are accepted)"
        )

    if model_type in FAMILIES:
        head_dim = _head_dim(config)
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            problems.append(f"head_dim={head_dim} (must be even and <= {MAX_HEAD_DIM})")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if not kv_heads or heads % kv_heads:
            problems.append(
                f"num_attention_heads={heads} not a multiple of num_kv_heads={kv_heads}"
            )
    return problems


def quantization_method(config: PretrainedConfig) -> str | None:
    """The config's ``quantization_config`` method (``"gguf"``, ``"fp8"``, ...), or None."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return str(getattr(method, "value", method))  # transformers' QuantizationMethod enum


def _is_rms_norm(module: object) -> bool:
    """A norm FlashDec implements: transformers' RMSNorm, a ``weight`` and nothing else."""
    if not isinstance(module, nn.Module) or not hasattr(module, "variance_epsilon"):
        return False
    params = dict(module.named_parameters(recurse=False))
    return (
        list(params) == ["weight"]
        and params["weight"].dim() == 1
        and not list(module.children())
        and "RMSNorm" in type(module).__name__
    )


def module_problems(model: PreTrainedModel) -> list[str]:
    """What the module tree of a model of a supported family adds to :func:`config_problems`:
    the head class, norms and projections the adapter implements, where the weights live."""
    problems: list[str] = []
    expected = FAMILIES.get(model.config.model_type)
    if type(model).__name__ != expected:
        return [f"model class {type(model).__name__} (expected {expected}, with its lm_head)"]

    inner = model.model
    windows = layer_windows(model.config)
    norms = {"model.norm": inner.norm}
    projections = {"lm_head": model.lm_head}
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms[f"layers.{i}.input_layernorm"] = layer.input_layernorm
        norms[f"layers.{i}.post_attention_layernorm"] = layer.post_attention_layernorm
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name):
                norms[f"layers.{i}.self_attn.{name}"] = getattr(attn, name)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            projections[f"layers.{i}.self_attn.{name}"] = getattr(attn, name, None)
        for name in ("gate_proj", "up_proj", "down_proj"):
            projections[f"layers.{i}.mlp.{name}"] = getattr(mlp, name, None)
        if getattr(attn, "scaling", None) != getattr(inner.layers[0].self_attn, "scaling", None):
            problems.append(f"layers.{i}.self_attn.scaling differs from layer 0's")
        module_window = getattr(attn, "sliding_window", windows[i])
        if module_window != windows[i]:
            problems.append(
                f"layers.{i}.self_attn.sliding_window={module_window} differs from the config's "
                f"{windows[i]}"
            )
    for name, module in norms.items():
        if not _is_rms_norm(module):
            problems.append(f"norm {name} of type {type(module).__name__} (only RMSNorm weights)")
    for name, module in projections.items():
        if not isinstance(module, nn.Linear):
            problems.append(f"projection {name} of type {type(module).__name__} (only nn.Linear)")

    rotary = getattr(inner, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        problems.append("no rotary module with an inv_freq buffer (model.rotary_emb)")
    else:
        if getattr(rotary, "rope_type", None) not in ROPE_TYPES:
            problems.append(f"rotary module rope_type {getattr(rotary, 'rope_type', None)!r}")
        if getattr(rotary, "attention_scaling", 1.0) != 1.0:
            problems.append(f"rotary attention_scaling={rotary.attention_scaling} (only 1.0)")
        if 2 * inv_freq.shape[0] != _head_dim(model.config):
            problems.append(
                f"rotary dims {2 * inv_freq.shape[0]} != head_dim {_head_dim(model.config)}"
            )

    tensors = [*model.parameters(), *model.buffers()]
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) != 1:
        problems.append(f"weights on several devices {devices} (one device only)")
    elif devices[0] == "meta":
        problems.append("weights on the meta device (not materialised)")
    packed = [(n, p.dtype) for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        problems.append(_packed_problem(model.config, packed))
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if len(dtypes) != 1 or model.dtype not in FLOAT_DTYPES:
        problems.append(f"weight dtypes {dtypes} (one of float32, float16, bfloat16)")
    return problems


def _packed_problem(config: PretrainedConfig, packed: list[tuple[str, torch.dtype]]) -> str:
    """Weights that stayed quantized (integer blocks) instead of arriving as floats."""
    name, dtype = packed[0]
    more = f" and {len(packed) - 1} more" if len(packed) > 1 else ""
    fix = ""
    if quantization_method(config) == "gguf":  # transformers can keep GGUF blocks packed
        fix = "; load the GGUF file with quantization_config=GgufConfig(dequantize=True)"
    return (
        f"weights left quantized ({name} is {str(dtype).removeprefix('torch.')}{more}): "
        f"FlashDec multiplies float weights only{fix}"
    )


def check_supported(model: PreTrainedModel) -> None:
    """Raise one ValueError naming every unsupported architecture or feature of ``model``."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    problems = config_problems(model.config)
    if getattr(model.config, "model_type", None) in FAMILIES:
        problems += module_problems(model)
    if problems:
        raise ValueError(
            f"FlashDec cannot run this {type(model).__name__}: unsupported " + "; ".join(problems)
        )


def _eos_token_ids(model: PreTrainedModel) -> tuple[int, ...]:
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def model_spec(model: PreTrainedModel) -> ModelSpec:
    """Check ``model`` (:func:`check_supported`) and read its :class:`ModelSpec`."""
    check_supported(model)
    config, inner = model.config, model.model
    inv_freq = inner.rotary_emb.inv_freq.detach().float()  # a bf16-cast buffer: HF upcasts too
    distinct = {p.data_ptr(): p.nbytes for p in model.parameters()}  # tied weights once
    return ModelSpec(
        family=config.model_type,
        num_layers=len(inner.layers),
        hidden_size=config.hidden_size,
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=_head_dim(config),
        intermediate_size=config.intermediate_size,
        vocab_size=model.lm_head.out_features,
        dtype=model.dtype,
        device=next(model.parameters()).device,
        rotary_dim=2 * inv_freq.shape[0],
        sm_scale=float(inner.layers[0].self_attn.scaling),
        rms_norm_eps=float(inner.norm.variance_epsilon),
        qk_norm=hasattr(inner.layers[0].self_attn, "q_norm"),
        eos_token_ids=_eos_token_ids(model),
        max_position_embeddings=config.max_position_embeddings,
        weight_bytes=sum(distinct.values()),
        layer_windows=layer_windows(config),
        inv_freq=inv_freq,
    )
