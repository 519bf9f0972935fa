"""Registration: the entry point, the version gate, and that flashdec never imports vLLM."""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import subprocess
import sys
import tomllib
import types
from enum import Enum
from pathlib import Path

import pytest

import flashdec.vllm_plugin as plugin

ROOT = Path(__file__).resolve().parents[2]
GROUP = "vllm.general_plugins"


def test_pyproject_declares_the_general_plugin_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][GROUP] == {"flashdec": "flashdec.vllm_plugin:register"}
    entry = importlib.metadata.EntryPoint("flashdec", "flashdec.vllm_plugin:register", GROUP)
    assert entry.load() is plugin.register


def test_installed_metadata_carries_the_entry_point():
    try:
        dist = importlib.metadata.distribution("flashdec")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flashdec is not installed (only imported from the source tree)")
    found = [e for e in dist.entry_points if e.group == GROUP]
    if not found:
        pytest.skip("the installed metadata predates the entry point: reinstall (pip install -e .)")
    assert [(e.name, e.value) for e in found] == [("flashdec", "flashdec.vllm_plugin:register")]


def test_the_registered_class_path_names_the_backend_class():
    module, name = plugin.BACKEND_CLASS_PATH.rsplit(".", 1)
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())  # parsed: importing it needs vLLM
    assert name in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def test_importing_flashdec_or_the_plugin_never_imports_vllm():
    code = (
        "import sys, flashdec, flashdec.vllm_plugin, flashdec.vllm_plugin.layout, "
        "flashdec.vllm_plugin.workspace, flashdec.vllm_plugin.stats\n"
        "flashdec.decode, flashdec.LLM, flashdec.PagedKVCache\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_the_plugin_package_imports_neither_triton_nor_torch_kernels():
    code = (
        "import sys, flashdec.vllm_plugin\n"
        "assert 'triton' not in sys.modules and 'flashdec.kernels' not in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


class FakeBackendEnum(Enum):
    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    CUSTOM = None


def install_fake_vllm(monkeypatch, version, *, with_registry=True):
    """A ``vllm`` package of the given version whose registry records registrations."""
    calls = []
    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["vllm"].__version__ = version
    if with_registry:
        registry = types.ModuleType("vllm.v1.attention.backends.registry")
        registry.AttentionBackendEnum = FakeBackendEnum
        registry.register_backend = lambda backend, path=None: calls.append((backend, path))
        monkeypatch.setitem(sys.modules, registry.__name__, registry)
    return calls


def plugin_records(caplog):
    return [r for r in caplog.records if r.name == plugin.LOGGER_NAME]


@pytest.mark.parametrize("version", ["0.24.0", "0.24.0+cu130"])
def test_register_with_the_supported_version_registers_the_custom_backend(
    monkeypatch, caplog, version
):
    calls = install_fake_vllm(monkeypatch, version)
    with caplog.at_level(logging.INFO, logger=plugin.LOGGER_NAME):
        assert plugin.register() is True
    assert calls == [(FakeBackendEnum.CUSTOM, "flashdec.vllm_plugin.backend.FlashDecBackend")]
    (record,) = plugin_records(caplog)
    assert "CUSTOM" in record.getMessage()


@pytest.mark.parametrize("version", ["0.23.1", "0.24.1", "0.25.0", None])
def test_register_with_another_version_logs_one_line_and_registers_nothing(
    monkeypatch, caplog, version
):
    calls = install_fake_vllm(monkeypatch, version)
    with caplog.at_level(logging.INFO, logger=plugin.LOGGER_NAME):
        assert plugin.register() is False
    assert calls == []
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "0.24.0" in message and str(version) in message and "\n" not in message


def test_register_without_vllm_logs_one_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with caplog.at_level(logging.INFO, logger=plugin.LOGGER_NAME):
        assert plugin.register() is False
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING and "cannot import vllm" in record.getMessage()


def test_register_survives_a_registry_that_cannot_be_imported(monkeypatch, caplog):
    install_fake_vllm(monkeypatch, "0.24.0", with_registry=False)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", None)
    with caplog.at_level(logging.INFO, logger=plugin.LOGGER_NAME):
        assert plugin.register() is False
    assert len(plugin_records(caplog)) == 1


def test_register_survives_a_failing_registration(monkeypatch, caplog):
    install_fake_vllm(monkeypatch, "0.24.0")

    def broken(backend, path=None):
        raise RuntimeError("registry is closed")

    monkeypatch.setattr(
        sys.modules["vllm.v1.attention.backends.registry"], "register_backend", broken
    )
    with caplog.at_level(logging.INFO, logger=plugin.LOGGER_NAME):
        assert plugin.register() is False
    (record,) = plugin_records(caplog)
    assert "registry is closed" in record.getMessage()


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.24.0", True), ("0.24.0+cu130", True), ("0.24.00", False), ("0.24", False), (24, False)],
)
def test_version_gate(version, ok):
    assert plugin.is_supported_version(version) is ok


def test_real_vllm_registration():
    vllm = pytest.importorskip("vllm")
    if not plugin.is_supported_version(vllm.__version__):
        pytest.skip(f"vLLM {vllm.__version__} is not the supported version")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert plugin.register() is True
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_CLASS_PATH
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend.get_name() == "CUSTOM"
