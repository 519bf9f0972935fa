"""The ``flashdec`` command line's grammar: the argparse parser of every sub-command
(:func:`build_parser`), whose usage errors are one line (exit status 2).

Workload knobs are generated from the fields of each workload's frozen config dataclass (their
help, bounds and choices), so the CLI and the Python API cannot drift apart. What runs a parsed
command is :mod:`flashdec.cli`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NoReturn

from flashdec import __version__


def one_line(message: object) -> str:
    """``message`` with its whitespace runs folded: the CLI's errors are one line each."""
    return " ".join(str(message).split())


class _Parser(argparse.ArgumentParser):
    """argparse, but every usage error is the one line ``flashdec: error: ...`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"flashdec: error: {one_line(message)}\n")


def _add_config_arguments(
    parser: argparse.ArgumentParser, config_cls, exclusive: tuple[str, ...] = ()
) -> None:
    """One ``--field-name`` option per dataclass field, typed, defaulted and constrained by it;
    the fields named in ``exclusive`` may not be given together."""
    group = parser.add_mutually_exclusive_group() if exclusive else None
    for field in dataclasses.fields(config_cls):
        default = field.default
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        target = group if field.name in exclusive else parser
        if isinstance(default, bool):
            parser.add_argument(
                flag, default=default, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            target.add_argument(
                flag,
                type=type(default),
                # argparse sees a conflict only for a value that is not the default object
                # (``--prompt-len 32`` parses to the cached int 32): None stands for the default
                default=None if target is group else default,
                choices=field.metadata.get("choices"),
                help=f"{help_text} (default: {default if default != '' else 'none'})",
            )


def config_values(args: argparse.Namespace, config_cls) -> dict:
    """The config's fields as parsed; an option left out (None) takes the field's default."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    return {name: value for name, value in values.items() if value is not None}


def _workloads() -> dict:
    from flashdec.workloads import registry

    return registry()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flashdec",
        description="FlashDec: a correctness-first single-GPU LLM decode runtime "
        "(paged KV cache, Triton decode kernels, block-aware scheduler).",
        epilog="Exit status: 0 success, 1 a run failed, 2 a bad flag or configuration "
        "(nothing was run), 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"flashdec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks")
    # -v after a subcommand too; SUPPRESS keeps a subcommand from resetting the top-level value
    verbose = _Parser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from flashdec.workloads.model_config import GenerateConfig, ServeConfig

    generate = sub.add_parser(
        "generate",
        parents=[verbose],
        help="generate with a model (a built-in random-weight shape or a local directory) and "
        "report tokens/s, TTFT and TPOT",
    )
    _add_config_arguments(generate, GenerateConfig, exclusive=("prompt", "prompt_len"))
    generate.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    serve = sub.add_parser(
        "bench-serve",
        parents=[verbose],
        help="Poisson arrivals through the serving loop (continuous batching): TTFT and TPOT "
        "percentiles, output tokens/s",
    )
    _add_config_arguments(serve, ServeConfig)
    serve.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    from flashdec.server.config import ServerConfig

    server = sub.add_parser(
        "serve",
        parents=[verbose],
        help="an OpenAI-compatible HTTP server (completions, chat completions, streaming, "
        "/metrics) until Ctrl-C or SIGTERM",
        description="Serve a model over HTTP with OpenAI's API: POST /v1/completions and "
        "/v1/chat/completions (stream: server-sent events), GET /v1/models, /health, /metrics. "
        "The first Ctrl-C or SIGTERM lets requests in flight finish (--drain-timeout), a "
        "second one cancels them; the exit status is 0.",
    )
    _add_config_arguments(server, ServerConfig)
    sub.add_parser(
        "env",
        parents=[verbose],
        help="versions, GPU, and whether Triton runs natively or interpreted",
    )
    spec = sub.add_parser(
        "spec",
        parents=[verbose],
        help="parse a KV layer-group spec and print its groups, layers and memory per group",
        description="Parse a KV layer-group spec, e.g. "
        "'(2,1024,16,8,128):bfloat16:30;(2,1024,16,2,64):bfloat16:2:window=4096', and print "
        "each group's geometry, layer indices, blocks and memory, and the canonical form.",
    )
    spec.add_argument("spec", metavar="SPEC", help="the spec text (quote it for the shell)")
    demo = sub.add_parser(
        "demo",
        parents=[verbose],
        help="real text from SmolLM2-135M-Instruct checked token for token against "
        "transformers (on a GPU after a Llama-3-8B-shape speed run), then the integrated "
        "runtime workload and a one-line verdict",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    workload = sub.add_parser(
        "workload", parents=[verbose], help="run one named workload with its knobs"
    )
    names = workload.add_subparsers(dest="workload", metavar="NAME")
    for name, entry in _workloads().items():
        p = names.add_parser(name, parents=[verbose], help=entry.help, description=entry.help)
        _add_config_arguments(p, entry.config_cls)
        p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    return parser
