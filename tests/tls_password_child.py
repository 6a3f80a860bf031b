"""Child process for tests/test_tls_password_memory.py: load an encrypted key file with
its password given one way, then stop at each stage to be scanned.

argv: KIND KEY_FILE CERT_FILE PASSWORD_FILE, KIND one of ``secret`` (a
``Secret.from_file``), ``callable`` (a function reading the file into a new
``bytearray`` at every call), ``bytes`` / ``str`` (the plain value, read here; this
process then overwrites its own object, as a caller that keeps no copy would, so only
rehydrate's copies are left to find).

The password never reaches this process through argv or the environment (both stay in
memory): only through the file. Stages, each announced on stdout and continued by a line
on stdin: ``loaded`` (certificate loaded into a server context), ``saved`` (the
before-snapshot pass ran), then ``restored <ok>`` before exiting.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import rehydrate
from rehydrate import tls
from rehydrate.secrets import Secret

kind, key_file, cert_file, pw_file = sys.argv[1:5]


def read_password() -> bytearray:
    """The password file straight into a bytearray (rehydrate wipes it after use)."""
    buf = bytearray(os.path.getsize(pw_file))
    fd = os.open(pw_file, os.O_RDONLY)
    try:
        assert os.readv(fd, [buf]) == len(buf)
    finally:
        os.close(fd)
    return buf


def wipe_immutable(obj: bytes | str) -> None:
    """Overwrite the payload of this process's own ``bytes``/ASCII ``str`` in place: the
    caller's copy, which rehydrate cannot wipe, must not be what the scan finds."""
    n = len(obj)
    ctypes.memset(id(obj) + sys.getsizeof(obj) - n - 1, 0, n)


def read_plain() -> bytes:
    fd = os.open(pw_file, os.O_RDONLY)
    try:
        return os.read(fd, os.path.getsize(pw_file))  # exactly sized: no resized copy
    finally:
        os.close(fd)


def stage(name: str) -> None:
    gc.collect()
    print(name, flush=True)
    sys.stdin.readline()


password: object
if kind == "secret":
    password = Secret.from_file(pw_file, name="tls-key-password")
elif kind == "callable":
    password = read_password
elif kind == "bytes":
    password = read_plain()
elif kind == "str":
    raw = read_plain()
    password = raw.decode("ascii")
    wipe_immutable(raw)
    del raw
else:
    raise SystemExit(f"unknown kind {kind}")

cert = tls.from_files("web", key=key_file, cert=cert_file, password=password,  # type: ignore[arg-type]
                      watch=False)
server_ctx = cert.server_context()
if isinstance(password, (bytes, str)):
    wipe_immutable(password)
del password
stage("loaded")

report = rehydrate.simulate_snapshot()
assert report.ok and cert.key_dropped, report
stage("saved")

report = rehydrate.simulate_restore()
print("restored", "ok" if report.ok and not cert.key_dropped else "failed", flush=True)
sys.stdin.readline()
