"""The import structure of ``rehydrate/``: one direction, no cycles (docs/architecture.md).

Every import statement counts — module level and inside functions — except those under
``if TYPE_CHECKING:`` (never executed). The graph is built from the source with ``ast``, so
a new cycle fails here before it can fail at import time in some unusual order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rehydrate"

# Extensions: the engine must not import any of them (it loads them by dotted name). The
# detector interface and catalogue (``rehydrate.detect`` itself) is not one: it names its
# detectors by dotted name too.
EXTENSION_MODULES = ("rehydrate.detect.", "rehydrate.adapters", "rehydrate.entropy",
                     "rehydrate.keys", "rehydrate.tls", "rehydrate.secrets",
                     "rehydrate.routes", "rehydrate.connections", "rehydrate.telemetry",
                     "rehydrate.fingerprint", "rehydrate.files", "rehydrate._trigger")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from … import`` in ``package`` imports from (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                mod = _from_module(node, package)
                # `from pkg import submodule` imports the submodule (and pkg, its parent,
                # implicitly like every parent: not counted); any other name comes from pkg.
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                           for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_graph_sees_function_level_imports_and_skips_type_checking():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .a import X\n"
        "def f():\n    from .b import Y\n")
    names = [n.module for n in _runtime_imports(tree) if isinstance(n, ast.ImportFrom)]
    assert names == ["typing", "b"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert cycles == [], "run-time import cycles inside rehydrate/: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_engine_imports_no_extension():
    graph = _graph()
    bad = sorted(t for t in graph["rehydrate._lifecycle"]
                 if any(t == m or t.startswith(m.rstrip(".") + ".") for m in EXTENSION_MODULES))
    assert bad == [], f"rehydrate._lifecycle imports extension modules: {bad}"


def test_nothing_below_the_api_imports_it():
    importers = sorted(name for name, targets in _graph().items()
                       if "rehydrate._api" in targets
                       and name not in ("rehydrate", "rehydrate.api"))
    assert importers == []


def test_detectors_are_named_after_their_catalogue_keys():
    from rehydrate import detect

    assert len(set(detect.catalogue_keys())) == len(detect.DETECTORS)
    for target in detect.DETECTORS:
        key = detect.key_of(target)
        module, _, cls = target.partition(":")
        assert module == "rehydrate.detect." + key.replace("-", "_"), key
        camel = "".join(part.capitalize() for part in key.split("-"))
        assert cls.lower() == (camel + "Detector").lower(), key
        assert detect.load(key).key == key


# The layers of docs/architecture.md, lowest first; a module imports from its own layer or
# below (function-level imports included). A module not named here takes its family's
# layer: ``rehydrate.detect.*`` detectors, ``rehydrate.adapters.*`` adapters, any other
# public module (and its private submodules, ``routes._model``) managers, any other
# private top-level module (``_config``, ``_files`` …) the bottom.
LAYERS: dict[str, tuple[str, ...]] = {
    "bottom": ("rehydrate.env", "rehydrate.detect"),  # + private helpers (default)
    "engine": ("rehydrate._lifecycle", "rehydrate._runner"),
    "contract": ("rehydrate.extensions",),
    "detectors": ("rehydrate._trigger",),  # + rehydrate.detect.* (default)
    "managers": (),  # entropy, keys, tls, secrets, routes, connections, telemetry, … (default)
    "facade": ("rehydrate", "rehydrate._api"),
    "adapters": (),  # rehydrate.adapters.* (default)
    "entry": ("rehydrate.__main__", "rehydrate._cli", "rehydrate._control_client",
              "rehydrate.testing", "rehydrate._pytest_plugin"),
    # The deprecated old paths of modules made private: each re-exports its module.
    "moved": tuple(f"rehydrate.{m}" for m in ("api", "cli", "context", "control_client",
                                                "hooks", "lifecycle", "nodefit", "trigger")),
}


def _layer(module: str) -> int:
    names = list(LAYERS)
    for i, members in enumerate(LAYERS.values()):
        if module in members:
            return i
    parts = module.split(".")
    if parts[1:2] == ["detect"]:
        return names.index("detectors")
    if parts[1:2] == ["adapters"]:
        return names.index("adapters")
    return names.index("bottom" if parts[1].startswith("_") else "managers")


def test_imports_point_to_the_same_layer_or_below():
    names = list(LAYERS)
    upward = sorted(f"{m} ({names[_layer(m)]}) imports {t} ({names[_layer(t)]})"
                    for m, targets in _graph().items() for t in targets
                    if _layer(t) > _layer(m))
    assert upward == [], "imports against the layers of docs/architecture.md:\n" + "\n".join(
        upward)


def test_the_layer_rules_see_an_upward_import():
    assert _layer("rehydrate.keys") > _layer("rehydrate.detect.gvisor") > _layer(
        "rehydrate.extensions") > _layer("rehydrate._lifecycle") > _layer("rehydrate._config")
    assert _layer("rehydrate.routes._model") == _layer("rehydrate.routes")
    assert _layer("rehydrate.adapters._server") > _layer("rehydrate")


def _private_imports(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """What ``module`` imports of rehydrate that is not its public API: a module or name
    with a leading underscore below ``rehydrate`` (or a deprecated old path), other than
    the adapters' own helpers ``rehydrate.adapters._*``. Every import counts, those under
    ``if TYPE_CHECKING:`` too: a type an adapter names is part of what it depends on, and
    a private one may be renamed in any release."""
    from test_public_api import MOVED_PATHS

    moved = {f"rehydrate.{m}" for m in MOVED_PATHS}  # deprecated paths of private modules
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules
                       or a.name.startswith("_") else mod for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] != "rehydrate" or target.startswith("rehydrate.adapters._"):
                continue
            if target in moved or any(p.startswith("_") for p in parts[1:]):
                found.add((node.lineno, f"{module}:{node.lineno} imports {target}"))
    return [line for _, line in sorted(found)]


def test_adapters_import_only_the_public_api():
    """docs/architecture.md: an adapter imports only rehydrate's public API (``rehydrate``,
    ``rehydrate.extensions``, the documented submodules) and its own ``adapters._*``
    helpers — what a third-party adapter can do too."""
    modules = _modules()
    bad = [line for name, path in sorted(modules.items())
           if name == "rehydrate.adapters" or name.startswith("rehydrate.adapters.")
           for line in _private_imports(name, path, modules)]
    assert bad == [], "adapters import private rehydrate modules:\n" + "\n".join(bad)


def test_the_adapter_rule_sees_every_spelling_of_a_private_import(tmp_path: Path):
    modules = {"rehydrate._config": Path(), "rehydrate.adapters._server": Path(),
               "rehydrate.extensions": Path()}
    src = tmp_path / "x.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import rehydrate._config\n"
        "from .. import Phase, _config\n"
        "from rehydrate.extensions import _lock, shown\n"
        "from . import _server\n"
        "from ._server import within\n"
        "if TYPE_CHECKING:\n    from ..hooks import Hook\n"
        "def f():\n    from .._runner import inside_hook\n")
    assert _private_imports("rehydrate.adapters.x", src, modules) == [
        "rehydrate.adapters.x:2 imports rehydrate._config",
        "rehydrate.adapters.x:3 imports rehydrate._config",
        "rehydrate.adapters.x:4 imports rehydrate.extensions._lock",
        "rehydrate.adapters.x:8 imports rehydrate.hooks",
        "rehydrate.adapters.x:10 imports rehydrate._runner",
    ]
