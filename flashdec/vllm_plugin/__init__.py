"""FlashDec as a vLLM attention backend (optional; vLLM 0.24.0 only).

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point (in every process it
starts: the front end, the engine core and each worker). It registers
:class:`flashdec.vllm_plugin.backend.FlashDecBackend` as vLLM's ``CUSTOM`` attention backend;
selecting that backend (``attention_backend="CUSTOM"`` / ``--attention-backend CUSTOM``) then runs
single-token decode batches through FlashDec's paged decode, reading vLLM's KV cache in place,
and everything else through vLLM's own FlashAttention backend.

Importing this package imports neither vLLM nor Triton (``import flashdec`` never imports it at
all); only :func:`register` touches vLLM, and it never raises into vLLM's start-up: with another
vLLM version, or when anything in the registration fails, it logs one line and returns False.
"""

from __future__ import annotations

from flashdec.vllm_plugin.logs import LOGGER_NAME, logger

__all__ = ["LOGGER_NAME", "collect_stats", "is_supported_version", "register", "reset_stats"]

# The vLLM release whose attention interfaces the backend was written and tested against.
SUPPORTED_VLLM_VERSION = "0.24.0"
BACKEND_CLASS_PATH = "flashdec.vllm_plugin.backend.FlashDecBackend"


def is_supported_version(version: object) -> bool:
    """Whether ``version`` is the supported release (a local tag such as ``+cu130`` allowed)."""
    return isinstance(version, str) and version.split("+", 1)[0] == SUPPORTED_VLLM_VERSION


def register() -> bool:
    """Register FlashDec as vLLM's ``CUSTOM`` attention backend; True when registered.

    Safe to call any number of times, in any process. Never raises (except on interpreter exit
    signals): every failure is one logged line and a False return.
    """
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken installation failing at import
        logger.warning("FlashDec vLLM plugin not registered: cannot import vllm (%s)", exc)
        return False
    try:
        version = getattr(vllm, "__version__", None)
        if not is_supported_version(version):
            logger.warning(
                "FlashDec vLLM plugin not registered: it supports vLLM %s only, found %s; "
                "vLLM keeps its own attention backends",
                SUPPORTED_VLLM_VERSION,
                version,
            )
            return False
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    except Exception as exc:  # a plugin must never stop vLLM from starting
        logger.warning("FlashDec vLLM plugin not registered: %s: %s", type(exc).__name__, exc)
        return False
    logger.info(
        "FlashDec registered as vLLM's CUSTOM attention backend (%s); select it with "
        "attention_backend='CUSTOM'",
        BACKEND_CLASS_PATH,
    )
    return True


def collect_stats(worker: object = None) -> dict:
    """This process's plugin counters (see :mod:`flashdec.vllm_plugin.stats`).

    The ``worker`` argument lets ``LLM.collective_rpc(collect_stats)`` call it on every worker.
    """
    from flashdec.vllm_plugin.stats import STATS

    return STATS.snapshot()


def reset_stats(worker: object = None) -> None:
    """Zero this process's plugin counters (``LLM.collective_rpc(reset_stats)`` on workers)."""
    from flashdec.vllm_plugin.stats import STATS

    STATS.reset()
