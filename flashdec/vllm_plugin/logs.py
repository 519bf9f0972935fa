"""The plugin's logger: a child of vLLM's "vllm" logger, so its lines appear in vLLM's own log
format. A module of its own so that the package and its parts share it without importing each
other."""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.flashdec"

logger = logging.getLogger(LOGGER_NAME)
