"""The public surface, pinned: what ``import rehydrate`` offers and the documented modules.

Changing these lists is an API change: update CHANGELOG.md and the docs with it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rehydrate

PACKAGE_API = [
    "ControlError", "EnvChanges", "Hook", "HookFailed", "HookResult", "HookStillRunning",
    "HookTimeout", "Lifecycle", "Phase", "RedactedError", "Registry", "Report", "RestoreContext",
    "RestoreReport", "SnapshotReport", "Status", "UntrustedSocket", "__version__",
    "after_restore", "before_snapshot", "default_engine", "default_registry", "instance_id",
    "is_ready", "on_env_change", "request", "simulate_restore", "simulate_snapshot", "start",
    "status", "stop", "trigger_snapshot", "unregister", "wait_ready",
]

EXTENSIONS_API = [
    "BEFORE_USER_HOOKS", "DEFAULT_EXTENSIONS", "Engine", "Extension", "MAX_SECONDS", "Probe",
    "add_redactor", "check_seconds", "default_engine", "default_registry",
    "fresh_lock_after_fork", "in_hook", "load_extension", "loop_blocked", "redact",
    "resolve_engine", "running_before", "shown",
]

# Modules the docs tell users to import; each declares its public names in __all__.
DOCUMENTED_MODULES = [
    "rehydrate.extensions", "rehydrate.env", "rehydrate.entropy", "rehydrate.keys",
    "rehydrate.tls", "rehydrate.secrets", "rehydrate.connections", "rehydrate.routes",
    "rehydrate.telemetry", "rehydrate.fingerprint", "rehydrate.files", "rehydrate.detect",
    "rehydrate.testing",
]

# The documented modules' __all__, pinned like the package's.
SUBMODULE_API = {
    "rehydrate.env": [
        "EnvError", "EnvRefresher", "KEEP", "MAX_ENVIRON_BYTES", "MAX_ENVIRON_ENTRIES",
        "NEVER_FROM_FILE", "Policy", "check_overlay", "diff", "parse_environ", "read_environ"
    ],
    "rehydrate.entropy": [
        "EntropyManager", "instance_id", "manager", "on_instance_id_change", "register", "reseed",
        "unregister"
    ],
    "rehydrate.keys": [
        "ALGORITHMS", "Algorithm", "EphemeralKey", "KeyDroppedError", "KeyManager", "ephemeral",
        "generate_private_key", "generate_private_key_pem", "get", "manager"
    ],
    "rehydrate.tls": [
        "CertificateError", "FileCertificate", "HTTPIssuer", "IssuedCertificate", "Issuer",
        "ManagedCertificate", "Material", "Password", "SelfSignedCertificate", "TLSManager",
        "from_files", "issued", "manager", "self_signed", "validate"
    ],
    "rehydrate.secrets": [
        "Secret", "SecretError", "SecretSource", "SecretUnavailable", "SecretsManager",
        "manager", "utf8_into"
    ],
    "rehydrate.connections": [
        "Connection", "ConnectionManager", "ConnectionsNotReady", "DEFAULT_DEADLINE",
        "ManagedSocket", "TcpConnection", "connections", "established_tcp", "get", "grpc_channel",
        "httpx_async_client", "httpx_client", "manager", "redis_client", "register",
        "sqlalchemy_engine", "tcp_socket", "unregister"
    ],
    "rehydrate.routes": [
        "ApplyResult", "Capture", "NetworkError", "NetworkUnavailable", "Route", "RoutesManager",
        "apply", "capture", "iptables", "manager", "missing_prerequisites", "nftables",
        "read_routes", "read_table", "route"
    ],
    "rehydrate.telemetry": [
        "EVENT_SPAN_NAMES", "Telemetry", "instrument", "manager", "record_fingerprint_mismatch",
        "record_snapshot_miss", "refresh_on_restore", "resource_attributes", "resource_detector",
        "restorable_metric_exporter", "restorable_span_exporter"
    ],
    "rehydrate.fingerprint": [
        "FingerprintManager", "FingerprintMismatch", "ManifestError", "Mismatch", "NODE_FIELDS",
        "SCHEMA", "check", "compare", "configure", "engine_started", "fingerprint",
        "load_manifest", "manager", "most_likely_reason", "write_manifest"
    ],
    "rehydrate.files": [
        "FileGone", "FilesManager", "HELD_FSTYPES", "IDENTITY_FILE", "ManagedConnection",
        "ManagedFile", "ManagedMap", "MountInfo", "OpenFile", "ReopenFailed", "SnapshotRefused",
        "Volume", "audit", "doctor_report", "install", "manager", "mmap", "mounts", "open",
        "open_files", "sqlite", "volume"
    ],
    "rehydrate.detect": [
        "DETECTORS", "Detector", "DetectorInfo", "available", "catalogue_keys", "key_of", "load",
        "probe_of", "select"
    ],
    "rehydrate.testing": ["isolated_engine", "restored_environ"],
}

# Every module whose dotted path has no underscore-led part is public. A new module is
# either added here (and documented) or named with a leading underscore.
PUBLIC_MODULES = sorted(DOCUMENTED_MODULES + [
    "rehydrate.adapters", "rehydrate.adapters.agones", "rehydrate.adapters.asgi",
    "rehydrate.adapters.gameloop", "rehydrate.adapters.kserve", "rehydrate.adapters.sessions",
    "rehydrate.adapters.sglang", "rehydrate.adapters.udp", "rehydrate.adapters.vllm",
    "rehydrate.detect.clock_jump", "rehydrate.detect.control", "rehydrate.detect.file",
    "rehydrate.detect.gvisor", "rehydrate.detect.identity", "rehydrate.detect.signal",
    "rehydrate.detect.snapstart", "rehydrate.detect.vmclock",
])


def test_package_all_is_pinned():
    assert sorted(rehydrate.__all__) == sorted(PACKAGE_API)


def test_dir_lists_the_api_and_submodules_only():
    """``dir(rehydrate)`` showed ``TYPE_CHECKING`` and ``annotations`` (the future
    import) among the API."""
    import types

    public = [n for n in dir(rehydrate) if not n.startswith("_")]
    assert "TYPE_CHECKING" not in public and "annotations" not in public
    others = [n for n in public if n not in PACKAGE_API
              and not isinstance(getattr(rehydrate, n), types.ModuleType)]
    assert others == []
    assert set(PACKAGE_API) <= set(dir(rehydrate))


def test_extensions_all_is_pinned():
    from rehydrate import extensions

    assert sorted(extensions.__all__) == sorted(EXTENSIONS_API)


def test_public_classes_report_the_package_they_are_imported_from():
    for name in PACKAGE_API:
        obj = getattr(rehydrate, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "rehydrate", name


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_documented_modules_declare_resolvable_documented_names(module_name):
    module = importlib.import_module(module_name)
    names = module.__all__
    assert len(names) == len(set(names))
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"{module_name}.{name} has no docstring"


# The old public paths of modules that became private: they warn and re-export.
MOVED_PATHS = ["api", "cli", "context", "control_client", "hooks", "lifecycle", "nodefit",
               "trigger"]


def test_every_module_without_a_leading_underscore_is_a_pinned_public_module():
    found = sorted(m.name for m in pkgutil.walk_packages(rehydrate.__path__, "rehydrate.")
                   if not any(part.startswith("_") for part in m.name.split(".")[1:]))
    assert found == sorted(PUBLIC_MODULES + [f"rehydrate.{m}" for m in MOVED_PATHS])


@pytest.mark.parametrize("old", MOVED_PATHS)
def test_moved_paths_still_import_with_a_deprecation_warning(old: str) -> None:
    """Each old path warns once, naming its private module, and gives the same objects."""
    code = (f"import warnings; warnings.simplefilter('error')\n"
            f"try:\n    import rehydrate.{old}\n"
            f"except DeprecationWarning as w:\n    print(w)\n"
            f"warnings.simplefilter('ignore')\n"
            f"import rehydrate.{old} as o, rehydrate._{old} as n\n"
            f"assert o.__all__ and all(getattr(o, k) is getattr(n, k) for k in n.__all__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert f"rehydrate.{old} is deprecated: it is private now (rehydrate._{old})" in out.stdout
    _assert_the_advice_is_true(old, out.stdout.strip())


def _assert_the_advice_is_true(old: str, message: str) -> None:
    """Every old path said "import its public names from rehydrate": none of
    rehydrate.nodefit's 16 names is there, nor rehydrate.lifecycle.State."""
    module = importlib.import_module(f"rehydrate._{old}")
    names = module.__all__
    # the same object, not just the same name (rehydrate.trigger_snapshot is another one)
    private = [n for n in names if n not in rehydrate.__all__
               or getattr(rehydrate, n) is not getattr(module, n)]
    said = re.search(r"; import (.+?) from rehydrate \(`from rehydrate import (\w+)`\)",
                     message)
    if len(private) == len(names):
        assert said is None, message
    else:
        assert said is not None, message
        listed = said.group(1)
        if listed == "its names":
            assert private == [], message
        else:
            shown = re.sub(r" and \d+ more$", "", listed).split(", ")
            assert set(shown) <= set(names) - set(private), message
        assert said.group(2) in set(names) - set(private), message
    if not private:
        assert "no public replacement" not in message, message
    elif len(private) == len(names):
        assert "none of its names has a public replacement" in message, message
    else:
        clause = message.partition(" no public replacement")[0].rpartition("; ")[2]
        listed, verb = clause.rsplit(" ", 1)
        assert (listed.split(", "), verb) == (private, "has" if len(private) == 1
                                              else "have"), message


def test_the_deprecation_of_nodefit_names_the_commands_that_replace_it() -> None:
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    import rehydrate.nodefit\nexcept DeprecationWarning as w:\n"
            "    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.rstrip().endswith(
        "none of its names has a public replacement: run `rehydrate doctor` (the platform "
        "fit) and `rehydrate check --labels` / `--affinity` (node labels, nodeAffinity)"), out


@pytest.mark.parametrize(("old", "instead"), [
    ("trigger", "use `rehydrate.trigger_snapshot(timeout=…)` for the default engine "
                "(another function: no engine or proc=), or run `rehydrate trigger`"),
    ("cli", "run the `rehydrate` command (`python -m rehydrate`), or call "
            "`rehydrate.__main__.main(argv)` from Python (it returns the exit status)"),
    ("control_client", "run `rehydrate notify` (the command), or call "
                       "`rehydrate.__main__.notify_main(argv)` from Python (it returns the "
                       "exit status)"),
])
def test_the_deprecation_names_the_real_replacement(old: str, instead: str) -> None:
    """rehydrate.trigger said "from rehydrate import trigger_snapshot": another function,
    and the old call's engine and proc= then raised TypeError. rehydrate.cli and
    rehydrate.control_client said "no public replacement" although docs/control-socket.md
    documents rehydrate.__main__.main() and notify_main()."""
    code = (f"import warnings; warnings.simplefilter('error')\n"
            f"try:\n    import rehydrate.{old}\nexcept DeprecationWarning as w:\n"
            f"    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.rstrip().endswith(f"public replacement: {instead}"), out
    assert "from rehydrate import trigger_snapshot" not in out.stdout
    import rehydrate.__main__ as entry

    assert callable(entry.main) and callable(entry.notify_main)
    assert "timeout" in inspect.signature(rehydrate.trigger_snapshot).parameters
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "control-socket.md")
                   .read_text().split())
    assert "`rehydrate.__main__.main()` and `notify_main()` called from a Python program" in doc


def test_the_control_client_imports_from_where_its_deprecation_warning_points() -> None:
    """Before: docs/control-socket.md documented ``request(..., expect_uid=...)``, whose
    only path, ``rehydrate.control_client``, warned "import its public names from
    rehydrate" — where it was not."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from rehydrate import ControlError, UntrustedSocket, request\n"
            "import rehydrate._notify as n, rehydrate._control_client as c\n"
            "assert (request, ControlError, UntrustedSocket) == "
            "(n.request, n.ControlError, n.UntrustedSocket)\n"
            "assert (request, ControlError, UntrustedSocket) == "
            "(c.request, c.ControlError, c.UntrustedSocket)\n"
            "print(request.__module__, ControlError.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert (out.returncode, out.stdout, out.stderr) == (0, "rehydrate rehydrate\n", "")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "control-socket.md").read_text()
    assert "from rehydrate import ControlError, UntrustedSocket, request" in doc


def test_an_object_that_is_not_an_extension_is_refused_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"^42 \(int\) is not an extension"):
        rehydrate.Lifecycle(extensions=[42])


@pytest.mark.parametrize("module_name", sorted(SUBMODULE_API))
def test_documented_submodule_all_is_pinned(module_name):
    assert set(DOCUMENTED_MODULES) == {"rehydrate.extensions", *SUBMODULE_API}
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == SUBMODULE_API[module_name], (
        f"{module_name}.__all__ changed: an API change (update SUBMODULE_API, CHANGELOG.md "
        "and the docs together)")


REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"
_MEMBERS = re.compile(r"^[ \t]+members: \[(.*)\]", re.M)


def _reference_blocks() -> dict[str, list[str] | None]:
    """``::: module`` blocks of docs/reference/*.md: module -> its ``members:`` or None."""
    blocks: dict[str, list[str] | None] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        text = page.read_text()
        starts = [m.start() for m in re.finditer(r"^::: ", text, re.M)] + [len(text)]
        for begin, end in zip(starts, starts[1:]):
            head, _, options = text[begin:end].partition("\n")
            members = _MEMBERS.search(options.split("\n\n")[0])
            blocks[head.split()[1]] = ([n.strip() for n in members.group(1).split(",")]
                                       if members else None)
    return blocks


def test_the_reference_renders_the_public_surface_and_nothing_private():
    """Every public module is in docs/reference/; a private module appears only for names
    users import from ``rehydrate`` or ``rehydrate.extensions`` (listed as members)."""
    blocks = _reference_blocks()
    assert set(PUBLIC_MODULES) <= set(blocks)
    exported = set(PACKAGE_API) | set(EXTENSIONS_API)
    for module, members in blocks.items():
        if any(part.startswith("_") for part in module.split(".")[1:]):
            assert members is not None, f"{module}: list the exported names as members"
            assert set(members) <= exported, (module, sorted(set(members) - exported))


def test_a_type_checker_sees_the_public_names_and_refuses_a_typo(tmp_path: Path) -> None:
    """Before: the package's PEP 562 ``__getattr__`` (returning ``object``) was visible to
    type checkers, so ``rehydrate.wait_redy(...)`` type-checked as a call of ``object`` —
    "object not callable" instead of "no attribute"."""
    from mypy import api

    user = tmp_path / "user.py"
    user.write_text("import rehydrate\n\n"
                    "ready: bool = rehydrate.wait_ready(timeout=5)\n"
                    "key = rehydrate.keys.EphemeralKey\n"
                    "rehydrate.wait_redy(timeout=5)\n")
    out, _, status = api.run(["--strict", "--no-error-summary", "--cache-dir",
                              str(tmp_path / "cache"), str(user)])
    assert status == 1
    assert out.splitlines() == [
        f'{user}:5: error: Module has no attribute "wait_redy"; maybe "wait_ready"?  '
        "[attr-defined]"]


def test_the_testing_helpers_import_without_pytest() -> None:
    """Before: ``rehydrate.testing`` imported pytest at the top, so the helpers the docs
    offer "outside pytest" failed with ModuleNotFoundError where pytest is not installed."""
    code = ("import sys\n"
            "sys.modules['pytest'] = None  # as if not installed: importing it fails\n"
            "from rehydrate.testing import isolated_engine, restored_environ\n"
            "engine = isolated_engine()\n"
            "with restored_environ():\n"
            "    assert engine.simulate_restore(env={'K': 'v'}).ok\n"
            "engine.close()\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"
