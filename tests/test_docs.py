"""The docs say what the code does: README.md, docs/ and the examples' READMEs, checked
against the code mechanically.

* every ```python block runs as written (a copy-paste user's first try) — pytest-style
  blocks (``def test_…``) under pytest — unless the line before it marks it
  ``<!-- docs-test: fragment (why) -->``; a fragment must still parse, and what it imports
  from rehydrate must exist;
* every ``rehydrate …`` command line shown parses with the real CLI;
* every DaemonSet recipe (a shell block patching a node with ``rehydrate check --labels``)
  runs under ``sh`` with a stand-in ``kubectl`` and labels the node's machine series;
* every ``rehydrate.x.y`` name the docs use exists and is public (in its module's
  ``__all__``), or is a name the code gives a hook, span or metric; ``keys.x(…)``-style
  calls of a manager module name a function it has;
* every public name is in the rendered API reference (mkdocstrings shows only what has a
  docstring, and only the listed members of a private module);
* every ``REHYDRATE_*`` variable the docs name is one the code declares (or one the test
  suite reads), and the configuration table shows each declared default and meaning.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from rehydrate import _config
from rehydrate._cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "examples").rglob("README.md"))]
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
FRAGMENT = re.compile(r"^[ \t]*<!-- docs-test: fragment \((.+)\) -->[ \t]*$")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    code: str
    fragment: str | None  # why it does not run on its own

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        lines = text.split("\n")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            indent = len(m.group(1))
            code = "\n".join(raw[indent:] for raw in m.group(3).split("\n"))
            marker = FRAGMENT.match(lines[line - 2]) if line >= 2 else None
            out.append(Block(_rel(page), line, m.group(2), code, marker and marker.group(1)))
    return out


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def test_the_block_finder_sees_the_pages() -> None:
    assert len(PYTHON) > 25
    assert {b.page for b in PYTHON} >= {"README.md", "docs/concepts.md", "docs/testing.md"}


def test_every_fragment_marker_marks_a_python_block() -> None:
    marked = {(b.page, b.line - 1) for b in PYTHON if b.fragment}
    stray = [f"{_rel(p)}:{n}" for p in PAGES
             for n, line in enumerate(p.read_text().split("\n"), 1)
             if FRAGMENT.match(line) and (_rel(p), n) not in marked]
    assert stray == [], "a docs-test marker not directly above a ```python block"


def _clean_env() -> dict[str, str]:
    """The test process's environment without rehydrate's settings and Lambda's (a block
    runs as in a fresh shell)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("REHYDRATE_", "AWS_LAMBDA_", "GVISOR_", "CRTOOLS_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in PYTHON if not b.fragment], ids=str)
def test_every_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if re.search(r"^def test_", block.code, re.M):
        (tmp_path / "test_block.py").write_text(block.code)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-W", "ignore::DeprecationWarning", "test_block.py"]
    else:
        (tmp_path / "block.py").write_text(block.code)
        argv = [sys.executable, "block.py"]
    proc = subprocess.run(argv, cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=240, check=False)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
    assert proc.returncode == 0, (
        f"{block}: the ```python block fails when run as written (mark it "
        f"`<!-- docs-test: fragment (why) -->` if it is not meant to run):\n{tail}")


def _rehydrate_imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rehydrate":
            found += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "rehydrate"]
    return found


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_every_python_block_parses_and_imports_what_exists(block: Block) -> None:
    """Fragments too: the syntax, and every name imported from rehydrate."""
    tree = compile(block.code, str(block), "exec",
                   flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for module, name in _rehydrate_imports(tree):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            importlib.import_module(f"{module}.{name}")  # a submodule, or ImportError


# -- command lines ---------------------------------------------------------------------------

# Placeholders of usage lines, by the option (or position) they stand for.
_SAMPLES = {"PID": "1", "S": "5", "UID": "1000", "PATH": "/run/app/control.sock",
            "FILE": "/run/app/environ", "MANIFEST": "/snapshot-meta/manifest.json"}
_PREFIX = re.compile(r"^(?:\$ |.*?\bexec\b.*?\s(?:--\s+)?)?(?:[/.]\S*/)?"
                     r"(rehydrate-notify|rehydrate|python -m rehydrate)\s+(.*)$")
_COMMANDS = ("doctor", "status", "notify", "trigger", "check")


def _argv(usage: str) -> list[str] | None:
    """A usage line's first form as an argv: ``[x]`` taken as ``x``, ``a|b`` as ``a``,
    placeholders by sample values; ``None`` when it is not a command line."""
    usage = usage.split(" # ", maxsplit=1)[0].split("  ", maxsplit=1)[0].strip()
    usage = re.sub(r"\[([^\[\]]*)\]", r"\1", usage)
    usage = re.sub(r"(\S+?)\|\S+", r"\1", usage)
    usage = usage.replace("…", " ").replace("...", " ")
    try:
        words = shlex.split(usage)
    except ValueError:
        return None
    return [_SAMPLES.get(w, w) for w in words]


def _command(text: str) -> list[str] | None:
    """The argv of a shown ``rehydrate …`` / ``rehydrate-notify …`` command, else ``None``."""
    m = _PREFIX.match(text.strip())
    if m is None:
        return None
    rest = m.group(2)
    if m.group(1) == "rehydrate-notify":
        rest = f"notify {rest}"
    if rest.split(" ")[0] not in _COMMANDS:
        return None
    return _argv(rest)


def _command_lines() -> list[tuple[str, list[str]]]:
    found = []
    for b in BLOCKS:
        if b.lang in ("", "sh", "bash", "console", "shell"):
            for n, raw in enumerate(b.code.split("\n"), b.line + 1):
                argv = _command(raw)
                if argv is not None:
                    found.append((f"{b.page}:{n}", argv))
    for page in PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for span in re.findall(r"`([^`]+)`", line):
                # prose shorthand (`rehydrate notify/status`, `check --labels/--affinity`,
                # `notify <mode>`) is not a command line
                if re.search(r"(?<![\w./-])-{0,2}[a-z]+(?:-[a-z]+)*/-{0,2}[a-z]|<", span):
                    continue
                argv = _command(span)
                if argv is not None:
                    found.append((f"{_rel(page)}:{n}", argv))
    return found


COMMAND_LINES = _command_lines()


def test_the_command_finder_sees_the_usage_lines() -> None:
    shown = {" ".join(argv) for _, argv in COMMAND_LINES}
    assert {"doctor --json", "notify save", "check /snapshot-meta/manifest.json --node"} <= shown


@pytest.mark.parametrize(("where", "argv"), COMMAND_LINES,
                         ids=[f"{w} {' '.join(a)}" for w, a in COMMAND_LINES])
def test_every_command_line_shown_parses(where: str, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `rehydrate {' '.join(argv)}` is refused by the CLI: "
                    f"{err.getvalue().strip().splitlines()[-1:]}")


# The DaemonSet recipes: shell blocks that patch a node with ``rehydrate check --labels``.
NODE_RECIPES = [b for b in BLOCKS if b.lang in ("sh", "bash", "shell")
                and "kubectl patch node" in b.code and "rehydrate check --labels" in b.code]


def test_the_recipe_finder_sees_the_daemonset_recipes() -> None:
    assert {b.page for b in NODE_RECIPES} >= {"docs/platforms/gke.md",
                                              "docs/snapshot-lifecycle.md"}


_KUBECTL_GETS = {
    "the label": 'echo e2-standard-4',
    # a role without `get` on nodes: `export VAR="$(…)"` reports export's status, so
    # `sh -e` went on and patched the node without its machine series
    "refused": 'echo "Error from server (Forbidden): nodes \\"$3\\" is forbidden" >&2; exit 1',
    "no label": 'echo',  # a node without node.kubernetes.io/instance-type
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("get", _KUBECTL_GETS)
@pytest.mark.parametrize("block", NODE_RECIPES, ids=str)
def test_every_daemonset_recipe_labels_the_node_s_machine_series(block: Block, get: str,
                                                                 tmp_path: Path) -> None:
    """gke.md set ``REHYDRATE_MACHINE_TYPE=$(kubectl get node …)`` without ``export``:
    ``rehydrate check --labels`` never saw it, no node got a machine-series label, and the
    restored Pods' ``--affinity`` (their manifest records a series) matched no node. The
    recipe runs under ``sh`` with a stand-in ``kubectl`` whose node is an e2-standard-4.
    When the ``get`` is refused or gives no label the recipe stops without patching."""
    answer = _KUBECTL_GETS[get]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "kubectl": ('#!/bin/sh\n'
                    'case "$1 $2" in\n'
                    f'  "get node") {answer} ;;\n'
                    '  "patch node") shift $(($# - 1)); printf "PATCH %s\\n" "$1" ;;\n'
                    '  *) echo "kubectl stand-in: unexpected $*" >&2; exit 2 ;;\n'
                    'esac\n'),
        "rehydrate": f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m rehydrate "$@"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _clean_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", NODE_NAME="n1",
               # nothing listens there: no wait on (or answer from) a real metadata server
               GCE_METADATA_HOST="127.0.0.1:9")
    proc = subprocess.run(["sh", "-eu", "-c", block.code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    if get != "the label":
        assert proc.returncode != 0 and "PATCH" not in proc.stdout, (
            f"{block}: with the `get` {get}, the recipe went on (exit {proc.returncode}):\n"
            f"{proc.stdout}")
        return
    assert proc.returncode == 0, f"{block}: {proc.stderr.strip()[-600:]}"
    assert "PATCH" in proc.stdout
    assert 'rehydrate.io/machine-series: "e2"' in proc.stdout, (
        f"{block}: the recipe's patch has no machine series:\n{proc.stdout}")


# -- names -----------------------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w./-])rehydrate(?:\.[A-Za-z_]\w*)+")
# Deprecated names the docs mention as such.
_DEPRECATED = {"rehydrate.detect.CATALOGUE"}
# ``keys.ephemeral(…)``: calls of a manager module by its short name, as the docs import it.
_SHORT = ("keys", "tls", "files", "connections", "routes", "entropy", "telemetry",
          "fingerprint")
_SHORT_CALL = re.compile(rf"(?<![\w.])({'|'.join(_SHORT)})\.([A-Za-z_]\w*)\(")


def _sources_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "rehydrate").rglob("*.py"))


def _resolve(dotted: str) -> tuple[types.ModuleType | None, object]:
    """(the module holding the last part, the object); raises when it does not exist."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        holder = None
        for part in parts[i:]:
            holder = obj
            obj = getattr(obj, part)
        return (holder if isinstance(holder, types.ModuleType) else None), obj
    raise ImportError(dotted)


def _names_in_docs() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for name in _DOTTED.findall(line):
                found.setdefault(name, []).append(f"{_rel(page)}:{n}")
    return found


def test_every_rehydrate_name_in_the_docs_exists_and_is_public() -> None:
    sources = _sources_text()
    missing, private = {}, {}
    for name, where in sorted(_names_in_docs().items()):
        if name in _DEPRECATED or name.endswith(".__all__"):
            continue
        try:
            holder, _ = _resolve(name)
        except (ImportError, AttributeError):
            # not an object: it must be a name the code gives (a hook, span, metric, label),
            # whole: not the start of a longer name
            if not re.search(re.escape(name) + r"(?![\w.])", sources):
                missing[name] = where[:3]
            continue
        last = name.rsplit(".", 1)[-1]
        if holder is not None and last not in getattr(holder, "__all__", [last]):
            private[name] = where[:3]
    assert missing == {}, f"named in the docs, nowhere in the code: {missing}"
    assert private == {}, f"documented for users, but not in the module's __all__: {private}"


def test_manager_calls_in_the_docs_name_functions_that_exist() -> None:
    wrong = {}
    for page in PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for span in re.findall(r"`([^`]+)`", line):
                for module, attr in _SHORT_CALL.findall(span):
                    if not hasattr(importlib.import_module(f"rehydrate.{module}"), attr):
                        wrong.setdefault(f"{module}.{attr}()", []).append(f"{_rel(page)}:{n}")
    for b in PYTHON:
        for module, attr in _SHORT_CALL.findall(b.code):
            if not hasattr(importlib.import_module(f"rehydrate.{module}"), attr):
                wrong.setdefault(f"{module}.{attr}()", []).append(str(b))
    assert wrong == {}, f"rehydrate has no such function: {wrong}"


def test_every_public_name_is_in_the_api_reference() -> None:
    """mkdocstrings renders an object only when it (or a member) has a docstring, and from a
    private module only the listed members: a public name without either is missing from
    the reference, however often the prose uses it."""
    import griffe
    from test_public_api import PACKAGE_API, PUBLIC_MODULES, _reference_blocks

    package = griffe.load("rehydrate", search_paths=[str(ROOT)], resolve_aliases=True)
    undocumented = []
    for module_name in PUBLIC_MODULES:
        module = package[module_name.split(".", 1)[1]]
        for name in importlib.import_module(module_name).__all__:
            if not module[name].has_docstrings:
                undocumented.append(f"{module_name}.{name}")
    undocumented += [f"rehydrate.{name}" for name in PACKAGE_API
                     if not name.startswith("_") and not package[name].has_docstrings]
    assert undocumented == [], f"no docstring, so not in the API reference: {undocumented}"

    listed = {m for members in _reference_blocks().values() for m in members or ()}
    prose = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    unlisted = [n for n in PACKAGE_API if n not in listed
                and not (n.startswith("_") and f"rehydrate.{n}" in prose)]
    assert unlisted == [], ("rehydrate.<name>s missing from docs/reference/rehydrate.md "
                            f"(members lists): {unlisted}")


# -- configuration ---------------------------------------------------------------------------

_TEST_SUITE_VARIABLES = ("REHYDRATE_REQUIRE_GVISOR", "REHYDRATE_REQUIRE_ROOT_TESTS",
                         "REHYDRATE_RUNSC")


def test_every_variable_the_docs_name_is_declared_or_read_by_the_tests() -> None:
    declared = {v.name for v in _config.VARIABLES}
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py")
                      if p.name != "test_docs.py")
    unknown = {}
    for page in PAGES:
        for name in set(re.findall(r"\bREHYDRATE_[A-Z0-9_]*[A-Z0-9]\b", page.read_text())):
            if name not in declared and not (name in _TEST_SUITE_VARIABLES and name in tests):
                unknown.setdefault(name, []).append(_rel(page))
    assert unknown == {}, f"documented, but read by nothing: {unknown}"


def test_the_configuration_table_shows_the_declared_defaults_and_meanings() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m.group(1): [c.strip() for c in m.group(0).strip().strip("|").split(" | ")]
            for m in re.finditer(r"^\| `(REHYDRATE_[A-Z0-9_]+)` \|.*$", page, re.M)}
    wrong = {}
    for var in _config.VARIABLES:
        cells = rows[var.name]
        if cells[2] != f"`{_config._show(var.default)}`" or cells[3] != var.meaning:
            wrong[var.name] = (cells[2:], _config._show(var.default), var.meaning)
    assert wrong == {}


def test_the_argv_reader_takes_the_usage_forms() -> None:
    assert _argv("check MANIFEST [--node] [--env-from FILE] [--json]") == [
        "check", "/snapshot-meta/manifest.json", "--node", "--env-from", "/run/app/environ",
        "--json"]
    assert _argv("notify [save|resume|restore] [--socket PATH]   # a comment") == [
        "notify", "save", "--socket", "/run/app/control.sock"]
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_the_readme_layout_names_the_pytest_plugin_the_entry_point_registers() -> None:
    """The layout called ``testing.py`` the pytest plugin: that module imports no pytest;
    the plugin is the module the ``pytest11`` entry point names."""
    found = re.search(r'^\[project\.entry-points\.pytest11\]\nrehydrate = "([\w.]+)"$',
                      (ROOT / "pyproject.toml").read_text(), re.M)  # no tomllib on 3.10
    assert found is not None
    plugin = found[1]
    described = [line.split()[0] for line in (ROOT / "README.md").read_text().splitlines()
                 if "pytest plugin" in line and line.startswith("  ")]
    assert described == [plugin.rpartition(".")[2] + ".py"]


_STATUS_FIELD = re.compile(r"""status\(\)\[["']([^"']+)["']\]""")


def test_status_fields_the_docs_subscript_exist_and_subscripting_works() -> None:
    """The pages read ``status()["detector_errors"]`` and the like: ``Status`` must be
    subscriptable (it was a TypeError), and every field named must be one rehydrate
    publishes (an engine field — core, ``detector_errors``, ``hung_hooks`` — or an
    ``add_status`` key)."""
    from rehydrate import Lifecycle, Registry
    from rehydrate._lifecycle import _ENGINE_STATUS
    from rehydrate.env import EnvRefresher

    named = {key: f"{_rel(page)}:{n}" for page in PAGES
             for n, line in enumerate(page.read_text().split("\n"), 1)
             for key in _STATUS_FIELD.findall(line)}
    assert "detector_errors" in named and "fingerprint" in named
    published = set(re.findall(r"""add_status\(\s*["']([^"']+)["']""", _sources_text()))
    known = _ENGINE_STATUS | published
    assert {k: w for k, w in named.items() if k not in known} == {}
    engine = Lifecycle(Registry(), env=EnvRefresher(path=None))
    try:
        status = engine.status()
        assert status["state"] == status.state == "running"
        assert status["files"] == status.extra["files"]
        with pytest.raises(KeyError):
            status["detector_errors"]  # published only while a detector failed to start
    finally:
        engine.close()


def test_the_save_budget_the_docs_advise_is_the_one_the_process_announces() -> None:
    """docs/inference.md advised a platform limit of "drain plus sleep" (150 s); a failed
    pass also runs the resume hooks before ``notify save`` answers, and the process
    announces both (docs/control-socket.md): the number shown is that budget, and the
    advised 6 minutes cover it plus ``notify``'s margin."""
    from rehydrate import Lifecycle, Registry
    from rehydrate._notify import BUDGET_MARGIN
    from rehydrate._runner import worst_case
    from rehydrate.adapters.asgi import ReadinessGate
    from rehydrate.adapters.vllm import VLLMAdapter

    async def app(scope: object, receive: object, send: object) -> None: ...

    engine = Lifecycle(Registry())
    try:
        ReadinessGate(app, engine=engine)  # drain_timeout 30
        VLLMAdapter("http://127.0.0.1:1").install(engine)  # deadline 120
        # what the control socket's budget line says (detect/control.py, _budget_notice)
        budget = sum(worst_case([*engine.registry.hooks(e), *engine.builtins.hooks(e)])
                     for e in ("snapshot", "restore"))
    finally:
        engine.close()
    inference = " ".join((ROOT / "docs" / "inference.md").read_text().split())
    assert (f"{budget:g} s for the gate, a vLLM adapter and the default extensions"
            in inference)
    assert "(here 6 minutes:" in inference and budget + BUDGET_MARGIN <= 360
    runsc = " ".join((ROOT / "docs" / "platforms" / "runsc.md").read_text().split())
    assert f"that is {budget:g} s (`notify save` waits {budget + BUDGET_MARGIN:g} s)" in runsc
    assert "save-restore-exec-timeout=6m" in runsc


_CITED_TEST = re.compile(r"\b(test_\w+)(\.py\b|\*)?")
# Named by an entry that says the test was removed: citing it is the point.
_REMOVED_TESTS = {"test_an_ipv6_route_with_scope_0_reads_back_equal"}


def test_every_test_the_changelog_cites_exists() -> None:
    """An entry names the tests that pin it; a test later renamed or merged into another
    left entries citing tests that did not exist (and describing behaviour since
    superseded). ``test_x.py`` is a file under tests/, ``test_x_*`` a prefix, anything
    else a test function or class defined there, or a test module."""
    modules = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    defined = {node.name for p in (ROOT / "tests").rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    cited: dict[str, str] = {}
    missing: dict[str, str] = {}
    for n, line in enumerate((ROOT / "CHANGELOG.md").read_text().splitlines(), 1):
        for name, form in _CITED_TEST.findall(line):
            cited.setdefault(name, f"CHANGELOG.md:{n}")
            if form == ".py":
                found = name in modules
            elif form == "*":
                found = any(d.startswith(name) for d in defined)
            else:
                found = name in defined or name in modules or name in _REMOVED_TESTS
            if not found:
                missing[name + form] = f"CHANGELOG.md:{n}"
    assert len(cited) > 100  # the finder sees the citations
    assert missing == {}, f"cited, but no such test: {missing}"
    assert cited.keys() >= _REMOVED_TESTS and not _REMOVED_TESTS & defined
