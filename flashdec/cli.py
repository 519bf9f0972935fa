"""The ``flashdec`` command line: ``env``, ``demo`` and ``workload NAME``.

Workload knobs are generated from the fields of each workload's frozen config dataclass, so the
CLI and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from flashdec.runtime import environment_report, prepare_triton

log = logging.getLogger("flashdec")


def _add_config_arguments(parser: argparse.ArgumentParser, config_cls) -> None:
    """One ``--field-name`` option per dataclass field, typed and defaulted from the field."""
    for field in dataclasses.fields(config_cls):
        default = field.default
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        if isinstance(default, bool):
            parser.add_argument(
                flag, default=default, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(
                flag, type=kind, default=default, help=f"{help_text} (default: {default})"
            )


def _config_from_args(config_cls, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    return config_cls(**values)


def _workloads() -> dict:
    from flashdec.workloads import registry

    return registry()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashdec",
        description="FlashDec: a correctness-first single-GPU LLM decode runtime "
        "(paged KV cache, Triton decode kernels, block-aware scheduler).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("env", help="versions, GPU, and whether Triton runs natively or interpreted")
    demo = sub.add_parser(
        "demo",
        help="the integrated workload on embedded defaults (CPU: small shapes, torch backends; "
        "GPU: Triton)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    workload = sub.add_parser("workload", help="run one named workload with its knobs")
    names = sub_names = workload.add_subparsers(dest="workload", metavar="NAME")
    for name, entry in _workloads().items():
        p = sub_names.add_parser(name, help=entry.help, description=entry.help)
        _add_config_arguments(p, entry.config_cls)
        p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    del names
    return parser


def _print_env(console: Console) -> None:
    report = environment_report()
    table = Table(title="FlashDec environment", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    for key, value in report.rows():
        table.add_row(key, value)
    console.print(table)


def _run_workload(console: Console, name: str, config, json_path: str | None = None) -> int:
    from flashdec.workloads import registry, result_to_json

    entry = registry()[name]
    console.print(f"[bold]workload[/bold] {name}: {config}")
    result = entry.run(config, progress=console.is_terminal)
    for table in entry.tables(result):
        console.print(table)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(result_to_json(result))
        console.print(f"wrote {json_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    mode = prepare_triton()  # before anything imports Triton
    if mode != "native":
        # CPU runs use small tensors: extra intra-op threads only contend for the cores
        torch.set_num_threads(1)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # piped output (CI logs, files) is not limited to rich's 80-column default
    console = Console(width=None if sys.stdout.isatty() else 120)
    log.debug("triton mode: %s", mode)
    if args.command == "env":
        _print_env(console)
        return 0
    if args.command == "demo":
        from flashdec.workloads import IntegratedWorkloadConfig

        config = IntegratedWorkloadConfig.demo_defaults(seed=args.seed)
        return _run_workload(console, "integrated", config)
    if args.command == "workload":
        if not args.workload:
            parser.parse_args(["workload", "--help"])
        entry = _workloads()[args.workload]
        return _run_workload(
            console, args.workload, _config_from_args(entry.config_cls, args), args.json
        )
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
