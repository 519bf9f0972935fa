"""The flashdec command line: --help, env, demo, workload knobs."""

import json
import subprocess
import sys

import pytest

from flashdec.cli import build_parser, main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("env", "demo", "workload"):
        assert command in out


def test_workload_help_exposes_config_knobs(capsys):
    with pytest.raises(SystemExit):
        main(["workload", "integrated", "--help"])
    out = capsys.readouterr().out
    for knob in ("--num-layers", "--prefix-hit-rate", "--failure-rate", "--decode-backend"):
        assert knob in out


def test_env_reports_triton_mode(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "Triton kernels" in out and "torch" in out


def test_synthetic_workload_via_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    code = main(["workload", "synthetic", "--num-requests", "4", "--json", str(path)])
    assert code == 0
    assert json.loads(path.read_text())["finished"] == 4
    assert "completion rate" in capsys.readouterr().out


def test_scheduler_workload_via_cli(capsys):
    assert main(["workload", "scheduler", "--trace", "boundary"]) == 0
    out = capsys.readouterr().out
    assert "lifetime" in out and "greedy" in out


def test_bad_knob_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["workload", "synthetic", "--num-requests", "many"])
    assert exc.value.code == 2


def test_demo_runs_as_a_module():
    proc = subprocess.run(
        [sys.executable, "-m", "flashdec", "demo"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "completion rate" in proc.stdout and "100.0%" in proc.stdout
