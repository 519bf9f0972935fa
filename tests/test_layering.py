"""The import contract: which layer of the package may import which (parsed, not executed).

- ``reference`` and ``kernels`` import nothing of the package but the shared checks;
- ``cache`` imports neither ``kernels`` nor ``scheduler``; ``scheduler`` neither ``cache`` nor
  ``kernels`` (both only the shared checks and block accounting besides themselves);
- ``speculative`` (drafts, accept rules) imports only the shared checks;
- ``engine`` joins them; ``workloads``, ``models``, ``llm``, ``server`` and ``cli`` (with
  ``cli_parser``, its argparse grammar) sit above it.
A failing contract is a failing build.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashdec"

# layer -> layers it may import (itself always allowed)
ALLOWED = {
    "_checks": set(),
    "_blocks": {"_checks"},  # block accounting shared by the cache and the scheduler
    "runtime": set(),
    "reference": {"_checks"},
    "kernels": {"_checks"},
    "cache": {"_checks", "_blocks"},
    "scheduler": {"_checks", "_blocks"},
    "speculative": {"_checks"},  # drafts and accept rules: no engine, no model
    "kv_scales": {"_checks"},  # FP8 KV scales: calibrated, loaded, saved (no cache, no engine)
    "kv_pool": {"_checks", "_blocks", "runtime", "cache", "kv_scales"},  # how LLM sizes a cache
    "engine": {
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
    },
    "models": {
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
        "engine",
    },
    "llm": {
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
        "engine",
        "models",
        "kv_pool",
        "kv_scales",
    },
    "workloads": {
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
        "engine",
        "models",
        "kv_pool",
        "kv_scales",
        "llm",
    },
    "cli": {
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
        "engine",
        "models",
        "kv_pool",
        "kv_scales",
        "llm",
        "workloads",
        "server",
        "cli_parser",
    },
    "cli_parser": {"workloads", "server"},  # the cli's argparse grammar: the configs' fields
    "server": {  # flashdec serve: the LLM behind HTTP, with generate's model knobs
        "_checks",
        "_blocks",
        "runtime",
        "reference",
        "kernels",
        "cache",
        "scheduler",
        "speculative",
        "engine",
        "models",
        "kv_pool",
        "kv_scales",
        "llm",
        "workloads",
    },
    "__main__": {"cli"},
    "vllm_plugin": {"_checks", "kernels"},  # optional: imported by vLLM, never by the package
    "__init__": set(),  # resolves public names lazily, by string
}


def layer_of(module: str) -> str | None:
    """``flashdec.kernels.append`` -> ``kernels``; None for modules outside the package."""
    parts = module.split(".")
    if parts[0] != "flashdec":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    package = ".".join(("flashdec", *path.relative_to(PACKAGE).parent.parts))
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> set[str]:
    """Every module an import statement of ``source`` names (relative ones resolved), at any
    depth: imports inside functions count too."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
                if node.module == "flashdec":  # from flashdec import kernels (not __version__)
                    found.update(
                        f"flashdec.{a.name}"
                        for a in node.names
                        if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").is_file()
                    )
    return found


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_module_respects_the_import_contract(path):
    rel = path.relative_to(PACKAGE)
    own = rel.parts[0].removesuffix(".py")
    assert own in ALLOWED, f"{rel}: unknown layer {own!r}; add it to the contract"
    for module in imports_of(path):
        layer = layer_of(module)
        if layer is None or layer == own:
            continue
        if layer == "__init__" and module == "flashdec":
            # `import flashdec` / `from flashdec import __version__`: only the root and the cli
            assert own in (
                "cli",
                "cli_parser",
                "runtime",
                "__main__",
                "workloads",
                "llm",
                "server",
            ), f"{rel} imports the package root"
            continue
        assert layer in ALLOWED[own], f"{rel} ({own}) must not import {module} ({layer})"


def test_the_cache_never_imports_the_engine():
    """The cache is below the engine: no shim, no lazy import of it (issue 20)."""
    for path in (PACKAGE / "cache").rglob("*.py"):
        layers = {layer_of(m) for m in imports_of(path)}
        assert "engine" not in layers, f"{path.relative_to(PACKAGE)} imports the engine"


def module_name(path: Path) -> str:
    """``flashdec/engine/loop.py`` -> ``flashdec.engine.loop``; a package's ``__init__.py`` is
    the package."""
    rel = path.relative_to(PACKAGE)
    parts = rel.parent.parts if path.name == "__init__.py" else (*rel.parent.parts, path.stem)
    return ".".join(("flashdec", *parts))


def import_cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle of an import graph (its strongly connected components of two or more)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for other in modules[node]:
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in modules:
        if node not in order:
            visit(node)
    return cycles


PACKAGES = sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


@pytest.mark.parametrize("package", PACKAGES, ids=[p.name for p in PACKAGES])
def test_the_modules_of_a_package_import_one_another_without_a_cycle(package):
    """A package is split by concept (the engine: engine, step, states, submissions, loop,
    runner, ...; the cache: its facade, views and parts): a module it was split from is never
    imported back, e.g. the submission queue reaches the engine only through the instance it is
    given, and the cache's views name the facade's shape through ``cache/core.py``'s Protocol
    (issue 20's reshape), its storage parts each other's through ``cache/part_types.py``.
    Imports under TYPE_CHECKING count too."""
    names = {module_name(p): p for p in package.rglob("*.py")}

    def resolve(module: str) -> str | None:  # the package's module (or package) an import names
        while module and module not in names:
            module = module.rpartition(".")[0]
        return module or None

    graph = {
        name: {r for m in imports_of(path) if (r := resolve(m)) is not None and r != name}
        for name, path in names.items()
    }
    assert import_cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_parser_sees_every_import_form():
    source = (
        "import flashdec.scheduler.spec\n"
        "from flashdec.kernels import decode\n"
        "from . import allocator\n"
        "from ..engine import loop\n"
        "def f():\n    from flashdec import runtime\n"
    )
    found = imports_in(source, "flashdec.cache")
    assert {
        "flashdec.scheduler.spec",
        "flashdec.kernels",
        "flashdec.cache",
        "flashdec.engine",
        "flashdec.runtime",
    } <= found
    assert {layer_of(m) for m in found} >= {"scheduler", "kernels", "engine", "runtime"}


def test_no_module_is_shadowed_by_a_function():
    """``flashdec.kernels.decode`` was a function hiding the module of the same name."""
    import importlib

    for path in FILES:
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            continue
        package = importlib.import_module(".".join(("flashdec", *rel.parent.parts)))
        name = path.stem
        value = getattr(package, name, None)
        if value is not None:
            assert getattr(value, "__file__", None) == str(path), (
                f"flashdec.{'.'.join((*rel.parent.parts, name))} is not the module {rel}"
            )
