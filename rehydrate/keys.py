"""Ephemeral key pairs regenerated on every restore, from kernel entropy.

``rehydrate.keys.ephemeral("session", algorithm="ed25519")`` returns a handle whose key pair
is regenerated in the ``SECRETS`` phase after every restore (and resume), and whose private
key is dropped before every snapshot so that no snapshot image holds it.

Why not just ``Ed25519PrivateKey.generate()``? OpenSSL's generator (the one
``cryptography`` links in) keeps its state in process memory, so a snapshot clones it; it
reseeds itself after ``fork()`` only because it notices a PID change, and a restored
process keeps its PID. Five real ``runsc`` clones calling ``generate()`` after restore got
the same key. Every key here is therefore built from bytes read from the kernel
(``/dev/urandom``, ``os.urandom``): Ed25519/X25519 from 32 random bytes, EC private
scalars by rejection sampling, RSA primes by a Miller-Rabin search whose candidates and
witnesses all come from the kernel (``cryptography`` exposes no ``RAND_add`` to reseed its
OpenSSL, and OpenSSL's own fork detection is PID based).

While dropped (between the before-snapshot pass and the next restore/resume),
``.private_key`` raises :class:`KeyDroppedError`: regenerating there would put a fresh
private key into the image that is about to be written. :meth:`EphemeralKey.wait` blocks
until a key is available again. The same holds for a key *created* in that window
(``ephemeral("late")`` after the before-snapshot pass): it starts without a key pair and
gets its first one on the next restore or resume.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from ._config import optional_seconds, shown
from ._context import describe_error
from ._disable import is_disabled
from ._hooks import Phase
from ._redact import _GROUPS, redact
from ._threads import fresh_lock_after_fork
from .extensions import Probe, resolve_engine

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    from builtins import ExceptionGroup as _ExceptionGroup
else:  # pragma: no cover
    from exceptiongroup import ExceptionGroup as _ExceptionGroup  # type: ignore[import-not-found,unused-ignore]

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import (
        PrivateKeyTypes,
        PublicKeyTypes,
    )

    from .extensions import Engine

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "EphemeralKey",
    "KeyDroppedError",
    "KeyManager",
    "ephemeral",
    "generate_private_key",
    "generate_private_key_pem",
    "get",
    "manager",
]

log = logging.getLogger("rehydrate")
_A = TypeVar("_A")
_R = TypeVar("_R")

Algorithm = Literal[
    "ed25519", "x25519", "ec-p256", "ec-p384", "rsa-2048", "rsa-3072", "rsa-4096"
]
"""A key algorithm name, as :func:`ephemeral` takes it."""
ALGORITHMS: tuple[str, ...] = (
    "ed25519", "x25519", "ec-p256", "ec-p384", "rsa-2048", "rsa-3072", "rsa-4096",
)
"""Every :data:`Algorithm`, for checks and listings."""


class KeyDroppedError(RuntimeError):
    """The private key was dropped before a snapshot and not regenerated yet."""


# -- kernel entropy ------------------------------------------------------------------


def urandom_into(buf: bytearray) -> None:
    """Fill ``buf`` in place from the kernel, without an intermediate ``bytes`` object.

    Reading ``/dev/urandom`` straight into the buffer means the secret bytes exist only
    where the caller can wipe them; ``os.urandom`` (a fallback) returns immutable bytes.
    """
    view = memoryview(buf)
    try:
        with open("/dev/urandom", "rb", buffering=0) as fh:
            got = 0
            while got < len(buf):
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError("short read from /dev/urandom")
                got += n
        return
    except OSError:
        pass
    finally:
        view.release()
    buf[:] = os.urandom(len(buf))


def _wipe(buf: bytearray) -> None:
    buf[:] = bytes(len(buf))


# DER prefixes: ECPrivateKey ::= SEQUENCE { version 1, privateKey OCTET STRING,
# [0] namedCurve }. OpenSSL derives the public point itself.
_EC = {
    "ec-p256": (
        32,
        0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551,
        bytes.fromhex("30310201010420"),
        bytes.fromhex("a00a06082a8648ce3d030107"),
    ),
    "ec-p384": (
        48,
        int("FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF"
            "581A0DB248B0A77AECEC196ACCC52973", 16),
        bytes.fromhex("3041020101 0430".replace(" ", "")),
        bytes.fromhex("a00706052b81040022"),
    ),
}


def _ec_key(algorithm: str, *, pem: bool = False) -> tuple[Any, bytearray | None]:
    """A key of the EC ``algorithm`` from kernel entropy, and (``pem``) its SEC1 PEM in a
    buffer the caller wipes."""
    from cryptography.hazmat.primitives import serialization

    size, order, head, tail = _EC[algorithm]
    order_bytes = order.to_bytes(size, "big")
    # the total DER length byte must cover head's inner part + scalar + tail
    der = bytearray(len(head) + size + len(tail))
    der[: len(head)] = head
    der[len(head) + size :] = tail
    der[1] = len(der) - 2
    scalar = memoryview(der)[len(head) : len(head) + size]
    try:
        for _ in range(64):  # P(reject) < 2^-32 per draw for these curves
            tmp = bytearray(size)
            urandom_into(tmp)
            ok = tmp < order_bytes and any(tmp)
            scalar[:] = tmp
            _wipe(tmp)
            if ok:
                key = serialization.load_der_private_key(der, password=None)
                return key, (pem_armor(der, "EC PRIVATE KEY") if pem else None)
        raise RuntimeError("could not draw an EC scalar")  # pragma: no cover
    finally:
        scalar.release()
        _wipe(der)


_B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_ED25519_PKCS8 = bytes.fromhex("302e020100300506032b657004220420")


def pem_armor(der: bytearray | memoryview, label: str) -> bytearray:
    """PEM of ``der`` (``-----BEGIN <label>-----`` …) built in a new bytearray.

    Written out by hand because ``base64`` / ``binascii`` return immutable ``bytes``:
    a private key encoded with them would stay in the heap after use.
    """
    n = len(der)
    body = ((n + 2) // 3) * 4
    head = f"-----BEGIN {label}-----\n".encode()
    foot = f"-----END {label}-----\n".encode()
    out = bytearray(len(head) + body + (body + 63) // 64 + len(foot))
    out[: len(head)] = head
    pos, col = len(head), 0
    for i in range(0, n, 3):  # indexing, not slicing: a slice would copy key bytes
        left = min(3, n - i)
        v = (der[i] << 16) | ((der[i + 1] if left > 1 else 0) << 8) | (
            der[i + 2] if left > 2 else 0)
        for j in range(4):
            out[pos] = _B64[(v >> (18 - 6 * j)) & 63] if j <= left else 61  # '='
            pos += 1
        col += 4
        if col == 64 or i + 3 >= n:
            out[pos] = 10
            pos += 1
            col = 0
    out[pos:] = foot
    return out


def generate_private_key_pem(algorithm: str) -> tuple[PrivateKeyTypes, bytearray | None]:
    """Like :func:`generate_private_key`, plus the key as unencrypted PEM in a buffer the
    caller wipes (SEC1 ``EC PRIVATE KEY`` for EC keys, PKCS#8 for Ed25519), built from the
    kernel's bytes without an immutable copy. ``None`` for the other algorithms: their PEM
    can only come from ``cryptography``'s serializer, whose buffers nobody can wipe.
    """
    if algorithm in _EC:
        key, pem = _ec_key(algorithm, pem=True)
        return cast("PrivateKeyTypes", key), pem
    if algorithm == "ed25519":
        from cryptography.hazmat.primitives.asymmetric import ed25519

        der = bytearray(len(_ED25519_PKCS8) + 32)
        der[: len(_ED25519_PKCS8)] = _ED25519_PKCS8
        seed = memoryview(der)[len(_ED25519_PKCS8):]
        tmp = bytearray(32)
        try:
            urandom_into(tmp)
            seed[:] = tmp
            _wipe(tmp)
            return (ed25519.Ed25519PrivateKey.from_private_bytes(seed),
                    pem_armor(der, "PRIVATE KEY"))
        finally:
            seed.release()
            _wipe(der)
    return generate_private_key(algorithm), None


# -- RSA from kernel entropy -----------------------------------------------------------

_SMALL_PRIMES: list[int] = []
_WINDOW = 4096
"""Odd candidates sieved per random starting point."""


def _small_primes(limit: int = 1 << 15) -> list[int]:
    if not _SMALL_PRIMES:
        sieve = bytearray([1]) * limit
        sieve[0:2] = b"\0\0"
        for i in range(2, int(limit**0.5) + 1):
            if sieve[i]:
                sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
        _SMALL_PRIMES.extend(i for i in range(3, limit) if sieve[i])
    return _SMALL_PRIMES


def _rand_between(low: int, high: int) -> int:
    """Uniform in [low, high] from the kernel."""
    span = high - low
    nbits = span.bit_length()
    nbytes = (nbits + 7) // 8
    while True:
        x = int.from_bytes(os.urandom(nbytes), "big") >> (nbytes * 8 - nbits)
        if x <= span:
            return low + x


def _strong_probable_prime(n: int, base: int, d: int, s: int) -> bool:
    x = pow(base, d, n)
    if x in (1, n - 1):
        return True
    for _ in range(s - 1):
        x = pow(x, 2, n)
        if x == n - 1:
            return True
    return False


def _probably_prime(n: int, rounds: int) -> bool:
    """Miller-Rabin: base 2 first (cheap rejection), then ``rounds`` kernel-random bases."""
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    if not _strong_probable_prime(n, 2, d, s):
        return False
    return all(_strong_probable_prime(n, _rand_between(2, n - 2), d, s) for _ in range(rounds))


def _mr_rounds(bits: int) -> int:
    # FIPS 186-5 table B.1: rounds for error probability <= 2^-100 with random candidates
    if bits >= 1536:
        return 4
    if bits >= 1024:
        return 5
    return 8


def _random_prime(bits: int, e: int) -> int:
    """A random ``bits``-bit prime p with gcd(p-1, e) = 1; every random bit from the kernel.

    A random odd start (top two bits set) is drawn from ``os.urandom``; the next
    ``_WINDOW`` odd numbers are sieved by the small primes and the survivors tested with
    Miller-Rabin, as OpenSSL's own generator does.
    """
    small = _small_primes()
    rounds = _mr_rounds(bits)
    nbytes = (bits + 7) // 8
    while True:
        start = int.from_bytes(os.urandom(nbytes), "big") >> (nbytes * 8 - bits)
        start |= (3 << (bits - 2)) | 1  # top two bits set: p*q has exactly 2*bits bits
        alive = bytearray([1]) * _WINDOW
        for p in small:
            # index i such that start + 2*i == 0 (mod p)
            i = ((p - start % p) * ((p + 1) // 2)) % p
            alive[i::p] = bytes(len(range(i, _WINDOW, p)))
        i = alive.find(1)
        while i >= 0:
            c = start + 2 * i
            if c.bit_length() != bits:
                break
            if math.gcd(c - 1, e) == 1 and _probably_prime(c, rounds):
                return c
            i = alive.find(1, i + 1)


def rsa_private_key(bits: int, public_exponent: int = 65537) -> Any:
    """An RSA key whose primes were found from kernel entropy (see the module docstring)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    half = bits // 2
    while True:
        p = _random_prime(half, public_exponent)
        q = _random_prime(bits - half, public_exponent)
        if abs(p - q) >> (half - 100) == 0:  # FIPS 186-5: |p - q| > 2^(nlen/2 - 100)
            continue
        n = p * q
        if n.bit_length() != bits:
            continue
        lam = (p - 1) * (q - 1) // math.gcd(p - 1, q - 1)
        d = pow(public_exponent, -1, lam)
        numbers = rsa.RSAPrivateNumbers(
            p=p, q=q, d=d,
            dmp1=rsa.rsa_crt_dmp1(d, p), dmq1=rsa.rsa_crt_dmq1(d, q),
            iqmp=rsa.rsa_crt_iqmp(p, q),
            public_numbers=rsa.RSAPublicNumbers(public_exponent, n),
        )
        # Validation (RSA_check_key) would re-test both primes with many more rounds; the
        # numbers were just built and tested here, so skip it (saves ~80 ms for 2048 bits).
        return numbers.private_key(unsafe_skip_rsa_key_validation=True)


def generate_private_key(algorithm: str) -> PrivateKeyTypes:
    """A new private key of ``algorithm`` built from kernel entropy (never OpenSSL's RNG)."""
    if algorithm in ("ed25519", "x25519"):
        from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

        buf = bytearray(32)
        try:
            urandom_into(buf)
            if algorithm == "ed25519":
                return ed25519.Ed25519PrivateKey.from_private_bytes(buf)
            return x25519.X25519PrivateKey.from_private_bytes(buf)
        finally:
            _wipe(buf)
    if algorithm in _EC:
        return cast("PrivateKeyTypes", _ec_key(algorithm)[0])
    if algorithm.startswith("rsa-") and algorithm in ALGORITHMS:
        return cast("PrivateKeyTypes", rsa_private_key(int(algorithm[4:])))
    raise ValueError(f"unknown key algorithm {shown(algorithm)}; choose one of {ALGORITHMS}")


# -- handles ---------------------------------------------------------------------------


class EphemeralKey:
    """A named key pair that is regenerated on every restore. Get one with
    :func:`ephemeral`; its ``private_key`` and ``public_key`` are always the current ones
    (each read on its own: for a matching pair, ``private_key.public_key()``)."""

    def __init__(self, name: str, algorithm: str, manager: KeyManager, *,
                 generate: bool = True) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown key algorithm {shown(algorithm)}; choose one of "
                             f"{ALGORITHMS}")
        self.name = name
        self.algorithm = algorithm
        self._manager = manager
        self._cond = threading.Condition()
        # A parent thread may hold it at fork() (storing a rotation's key, a wait()
        # returning): the child's drop, rotation and wait() would block on it for ever.
        fresh_lock_after_fork(self, "_cond")
        self._private: PrivateKeyTypes | None = None
        self._public: PublicKeyTypes | None = None
        self._listeners: list[Callable[[EphemeralKey], None]] = []
        self.generation = 0
        """How many times the key was (re)generated; 1 after creation."""
        self.rotated_at: float | None = None
        """``time.time()`` of the last regeneration."""
        if generate:
            self._rotate_unlocked()

    def __repr__(self) -> str:
        state = "dropped" if self._private is None else "present"
        return (f"<EphemeralKey {self.name!r} {self.algorithm} generation={self.generation} "
                f"{state}>")

    @property
    def dropped(self) -> bool:
        return self._private is None

    @property
    def private_key(self) -> PrivateKeyTypes:
        """The current private key; :class:`KeyDroppedError` between snapshot and restore.
        Its ``public_key()`` is its public half even if a rotation comes after this read."""
        key = self._private
        if key is None:
            raise KeyDroppedError(
                f"ephemeral key {self.name!r} was dropped before a snapshot and is "
                "regenerated on restore/resume (use .wait() to block until then)"
            )
        return key

    @property
    def public_key(self) -> PublicKeyTypes:
        """The current public key (still readable while the private key is dropped;
        :class:`KeyDroppedError` for a key created after the before-snapshot pass, which
        has no key pair until the next restore or resume). A rotation may come between
        reading this and :attr:`private_key`: take ``private_key.public_key()`` for the
        public half of the private key read."""
        pub = self._public
        if pub is None:
            raise KeyDroppedError(
                f"ephemeral key {self.name!r} was created after the before-snapshot pass; "
                "its first key pair is generated on restore/resume (use .wait())"
            )
        return pub

    def public_bytes_raw(self) -> bytes:
        """Public key bytes (raw for Ed25519/X25519, DER SubjectPublicKeyInfo otherwise)."""
        from cryptography.hazmat.primitives import serialization

        pub: Any = self.public_key
        if self.algorithm in ("ed25519", "x25519"):
            return cast(bytes, pub.public_bytes_raw())
        return cast(bytes, pub.public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo))

    def wait(self, timeout: float | None = None) -> PrivateKeyTypes:
        """Block until the private key is available; :class:`KeyDroppedError` on timeout.

        ``timeout``: seconds, 0 (do not wait); ``None``, infinity or more than a year: no
        limit. A negative, NaN or non-number timeout is a ``ValueError``/``TypeError`` at
        once."""
        timeout = optional_seconds(timeout, "wait(): timeout")
        with self._cond:
            if not self._cond.wait_for(lambda: self._private is not None, timeout):
                raise KeyDroppedError(
                    f"ephemeral key {self.name!r} still dropped after {timeout}s"
                )
            assert self._private is not None
            return self._private

    def subscribe(
        self, fn: Callable[[EphemeralKey], None]
    ) -> Callable[[EphemeralKey], None]:
        """Call ``fn(handle)`` after every rotation (usable as a decorator). A listener
        that raises makes the ``rehydrate.keys`` hook fail with an ``ExceptionGroup`` of
        the errors, naming each key and listener (after all listeners ran); a later
        :meth:`rotate` that every listener takes mends that."""
        self._listeners.append(fn)
        return fn

    def unsubscribe(self, fn: Callable[[EphemeralKey], None]) -> None:
        self._listeners.remove(fn)

    def _rotate_unlocked(self) -> None:
        epoch = self._manager.epoch  # before generating: RSA takes a while
        private = generate_private_key(self.algorithm)
        with self._cond:
            # The before-snapshot pass may have dropped the keys while this one was being
            # generated: storing it would put it into the image. Or the rotation outlived
            # a snapshot and the restore after it (or a restore with no snapshot pass):
            # its key was made before, so every clone has it.
            if self._manager.dropped or epoch != self._manager.epoch:
                del private
                raise KeyDroppedError(
                    f"ephemeral key {self.name!r}: a snapshot or restore happened while "
                    "this rotation ran; its new key is discarded")
            self._private = private
            self._public = private.public_key()
            self.generation += 1
            self.rotated_at = time.time()
            self._cond.notify_all()

    def rotate(self) -> list[BaseException]:
        """Regenerate now and notify listeners. Returns the listeners' errors (each
        logged as one ``WARNING`` line; their tracebacks' frames cleared of locals, which
        may hold the private key).

        When every listener took the new key and no other key is still failed from the
        last run of the ``rehydrate.keys`` restore hook (a listener or the generation
        failed, or the run never got through it: hung past its timeout, a
        ``BaseException``), that hook's failure is forgotten
        (:meth:`~rehydrate.Lifecycle.recovered`): a listener whose registry was down
        during the restore makes the process ready again once a rotation reaches it.

        Refused (:class:`KeyDroppedError`) between the before-snapshot pass and the next
        restore/resume: the new private key would be written into the snapshot image."""
        began = time.monotonic()  # before the key is made: see Lifecycle.recovered(since=)
        epoch = self._manager.epoch
        failed = self._rotate_and_notify()
        for fn, exc in failed:
            # redacted: a listener pushing the key elsewhere may quote a token
            log.warning("%s", redact(f"rotation listener {_listener_name(fn)} of key "
                                     f"{self.name!r} failed: {exc}"))
        if not failed:
            self._manager._rotated(self.name, began, epoch)
        return [exc for _, exc in failed]

    def _rotate_and_notify(self) -> list[tuple[Callable[[EphemeralKey], None], Exception]]:
        """Regenerate and call every listener; the listeners that failed, with their
        errors (not logged: the restore hook's failure is logged by the engine)."""
        if self._manager.dropped:
            raise KeyDroppedError(
                f"ephemeral key {self.name!r}: private keys were dropped before a snapshot; "
                "it is regenerated on restore/resume, not before"
            )
        self._rotate_unlocked()
        failed: list[tuple[Callable[[EphemeralKey], None], Exception]] = []
        for fn in list(self._listeners):
            ok, out = _caught(fn, self)
            if not ok:
                failed.append((fn, cast(Exception, out)))
        return failed

    def drop(self) -> None:
        """Forget the private key (cryptography frees OpenSSL's copy with a wipe)."""
        with self._cond:
            self._private = None


class KeyManager:
    """The ephemeral keys of one engine, and their ``rehydrate.keys`` hooks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.enabled = True
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._keys: dict[str, EphemeralKey] = {}
        self._dropped = engine.snapshot_pending
        self.epoch = 0
        """+1 at every before-snapshot pass and restore/resume run: a rotation that began
        before one of them has its key discarded."""
        self._failed: frozenset[str] = frozenset()
        """Names of the keys the last run of the restore hook has not rotated with every
        listener taking the new key: all its keys when it starts, each one taken out when
        the hook or a later rotate() gets it through, or remove() removes it. A hook that
        hangs in a listener or raises a BaseException leaves the rest in."""
        self._restore_hook = engine.builtins.register(
            self._on_restore, phase=Phase.SECRETS, order=-100, name="rehydrate.keys",
            timeout=60.0)
        engine.builtins.register(self._on_snapshot, event="snapshot", phase=Phase.SECRETS,
                                 order=-100, name="rehydrate.keys", timeout=10.0)
        engine.add_status("keys", self._status)

    @property
    def active(self) -> bool:
        return self.enabled and not is_disabled("keys", "secrets")

    @property
    def dropped(self) -> bool:
        """True between the before-snapshot pass and the next restore/resume: keys are
        dropped, and keys created meanwhile start without a key pair."""
        return self._dropped

    def _status(self) -> dict[str, Any]:
        return {k.name: {"algorithm": k.algorithm, "generation": k.generation,
                         "dropped": k.dropped} for k in self.keys()}

    # keys(), get() and status() read the dict without the lock: ephemeral() holds it for
    # seconds (an rsa-4096 key), and a signal handler run in that thread and calling one
    # of them would wait for its own thread. A single dict.copy()/get() is atomic (the
    # GIL, or the dict's own lock in free-threaded builds), and the dict only ever holds
    # keys that have their first pair.
    def keys(self) -> list[EphemeralKey]:
        return list(self._keys.copy().values())

    def get(self, name: str) -> EphemeralKey | None:
        return self._keys.get(name)

    def ephemeral(self, name: str, algorithm: str | None = None) -> EphemeralKey:
        if not isinstance(name, str) or not name.strip() or not name.isprintable():
            # it names the key in status(), logs and reports: one readable line each
            raise TypeError(f"an ephemeral key's name must be a non-empty printable str, "
                            f"not {shown(name)}")
        with self._lock:
            key = self._keys.get(name)
            if key is None:
                # The first pair is made under the lock, and the key registered only once
                # it has one: a restore or before-snapshot pass waits for it (an rsa-4096
                # key takes seconds), and nothing can see a key whose creation was cut
                # short by a signal handler's exception or a fork from one.
                # After the before-snapshot pass a new key would be written into the
                # image: it starts without a key pair (generated on restore/resume).
                # `is None`, not `or`: an empty string is an unknown algorithm, refused
                key = EphemeralKey(name, "ed25519" if algorithm is None else algorithm, self,
                                   generate=not self._dropped)
                self._keys[name] = key
            elif algorithm is not None and key.algorithm != algorithm:
                raise ValueError(
                    f"ephemeral key {name!r} already exists with algorithm {key.algorithm!r}"
                )
            return key

    def remove(self, name: str) -> None:
        began = time.monotonic()
        with self._lock:
            key = self._keys.pop(name, None)
        if key is not None:
            key.drop()
            # a key whose rotation failed in the last restore and that is no longer used
            # does not hold the process degraded
            self._rotated(name, began, None)

    def _on_restore(self) -> None:
        active = self.active
        with self._lock:
            self._dropped = False
            self.epoch += 1
            epoch = self.epoch
            keys = list(self._keys.values())
            # a key dropped before the snapshot is gone: it gets a new pair (and its
            # listeners hear of it) even when keys are disabled; only keys still held
            # are left alone
            kept = [] if active else [k.name for k in keys if not k.dropped]
            keys = keys if active else [k for k in keys if k.dropped]
            # Failed until rotated: a hook that hangs in a listener (timed out) or is cut
            # short by a BaseException leaves every key it did not get through failed.
            self._failed = frozenset(k.name for k in keys)
        if not active:
            if not keys:
                log.info("keys disabled: ephemeral keys NOT regenerated")
            elif kept:
                log.info("keys disabled: ephemeral keys %s NOT regenerated",
                         ", ".join(kept))
            if keys:
                log.info("keys disabled, but ephemeral keys %s hold no private key "
                         "(dropped before the snapshot): regenerating them anyway",
                         ", ".join(k.name for k in keys))
        failures: list[tuple[str, str, Exception]] = []  # key, what failed, its error
        for k in keys:
            with self._lock:
                # Left alone: a key removed meanwhile (a fresh private key in a handle
                # no pass drops any more would go into the image), and one that a
                # rotate() already got through in this run (a new pair here, pushed by a
                # listener that fails, would undo it, and nothing would mend it again).
                if self.epoch == epoch and (self._keys.get(k.name) is not k
                                            or k.name not in self._failed):
                    continue
            began = time.monotonic()
            ok, out = _caught(EphemeralKey._rotate_and_notify, k)
            if not ok:  # generation failed: keep what we had
                failures.append((k.name, "generating its new key pair",
                                 cast(Exception, out)))
            else:
                failed = cast("list[tuple[Callable[[EphemeralKey], None], Exception]]",
                              out)
                failures.extend((k.name, f"rotation listener {_listener_name(fn)}", e)
                                for fn, e in failed)
                if not failed:
                    # after its timeout, the hook getting through the last key mends it
                    self._rotated(k.name, began, epoch)
                    continue
            with self._lock:
                # failed again, after a rotate() may have taken it off: only a later
                # rotation that reaches every listener (or remove()) mends it
                if self.epoch == epoch and self._keys.get(k.name) is k:
                    self._failed |= {k.name}
        if failures:
            # A group even for one failure: its message names the key and the listener
            # in the engine's one log line, the report and status() (a note on the
            # listener's own error shows in none of them, and would pile up on an error
            # a listener raises again at every restore), and `except*` still matches
            # the errors' own types.
            raise _ExceptionGroup(
                "ephemeral key rotation incomplete: "
                + "; ".join(f"key {name!r}: {what}: {describe_error(e)}"
                            for name, what, e in failures),
                [e for _, _, e in failures])

    def _rotated(self, name: str, began: float, epoch: int | None) -> None:
        """``name`` was rotated at ``began`` (``time.monotonic()``) and every listener
        took it (or it was removed: ``epoch`` None): once no key of the last restore
        hook's run is left failed, that hook's failure is forgotten (nothing happens when
        it did not fail; during a run, only once it timed out). ``epoch``: the manager's
        when the rotation began; a rotation that a later run or pass overtook does not
        count for it."""
        with self._lock:
            if epoch not in (None, self.epoch) or name not in self._failed:
                return
            self._failed -= {name}
            if self._failed:
                return
        # By record, not name: a user hook named rehydrate.keys is not this one.
        self.engine.recovered(self._restore_hook, since=began)

    def _on_snapshot(self) -> None:
        if not self.active:
            log.info("keys disabled: ephemeral private keys NOT dropped before snapshot")
            return
        with self._lock:  # set before dropping: ephemeral() checks it under this lock
            self._dropped = True
            self.epoch += 1
        for k in self.keys():
            k.drop()


def _caught(fn: Callable[[_A], _R], arg: _A) -> tuple[Literal[True], _R] | tuple[
        Literal[False], Exception]:
    """``(True, fn(arg))``, or ``(False, the exception it raised)`` with the frames of its
    traceback cleared (the lines stay, the locals go), and those of every error chained
    to it: a listener's frame may hold the private key it read, and the error outlives
    the before-snapshot pass (in the engine's report, or a caller's hands) and with it,
    through each frame's caller, a reference cycle that only the garbage collector would
    free. A flag, not ``isinstance``: a listener may return an exception object."""
    out = _call(fn, arg)
    if not out[0]:
        _clear_frames(out[1], set())
    return out


def _call(fn: Callable[[_A], _R], arg: _A) -> tuple[Literal[True], _R] | tuple[
        Literal[False], Exception]:
    # Caught in a frame of its own, which has returned once _caught clears it: the
    # caller's frame, still running, could not be cleared.
    try:
        return True, fn(arg)
    except Exception as exc:
        return False, exc


def _clear_frames(exc: BaseException, seen: set[int]) -> None:
    """Clear the frames of ``exc``'s traceback and of every error it chains to
    (``raise ... from``, raised in an ``except``, a group's members); ``seen``: the
    ids already cleared (a chain may loop)."""
    if id(exc) in seen:
        return
    seen.add(id(exc))
    traceback.clear_frames(exc.__traceback__)
    chained = [exc.__cause__, exc.__context__]
    if isinstance(exc, _GROUPS):
        chained.extend(cast(Any, exc).exceptions)
    for e in chained:
        if e is not None:
            _clear_frames(e, seen)


def _listener_name(fn: object) -> str:
    """How messages name a listener: its qualified name, never ``repr()`` (a bound
    method's shows its object, a client holding a token perhaps)."""
    try:
        name = getattr(fn, "__qualname__", None)
    except Exception:  # an object whose __getattr__ raises anything
        name = None
    return name if isinstance(name, str) else type(fn).__qualname__


def manager(engine: Engine | None = None) -> KeyManager:
    """The key manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("keys", KeyManager)


key = "keys"


def probe() -> Probe:
    """Always usable: key material comes from the kernel (``os.urandom``)."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the keys manager to ``engine`` now (its functions also do on first use)."""
    manager(engine)


def ephemeral(name: str, algorithm: str | None = None, *,
              engine: Engine | None = None) -> EphemeralKey:
    """The ephemeral key named ``name`` (created on first call; the same handle after).

    ``algorithm``: ``ed25519`` (when omitted for a new key), ``x25519``, ``ec-p256``,
    ``ec-p384``, ``rsa-2048``, ``rsa-3072``, ``rsa-4096``. Omitted for an existing name:
    that key, whatever its algorithm. Asking for an existing name with another algorithm
    raises ``ValueError``.
    """
    return manager(engine).ephemeral(name, algorithm)


def get(name: str, *, engine: Engine | None = None) -> EphemeralKey | None:
    """The ephemeral key registered as ``name``, or ``None``."""
    return manager(engine).get(name)
