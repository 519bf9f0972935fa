"""transformers models on FlashDec: support checks, the model spec, the decoder adapter that
splits the forward pass at attention, built-in random-weight shapes and local loading.

Importing this package imports transformers' modeling code, which imports Triton: on a machine
without a GPU, call :func:`flashdec.runtime.prepare_triton` first.
"""

from flashdec.models.decoder import DecoderAdapter
from flashdec.models.loading import LoadedModel, load_model, resolve_model
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
)

__all__ = [
    "BUILTIN_SHAPES",
    "DEFAULT_SHAPE",
    "FAMILIES",
    "DecoderAdapter",
    "LoadedModel",
    "ModelShape",
    "ModelSpec",
    "build_random_model",
    "check_supported",
    "config_problems",
    "layer_windows",
    "load_model",
    "model_spec",
    "module_problems",
    "random_model",
    "resolve_model",
]
