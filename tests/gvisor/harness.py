"""Drive real gVisor ``runsc`` from tests: run, exec, checkpoint, restore into clones.

The harness builds one OCI bundle per container whose root is the host's ``/``
mounted read-only, so the host's Python, the repository and its virtualenv are
visible inside the sandbox unchanged. Each container also gets

* a tmpfs at ``/var/tmp`` (``TMPDIR`` points there),
* its own host directory bind-mounted read-write at ``/results``
  (:data:`RESULTS_DIR`): the workload reports to the test by appending JSON
  lines to a file there, and the test polls that file
  (:func:`wait_for_record`);
* any extra bind mounts (:class:`Mount`), e.g. a host file standing in for
  ``/proc/gvisor/spec_environ`` that the test rewrites between checkpoint and
  restore;
* any extra Linux capabilities (``capabilities=["NET_ADMIN"]``: ``runsc spec``'s
  default set lacks CAP_NET_ADMIN, which changing the sandbox's routes needs).

A restored clone keeps the checkpointed process's memory, so it cannot learn
"which clone am I" from its environment: instead every clone gets a different
host directory at the same ``/results`` path. Files open at checkpoint time are
reopened by path on restore, must exist (restore fails with ENOENT otherwise)
and keep their file offsets, so :meth:`GVisorHarness.restore` pre-creates an
empty copy of each file of the checkpointed container's results directory.
Workloads should open result files in append mode (``"a"``); otherwise the
clone's file starts with NUL bytes up to the old offset (the readers here
strip them).

Every ``runsc`` call runs under coreutils ``timeout``; :meth:`GVisorHarness.close`
kills and deletes every container the harness created, and any sandbox or gofer
process left behind under its private ``--root`` state directory. ``run`` and
``restore`` go through a tiny subreaper process that reaps the detached sandbox
and gofer at once (PID 1 here leaves them zombies for ~1.5 s, which every
``runsc delete`` waits out) and kills them if the test process dies.

Flags that work here (both Debian runsc builds): ``runsc --root DIR
--network=none [--debug-log=DIR/] run -bundle B -detach ID``, ``checkpoint
-image-path IMG [--compression=none] [-leave-running] ID``, ``restore
-image-path IMG -bundle B2 -detach ID2``, ``exec [-env K=V] ID CMD...``,
``kill ID KILL``, ``delete -force ID``. No ``--ignore-cgroups`` needed.

Nothing here imports pytest; see ``conftest.py`` for the fixtures.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import mmap
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_RUNSC_CANDIDATES",
    "REPO_ROOT",
    "RESULTS_DIR",
    "Container",
    "GVisorHarness",
    "Mount",
    "RunscError",
    "find_runsc",
    "image_contains",
    "read_jsonl",
    "runsc_available",
    "supports_uncompressed_checkpoint",
    "wait_for_file",
    "wait_for_record",
]

#: The repository root (host path; visible inside the sandbox, whose root is the host's /).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Where each container sees its own read-write results directory.
RESULTS_DIR = "/results"

#: Tried in order when neither ``runsc=`` nor ``$REHYDRATE_RUNSC`` names a binary.
#: Trixie's runsc (installed by scripts/install-runsc.sh) comes first: it is newer,
#: faster (systrap platform) and supports ``checkpoint --compression=none``.
DEFAULT_RUNSC_CANDIDATES: tuple[str, ...] = ("/usr/local/bin/runsc-trixie", "runsc")

# Flags given to every runsc command. Sandbox networking does not work on this
# kernel and --network=host refuses to checkpoint, so --network=none is required.
_GLOBAL_FLAGS: tuple[str, ...] = ("--network=none",)

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RunscError(RuntimeError):
    """A runsc command failed or timed out; the message carries its output."""


# --------------------------------------------------------------------------- discovery


def find_runsc(runsc: str | None = None) -> str | None:
    """Absolute path of the runsc binary to use, or None if there is none.

    Order: the ``runsc`` argument, ``$REHYDRATE_RUNSC``, then
    :data:`DEFAULT_RUNSC_CANDIDATES`.
    """
    candidates = [runsc] if runsc else []
    if not candidates and os.environ.get("REHYDRATE_RUNSC"):
        candidates = [os.environ["REHYDRATE_RUNSC"]]
    if not candidates:
        candidates = list(DEFAULT_RUNSC_CANDIDATES)
    for cand in candidates:
        path = shutil.which(cand)
        if path:
            return os.path.abspath(path)
    return None


@functools.cache
def _runsc_help(runsc: str, command: str) -> str:
    proc = subprocess.run(
        ["timeout", "-k", "5", "20", runsc, "help", command],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout + proc.stderr


def supports_uncompressed_checkpoint(runsc: str) -> bool:
    """True if ``runsc checkpoint --compression=none`` exists (trixie's runsc does)."""
    return "-compression" in _runsc_help(runsc, "checkpoint")


@functools.cache
def _probe(runsc: str) -> str | None:
    """Run ``/bin/true`` in a real sandbox; a reason string if that fails."""
    workdir = Path(tempfile.mkdtemp(prefix="rehydrate-runsc-probe-"))
    harness = GVisorHarness(workdir, runsc=runsc, debug_log=False)
    try:
        proc = harness.run_once(["/bin/true"], timeout=60)
        if proc.returncode != 0:
            detail = proc.stderr.strip()[-2000:]
            return (
                f"{runsc} could not run /bin/true in a sandbox (exit {proc.returncode}): {detail}"
            )
        return None
    except (RunscError, OSError) as exc:
        return f"{runsc} could not run a sandbox: {exc}"
    finally:
        harness.close()
        shutil.rmtree(workdir, ignore_errors=True)


def runsc_available(runsc: str | None = None, *, probe: bool = True) -> str | None:
    """None if runsc can run/checkpoint/restore here, else the reason it cannot.

    With ``probe`` (the default) a trivial sandbox is actually started, once per
    binary and process (about half a second).
    """
    if not sys.platform.startswith("linux"):
        return f"gVisor needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "runsc needs root (these tests do not use rootless sandboxes)"
    path = find_runsc(runsc)
    if path is None:
        wanted = runsc or os.environ.get("REHYDRATE_RUNSC") or " or ".join(DEFAULT_RUNSC_CANDIDATES)
        return f"no runsc binary found ({wanted}); run scripts/install-runsc.sh as root"
    if shutil.which("timeout") is None:
        return "coreutils 'timeout' is missing"
    try:
        version = subprocess.run(
            ["timeout", "-k", "5", "20", path, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        return f"{path} cannot be executed: {exc}"
    if version.returncode != 0:
        return f"{path} --version failed: {(version.stdout + version.stderr).strip()[-500:]}"
    if probe:
        return _probe(path)
    return None


# --------------------------------------------------------------------------- results


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete JSON-object lines of ``path`` (missing file: ``[]``).

    NUL bytes (the hole a restored clone leaves before its old file offset) are
    dropped; a trailing partial line and lines that are not JSON objects are
    skipped.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    data = data.replace(b"\0", b"")
    records: list[dict[str, Any]] = []
    lines = data.split(b"\n")
    for raw in lines[:-1]:  # the last element is "" or an incomplete line
        line = raw.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def wait_for_file(
    path: str | os.PathLike[str],
    timeout: float = 30.0,
    *,
    interval: float = 0.05,
    alive: Callable[[], str | None] | None = None,
) -> Path:
    """Poll until ``path`` exists and is not empty; raise TimeoutError otherwise."""
    p = Path(path)
    _poll(lambda: p.exists() and p.stat().st_size > 0, timeout, interval, alive, f"file {p}")
    return p


def wait_for_record(
    path: str | os.PathLike[str],
    predicate: Callable[[dict[str, Any]], bool] = lambda rec: True,
    timeout: float = 30.0,
    *,
    interval: float = 0.05,
    alive: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Poll the JSON-lines file ``path`` until a record satisfies ``predicate``.

    Returns the first such record. ``alive`` (e.g. :meth:`Container.dead_reason`)
    is checked about once a second so that a crashed workload fails fast
    instead of at the deadline.
    """
    found: list[dict[str, Any]] = []

    def check() -> bool:
        for rec in read_jsonl(path):
            if predicate(rec):
                found.append(rec)
                return True
        return False

    def describe() -> str:
        recs = read_jsonl(path)
        tail = "\n".join(json.dumps(r) for r in recs[-5:]) or "(no records)"
        return f"a matching record in {path}; last records:\n{tail}"

    _poll(check, timeout, interval, alive, describe)
    return found[0]


def _poll(
    check: Callable[[], bool],
    timeout: float,
    interval: float,
    alive: Callable[[], str | None] | None,
    what: str | Callable[[], str],
) -> None:
    deadline = time.monotonic() + timeout
    next_alive = time.monotonic() + 1.0
    while True:
        if check():
            return
        now = time.monotonic()
        if alive is not None and now >= next_alive:
            next_alive = now + 1.0
            reason = alive()
            if reason is not None and not check():
                desc = what() if callable(what) else what
                raise RuntimeError(f"gave up waiting for {desc}: {reason}")
        if now >= deadline:
            desc = what() if callable(what) else what
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {desc}")
        time.sleep(interval)


# --------------------------------------------------------------------------- images


def image_contains(image_dir: str | os.PathLike[str], needle: bytes) -> int:
    """Count occurrences of ``needle`` in all files under a checkpoint image dir.

    Only meaningful for uncompressed images (``checkpoint(..., compression="none")``
    writes the memory pages to ``pages.img``); the default flate-compressed
    ``checkpoint.img`` hides everything.
    """
    if not needle:
        raise ValueError("needle must not be empty")
    total = 0
    for file in sorted(Path(image_dir).rglob("*")):
        if not file.is_file() or file.stat().st_size == 0:
            continue
        with open(file, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = mm.find(needle)
            while pos != -1:
                total += 1
                pos = mm.find(needle, pos + len(needle))
    return total


# --------------------------------------------------------------------------- harness


@dataclass(frozen=True)
class Mount:
    """A host file or directory bind-mounted into the sandbox."""

    destination: str
    source: str | os.PathLike[str]
    readonly: bool = True

    def to_oci(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "type": "bind",
            "source": os.fspath(Path(self.source).resolve()),
            "options": ["rbind", "ro" if self.readonly else "rw"],
        }


@dataclass(repr=False)
class Container:
    """One sandboxed container (an original or a restored clone)."""

    harness: GVisorHarness
    id: str
    dir: Path
    spec: dict[str, Any]
    restored_from: Path | None = None
    #: The last checkpoint image taken of this container.
    image: Path | None = None
    started_at: float = field(default_factory=time.time)

    def __repr__(self) -> str:
        origin = f" restored from {self.restored_from.name}" if self.restored_from else ""
        return f"<Container {self.id}{origin}>"

    @property
    def bundle(self) -> Path:
        return self.dir / "bundle"

    @property
    def results(self) -> Path:
        """Host directory mounted at :data:`RESULTS_DIR` in this container."""
        return self.dir / "results"

    @property
    def stdout(self) -> Path:
        return self.dir / "stdout"

    @property
    def stderr(self) -> Path:
        """Container stderr; runsc's own messages for run/restore land here too."""
        return self.dir / "stderr"

    def result_file(self, name: str) -> Path:
        return self.results / name

    def records(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.result_file(name))

    def wait_for(
        self,
        name: str,
        predicate: Callable[[dict[str, Any]], bool] = lambda rec: True,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Wait for a record in results file ``name``; fail fast if the container dies."""
        return wait_for_record(self.result_file(name), predicate, timeout, alive=self.dead_reason)

    def state(self) -> dict[str, Any]:
        return self.harness.state(self.id)

    def status(self) -> str:
        """``running``, ``stopped``, ``created``, ... or ``missing``."""
        try:
            return str(self.state().get("status", "unknown"))
        except RunscError:
            return "missing"

    def wait_stopped(self, timeout: float = 15.0) -> None:
        """Poll until the container no longer runs (e.g. after a checkpoint)."""
        _poll(
            lambda: self.status() != "running", timeout, 0.05, None, f"container {self.id} to stop"
        )

    def dead_reason(self) -> str | None:
        status = self.status()
        if status == "running":
            return None
        return f"container {self.id} is {status}; stderr:\n{_tail_text(self.stderr, 30)}"

    def exec(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.harness.exec(self.id, args, **kwargs)

    def checkpoint(self, image_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Path:
        return self.harness.checkpoint(self, image_dir, **kwargs)

    def restore(self, image_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Container:
        """Restore a clone of this container from ``image_dir`` (default: its last image)."""
        image = image_dir if image_dir is not None else self.image
        if image is None:
            raise ValueError(f"{self!r} has not been checkpointed")
        return self.harness.restore(image, self, **kwargs)


class GVisorHarness:
    """Runs, checkpoints and restores gVisor containers for one test.

    ``workdir`` (a pytest ``tmp_path``) receives one sub-directory per
    container (bundle, results, stdout, stderr), the checkpoint images and the
    runsc debug logs. The runsc state (``--root``) lives in a private temporary
    directory that :meth:`close` removes. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        runsc: str | None = None,
        *,
        debug_log: bool = True,
        debug: bool = False,
        extra_flags: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> None:
        path = find_runsc(runsc)
        if path is None:
            raise RunscError(f"no runsc binary found ({runsc or DEFAULT_RUNSC_CANDIDATES})")
        self.runsc = path
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir: Path | None = self.workdir / "runsc-logs" if debug_log else None
        if self.log_dir is not None:
            self.log_dir.mkdir(exist_ok=True)
        # Short and private: runsc keeps per-container state (and lock files) here.
        self.state_root = Path(tempfile.mkdtemp(prefix="rsc-"))
        self.timeout = timeout
        self.flags: list[str] = ["--root", str(self.state_root), *_GLOBAL_FLAGS]
        if self.log_dir is not None:
            self.flags.append(f"--debug-log={self.log_dir}/")
        if debug:
            self.flags.append("--debug")
        self.flags.extend(extra_flags)
        self.containers: list[Container] = []
        self._base_spec: dict[str, Any] | None = None
        self._counter = 0
        self._token = secrets.token_hex(3)
        self._closed = False
        self._reapers: list[subprocess.Popen[bytes]] = []

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> GVisorHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- low level ---------------------------------------------------------

    def command(self, *args: str | os.PathLike[str]) -> list[str]:
        """The argv of a runsc command with this harness's global flags."""
        return [self.runsc, *self.flags, *(os.fspath(a) for a in args)]

    def runsc_call(
        self,
        *args: str | os.PathLike[str],
        timeout: float | None = None,
        check: bool = True,
        stdout: Any = subprocess.PIPE,
        stderr: Any = subprocess.PIPE,
    ) -> subprocess.CompletedProcess[str]:
        """Run one runsc command under coreutils ``timeout``."""
        limit = self.timeout if timeout is None else timeout
        argv = ["timeout", "-k", "5", f"{limit:g}", *self.command(*args)]
        try:
            proc = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                text=True,
                check=False,
                close_fds=True,
                timeout=limit + 15,  # backstop if `timeout` itself hangs
            )
        except subprocess.TimeoutExpired as exc:
            raise RunscError(f"runsc {' '.join(map(str, args))} hung for {limit + 15:g}s") from exc
        if check and proc.returncode != 0:
            what = "timed out" if proc.returncode in (124, 137) else f"exited {proc.returncode}"
            raise RunscError(
                f"runsc {' '.join(map(str, args))} {what}\n"
                f"stdout: {(proc.stdout or '').strip()[-2000:]}\n"
                f"stderr: {(proc.stderr or '').strip()[-2000:]}"
            )
        return proc

    def _new_id(self, name: str) -> str:
        self._counter += 1
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name)[:24] or "c"
        return f"{safe}-{self._counter}-{self._token}"

    def base_spec(self) -> dict[str, Any]:
        """``runsc spec`` output (generated once per harness)."""
        if self._base_spec is None:
            tmp = Path(tempfile.mkdtemp(prefix="spec-", dir=self.workdir))
            self.runsc_call("spec", "-bundle", tmp, timeout=20)
            self._base_spec = json.loads((tmp / "config.json").read_text())
            shutil.rmtree(tmp, ignore_errors=True)
        return copy.deepcopy(self._base_spec)

    def make_spec(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        mounts: Iterable[Mount] = (),
        results_source: Path,
        annotations: Mapping[str, str] | None = None,
        capabilities: Iterable[str] = (),
    ) -> dict[str, Any]:
        """An OCI config: host ``/`` read-only, tmpfs /var/tmp, rw /results, no tty.

        ``capabilities`` (``"NET_ADMIN"`` or ``"CAP_NET_ADMIN"`` …) are added to the
        process's bounding, effective, permitted and inheritable sets, on top of
        ``runsc spec``'s defaults (``CAP_AUDIT_WRITE``, ``CAP_KILL``,
        ``CAP_NET_BIND_SERVICE``); a clone restored from the container keeps them.
        """
        caps = _capability_names(capabilities)  # a bad name fails before any runsc call
        spec = self.base_spec()
        spec["root"] = {"path": "/", "readonly": True}
        proc = spec["process"]
        proc["terminal"] = False
        proc["args"] = [os.fspath(a) for a in args]
        proc["cwd"] = cwd
        full_env = {
            # The test's Python (a virtualenv's bin: its console scripts) comes first.
            "PATH": f"{Path(sys.executable).parent}:{_DEFAULT_PATH}",
            "HOME": "/var/tmp",
            "TMPDIR": "/var/tmp",
            "PYTHONUNBUFFERED": "1",
            # The working tree's package is importable even from a Python without it.
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONDONTWRITEBYTECODE": "1",
            "LANG": "C.UTF-8",
        }
        full_env.update(env or {})
        proc["env"] = [f"{k}={v}" for k, v in full_env.items()]
        spec["hostname"] = "rehydrate-test"
        spec["mounts"] = [
            m
            for m in spec.get("mounts", [])
            if m.get("destination") not in ("/var/tmp", RESULTS_DIR)
        ]
        spec["mounts"].append(
            {
                "destination": "/var/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["mode=1777"],
            }
        )
        spec["mounts"].append(Mount(RESULTS_DIR, results_source, readonly=False).to_oci())
        spec["mounts"].extend(m.to_oci() for m in mounts)
        if annotations:
            spec.setdefault("annotations", {}).update(annotations)
        if caps:
            sets = proc.setdefault("capabilities", {})
            for kind in ("bounding", "effective", "permitted", "inheritable"):
                held = sets.setdefault(kind, [])
                held.extend(c for c in caps if c not in held)
        return spec

    def _prepare(
        self, name: str, spec: dict[str, Any], restored_from: Path | None = None
    ) -> Container:
        cid = self._new_id(name)
        cdir = self.workdir / cid
        (cdir / "bundle").mkdir(parents=True)
        (cdir / "results").mkdir()
        container = Container(self, cid, cdir, spec, restored_from=restored_from)
        # results mount source is per container
        for m in spec["mounts"]:
            if m.get("destination") == RESULTS_DIR:
                m["source"] = str(container.results)
        (cdir / "bundle" / "config.json").write_text(json.dumps(spec, indent=2))
        return container

    def _start(
        self, container: Container, args: Sequence[str | os.PathLike[str]], timeout: float | None
    ) -> None:
        """Run ``runsc run|restore ... -detach`` with the container's stdio on files.

        A detached sandbox inherits runsc's stdout/stderr, so these must be
        files: with pipes, waiting for runsc would wait for the workload.

        runsc is started through a small subreaper process (:data:`_REAPER`)
        that adopts the sandbox and gofer once ``runsc -detach`` exits and
        reaps them the moment they die. Orphaned to PID 1 instead, they stay
        zombies for ~1.5 s on this machine, and ``runsc delete`` (and ``state``
        after a checkpoint) waits for that: 1.7 s per container at teardown.
        """
        self.containers.append(container)  # tracked before start: cleaned up even if start fails
        limit = timeout if timeout is not None else self.timeout
        argv = ["timeout", "-k", "5", f"{limit:g}", *self.command(*args)]
        cleanup = ["timeout", "-k", "5", "30", *self.command("delete", "-force", container.id)]
        read_fd, write_fd = os.pipe()
        try:
            with open(container.stdout, "ab") as out, open(container.stderr, "ab") as err:
                reaper = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-S",
                        "-c",
                        _REAPER,
                        str(os.getpid()),
                        str(write_fd),
                        json.dumps(cleanup),
                        *argv,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(write_fd,),
                )
            self._reapers.append(reaper)
            os.close(write_fd)
            write_fd = -1
            status = _read_status(read_fd, limit + 15)
        finally:
            os.close(read_fd)
            if write_fd != -1:
                os.close(write_fd)
        if status != 0:
            what = {
                None: "hung",
                124: "timed out",
                137: "timed out",
                _REAPER_DIED: "could not start (reaper failed)",
            }.get(status, f"exited {status}")
            stderr = _tail_text(container.stderr, 30)
            hint = ""
            if args[0] == "restore" and "no such file or directory" in stderr:
                hint = (
                    "\nhint: a file the process had open at checkpoint time is missing for "
                    "the clone (a results file, or a bind-mount source); restore reopens "
                    "files by path"
                )
            raise RunscError(
                f"runsc {' '.join(map(str, args))} {what}\n{container.stderr}:\n{stderr}{hint}"
            )

    # -- public operations -------------------------------------------------

    def run(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        mounts: Iterable[Mount] = (),
        annotations: Mapping[str, str] | None = None,
        capabilities: Iterable[str] = (),
        name: str = "run",
        timeout: float | None = None,
    ) -> Container:
        """Start ``args`` in a new detached sandbox and return at once.

        ``capabilities``: extra Linux capabilities of the process (see :meth:`make_spec`),
        e.g. ``["NET_ADMIN"]`` to change the sandbox's routes.
        """
        spec = self.make_spec(
            args,
            env=env,
            cwd=cwd,
            mounts=mounts,
            annotations=annotations,
            capabilities=capabilities,
            results_source=Path("/nonexistent"),
        )
        container = self._prepare(name, spec)
        self._start(
            container, ("run", "-bundle", container.bundle, "-detach", container.id), timeout
        )
        container.started_at = time.time()
        return container

    def run_once(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        mounts: Iterable[Mount] = (),
        capabilities: Iterable[str] = (),
        name: str = "once",
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` to completion in a sandbox; its output and exit code."""
        spec = self.make_spec(
            args,
            env=env,
            mounts=mounts,
            capabilities=capabilities,
            results_source=Path("/nonexistent"),
        )
        container = self._prepare(name, spec)
        self.containers.append(container)
        with open(container.stdout, "ab") as out, open(container.stderr, "ab") as err:
            proc = self.runsc_call(
                "run",
                "-bundle",
                container.bundle,
                container.id,
                timeout=timeout,
                check=False,
                stdout=out,
                stderr=err,
            )
        return subprocess.CompletedProcess(
            proc.args,
            proc.returncode,
            container.stdout.read_text(errors="replace"),
            container.stderr.read_text(errors="replace"),
        )

    def exec(
        self,
        container: Container | str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """``runsc exec`` a command in a running container and collect its output.

        The process gets the container spec's environment, updated with ``env``.
        The command must not leave children holding its stdout open, or this
        waits for them (up to the timeout).
        """
        cid = container.id if isinstance(container, Container) else container
        flags: list[str] = []
        for k, v in (env or {}).items():
            flags += ["-env", f"{k}={v}"]
        if cwd is not None:
            flags += ["-cwd", cwd]
        proc = self.runsc_call("exec", *flags, cid, *args, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            detail = proc.stderr.strip()[-2000:]
            raise RunscError(f"exec {list(args)} in {cid} exited {proc.returncode}: {detail}")
        return proc

    def checkpoint(
        self,
        container: Container | str,
        image_dir: str | os.PathLike[str] | None = None,
        *,
        compression: str | None = None,
        leave_running: bool = False,
        extra_args: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Path:
        """``runsc checkpoint`` into ``image_dir`` (default: a fresh dir in workdir).

        Without ``leave_running`` the original container stops. ``compression``
        ("none" makes ``pages.img`` greppable) needs trixie's runsc.
        """
        cid = container.id if isinstance(container, Container) else container
        if image_dir is None:
            image = self.workdir / f"image-{cid}-{secrets.token_hex(2)}"
        else:
            image = Path(image_dir).resolve()
        if image.exists() and any(image.iterdir()):
            raise RunscError(f"checkpoint image dir {image} is not empty")
        flags = ["-image-path", str(image)]
        if compression is not None:
            if not supports_uncompressed_checkpoint(self.runsc):
                raise RunscError(
                    f"{self.runsc} has no checkpoint --compression (use trixie's runsc)"
                )
            flags.append(f"--compression={compression}")
        if leave_running:
            flags.append("-leave-running")
        flags.extend(extra_args)
        self.runsc_call("checkpoint", *flags, cid, timeout=timeout or max(self.timeout, 120.0))
        if isinstance(container, Container):
            container.image = image
            if not leave_running:
                # `runsc state` still says "running" until the sandbox has exited.
                container.wait_stopped()
        return image

    def restore(
        self,
        image_dir: str | os.PathLike[str],
        template: Container,
        *,
        name: str = "clone",
        env: Mapping[str, str] | None = None,
        mounts: Iterable[Mount] = (),
        seed_results: str = "empty",
        timeout: float | None = None,
    ) -> Container:
        """Restore a checkpoint image into a new container (its own id and bundle).

        ``template`` is the checkpointed container: its spec is reused with a
        fresh results directory, ``env`` keys set in the spec's process env
        (what gVisor would expose as spec_environ; the restored process's own
        environment is the frozen one), and ``mounts`` replacing the mounts of
        the same destination (sources may change; destinations may not).
        ``seed_results``: "empty" creates an empty file for every file of the
        template's results dir, "copy" copies them (restore needs every file
        that was open to exist).
        """
        spec = copy.deepcopy(template.spec)
        proc_env = dict(item.split("=", 1) for item in spec["process"].get("env", []))
        proc_env.update(env or {})
        spec["process"]["env"] = [f"{k}={v}" for k, v in proc_env.items()]
        overrides = {m.destination: m for m in mounts}
        new_mounts = []
        for m in spec["mounts"]:
            dest = m.get("destination")
            new_mounts.append(overrides.pop(dest).to_oci() if dest in overrides else m)
        if overrides:
            raise ValueError(
                f"restore mounts must replace existing destinations, not add {sorted(overrides)}"
            )
        spec["mounts"] = new_mounts
        image = Path(image_dir).resolve()
        clone = self._prepare(name, spec, restored_from=image)
        _seed(template.results, clone.results, seed_results)
        self._start(
            clone,
            ("restore", "-image-path", image, "-bundle", clone.bundle, "-detach", clone.id),
            timeout or max(self.timeout, 120.0),
        )
        clone.started_at = time.time()
        return clone

    def restore_many(
        self, image_dir: str | os.PathLike[str], template: Container, n: int, **kwargs: Any
    ) -> list[Container]:
        name = kwargs.pop("name", "clone")
        return [self.restore(image_dir, template, name=f"{name}{i}", **kwargs) for i in range(n)]

    def state(self, container: Container | str) -> dict[str, Any]:
        cid = container.id if isinstance(container, Container) else container
        proc = self.runsc_call("state", cid, timeout=20)
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def list_ids(self) -> list[str]:
        proc = self.runsc_call("list", "-quiet", timeout=20, check=False)
        return [line.strip() for line in (proc.stdout or "").splitlines() if line.strip()]

    def kill(self, container: Container | str, sig: str = "KILL") -> None:
        cid = container.id if isinstance(container, Container) else container
        self.runsc_call("kill", cid, sig, timeout=20, check=False)

    def delete(self, container: Container | str) -> None:
        cid = container.id if isinstance(container, Container) else container
        self.runsc_call("delete", "-force", cid, timeout=30, check=False)

    # -- teardown and diagnostics -------------------------------------------

    def close(self) -> None:
        """Kill and delete every container; reap strays; remove the state dir."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        ids = [c.id for c in reversed(self.containers)]
        try:
            ids += [i for i in self.list_ids() if i not in ids]
        except Exception as exc:  # noqa: BLE001 - teardown must go on
            errors.append(f"list: {exc}")
        for cid in ids:
            for op in (self.kill, self.delete):
                try:
                    op(cid)
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{cid}: {exc}")
        _kill_strays(self.state_root)
        for reaper in self._reapers:
            try:
                reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"reaper {reaper.pid} still had children; killed")
                reaper.kill()
                reaper.wait()
        shutil.rmtree(self.state_root, ignore_errors=True)
        if errors:
            print("gvisor harness teardown:", *errors, sep="\n  ", file=sys.stderr)

    def describe(self, log_lines: int = 40, max_chars: int = 30000) -> str:
        """Containers, their output and the runsc debug logs, for a failure report."""
        parts = [f"runsc: {self.runsc}  flags: {' '.join(self.flags)}  workdir: {self.workdir}"]
        for c in self.containers:
            origin = f" restored from {c.restored_from}" if c.restored_from else ""
            parts.append(f"== container {c.id}{origin} ({c.dir})")
            for label, path in (("stdout", c.stdout), ("stderr", c.stderr)):
                text = _tail_text(path, 20)
                if text:
                    parts.append(f"-- {label}:\n{text}")
        if self.log_dir is not None and self.log_dir.exists():
            for log in sorted(self.log_dir.iterdir()):
                parts.append(f"== {log.name}\n{_log_excerpt(log, log_lines)}")
        text = "\n".join(parts)
        if len(text) > max_chars:
            text = "... (truncated)\n" + text[-max_chars:]
        return text


# --------------------------------------------------------------------------- helpers

# argv: PARENT_PID STATUS_FD CLEANUP_JSON CMD...: become a child subreaper, run
# CMD, write its exit code to STATUS_FD, then reap adopted orphans (sandbox,
# gofer) as soon as they die, until none are left. If the test process
# (PARENT_PID) dies without cleaning up, SIGKILL the adopted sandbox and gofer
# and run CLEANUP (``runsc delete -force ID``) instead of leaking them.
_REAPER = """
import ctypes, json, os, signal, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit(125)
parent, fd, cleanup = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
pid = os.fork()
if pid == 0:
    try:
        os.close(fd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.execvp(sys.argv[4], sys.argv[4:])
    finally:
        os._exit(127)
_, st = os.waitpid(pid, 0)
os.write(fd, str(os.waitstatus_to_exitcode(st)).encode())
os.close(fd)
os.close(0); os.close(1); os.close(2)

def children():
    me = str(os.getpid())
    for p in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % p) as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    yield int(p)
        except (OSError, IndexError, ValueError):
            pass

while True:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            sys.exit(0)
        if pid == 0:
            break
    if os.getppid() != parent:
        for child in children():
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        subprocess.run(cleanup, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        sys.exit(0)
    signal.sigtimedwait({signal.SIGCHLD}, 0.5)
"""


_REAPER_DIED = -1000


def _read_status(fd: int, timeout: float) -> int | None:
    """The exit code the reaper writes to ``fd``; None on timeout.

    :data:`_REAPER_DIED` if the reaper exited without writing one.
    """
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    try:
        return int(data)
    except ValueError:
        return _REAPER_DIED


def _capability_names(names: Iterable[str]) -> list[str]:
    """``names`` as OCI spells them (``CAP_NET_ADMIN``), in order, without repeats.

    One string is refused rather than taken letter by letter."""
    if isinstance(names, str):
        raise TypeError(f"capabilities is a list of names, not one string (write [{names!r}])")
    out: list[str] = []
    for name in names:
        cap = name.strip().upper() if isinstance(name, str) else ""
        cap = cap if cap.startswith("CAP_") else f"CAP_{cap}"
        if not cap[4:] or not cap[4:].replace("_", "").isalnum():
            raise ValueError(f"not a capability name: {name!r} (e.g. 'NET_ADMIN')")
        if cap not in out:
            out.append(cap)
    return out


def _seed(src: Path, dst: Path, mode: str) -> None:
    if mode not in ("empty", "copy"):
        raise ValueError(f"seed_results must be 'empty' or 'copy', not {mode!r}")
    if not src.is_dir():
        return
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "copy":
                shutil.copy2(path, target)
            else:
                target.touch()


def _tail_text(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    text = data.replace(b"\0", b"").decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _log_excerpt(path: Path, lines: int) -> str:
    """Warnings and errors of a runsc log (glog W/E/F lines), then its last lines."""
    all_lines = _tail_text(path, 100000).splitlines()
    bad = [ln for ln in all_lines if ln[:1] in ("W", "E", "F") and ln[1:5].isdigit()]
    if not bad:
        return "\n".join(all_lines[-3:])
    return "\n".join([*bad[-lines:], "...", *all_lines[-10:]])


def _kill_strays(state_root: Path) -> None:
    """SIGKILL runsc sandbox/gofer processes that use this harness's private --root.

    The state root is unique to this harness, so this only ever hits processes
    that this harness started (by pid, never by name).
    """
    root = os.fspath(state_root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"--root=" + root in args or any(
            a == b"--root" and i + 1 < len(args) and args[i + 1] == root for i, a in enumerate(args)
        )
        if ours:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)
