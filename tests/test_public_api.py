"""The public surface, pinned: what ``import rehydrate`` offers and the documented modules.

Changing these lists is an API change: update CHANGELOG.md and the docs with it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import rehydrate

PACKAGE_API = [
    "EnvChanges", "Hook", "HookFailed", "HookResult", "HookStillRunning", "HookTimeout",
    "Lifecycle", "Phase", "Registry", "Report", "RestoreContext", "RestoreReport",
    "SnapshotReport", "Status", "__version__", "after_restore", "before_snapshot",
    "default_engine", "default_registry", "instance_id", "is_ready", "on_env_change",
    "simulate_restore", "simulate_snapshot", "start", "status", "stop", "trigger_snapshot",
    "unregister", "wait_ready",
]

EXTENSIONS_API = [
    "DEFAULT_EXTENSIONS", "Engine", "Extension", "Probe", "default_engine", "default_registry",
    "load_extension", "resolve_engine",
]

# Modules the docs tell users to import; each declares its public names in __all__.
DOCUMENTED_MODULES = [
    "rehydrate.extensions", "rehydrate.env", "rehydrate.entropy", "rehydrate.keys",
    "rehydrate.tls", "rehydrate.secrets", "rehydrate.connections", "rehydrate.routes",
    "rehydrate.telemetry", "rehydrate.fingerprint", "rehydrate.files", "rehydrate.detect",
    "rehydrate.testing",
]

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


def test_every_module_without_a_leading_underscore_is_a_pinned_public_module():
    found = sorted(m.name for m in pkgutil.walk_packages(rehydrate.__path__, "rehydrate.")
                   if not any(part.startswith("_") for part in m.name.split(".")[1:]))
    assert found == PUBLIC_MODULES
