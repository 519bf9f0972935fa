"""Speculative decoding: what proposes draft tokens and how a verification step accepts them.

The runner (:mod:`flashdec.engine.runner`) verifies every request's drafts in one mixed-token
engine step and rolls the rejected ones back with ``commit_step(accept=...)``; this package holds
the parts that need no engine: the config, what a drafter is asked for, the n-gram drafter, the
accept rules and the per-request adaptivity (the draft-model drafter runs an engine of its own:
:mod:`flashdec.engine.draft_model`). Their device-side parts, for rounds that do not wait for
the host (a token history, the n-gram proposer, greedy acceptance), are in ``device_rounds``.
"""

from flashdec.speculative.adaptive import DraftController, SpeculationGate
from flashdec.speculative.config import SPECULATIVE_METHODS, SpeculativeConfig
from flashdec.speculative.device_rounds import (
    DeviceTokenHistory,
    accept_greedy_device,
    propose_ngram_device,
)
from flashdec.speculative.drafts import Drafter, DraftRequest
from flashdec.speculative.ngram import NgramDrafter, propose_ngram
from flashdec.speculative.rules import accept_greedy, accept_sampled

__all__ = [
    "SPECULATIVE_METHODS",
    "DeviceTokenHistory",
    "DraftController",
    "DraftRequest",
    "Drafter",
    "NgramDrafter",
    "SpeculationGate",
    "SpeculativeConfig",
    "accept_greedy",
    "accept_greedy_device",
    "accept_sampled",
    "propose_ngram",
    "propose_ngram_device",
]
