"""The ``flashdec`` command line: ``generate``, ``serve``, ``bench-serve``, ``env``, ``spec``,
``demo`` and ``workload NAME``.

The parser (:mod:`flashdec.cli_parser`) generates workload knobs from the fields of each
workload's frozen config dataclass (their help, bounds and choices), so the CLI and the Python
API cannot drift apart.

Every error reaches the user as one line on stderr, ``flashdec: error: <what and why>``:
- exit status 2 for a bad flag or configuration, found before any work starts (argparse, the
  config's own checks, the ``--json`` path, the memory estimate against what is free);
- exit status 1 for a failure during a run (the traceback only with ``-v``);
- exit status 130 when interrupted, start-up included (torch, transformers and the model load for
  seconds: this module imports them only inside ``main``).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from flashdec.cli_parser import build_parser, config_values, one_line

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger("flashdec")


def _print_env(console: Console) -> None:
    from rich.table import Table

    from flashdec.runtime import environment_report

    report = environment_report()
    table = Table(title="FlashDec environment", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    for key, value in report.rows():
        table.add_row(key, value)
    console.print(table)


def _print_spec(console: Console, groups) -> None:
    from rich.table import Table

    from flashdec.cache import format_kv_spec

    table = Table(title="KV layer groups")
    for column in ("group", "layers", "kv", "heads x dim", "block", "dtype", "window", "blocks"):
        table.add_column(column, justify="right")
    table.add_column("memory", justify="right")
    first_layer = 0
    for index, group in enumerate(groups):
        last_layer = first_layer + group.layer_count - 1
        layers = f"{first_layer}-{last_layer}" if last_layer > first_layer else str(first_layer)
        table.add_row(
            str(index),
            f"{layers} ({group.layer_count})",
            "K,V" if group.kv_size == 2 else "KV",
            f"{group.num_kv_heads} x {group.head_dim}",
            str(group.block_size),
            str(group.dtype).removeprefix("torch."),
            "full" if group.window is None else f"{group.window:,}",
            f"{group.num_blocks:,}",
            _size(group.nbytes),
        )
        first_layer = last_layer + 1
    console.print(table)
    total = sum(group.nbytes for group in groups)
    layers = "1 layer" if first_layer == 1 else f"{first_layer} layers"
    console.print(f"{layers}, {_size(total)} of KV storage")
    console.print(f"canonical: {format_kv_spec(groups)}", markup=False, highlight=False)


def _size(num_bytes: int) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:,.1f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:,.1f} MiB"
    if num_bytes >= 2**10:
        return f"{num_bytes / 2**10:,.1f} KiB"
    return f"{num_bytes} B"


def _check_memory(parser: argparse.ArgumentParser, config) -> None:
    """Refuse a run whose estimated memory exceeds what the device or the host has free."""
    if not hasattr(config, "memory_estimate"):
        return  # the scheduler workload's traces are tiny and fixed
    import torch

    from flashdec import runtime

    est = config.memory_estimate()
    kv = f"KV cache {_size(est.kv_cache_bytes)} for {config.kv_description()}"
    if est.weight_bytes:  # a model run
        parts = f"weights {_size(est.weight_bytes)}, {kv}"
        hint = "try a smaller --model, --dtype bfloat16 (half of float32) or shorter requests"
        host_parts = parts if est.device.type == "cpu" else f"weights {_size(est.weight_bytes)}"
        host_hint = hint
    else:
        parts = kv
        hint = "lower --num-blocks, --num-layers or --max-batch-size"
        on_cpu = f"{kv}, on the CPU; " if est.device.type == "cpu" else ""
        host_parts = f"{on_cpu}bookkeeping for {config.num_requests:,} requests"
        host_hint = "lower --num-requests, --num-blocks or --num-layers"
    if est.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(est.device)
        if est.device_bytes > free:
            parser.error(
                f"the run needs an estimated {_size(est.device_bytes)} of GPU memory ({parts}), "
                f"more than the {_size(free)} free on {est.device}; {hint}"
            )
    available = runtime.available_host_bytes()
    if available is not None and est.host_bytes > available:
        parser.error(
            f"the run needs an estimated {_size(est.host_bytes)} of host memory ({host_parts}), "
            f"more than the {_size(available)} available; {host_hint}"
        )


def _check_json_path(parser: argparse.ArgumentParser, path: str | None) -> None:
    """``--json PATH`` must name a file we can write, checked before the run by opening it
    (permission bits say nothing to root, nor about /proc or a read-only mount)."""
    if path is None:
        return
    if not path:
        parser.error("--json needs a file path, got ''")
    target = Path(path)
    if target.is_dir():
        parser.error(f"--json {path}: is a directory; give a file path")
    for parent in reversed((target.parent, *target.parent.parents)):
        if parent.exists() and not parent.is_dir():
            parser.error(f"--json {path}: {str(parent)!r} is a file, not a directory")
    if not target.parent.is_dir():
        parser.error(f"--json {path}: directory {str(target.parent)!r} does not exist")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        reason = exc.strerror or os.strerror(exc.errno or errno.EIO)
        parser.error(f"--json {path}: cannot be written ({reason})")
    if not existed:
        target.unlink()  # a refused run leaves nothing behind


def _progress(
    console: Console, label: str = "decoding", unit: str = "requests done"
) -> AbstractContextManager:
    """A live bar on a terminal; plain lines (a tenth of the work, or a few seconds, each) on
    pipes and logs, where a bar would be garbage."""
    from flashdec.workloads.report import ProgressLines, progress_bar

    if console.is_terminal:
        return progress_bar(label, unit)
    return nullcontext(
        ProgressLines(label, lambda line: console.print(line, markup=False, highlight=False), unit)
    )


def _workload_result(console: Console, name: str, config):
    """Run one workload with progress, print its tables, return its result."""
    from flashdec.workloads import registry

    entry = registry()[name]
    console.print(f"[bold]workload[/bold] {name}: {config}")
    # a rejected request ends the workload's wait for it too: the count says so
    with _progress(console, unit="requests finished or rejected") as progress:
        result = entry.run(config, progress=progress)
    for renderable in entry.tables(result):
        console.print(renderable)
    rejected = getattr(result, "rejected", 0)
    if rejected:
        console.print(
            f"[bold yellow]warning:[/bold yellow] {rejected} of {result.num_requests} requests "
            "were rejected: each needs more KV blocks than the pool holds (--num-blocks, "
            "--block-size)"
        )
    return result


def _run_workload(console: Console, name: str, config, json_path: str | None = None) -> int:
    from flashdec.workloads import result_to_json

    result = _workload_result(console, name, config)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(result_to_json(result))
        console.print(f"wrote {json_path}")
    return 0


def _run_model(console: Console, title: str, config, json_path: str | None = None) -> int:
    """``generate`` or ``bench-serve``: load the model, run with progress, print, write JSON."""
    from flashdec.workloads import result_to_json
    from flashdec.workloads.generation import load_llm, run_generate
    from flashdec.workloads.report import _kv_table
    from flashdec.workloads.serving import run_serve_benchmark

    console.print(f"[bold]{title}[/bold] {config.model}: loading")
    llm = load_llm(config)
    if title == "generate":
        label, unit = "generating", "tokens"
        run = lambda progress: run_generate(config, llm=llm, progress=progress)  # noqa: E731
    else:
        label, unit = "serving", "requests done"
        run = lambda progress: run_serve_benchmark(llm, config, progress=progress)  # noqa: E731
    if title == "generate" and config.prompt:
        result = _generate_text(console, config, llm)
    else:
        with _progress(console, label, unit) as progress:
            result = run(progress)
    console.print(_kv_table(f"FlashDec {title}", result.rows()))
    if json_path:
        Path(json_path).write_text(result_to_json(result))
        console.print(f"wrote {json_path}")
    return 0


def _generate_text(console: Console, config, llm):
    """A text prompt's output: streamed token by token to a terminal, printed whole (after
    plain progress lines) to pipes and logs."""
    from flashdec.workloads.generation import run_generate

    if console.is_terminal:

        def show(piece: str) -> None:
            console.file.write(piece)
            console.file.flush()

        result = run_generate(config, llm=llm, on_text=show)
        console.file.write("\n")
        return result
    with _progress(console, "generating", "tokens") as progress:
        result = run_generate(config, llm=llm, progress=progress)
    console.print(result.text, markup=False, highlight=False)
    return result


def _run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace, console: Console) -> int:
    """Real text from the built-in real model (CPU and GPU; on a GPU after the Llama-3-8B
    shape's speed run), then the integrated workload, then a one-line verdict. Without the
    real model's packages the CPU demo falls back to the tiny random-weight model."""
    import torch

    from flashdec.models import real_model_problem
    from flashdec.workloads import IntegratedWorkloadConfig
    from flashdec.workloads.generation import ChatDemo
    from flashdec.workloads.model_config import GenerateConfig

    on_gpu = torch.cuda.is_available()
    missing = real_model_problem("smollm2")
    # every part's config and memory is checked before any part runs
    generation = None
    if on_gpu or missing is not None:
        generation = _checked_config(parser, lambda: GenerateConfig.demo_defaults(seed=args.seed))
    chat_config = None if missing is not None else _checked_config(parser, ChatDemo.config_for)
    config = _checked_config(parser, lambda: IntegratedWorkloadConfig.demo_defaults(seed=args.seed))
    for part in (generation, chat_config, config):
        if part is not None:
            _check_memory(parser, part)
    if on_gpu:
        _run_model(console, "generate", generation)
    chat = None
    if chat_config is not None:
        chat = _chat_demo(console, chat_config)
    else:
        console.print(f"real model: unavailable ({missing})", markup=False, highlight=False)
        if not on_gpu:
            _run_model(console, "generate", generation)
    workload = _workload_result(console, "integrated", config)
    console.print(_demo_verdict(chat, workload), markup=False, highlight=False, soft_wrap=True)
    return 0


def _chat_demo(console: Console, config):
    """SmolLM2 answering the demo's chat prompts, with transformers' agreement."""
    from flashdec.workloads.generation import ChatDemo
    from flashdec.workloads.report import _kv_table

    console.print("[bold]demo[/bold] smollm2 (SmolLM2-135M-Instruct, float32): loading")
    demo = ChatDemo.load(config=config)
    with _progress(console, "generating", "tokens") as progress:
        result = demo.run(progress)
    for message, reply in zip(demo.messages, result.texts, strict=True):
        console.print(f"[bold]user:[/bold] {message}", highlight=False)
        console.print("[bold]SmolLM2:[/bold] ", end="", highlight=False)
        console.print(reply.strip(), markup=False, highlight=False)
    console.print(_kv_table("FlashDec generate: smollm2, chat prompts", result.rows()))
    return result


def _demo_verdict(chat, workload) -> str:
    """The demo's last line: real text exact or not, speed, and the workload's outcome."""
    done = f"integrated workload: {workload.completion_rate:.0%} of requests done"
    if chat is None:
        return f"verdict: real model unavailable (see above); {done}"
    same = (
        f"{chat.tokens_equal}/{chat.generated_tokens} tokens "
        f"({chat.matches_transformers}/{chat.num_prompts} prompts)"
    )
    outcome = (
        f"OK, SmolLM2 text token-identical to transformers greedy: {same}"
        if chat.exact
        else f"DIFFERS, SmolLM2 tokens equal to transformers greedy: only {same}"
    )
    speed = f"{chat.tokens_per_s:,.1f} tokens/s, TTFT p50 {chat.ttft.p50_ms:,.0f} ms"
    return f"verdict: {outcome}; {speed}; {done}"


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace, console: Console) -> int:
    """``flashdec serve``: check the knobs, bind the port, load the model, serve until a signal."""
    from flashdec.server.config import ServerConfig
    from flashdec.server.run import bind_socket, require_http_stack, serve
    from flashdec.workloads.generation import load_llm

    values = config_values(args, ServerConfig)
    config = _checked_config(parser, lambda: ServerConfig(**values))
    try:
        require_http_stack()
        sock = bind_socket(config.host, config.port)  # a busy port fails before the model loads
    except (ImportError, OSError) as exc:
        parser.error(f"serve: {exc}")
    with sock:
        console.print(f"[bold]serve[/bold] {config.model}: loading")
        llm = load_llm(config)
        host, port = sock.getsockname()[:2]
        console.print(
            f"serving {config.model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)",
            markup=False,
            highlight=False,
        )
        serve(
            llm,
            sock,
            model_name=config.model_name,
            default_max_tokens=config.default_max_tokens,
            drain_timeout=config.drain_timeout,
        )
    console.print("serve: stopped")
    return 0


def _checked_config(parser: argparse.ArgumentParser, make):
    try:
        return make()
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, console: Console) -> int:
    if args.command == "env":
        _print_env(console)
        return 0
    if args.command == "spec":
        from flashdec.cache.kv_spec import check_storable, parse_kv_spec

        groups = _checked_config(parser, lambda: parse_kv_spec(args.spec))
        _checked_config(parser, lambda: check_storable(groups))
        _print_spec(console, groups)
        return 0
    if args.command in ("generate", "bench-serve"):
        from flashdec.workloads.model_config import GenerateConfig, ServeConfig

        config_cls = GenerateConfig if args.command == "generate" else ServeConfig
        values = config_values(args, config_cls)
        config = _checked_config(parser, lambda: config_cls(**values))
        _check_json_path(parser, args.json)
        _check_memory(parser, config)
        return _run_model(console, args.command, config, args.json)
    if args.command == "serve":
        return _serve(parser, args, console)
    if args.command == "demo":
        return _run_demo(parser, args, console)
    if args.command == "workload":
        from flashdec.workloads import registry

        workloads = registry()
        if not args.workload:
            parser.error(
                f"workload needs a NAME, one of {', '.join(workloads)} "
                "(flashdec workload NAME --help lists its knobs)"
            )
        config_cls = workloads[args.workload].config_cls
        values = config_values(args, config_cls)
        config = _checked_config(parser, lambda: config_cls(**values))
        _check_json_path(parser, args.json)
        _check_memory(parser, config)
        return _run_workload(console, args.workload, config, args.json)
    parser.print_help()
    return 0


def _start(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Imports (seconds: torch, then transformers), Triton's mode, the parsed arguments."""
    from flashdec.runtime import prepare_triton  # imports torch

    mode = prepare_triton()  # before anything imports Triton
    if mode != "native":
        import torch

        # CPU runs use small tensors: extra intra-op threads only contend for the cores
        torch.set_num_threads(1)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    log.debug("triton mode: %s", mode)
    return parser, args


def _interrupted() -> int:
    print("flashdec: error: interrupted", file=sys.stderr)
    return 130


@contextmanager
def _noting_interrupts() -> Iterator[list[bool]]:
    """Ctrl-C raises KeyboardInterrupt as ever, and is noted: an import it cuts short can end in
    another error (numpy's C module: RuntimeError on the retried initialisation)."""
    pressed: list[bool] = []

    def on_sigint(signum, frame) -> NoReturn:
        pressed.append(True)
        raise KeyboardInterrupt

    installed = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if installed:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        if installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    with _noting_interrupts() as pressed:
        try:
            parser, args = _start(argv)
        except KeyboardInterrupt:
            return _interrupted()
        except Exception:
            if pressed:
                return _interrupted()
            raise
        if pressed:  # a library's bare ``except`` swallowed the KeyboardInterrupt
            return _interrupted()
        try:
            from rich.console import Console

            # piped output (CI logs, files) is not limited to rich's 80-column default
            console = Console(width=None if sys.stdout.isatty() else 120)
            status = _dispatch(parser, args, console)
            return _interrupted() if pressed else status
        except KeyboardInterrupt:
            return _interrupted()
        except Exception as exc:
            if pressed:
                return _interrupted()
            if args.verbose:
                traceback.print_exc()
            hint = "" if args.verbose else " (-v shows the traceback)"
            print(
                f"flashdec: error: the run failed: {type(exc).__name__}: {one_line(exc)}{hint}",
                file=sys.stderr,
            )
            return 1


if __name__ == "__main__":
    sys.exit(main())
