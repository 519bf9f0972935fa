"""transformers models on FlashDec: support checks, the model spec, the decoder adapter that
splits the forward pass at attention, built-in random-weight shapes, built-in real models (GGUF
files that installed packages ship) and local loading.

Importing this package imports transformers' modeling code, which imports Triton: on a machine
without a GPU, call :func:`flashdec.runtime.prepare_triton` first.
"""

from flashdec.models.chat import chat_prompt
from flashdec.models.decoder import DecoderAdapter
from flashdec.models.loading import LoadedModel, load_draft_model, load_model, resolve_model
from flashdec.models.real import REAL_MODELS, RealModel, real_model_problem
from flashdec.models.shapes import (
    BUILTIN_SHAPES,
    DEFAULT_SHAPE,
    ModelShape,
    build_random_model,
    random_model,
)
from flashdec.models.spec import (
    FAMILIES,
    ModelSpec,
    check_supported,
    config_problems,
    layer_windows,
    model_spec,
    module_problems,
    quantization_method,
)

__all__ = [
    "BUILTIN_SHAPES",
    "DEFAULT_SHAPE",
    "FAMILIES",
    "REAL_MODELS",
    "DecoderAdapter",
    "LoadedModel",
    "ModelShape",
    "ModelSpec",
    "RealModel",
    "build_random_model",
    "chat_prompt",
    "check_supported",
    "config_problems",
    "layer_windows",
    "load_draft_model",
    "load_model",
    "model_spec",
    "module_problems",
    "quantization_method",
    "random_model",
    "real_model_problem",
    "resolve_model",
]
