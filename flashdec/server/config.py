"""``flashdec serve`` knobs: the model knobs ``generate`` has, plus the HTTP server's own."""

from __future__ import annotations

from dataclasses import dataclass

from flashdec.workloads.knobs import knob
from flashdec.workloads.model_config import ModelRunConfig

PORT_MAX = 65535


@dataclass(frozen=True)
class ServerConfig(ModelRunConfig):
    """Knobs of ``flashdec serve`` (an OpenAI-compatible HTTP server)."""

    host: str = knob(
        "127.0.0.1", "address to listen on (0.0.0.0: every interface; the default: this machine)"
    )
    port: int = knob(8000, "TCP port to listen on (0: any free port)", minimum=0, maximum=PORT_MAX)
    served_model_name: str = knob(
        "", "the model name clients send and /v1/models lists (empty: the --model value)"
    )
    default_max_tokens: int = knob(
        256,
        "tokens a chat completion may generate when the client sends no max_tokens (completions "
        "default to 16, as OpenAI's do); capped by what the context has left",
        minimum=1,
        maximum=131072,
    )
    drain_timeout: float = knob(
        30.0,
        "seconds the first Ctrl-C / SIGTERM waits for in-flight requests to finish before it "
        "cancels them (a second Ctrl-C cancels at once)",
        minimum=0.0,
        maximum=86400.0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.host:
            raise ValueError("host must not be empty")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
