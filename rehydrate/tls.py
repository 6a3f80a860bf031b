"""TLS certificates that follow restores: self-signed, issued from a CSR, or read from files.

Every managed certificate is a handle with the current :class:`Material` (certificate,
private key, chain, trust anchors). After every restore (and resume) its built-in hook
``rehydrate.tls:<name>`` (``SECRETS`` phase, after the ephemeral keys) renews it:

* :func:`self_signed` — a fresh key from kernel entropy, a fresh random serial, a validity
  window starting now;
* :func:`issued` — a fresh key and a CSR sent to an :class:`Issuer` (:class:`HTTPIssuer`
  posts ``{"csr": PEM}`` and expects ``{"certificate": PEM, "chain": [PEM, …]}``);
* :func:`from_files` — PEM certificate (+ chain), key and optional CA bundle, re-read on
  restore and whenever the directory holding them changes (watched with watchdog; polled
  under gVisor, where inotify misses changes made outside the sandbox). Kubernetes' atomic
  ``..data`` symlink swap is seen because the directory, not the file, is watched. An
  encrypted key's password is read only when the key is (a ``Secret`` or a callable, at
  every load, nothing kept in between; a plain value from rehydrate's own copy, which is
  therefore in snapshot images).

New material is validated before use — the key matches the certificate, the certificate is
inside its validity window, and the chain verifies against the CA bundle when one is given.
Bad material never replaces good material: the previous certificate stays in use, the
restore hook fails (``required`` decides readiness) and one clear line is logged.

Live TLS: :meth:`ManagedCertificate.server_context` returns an ``ssl.SSLContext`` that is
kept current: new handshakes present the certificate in use while established
connections continue. :meth:`ManagedCertificate.attach` does the same for a context made
elsewhere (uvicorn's ``config.ssl``); an ``sni_callback`` of your own hands out
:meth:`ManagedCertificate.current_server_context`. A context that serves is never
changed (that crashed threaded servers, and left a certificate of another key type
served): each renewal builds a fresh context with the attached one's settings, and the
attached context's ``sni_callback`` moves every new connection to it (:class:`_Swap`).
Both turn
session resumption off on the context (no tickets, no session
cache): the ticket key and cached sessions are in the snapshot image, and a resumed
session would skip the renewed certificate on every clone.
:meth:`ManagedCertificate.client_context` returns a client context that trusts (and
optionally presents) the current material; it is rebuilt after every renewal (a context
cannot forget trust anchors), so fetch it again or :meth:`subscribe`. A listener that
raises fails the renewal (and the restore hook) with the new material in use; it is called
again at the next renewal or re-read, and the hook recovers once every listener took it.

Before a snapshot (hook ``rehydrate.tls``, ``SECRETS`` phase) every certificate's private
key is dropped from its :class:`Material` (the certificate itself stays readable) and the
attached contexts move to a fresh context presenting a throwaway placeholder (a
self-signed certificate for a fresh key of the same type; presenting client contexts get
it loaded), so that OpenSSL lets go of its copy of the real key too. Until the next
restore or resume, new handshakes present the placeholder, :attr:`ManagedCertificate.private_key`
raises :class:`CertificateError`, the file watcher pauses and :meth:`~ManagedCertificate.renew`
is refused (a key made now would be written into the image). After a *restore*, a
self-signed or issued certificate whose renewal fails is never served with the key from
the image: its contexts get a fresh placeholder and its hook fails.

Renewals of one handle (restore hook, file watcher, :meth:`~ManagedCertificate.renew`) are
serialised: read, validate and apply happen under one per-handle lock. So are the adds of
one name: a second call with a name being added (or closed) waits for that to finish, then
returns the handle set up under it (see :meth:`TLSManager.add`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import logging
import os
import re
import ssl
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

from . import _config
from ._disable import is_disabled
from ._files import READ_ONLY_EVENTS, read_regular, wipe
from ._hooks import Hook, Phase
from ._redact import _hide, redact_error
from ._threads import fresh_lock_after_fork, held_by_another_thread
from ._urls import without_credentials
from .extensions import Probe, resolve_engine
from .secrets import Secret, SecretError, SecretSource

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import (
        CertificateIssuerPrivateKeyTypes,
        PrivateKeyTypes,
    )

    from ._context import RestoreContext
    from .extensions import Engine

__all__ = [
    "CertificateError",
    "FileCertificate",
    "HTTPIssuer",
    "IssuedCertificate",
    "Issuer",
    "ManagedCertificate",
    "Material",
    "Password",
    "SelfSignedCertificate",
    "TLSManager",
    "from_files",
    "issued",
    "manager",
    "self_signed",
    "validate",
]

log = logging.getLogger("rehydrate")

CLOCK_SKEW = _dt.timedelta(minutes=5)
DROP_WAIT = 5.0
"""Seconds the before-snapshot pass waits for a running renewal before dropping anyway."""


class CertificateError(ValueError):
    """New certificate material was rejected (the previous material stays in use), or a
    :meth:`~ManagedCertificate.subscribe` listener failed to take the material in use
    (the message says ``renewed but: listener ...`` or ``serial ... in use, but still:
    listener ...``; it is called again at the next renewal or re-read)."""

    _in_use = False
    """Only listeners failed: the material is in use (see :func:`_listeners_failed`)."""


def _listeners_failed(message: str) -> CertificateError:
    """A :class:`CertificateError` saying listeners failed to take the material in use.
    Not a subclass: its class name is in log lines and reports, and greps and alerts on
    ``CertificateError`` must match it too."""
    # a listener's error may quote a secret, or a URL with a token in its query
    exc = CertificateError(_hide(message))
    exc._in_use = True
    return exc


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


@dataclass(frozen=True)
class Material:
    """One certificate with its key; immutable (a renewal makes a new one).

    ``private_key`` is None in the copy a handle keeps after the key was dropped before a
    snapshot."""

    certificate: x509.Certificate
    private_key: PrivateKeyTypes | None
    chain: tuple[x509.Certificate, ...] = ()
    """Intermediates presented after the leaf (not the root)."""
    trust: tuple[x509.Certificate, ...] = ()
    """Trust anchors for clients of this certificate (CA bundle, issuer root, or the
    certificate itself when self-signed)."""
    loaded_at: float = field(default_factory=time.time)
    key_buffer: bytearray | None = field(default=None, repr=False, compare=False)
    """The private key as unencrypted PEM in a buffer rehydrate wipes when the key is
    dropped or replaced (None when it could not be had without an unwipeable copy: RSA
    and Ed448 keys, encrypted key files). What contexts are loaded from."""

    @property
    def serial(self) -> int:
        return int(self.certificate.serial_number)

    @property
    def not_after(self) -> _dt.datetime:
        return self.certificate.not_valid_after_utc

    def fingerprint(self) -> str:
        from cryptography.hazmat.primitives import hashes

        return self.certificate.fingerprint(hashes.SHA256()).hex()

    def chain_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return b"".join(c.public_bytes(serialization.Encoding.PEM)
                        for c in (self.certificate, *self.chain))

    def trust_pem(self) -> str:
        from cryptography.hazmat.primitives import serialization

        return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in self.trust)

    def key_pem(self) -> bytearray:
        """The private key as unencrypted PEM, in a new buffer: wipe it when done
        (``pem[:] = bytes(len(pem))``) and no copy of the key is left behind.

        EC keys rehydrate made come as SEC1 (``EC PRIVATE KEY``), Ed25519 keys and key
        files as they are (PKCS#8 or SEC1). For RSA and Ed448 keys and encrypted key
        files the PEM comes from ``cryptography``'s serializer, which leaves copies in
        memory nobody can wipe (see docs/identity.md).
        """
        if self.private_key is None:
            raise CertificateError("the private key was dropped before a snapshot")
        if self.key_buffer is not None and any(self.key_buffer):
            return bytearray(self.key_buffer)
        from cryptography.hazmat.primitives import serialization

        return bytearray(self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    def wipe_key(self) -> None:
        """Overwrite :attr:`key_buffer` with zeros (the key object goes with the Material)."""
        if self.key_buffer is not None:
            wipe(self.key_buffer)


# -- validation --------------------------------------------------------------------------


def _spki(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cast(bytes, key.public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo))


def validate(
    certificate: x509.Certificate,
    private_key: PrivateKeyTypes,
    chain: Sequence[x509.Certificate] = (),
    trust: Sequence[x509.Certificate] = (),
    *,
    now: _dt.datetime | None = None,
) -> None:
    """Raise :class:`CertificateError` unless the material is usable.

    Checks: ``private_key`` belongs to ``certificate``; ``now`` lies inside its validity
    window (with 5 minutes of clock skew before ``notBefore``); when ``trust`` is given, a
    path from the certificate through ``chain`` to one of ``trust`` verifies (signatures,
    validity of every certificate) — with cryptography's X.509 path validation where
    available, else by checking each signature.
    """
    now = now or _now()
    if _spki(certificate.public_key()) != _spki(private_key.public_key()):
        raise CertificateError("private key does not match the certificate")
    if now > certificate.not_valid_after_utc:
        raise CertificateError(
            f"certificate expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")
    if now + CLOCK_SKEW < certificate.not_valid_before_utc:
        raise CertificateError(
            f"certificate not valid before "
            f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M:%S}Z")
    if trust:
        _verify_chain(certificate, list(chain), list(trust), now)


def _verify_chain(leaf: x509.Certificate, chain: list[x509.Certificate],
                  trust: list[x509.Certificate], now: _dt.datetime) -> None:
    try:
        from cryptography import x509 as _x509
        from cryptography.x509.verification import (
            Criticality,
            ExtensionPolicy,
            PolicyBuilder,
            Store,
            VerificationError,
        )
    except ImportError:  # cryptography < 45: check signatures along the chain ourselves
        _verify_signatures(leaf, chain, trust, now)
        return
    if leaf in trust:
        return  # pinned directly (a self-signed certificate in its own bundle)
    # Path validation (signatures, validity windows, name chaining, CA basicConstraints)
    # without the Web PKI profile's extension demands, which private CAs rarely meet.
    ca_policy = ExtensionPolicy.permit_all().require_present(
        _x509.BasicConstraints, Criticality.AGNOSTIC, None)
    verifier = (
        PolicyBuilder()
        .store(Store(trust))
        .time(now.replace(tzinfo=None))
        .extension_policies(ca_policy=ca_policy,
                            ee_policy=ExtensionPolicy.permit_all())
        .build_client_verifier()
    )
    try:
        verifier.verify(leaf, chain)
    except VerificationError as exc:
        raise CertificateError(
            f"certificate chain does not verify against the CA bundle: {exc}") from None


def _verify_signatures(leaf: x509.Certificate, chain: list[x509.Certificate],
                       trust: list[x509.Certificate], now: _dt.datetime) -> None:
    current = leaf
    pool = chain + trust
    for _ in range(len(pool) + 1):
        if current in trust:
            return
        issuer = next((c for c in pool if c.subject == current.issuer and c != current), None)
        if issuer is None:
            break
        try:
            current.verify_directly_issued_by(issuer)
        except Exception:
            break
        if not issuer.not_valid_before_utc <= now <= issuer.not_valid_after_utc:
            raise CertificateError("a CA certificate in the chain is outside its validity")
        current = issuer
    raise CertificateError("certificate chain does not verify against the CA bundle")


# -- writing material into ssl contexts ------------------------------------------------


def _private_tmp() -> str | None:
    # tmpfs: the key PEM never reaches a disk; mkdtemp makes a private 0700 directory there
    shm = "/dev/shm"  # noqa: S108
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _write_private(path: str, data: bytes | bytearray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def load_into(ctx: ssl.SSLContext, material: Material) -> None:
    """``load_cert_chain`` the material into ``ctx`` (via 0600 files in a private 0700
    directory on tmpfs when available, removed right after loading).

    The key is written from :attr:`Material.key_buffer` where there is one: OpenSSL reads
    a SEC1 EC key without leaving a copy in the heap, where a PKCS#8 one leaves two."""
    d = tempfile.mkdtemp(prefix="rehydrate-tls-", dir=_private_tmp())
    cert_path, key_path = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    key = material.key_pem()
    try:
        _write_private(cert_path, material.chain_pem())
        _write_private(key_path, key)
        ctx.load_cert_chain(cert_path, key_path)
    finally:
        wipe(key)
        for p in (cert_path, key_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        os.rmdir(d)


_SSL_CTRL_SET_SESS_CACHE_MODE = 44
_SSL_CTRL_GET_SESS_CACHE_MODE = 45
_SSL_SESS_CACHE_OFF = 0
_SSL_CTRL_SET_DH_AUTO = 118


@functools.cache
def _libssl() -> tuple[Any, Any, Any, Any, Any] | None:
    """``SSL_CTX_get_options``, ``SSL_CTX_ctrl``, ``SSL_CTX_flush_sessions``,
    ``SSL_CTX_get_cert_store`` and ``SSL_CTX_set1_cert_store`` of the OpenSSL the ``ssl``
    module uses (looked up through ``_ssl``'s own dependencies): the last two None where
    that OpenSSL lacks either, the whole None where the first three cannot be reached
    safely (not CPython, ``_ssl`` built in)."""
    if sys.implementation.name != "cpython":
        return None  # id() is an address, and an SSLContext starts with its SSL_CTX*,
        # only in CPython
    try:
        import _ssl
        import ctypes

        lib = ctypes.CDLL(_ssl.__file__)
        get_options, ctrl = lib.SSL_CTX_get_options, lib.SSL_CTX_ctrl
        when: Any
        try:  # OpenSSL 3.4 deprecates the long-typed one
            flush, when = lib.SSL_CTX_flush_sessions_ex, ctypes.c_int64
        except AttributeError:
            flush, when = lib.SSL_CTX_flush_sessions, ctypes.c_long
    except (ImportError, OSError, AttributeError):
        return None
    get_options.argtypes = [ctypes.c_void_p]
    get_options.restype = ctypes.c_uint64
    ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    ctrl.restype = ctypes.c_long
    flush.argtypes = [ctypes.c_void_p, when]
    flush.restype = None
    get_store: Any
    set1_store: Any
    try:
        get_store, set1_store = lib.SSL_CTX_get_cert_store, lib.SSL_CTX_set1_cert_store
    except AttributeError:  # the session cache can still be turned off
        get_store = set1_store = None
    else:
        get_store.argtypes = [ctypes.c_void_p]
        get_store.restype = ctypes.c_void_p
        set1_store.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        set1_store.restype = None
    return get_options, ctrl, flush, get_store, set1_store


def _session_cache_off(ctx: ssl.SSLContext) -> bool:
    """Turn off and empty OpenSSL's server-side session cache of ``ctx``; False when that
    is not possible here. Python's ``ssl`` has no API for it, so it goes through ctypes:
    the ``SSL_CTX*`` is the first field after the object header of CPython's
    ``SSLContext``, checked against the context's options before anything is changed."""
    ptr = _ssl_ctx_ptr(ctx)
    fns = _libssl()
    if ptr is None or fns is None:
        return False
    _get_options, ctrl, flush, _, _ = fns
    ctrl(ptr, _SSL_CTRL_SET_SESS_CACHE_MODE, _SSL_SESS_CACHE_OFF, None)
    # the mode only stops new entries; lookups still find old ones: remove them all
    # (time 0 = every session; OpenSSL wipes their master secrets as it frees them)
    flush(ptr, 0)
    return bool(ctrl(ptr, _SSL_CTRL_GET_SESS_CACHE_MODE, 0, None) == _SSL_SESS_CACHE_OFF)


def _no_resumption(ctx: ssl.SSLContext) -> bool:
    """Turn off TLS session resumption on a server context: no session tickets (TLS 1.2
    and 1.3) and no server-side session cache (TLS 1.2 session IDs, TLS 1.3 stateful
    tickets). Returns False when the session cache could not be turned off (tickets are
    off in any case).

    Why: resumption skips the certificate. A context's ticket key is made by OpenSSL
    when the context is, and its session cache holds the sessions' master secrets; both
    are in a snapshot image and the same in every clone, so a session from before the
    snapshot would resume on every clone without the renewed certificate's key ever being
    used — and anyone holding the image could serve it. Every connection makes a full
    handshake instead."""
    ctx.options |= ssl.OP_NO_TICKET
    # TLS 1.3 sends tickets even with OP_NO_TICKET (stateful ones, in the session cache)
    with contextlib.suppress(ValueError):  # a client context: it sends none
        ctx.num_tickets = 0
    return _session_cache_off(ctx)


def _ssl_ctx_ptr(ctx: ssl.SSLContext) -> int | None:
    """The ``SSL_CTX*`` of ``ctx`` (see :func:`_session_cache_off`), or None."""
    import _ssl

    fns = _libssl()
    # anything but a real SSLContext (a stand-in object) has no SSL_CTX* to read
    if fns is None or not isinstance(ctx, _ssl._SSLContext):
        return None
    import ctypes

    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not ptr or fns[0](ptr) != int(ctx.options):
        return None
    return int(ptr)


def _share_cert_store(source: ssl.SSLContext, target: ssl.SSLContext) -> bool:
    """Make ``target`` verify peers against the very trust store of ``source`` (CA files,
    directories and CRLs the application loaded, and what it loads later). False when
    that is not possible here."""
    fns = _libssl()
    src, dst = _ssl_ctx_ptr(source), _ssl_ctx_ptr(target)
    if fns is None or fns[4] is None or src is None or dst is None:
        return False
    *_, get, set1 = fns
    store = get(src)
    if not store:
        return False
    set1(dst, store)  # up-refs the store: each context frees its own reference
    return bool(get(dst) == store)


def _alpn_protocols(ctx: ssl.SSLContext, callback: object) -> list[str] | None:
    """The protocols ``ctx.set_alpn_protocols`` was given (``[]`` when never called), or
    None when they cannot be read here. Python has no getter: they are read from CPython's
    ``PySSLContext`` (``SSL_CTX *ctx; unsigned char *alpn_protocols; unsigned int
    alpn_protocols_len; PyObject *set_sni_cb`` in 3.10 to 3.13), the layout checked by
    finding ``callback``, the context's current ``sni_callback``, where it must be."""
    if _ssl_ctx_ptr(ctx) is None or ctx.sni_callback is not callback:
        return None
    import ctypes

    base = id(ctx) + object.__basicsize__
    size = ctypes.sizeof(ctypes.c_void_p)
    wire_at = ctypes.c_void_p.from_address(base + size).value
    length = ctypes.c_uint.from_address(base + 2 * size).value
    if ctypes.c_void_p.from_address(base + 3 * size).value != id(callback):
        return None
    wire = ctypes.string_at(wire_at, length) if wire_at and length else b""
    protocols: list[str] = []
    i = 0
    while i < len(wire):  # length-prefixed names, as on the wire
        n = wire[i]
        if n == 0 or i + 1 + n > len(wire):
            return None
        protocols.append(wire[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return protocols


class _Swap:
    """The ``sni_callback`` rehydrate puts on an attached server context: it moves each
    new connection to :attr:`current`, a context of its own presenting the material in
    use (``SSLSocket.context = current``, OpenSSL's ``SSL_set_SSL_CTX``). OpenSSL calls
    it for every handshake, also when the client sends no server name.

    Why: a context may not be changed while it serves. ``load_cert_chain`` on a context
    other threads handshake with crashed the process (segfault, heap corruption: OpenSSL
    3.0 under Python 3.11 does not guard it, CPython gh-134698), and a context keeps one
    certificate per key type, so a renewal to another key type left the old certificate
    served. Each renewal builds a fresh context instead; the attached one is never
    touched again.

    ``chained``: the callback the context had before (called first; when it refuses the
    name, rehydrate leaves it; when it moves the connection to a context of its own,
    rehydrate leaves it there — or, when that context is attached too, moves it on to
    that one's :attr:`current`: OpenSSL never runs the callback of the context a
    connection is moved to, so it would present that context's placeholder).

    One per attached context, shared by every handle attached to it (an RSA and an ECDSA
    certificate on one context): :attr:`current` presents each one's :attr:`materials`.
    Kept on the context itself (:func:`_swap_of`), so a callback referring back to the
    context (a bound method of the server holding it) makes an ordinary reference cycle
    the garbage collector frees."""

    def __init__(self, chained: Any) -> None:
        self.current: ssl.SSLContext | None = None
        self.chained = chained
        self.materials: dict[ManagedCertificate, Material] = {}
        """What each attached handle presents here (built under :data:`_SWAP_LOCK`)."""
        self.warned = False
        """The missing-ALPN warning was logged for this context."""
        self.warned_replaced = False
        """The replaced-callback warning was logged for this context."""

    def __call__(self, sslobj: Any, server_name: str | None,
                 ctx: ssl.SSLContext) -> int | None:
        if self.chained is not None:
            alert = self.chained(sslobj, server_name, ctx)
            if alert is not None:
                return cast("int | None", alert)
            target = sslobj.context
            if target is not ctx:
                swap = _swap_of(target)
                if swap is not None and swap.current is not None:
                    sslobj.context = swap.current
                return None
        current = self.current
        if current is not None:
            sslobj.context = current
        return None


_SWAP_LOCK = threading.RLock()
"""Held while a :class:`_Swap`'s context is built and replaced: the handles attached to
one context renew independently, and a build must not replace one that has newer
material of another handle."""
# a fork() while a parent thread builds a fresh context must not leave the child without it
fresh_lock_after_fork(sys.modules[__name__], "_SWAP_LOCK")
_SWAPS: weakref.WeakKeyDictionary[ssl.SSLContext, _Swap] = weakref.WeakKeyDictionary()
"""Swaps of contexts that take no attribute (not an ``ssl.SSLContext`` subclass)."""


def _swap_of(ctx: ssl.SSLContext) -> _Swap | None:
    """The :class:`_Swap` of an attached context (None when not attached)."""
    swap = getattr(ctx, "_rehydrate_swap", None)
    return swap if isinstance(swap, _Swap) else _SWAPS.get(ctx)


def _set_swap(ctx: ssl.SSLContext, swap: _Swap) -> None:
    try:
        ctx._rehydrate_swap = swap  # type: ignore[attr-defined]
    except AttributeError:
        _SWAPS[ctx] = swap


def _fresh_server_context(attached: ssl.SSLContext, swap: _Swap) -> ssl.SSLContext:
    """A new server context with the settings of ``attached`` that OpenSSL takes from the
    context a connection is moved to: trust store (client certificates are verified
    against it), ALPN protocols, security level — and, for good measure, those a
    connection keeps from the context it was made by (verify mode, options, protocol
    versions, ciphers, post-handshake auth). DH parameters chosen by OpenSSL (see
    :func:`_dh_auto`). Session resumption off."""
    new = ssl.SSLContext(attached.protocol)
    new.options = attached.options
    with contextlib.suppress(ValueError):  # only the TLS_* protocols have these
        new.minimum_version = attached.minimum_version
        new.maximum_version = attached.maximum_version
    new.check_hostname = False
    new.verify_mode = attached.verify_mode
    new.check_hostname = attached.check_hostname
    new.verify_flags = attached.verify_flags
    with contextlib.suppress(AttributeError, ValueError):
        new.post_handshake_auth = attached.post_handshake_auth
    below_13 = [c["name"] for c in attached.get_ciphers() if c.get("protocol") != "TLSv1.3"]
    if below_13:
        new.set_ciphers(":".join(below_13) + f":@SECLEVEL={attached.security_level}")
    if not _share_cert_store(attached, new):
        certs = attached.get_ca_certs(binary_form=True)
        if certs:  # what Python can see of the store: files loaded, not lazy directories
            new.load_verify_locations(cadata=b"".join(certs))
    alpn = _alpn_protocols(attached, swap)
    if alpn:
        new.set_alpn_protocols(alpn)
    elif alpn is None and not swap.warned:
        swap.warned = True
        log.warning("tls: the ALPN protocols of an attached server context cannot be read "
                    "here; connections presenting renewed certificates negotiate none")
    if attached.keylog_filename:
        new.keylog_filename = attached.keylog_filename
    _dh_auto(new)
    _no_resumption(new)
    return new


def _dh_auto(ctx: ssl.SSLContext) -> None:
    """Let OpenSSL pick DH parameters matching the key size (``SSL_CTX_set_dh_auto``).

    Why: moving a connection to ``ctx`` replaces its DH parameters with ``ctx``'s, and
    those ``load_dh_params`` put into the attached context cannot be read back from
    Python: without any, a server allowing only DHE cipher suites failed every
    handshake. (A context that never loaded DH parameters now offers DHE too, with
    parameters of at least the key's strength.)"""
    fns, ptr = _libssl(), _ssl_ctx_ptr(ctx)
    if fns is not None and ptr is not None:
        fns[1](ptr, _SSL_CTRL_SET_DH_AUTO, 1, None)


def _slot(public_key: Any) -> str:
    """OpenSSL keeps one certificate/key per key type in a context (RSA, EC, Ed25519 …):
    replacing a key means loading one of the same type."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    if isinstance(public_key, rsa.RSAPublicKey):
        return "rsa-2048"
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        return "ed25519"
    if isinstance(public_key, ed448.Ed448PublicKey):
        return "ed448"
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return "ec-p256"
    return "ec-p256"  # DSA and others: not replaceable by a placeholder of their type


def placeholder_material(slot: str = "ec-p256") -> Material:
    """A throwaway self-signed certificate for a fresh key of the ``slot`` type, trusted by
    nobody: what contexts present while the real key is dropped or could not be renewed.

    EC and Ed25519 keys come from kernel entropy; RSA and Ed448 placeholders from
    ``cryptography``'s generator (fast; the placeholder secures nothing)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ed448, rsa

    from .keys import generate_private_key_pem

    key: Any
    pem: bytearray | None = None
    if slot == "rsa-2048":
        key = rsa.generate_private_key(65537, 2048)
    elif slot == "ed448":
        key = ed448.Ed448PrivateKey.generate()
    else:
        key, pem = generate_private_key_pem(slot)
    subject, san = _names("rehydrate placeholder (no certificate available)", ())
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=1))
        .not_valid_after(now + _dt.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(key, _signing_hash(key))
    )
    return Material(cert, key, (), (), key_buffer=pem)


# -- handles -----------------------------------------------------------------------------


class ManagedCertificate:
    """Base class of the certificate handles. Subclasses implement :meth:`produce`."""

    kind = "certificate"
    regenerates_key = True
    """True when every renewal makes a new key (self-signed, issued): after a restore, a
    failed renewal must not fall back to the key from the snapshot image. False for
    certificates read from files (their key is the file's, the same in every clone)."""

    def __init__(self, name: str, *, required: bool = True, manager: TLSManager) -> None:
        self.name = name
        self.required = required
        self._manager = manager
        self._lock = threading.RLock()
        """Guards the handle's state (short holds)."""
        fresh_lock_after_fork(self)  # kept for the forking thread's own hold (reentrant)
        self._renew_lock = threading.RLock()
        """Serialises read-validate-apply (restore hook, watcher, renew(), drop)."""
        self._material: Material | None = None
        self._placeholder: Material | None = None
        """What the contexts present while there is no usable material (key dropped before
        a snapshot, or the renewal after a restore failed)."""
        self._slots: weakref.WeakKeyDictionary[ssl.SSLContext, set[str]] = \
            weakref.WeakKeyDictionary()
        """Key types this handle loaded into each client context (each holds one key per
        type)."""
        self._served: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()
        """Attached server contexts; each holds its callback moving connections to the
        context presenting the material in use (see :class:`_Swap`, :func:`_swap_of`)."""
        self._own_server: ssl.SSLContext | None = None
        """The server context :meth:`current_server_context` without a context uses."""
        self._presenting: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()
        """Every client context made to present the certificate, also those a renewal
        replaced (an application may still hold one): each holds a private key."""
        self._clients: dict[bool, ssl.SSLContext] = {}
        self._listeners: list[Callable[[ManagedCertificate], None]] = []
        self._unnotified: list[Callable[[ManagedCertificate], None]] | None = None
        """Listeners that failed to take the current material (None: none did): called
        again when the material is re-read unchanged (:meth:`_retry_listeners`)."""
        self._last_error: str | None = None
        self.renewals = 0
        self._hooks: tuple[Hook, ...] = ()
        self._closed = False
        """Set by :meth:`close`: no material is taken any more (no snapshot hook would
        drop its key)."""
        _HANDLES.add(self)

    @property
    def last_error(self) -> str | None:
        """Why the last renewal was rejected, or which listeners failed to take it (None
        after a success). Redacted when set (:func:`rehydrate.extensions.redact`), and
        without the user info and query strings of the URLs it quotes, as a hook error:
        an issuer's or a listener's error may quote a managed secret or a URL's token
        (``…/sign/web?token=hvs.…``), and ``status()``, log lines, :meth:`renew`'s
        error and :attr:`material`'s error show it."""
        return self._last_error

    @last_error.setter
    def last_error(self, text: str | None) -> None:
        self._last_error = None if text is None else _hide(text)

    def __repr__(self) -> str:
        m = self._material
        serial = f"{m.serial:x}" if m else "none"
        return f"<{type(self).__name__} {self.name!r} serial={serial}>"

    # -- material ------------------------------------------------------------------

    def produce(self) -> Material:
        """Build (or read) new material; raise :class:`CertificateError` when unusable."""
        raise NotImplementedError

    @property
    def material(self) -> Material:
        """The current material. Its ``private_key`` is None between the before-snapshot
        pass and the next restore/resume."""
        m = self._material
        if m is None:
            raise CertificateError(f"certificate {self.name!r} has no usable material"
                                   + (f": {self.last_error}" if self.last_error else
                                      " (created after the before-snapshot pass; "
                                      "produced on restore/resume)"))
        return m

    @property
    def key_dropped(self) -> bool:
        """True while the handle holds no private key (dropped before a snapshot, or no
        usable material): contexts present a placeholder."""
        m = self._material
        return m is None or m.private_key is None

    @property
    def certificate(self) -> x509.Certificate:
        return self.material.certificate

    @property
    def private_key(self) -> PrivateKeyTypes:
        key = self.material.private_key
        if key is None:
            raise self._no_key()
        return key

    def _no_key(self) -> CertificateError:
        if self._closed:
            return CertificateError(f"certificate {self.name!r} is closed: its private key "
                                    "was wiped")
        return CertificateError(f"certificate {self.name!r}: the private key was dropped "
                                "before a snapshot; renewed on restore/resume")

    @property
    def serial(self) -> int:
        return self.material.serial

    def renew(self) -> Material:
        """Produce, validate and apply new material now. On failure the previous material
        stays, :attr:`last_error` is set and :class:`CertificateError` raised. Refused
        between the before-snapshot pass and the next restore/resume, and after
        :meth:`close`. When the material comes out unchanged (a file certificate's
        files), the listeners that failed to take it are called again (see
        :meth:`subscribe`): a failure raises; otherwise the restore hook counts as
        recovered, whatever made it fail (the files hold the material in use)."""
        with self._renew_lock:
            if self._closed:  # before produce(): a key made now would never be dropped
                raise CertificateError(f"certificate {self.name!r} is closed")
            if self._manager.frozen:
                raise CertificateError(
                    f"certificate {self.name!r}: keys were dropped before a snapshot; "
                    "renewing now would put a key into the image (renewed on restore)")
            return self._renew_locked()

    def _renew_locked(self) -> Material:
        epoch = self._manager.epoch  # before produce(): an issuer may take long
        failure: Exception | None = None
        try:
            new = self.produce()
        except Exception as exc:
            failure = exc
        if failure is not None:
            # Raised out here, not in the except block: the original would stay attached
            # as __context__, its text (a quoted secret) with it.
            text = str(failure) if isinstance(failure, CertificateError) else (
                f"{type(failure).__name__}: {failure}")
            self.last_error = text
            # itself, unless it (or its cause) quotes a secret or a URL's credentials
            shown = redact_error(failure)
            if isinstance(shown, CertificateError):
                raise shown
            raise CertificateError(self.last_error) from (
                None if isinstance(failure, CertificateError) else shown)
        if self._unchanged(new):
            new.wipe_key()
            self.last_error = None
            self._retry_listeners()
            return self.material
        self.apply(new, epoch=epoch)
        return new

    def _unchanged(self, new: Material) -> bool:
        """True when ``new`` is the material already in use (files re-read unchanged)."""
        cur = self._material
        return (cur is not None and cur.private_key is not None
                and new.private_key is not None
                and cur.certificate == new.certificate
                and cur.chain == new.chain and cur.trust == new.trust
                and _spki(cur.private_key.public_key()) == _spki(new.private_key.public_key()))

    def _load(self, ctx: ssl.SSLContext, material: Material) -> None:
        load_into(ctx, material)
        self._slots.setdefault(ctx, set()).add(_slot(material.certificate.public_key()))

    def apply(self, material: Material, *, epoch: int | None = None) -> None:
        """Make ``material`` current: live server contexts, client contexts, listeners.

        All or nothing for the contexts: material OpenSSL refuses (a key or CA key below
        its security level, which :func:`validate` does not see without a CA bundle) is
        a :class:`CertificateError` and every context keeps serving what it served.

        ``epoch``: the manager's :attr:`TLSManager.epoch` read before the material was
        made; when a snapshot pass or a restore/resume run began since, the material
        existed before it (in the image, the same in every clone) and is discarded."""
        if material.private_key is None:
            raise CertificateError(f"certificate {self.name!r}: material without a key")
        with self._renew_lock:
            with self._lock:
                if self._closed:  # a renewal that outlived close(): nothing drops its key
                    material.wipe_key()
                    raise CertificateError(f"certificate {self.name!r} is closed; the "
                                           "renewed key is discarded")
                if self._manager.frozen:  # a renewal that outlived the snapshot pass
                    material.wipe_key()
                    raise CertificateError(
                        f"certificate {self.name!r}: keys were dropped before a snapshot "
                        "while this renewal ran; its new key is discarded")
                if epoch is not None and epoch != self._manager.epoch:
                    # it outlived a snapshot and the restore after it, or a restore of
                    # the whole process: its key was made before, so every clone has it
                    material.wipe_key()
                    raise CertificateError(
                        f"certificate {self.name!r}: a snapshot or restore happened while "
                        "this renewal ran; its new key is discarded")
                self._load_everywhere(material)
                old, self._material = self._material, material
                if old is not None and old.key_buffer is not material.key_buffer:
                    old.wipe_key()
                self._placeholder = None
                self._clients.clear()
                self.renewals += 1
                self.last_error = None
            errors = self._notify(list(self._listeners), "renewed but: ")
        if errors:
            raise _listeners_failed(f"certificate {self.name!r} renewed but: "
                                    + "; ".join(errors))

    def _notify(self, listeners: list[Callable[[ManagedCertificate], None]],
                prefix: str) -> list[str]:
        """Call ``listeners`` with the current material (caller holds the renewal lock);
        remember those that fail for :meth:`_retry_listeners`, and say so in
        :attr:`last_error` after ``prefix``. When none fails, the certificate's restore
        hook counts as recovered. Returns the errors."""
        errors: list[str] = []
        failed: list[Callable[[ManagedCertificate], None]] = []
        for fn in listeners:
            try:
                fn(self)
            except Exception as exc:
                failed.append(fn)
                errors.append(f"listener {fn!r}: {type(exc).__name__}: {exc}")
        self._unnotified = failed or None
        if errors:
            self.last_error = prefix + "; ".join(errors)
        elif self._hooks:
            # Under the renewal lock: a later run's hook for this certificate waits for
            # it, so this success never takes back that run's failure. By record, not
            # name: a user hook named like this one is not this certificate's.
            self._manager.engine.recovered(self._hooks[0])
        return errors

    def _retry_listeners(self) -> None:
        """The material was re-read unchanged (restore hook, :meth:`renew`, the file
        watcher): call the listeners that failed to take it again (those still
        subscribed) and, when they all take it now — or none had failed — count the
        restore hook as recovered (:meth:`_notify`). Raises :class:`CertificateError`
        while one still fails. Caller holds the renewal lock."""
        # Recovered also with no listener pending: the hook may have failed for another
        # reason (the key file briefly unreadable at the restore, "keeping serial"), and
        # the files now hold what is in use. It also mends a listener retry that took
        # the material in the moment between the hook raising and the run counting its
        # failure: that retry's recovered() found no failure yet to forget.
        pending = self._unnotified or []
        serial = self.material.serial
        prefix = f"serial {serial:x} in use, but still: "
        errors = self._notify([fn for fn in pending if fn in self._listeners], prefix)
        if errors:
            raise _listeners_failed(f"certificate {self.name!r}: {prefix}"
                                    + "; ".join(errors))

    def _load_everywhere(self, material: Material) -> None:
        """Build a fresh context presenting ``material`` for every attached server
        context, then move their new connections to it — all of them, or none when
        OpenSSL refuses the material (every context keeps serving what it served). No
        context that serves is changed (see :class:`_Swap`). (No throwaway context tries
        the material when none is attached: OpenSSL would leave a copy of the key in the
        heap; a context attached later says so, see :meth:`attach`.)"""
        with _SWAP_LOCK:
            served = self._swaps()
            fresh: list[ssl.SSLContext] = []
            try:
                for ctx, swap in served:
                    fresh.append(self._fresh_for(ctx, swap, material))
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                material.wipe_key()
                raise self._refused(exc, "the new certificate") from None
            for (_, swap), new in zip(served, fresh, strict=True):
                swap.materials[self] = material
                swap.current = new

    def _swaps(self) -> list[tuple[ssl.SSLContext, _Swap]]:
        """The attached contexts with their swaps."""
        pairs = []
        for ctx in list(self._served):
            swap = _swap_of(ctx)
            if swap is not None:
                pairs.append((ctx, swap))
        return pairs

    def _fresh_for(self, ctx: ssl.SSLContext, swap: _Swap, material: Material
                   ) -> ssl.SSLContext:
        """A fresh context with the settings of the attached ``ctx``, presenting
        ``material`` and what the other handles attached to ``ctx`` present there (caller
        holds :data:`_SWAP_LOCK`). First puts rehydrate's callback back when the
        application replaced ``ctx.sni_callback`` after :meth:`attach` (its connections
        stopped following renewals): the new callback is chained, and one warning says
        so."""
        if ctx.sni_callback is not swap:
            if not swap.warned_replaced:
                swap.warned_replaced = True
                log.warning("tls: certificate %s: the sni_callback of an attached server "
                            "context was replaced after attach(); until now its new "
                            "connections presented a placeholder. rehydrate's callback is "
                            "back, calling the new one first (set sni_callback before "
                            "attach() to chain it from the start)", self.name)
            swap.chained = ctx.sni_callback
            ctx.sni_callback = swap
        new = _fresh_server_context(ctx, swap)
        for handle, other in swap.materials.items():
            if handle is not self:  # first: this handle's own wins a shared key type
                load_into(new, other)
        load_into(new, material)
        return new

    def _refused(self, exc: BaseException, what: str = "the certificate") -> CertificateError:
        """OpenSSL's refusal (``EE_KEY_TOO_SMALL`` …) as one line naming this handle."""
        reason = getattr(exc, "reason", None) or exc
        return CertificateError(f"certificate {self.name!r}: OpenSSL refuses {what} "
                                f"({reason})")

    def _serving(self) -> Material:
        """What a context should present now: the material, or the placeholder while the
        handle holds no key."""
        m = self._material
        if m is not None and m.private_key is not None:
            return m
        if self._placeholder is None:
            self._placeholder = placeholder_material(
                _slot(m.certificate.public_key()) if m is not None else self._default_slot())
        return self._placeholder

    def _default_slot(self) -> str:
        algorithm = getattr(self, "algorithm", "ec-p256")
        return "rsa-2048" if str(algorithm).startswith("rsa-") else str(algorithm)

    def _install_placeholders(self, placeholders: dict[str, Material]) -> list[str]:
        """Move every attached server context to a fresh one presenting a placeholder
        (letting go of the one with the real key), and load a placeholder of every key
        type this handle put into each presenting client context (so no real key is left
        in any of OpenSSL's per-type slots); forget client contexts. Caller holds both
        locks. Returns errors (client contexts only: a server context whose fresh one
        cannot be built falls back to its own placeholder, see :meth:`attach`)."""
        errors: list[str] = []
        m = self._material
        # every presenting client context, not only the current one: one a renewal
        # replaced still holds its (older, real) key, and would carry it into the image
        self._clients.clear()
        slot = _slot(m.certificate.public_key()) if m is not None else self._default_slot()
        with _SWAP_LOCK:
            for ctx, swap in self._swaps():
                ph = placeholders.get(slot)
                if ph is None:
                    ph = placeholders[slot] = placeholder_material(slot)
                try:
                    swap.current = self._fresh_for(ctx, swap, ph)
                except (OSError, ValueError):
                    # the attached context's own placeholder (see attach) is served
                    # instead: the context holding the real key is let go either way
                    swap.current = None
                swap.materials[self] = ph  # no reference to the real key stays either
        for ctx in list(self._presenting):
            slots = set(self._slots.get(ctx, ()))
            if m is not None:
                slots.add(_slot(m.certificate.public_key()))
            for one in sorted(slots):
                ph = placeholders.get(one)
                if ph is None:
                    ph = placeholders[one] = placeholder_material(one)
                try:
                    self._load(ctx, ph)
                except (OSError, ssl.SSLError) as exc:
                    errors.append(f"context: {exc}")
        self._placeholder = placeholders.get(slot)
        return errors

    def _drop(self, placeholders: dict[str, Material]) -> None:
        """Before a snapshot: forget the private key (keep the certificate) and replace it
        in every context with a placeholder. Raises when a context kept the real key."""
        self._cancel_pending()
        # A renewal stuck in an issuer holds the renew lock: wait for it a little, then
        # drop the key anyway. apply() refuses material while keys are dropped, so what
        # that renewal brings back later is discarded, never put into the image.
        renewing = not self._renew_lock.acquire(timeout=DROP_WAIT)
        try:
            with self._lock:
                m = self._material
                if m is not None and m.private_key is not None:
                    m.wipe_key()
                    self._material = dataclasses.replace(m, private_key=None,
                                                         key_buffer=None)
                errors = self._install_placeholders(placeholders)
        finally:
            if not renewing:
                self._renew_lock.release()
        if renewing:
            log.warning("tls: certificate %s: a renewal still running after %gs; the key "
                        "was dropped anyway and that renewal's result will be discarded",
                        self.name, DROP_WAIT)
        if errors:
            raise CertificateError(f"certificate {self.name!r}: the private key could not be "
                                   "replaced in every context: " + "; ".join(errors))

    def _cancel_pending(self) -> None:
        """Subclasses: stop pending background reloads."""

    def subscribe(self, fn: Callable[[ManagedCertificate], None]
                  ) -> Callable[[ManagedCertificate], None]:
        """Call ``fn(handle)`` after every renewal (usable as a decorator).

        A listener that raises leaves the renewal in place but fails it
        (:class:`CertificateError`, the restore hook failed during a restore); it is
        called again at the next renewal or re-read — also of unchanged files:
        :meth:`renew`, the file watcher, the next restore — and once every listener
        took the material in use, the restore hook counts as recovered
        (:meth:`~rehydrate.Lifecycle.recovered`). No timer retries it."""
        self._listeners.append(fn)
        return fn

    def unsubscribe(self, fn: Callable[[ManagedCertificate], None]) -> None:
        self._listeners.remove(fn)

    # -- ssl contexts --------------------------------------------------------------

    def server_context(self, *, purpose: int = ssl.PROTOCOL_TLS_SERVER) -> ssl.SSLContext:
        """A new server ``SSLContext`` presenting this certificate, kept current, with
        session resumption off (see :meth:`attach`). To serve with: an ``sni_callback``
        of a context rehydrate did not attach must move connections to
        :meth:`current_server_context` instead (this one would present a placeholder)."""
        ctx = ssl.SSLContext(purpose)
        self.attach(ctx)
        return ctx

    def current_server_context(self, ctx: ssl.SSLContext | None = None) -> ssl.SSLContext:
        """The context presenting the material in use right now, for an ``sni_callback``
        of your own to move a connection to (``sslsock.context = ...``): the fresh context
        rehydrate built for ``ctx`` (a context attached to this handle, whose settings it
        has), or without ``ctx`` for a default :meth:`server_context` the handle keeps.

        Why: OpenSSL runs only the ``sni_callback`` of the context a connection began on.
        A connection moved to an attached context by the callback of a context rehydrate
        did not attach presents that context's throwaway placeholder. Renewals replace the
        context: call this in the callback, do not keep what it returns."""
        # No lock but to make the default context: this runs in every handshake that
        # needs it, and a renewal holds the handle's lock while it builds contexts.
        if ctx is None:
            ctx = self._own_server
            if ctx is None:
                with self._lock:
                    if self._own_server is None:
                        self._own_server = self.server_context()
                    ctx = self._own_server
        swap = _swap_of(ctx) if ctx in self._served else None
        if swap is None:
            raise ValueError(f"certificate {self.name!r}: that context is not attached to "
                             "it (attach() it first)")
        current = swap.current
        return current if current is not None else ctx

    def attach(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        """Make the server context ``ctx`` present the current material (the placeholder
        while the handle holds no key) now and after every renewal, and turn off session
        resumption on it (:func:`_no_resumption`): a session from before a snapshot must
        not skip the renewed certificate on a restored clone.

        ``ctx`` itself is changed only here — call it before serving: it gets a
        throwaway placeholder certificate and an ``sni_callback`` that moves each new
        connection to a context of rehydrate's presenting the material in use (see
        :class:`_Swap`; a callback ``ctx`` already had is called first). That context is
        built afresh at every renewal with ``ctx``'s settings as they are then (verify
        mode, ALPN protocols, options, protocol versions, ciphers; the trust store is
        shared), so a setting changed after attach reaches new connections from the next
        renewal on. A connection's ``context``
        attribute is that context, not ``ctx``. Assigning ``ctx.sni_callback`` after
        attach stops the moves: new connections present the placeholder until the next
        renewal puts rehydrate's callback back (chaining yours, one warning).

        Several handles may be attached to one context (an RSA and an ECDSA certificate:
        OpenSSL picks the one the client supports): its fresh context presents each
        one's material in use (of two of one key type, the one renewed last)."""
        with self._lock, _SWAP_LOCK:
            if ctx in self._served:
                return ctx
            swap = _swap_of(ctx)
            first = swap is None
            if swap is None:
                swap = _Swap(ctx.sni_callback)
                cache_off = _no_resumption(ctx)  # first: the fresh context copies options
            else:  # attached to another handle already: ctx serves, and is not changed
                cache_off = True
            material = self._serving()
            try:
                if first:
                    load_into(ctx, placeholder_material())
                    ctx.sni_callback = swap
                new = self._fresh_for(ctx, swap, material)
            except (OSError, ValueError) as exc:
                if first:
                    ctx.sni_callback = swap.chained
                raise self._refused(exc) from None
            swap.materials[self] = material
            swap.current = new
            if first:
                _set_swap(ctx, swap)
            self._served.add(ctx)
        if not cache_off:
            log.warning("tls: certificate %s: OpenSSL's session cache of a server context "
                        "could not be turned off here; after a restore, TLS 1.2 clients "
                        "can resume sessions from before the snapshot", self.name)
        return ctx

    def detach(self, ctx: ssl.SSLContext) -> None:
        """Stop presenting this certificate on ``ctx`` and renewing it there: new
        connections move at once to a fresh context presenting what the other handles
        attached to ``ctx`` present; with none, ``ctx`` presents its own throwaway
        placeholder until a handle is attached again (connections already made keep
        theirs). To switch ``ctx`` to another certificate without a placeholder in
        between, attach the other handle first.

        Why not keep presenting the last material: the before-snapshot pass visits only
        attached contexts, so the key in it would go into every snapshot image and serve
        in every clone."""
        with self._lock, _SWAP_LOCK:
            if ctx in self._served:
                self._served.discard(ctx)
                swap = _swap_of(ctx)
                if swap is not None:
                    self._leave(ctx, swap)

    def client_context(self, *, present: bool = False) -> ssl.SSLContext:
        """A client context trusting this certificate's trust anchors (and presenting
        the certificate for mutual TLS when ``present``). Rebuilt after each renewal:
        call again (or subscribe) to get the current one."""
        with self._lock:
            ctx = self._clients.get(present)
            if ctx is None:
                m = self.material
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                if m.trust:
                    ctx.load_verify_locations(cadata=m.trust_pem())
                if present:
                    if m.private_key is None:
                        raise self._no_key()
                    try:
                        self._load(ctx, m)
                    except ssl.SSLError as exc:
                        raise self._refused(exc) from None
                    self._presenting.add(ctx)
                self._clients[present] = ctx
            return ctx

    # -- lifecycle -----------------------------------------------------------------

    def _on_restore(self, ctx: RestoreContext) -> None:
        kind = getattr(ctx, "kind", "restore")
        with self._renew_lock:
            # close() does not wait for this hook (a restore run may have queued it, or be
            # in it, when the handle is closed): a closed handle serves nothing and its
            # key is gone, so there is nothing to renew and nothing failed.
            if self._closed:
                self._log_closed(kind)
                return
            previous = self._material
            held = previous is not None and previous.private_key is not None
            if not self._manager.active:
                if held:
                    log.info("tls disabled: certificate %s NOT renewed", self.name)
                    return
                log.info("tls disabled, but certificate %s holds no key (dropped before "
                         "the snapshot): renewing it anyway", self.name)
            try:
                self._renew_locked()
                return
            except CertificateError as exc:
                error = exc
            # Decided under the lock close() sets the flag under. Closed while produce()
            # ran (apply() refused, and wiped, the new key) or since: no failure, and no
            # placeholder or change to the material close() left readable.
            with self._lock:
                if self._closed:
                    self._log_closed(kind)
                    return
                if self._material is not previous or error._in_use:
                    raise error  # the material is in use: a listener failed to take it
                if held and previous is not None and (kind == "resume"
                                                      or not self.regenerates_key):
                    # a resumed original keeps its own key; a file key is the same
                    # everywhere
                    detail = str(error).removeprefix(f"certificate {self.name!r}: ")
                    raise CertificateError(f"certificate {self.name!r}: {detail}; keeping "
                                           f"serial {previous.serial:x}") from None
                # A restored clone must not serve the key from the snapshot image (every
                # clone would share it), and a dropped key is gone: present a fresh
                # placeholder.
                if previous is not None:
                    previous.wipe_key()
                self._material = None
                self._install_placeholders({})
                self.last_error = str(error)
            raise CertificateError(
                f"certificate {self.name!r}: {error}; no certificate available, serving a "
                "throwaway self-signed placeholder (fresh key) until a renewal succeeds"
            ) from None

    def _log_closed(self, kind: str) -> None:
        log.info("tls: certificate %s was closed: not renewed on %s", self.name, kind)

    def close(self) -> None:
        """Stop managing this certificate, and let go of its private key: no snapshot hook
        drops it any more, so a key kept would go into every snapshot image and serve in
        every clone.

        The key is wiped (``certificate`` and ``serial`` stay readable, ``private_key``
        raises) and a renewal still running is discarded: its key is wiped; its restore
        hook, running or still to run in a restore/resume under way, ends without
        failing (nothing to renew: one INFO line), as does a file re-read under way.
        Every server context it is attached to is detached from it and moved to a fresh
        context presenting what the other handles attached there present; a context no
        other handle is attached to presents its own throwaway placeholder from then on
        (see :meth:`attach`).
        Mutual-TLS client contexts it made get a placeholder of each key type they held."""
        self._manager.remove(self)
        with self._lock:
            self._closed = True
            m = self._material
            if m is not None and m.private_key is not None:
                m.wipe_key()
                self._material = dataclasses.replace(m, private_key=None, key_buffer=None)
            with _SWAP_LOCK:
                for ctx, swap in self._swaps():
                    self._served.discard(ctx)
                    self._leave(ctx, swap)
            errors = self._install_placeholders({})  # detached above: client contexts only
        if errors:
            raise CertificateError(f"certificate {self.name!r} closed, but its private key "
                                   "could not be replaced in every context: "
                                   + "; ".join(errors))

    def _leave(self, ctx: ssl.SSLContext, swap: _Swap) -> None:
        """Take this handle's material out of ``swap`` and move the attached ``ctx``'s new
        connections to a fresh context presenting what the other handles attached to it
        present — none left, or one OpenSSL refuses now: to ``ctx`` itself, its
        placeholder (caller holds :data:`_SWAP_LOCK`). Why not keep the context in use:
        it holds this handle's key, and nothing would drop it before a snapshot."""
        swap.materials.pop(self, None)
        swap.current = None
        if swap.materials:
            handle, material = next(reversed(swap.materials.items()))
            with contextlib.suppress(OSError, ValueError):
                swap.current = handle._fresh_for(ctx, swap, material)

    def _discard(self) -> None:
        """A handle :meth:`TLSManager.add` did not keep (failed, or the name exists):
        wipe what it made."""
        if self._material is not None:
            self._material.wipe_key()

    def status(self) -> dict[str, Any]:
        m = self._material
        return {
            "kind": self.kind,
            "key_dropped": self.key_dropped,
            "serial": f"{m.serial:x}" if m else None,
            "not_after": m.not_after.isoformat() if m else None,
            "renewals": self.renewals,
            "error": self.last_error,
        }


def _signing_hash(key: Any) -> Any:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ed448, ed25519

    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return None
    return hashes.SHA256()


def _san_list(sans: Sequence[str] | str) -> tuple[str, ...]:
    """``sans`` as a tuple of names: one string is one name (``tuple("localhost")`` would
    be nine one-letter names), anything else must hold only strings."""
    if isinstance(sans, str):
        return (sans,)
    names = tuple(sans)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"sans must be non-empty strings (DNS names or IP addresses), "
                        f"not {_config.shown(bad[0])}")
    return names


def _names(common_name: str, sans: Sequence[str]) -> tuple[Any, Any]:
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    general: list[x509.GeneralName] = []
    for san in sans or (common_name,):
        try:
            general.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            general.append(x509.DNSName(san))
    return subject, x509.SubjectAlternativeName(general)


SIGNING_ALGORITHMS: tuple[str, ...] = ("ec-p256", "ec-p384", "ed25519", "rsa-2048",
                                       "rsa-3072", "rsa-4096")
"""The key algorithms a certificate can be made for (``x25519`` only agrees keys)."""


def _signing_algorithm(name: str, algorithm: str) -> str:
    """``algorithm`` when a certificate's key can be of it, else one line naming the
    certificate and the algorithms that can sign (generating the key first ended in
    cryptography's "Key must be an rsa, dsa, ec…" without either)."""
    if algorithm in SIGNING_ALGORITHMS:
        return algorithm
    why = " (a key-exchange algorithm: it cannot sign)" if algorithm == "x25519" else ""
    raise CertificateError(f"certificate {name!r}: algorithm {_config.shown(algorithm)}"
                           f"{why} cannot be used for a certificate; choose one of "
                           + ", ".join(SIGNING_ALGORITHMS))


class SelfSignedCertificate(ManagedCertificate):
    """A self-signed certificate: new key, serial and validity on every restore."""

    kind = "self-signed"

    def __init__(self, name: str, *, common_name: str = "localhost",
                 sans: Sequence[str] = ("localhost", "127.0.0.1"),
                 algorithm: str = "ec-p256", valid_for: _dt.timedelta = _dt.timedelta(days=7),
                 required: bool = True, manager: TLSManager) -> None:
        algorithm = _signing_algorithm(name, algorithm)
        super().__init__(name, required=required, manager=manager)
        self.common_name = common_name
        self.sans = _san_list(sans)
        self.algorithm = algorithm
        self.valid_for = valid_for

    def produce(self) -> Material:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        from .keys import generate_private_key_pem

        raw_key, pem = generate_private_key_pem(self.algorithm)
        key = cast("CertificateIssuerPrivateKeyTypes", raw_key)
        subject, san = _names(self.common_name, self.sans)
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())  # os.urandom: fresh per clone
            .not_valid_before(now - _dt.timedelta(minutes=1))
            .not_valid_after(now + self.valid_for)
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(key, _signing_hash(key))
        )
        return Material(cert, key, (), (cert,), key_buffer=pem)


class Issuer(Protocol):
    """Turns a CSR into a certificate. ``issue`` returns (certificate, chain), where the
    chain lists the intermediates (and optionally the root) in order."""

    def issue(self, csr: x509.CertificateSigningRequest
              ) -> tuple[x509.Certificate, list[x509.Certificate]]: ...


_CERT_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
_KEY_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]*PRIVATE KEY)-----.+?-----END \1-----", re.S)


def _key_block(data: bytearray) -> bytearray:
    """The first private-key PEM block of ``data`` in a new buffer, ``data`` wiped; ``data``
    itself when it holds none (the parser then says what is wrong with it).

    A bundle.pem given as the key file holds certificates too: kept whole, every parse and
    every context load reads them ahead of the key, a path on which a scan once found the
    key's text in freed heap (the key-only file never showed it)."""
    found = _KEY_BLOCK.search(data)
    if found is None:
        return data
    block = bytearray(found.end() - found.start() + 1)
    # view to view: a bytearray slice assigned from a memoryview goes through an unwiped
    # temporary bytearray (CPython), one more copy of the key text in freed heap
    with memoryview(data) as view, memoryview(block) as into:
        into[:-1] = view[found.start():found.end()]
        into[-1] = 0x0A  # the block ends with its newline
    wipe(data)
    return block


def _load_pem_list(data: bytes | bytearray, what: str) -> list[x509.Certificate]:
    from cryptography import x509

    # Only the certificate blocks are copied (cryptography wants bytes, which cannot be
    # wiped): a bundle.pem holding the key too leaves no copy of the key's text behind.
    found = list(_CERT_BLOCK.finditer(data))
    if len(found) != data.count(b"-----BEGIN CERTIFICATE-----"):
        # A file cut off (a partial write, a full disk, read while being written): only
        # its whole blocks used to be read, so a fullchain.pem missing its intermediate
        # replaced a good chain and every client's verification failed. OpenSSL refuses
        # such a file too.
        raise CertificateError(f"{what} is not valid PEM: cut off (a certificate in it has "
                               "no END line)")
    blocks = b"\n".join(bytes(m.group(0)) for m in found)
    try:
        certs = x509.load_pem_x509_certificates(blocks)
    except ValueError:
        if b"-----BEGIN " in data and b"CERTIFICATE-----" not in data:
            # valid PEM of something else: the usual mistake is a key given as the cert
            raise CertificateError(f"{what} holds no certificate (PEM of another kind: a "
                                   "key given as the certificate?)") from None
        raise CertificateError(f"{what} is not valid PEM") from None
    if not certs:
        raise CertificateError(f"{what} holds no certificate")
    return certs


MAX_ISSUER_RESPONSE = 1024 * 1024
"""Largest issuer response :class:`HTTPIssuer` reads (a certificate chain is a few KiB)."""


class HTTPIssuer:
    """POSTs ``{"csr": "<PEM>"}`` as JSON to ``url`` and reads
    ``{"certificate": "<PEM>", "chain": ["<PEM>", …]}`` back (httpx).

    ``verify``: passed to httpx (True, a CA bundle path or an ``SSLContext``).
    ``trust``: CA certificates (or a PEM bundle path) the issued chain must verify
    against, and that clients of the certificate should trust. Default: the last
    certificate of the returned chain, when it is self-signed.

    ``timeout`` bounds the whole request — connect, send, and a response however slowly
    it trickles in — not each read; a response over ``max_response`` bytes (default
    1 MiB) is refused as soon as it is seen to be. The request runs in a worker thread
    that holds no lock: when the deadline passes, :meth:`issue` fails at once and the
    worker, abandoned, ends at its next read.
    """

    def __init__(self, url: str, *, headers: dict[str, str] | None = None,
                 timeout: float = 10.0, verify: Any = True,
                 trust: Sequence[x509.Certificate] | str | os.PathLike[str] | None = None,
                 max_response: int = MAX_ISSUER_RESPONSE) -> None:
        # the one rule for seconds: 10**400 passed a "> 0 and finite" check, then failed
        # every issue() with OverflowError in the worker's join
        timeout = _config.seconds(timeout, "HTTPIssuer timeout")
        self.url = url
        self.shown_url = without_credentials(url)
        """``url`` for messages, logs and ``status()``: no user info, query or fragment
        (where tokens go)."""
        self.headers = dict(headers or {})
        for name, value in self.headers.items():
            # Checked here, never quoting the value: httpx's refusal of such a header
            # quotes it (a bearer token read with its newline) into errors and status.
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError("HTTPIssuer headers must map str names to str values")
            if any(c in name + value for c in "\r\n\0"):
                raise ValueError(f"HTTPIssuer header {name!r}: its value (not shown) or "
                                 "name holds a line break or NUL; strip it (a token read "
                                 "from a file keeps its newline)")
        self.timeout = timeout
        self.max_response = max_response
        self.verify = verify
        if isinstance(trust, (str, os.PathLike)):
            trust = _load_pem_list(_read(os.fspath(trust), "CA bundle"),
                                   f"CA bundle {os.fspath(trust)}")
        self.trust: tuple[x509.Certificate, ...] = tuple(trust or ())

    def __repr__(self) -> str:
        return f"<HTTPIssuer {self.shown_url}>"

    def issue(self, csr: x509.CertificateSigningRequest
              ) -> tuple[x509.Certificate, list[x509.Certificate]]:
        import httpx
        from cryptography.hazmat.primitives import serialization

        pem = csr.public_bytes(serialization.Encoding.PEM).decode()
        deadline = time.monotonic() + self.timeout
        outcome: list[Any] = []
        done = threading.Event()

        def post() -> None:
            try:
                outcome.append(self._post(httpx, pem, deadline))
            except BaseException as exc:
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=post, name="rehydrate-tls-issuer", daemon=True).start()
        if not done.wait(self.timeout):
            raise CertificateError(f"issuer {self.shown_url} did not answer within "
                                   f"{self.timeout:g}s")
        result = outcome[0]
        if isinstance(result, CertificateError):
            raise result
        if isinstance(result, httpx.HTTPError):
            # A protocol error's message may quote what was sent (headers: tokens)
            detail = (type(result).__name__ if isinstance(result, httpx.ProtocolError)
                      else f"{type(result).__name__}: {result}")
            raise CertificateError(f"issuer {self.shown_url} unreachable: {detail}") from None
        if isinstance(result, BaseException):
            raise result
        status, body = cast("tuple[int, bytes]", result)
        if status != 200:
            raise CertificateError(f"issuer {self.shown_url} answered HTTP {status}")
        return self._parse(body)

    def _post(self, httpx: Any, pem: str, deadline: float) -> tuple[int, bytes]:
        """The request, streamed: each read waits at most until ``deadline`` and the
        body stops at ``max_response`` bytes."""
        body = bytearray()
        with httpx.stream("POST", self.url, json={"csr": pem}, headers=self.headers,
                          timeout=self.timeout, verify=self.verify) as resp:
            if resp.status_code != 200:
                return resp.status_code, b""
            for chunk in resp.iter_bytes():  # decoded: a compressed bomb is capped too
                body += chunk
                if len(body) > self.max_response:
                    raise CertificateError(f"issuer {self.shown_url} sent more than "
                                           f"{self.max_response} bytes")
                if time.monotonic() > deadline:
                    raise CertificateError(f"issuer {self.shown_url} did not answer within "
                                           f"{self.timeout:g}s")
        return 200, bytes(body)

    def _parse(self, body: bytes) -> tuple[x509.Certificate, list[x509.Certificate]]:
        import json

        try:
            data = json.loads(body)
            cert_pem = data["certificate"]
            chain_pem = data.get("chain") or []
            if not isinstance(cert_pem, str) or not isinstance(chain_pem, list):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CertificateError(f"issuer {self.shown_url} returned no JSON "
                                   '{"certificate": PEM, "chain": [...]}') from None
        cert = _load_pem_list(cert_pem.encode(), f"certificate from issuer {self.shown_url}")[0]
        chain = [c for p in chain_pem
                 for c in _load_pem_list(str(p).encode(), f"chain from issuer {self.shown_url}")]
        return cert, chain


class IssuedCertificate(ManagedCertificate):
    """A certificate issued by an :class:`Issuer` for a fresh key on every restore."""

    kind = "issued"

    def __init__(self, name: str, issuer: Issuer, *, common_name: str,
                 sans: Sequence[str] = (), algorithm: str = "ec-p256",
                 required: bool = True, manager: TLSManager) -> None:
        algorithm = _signing_algorithm(name, algorithm)
        super().__init__(name, required=required, manager=manager)
        self.issuer = issuer
        self.common_name = common_name
        self.sans = _san_list(sans)
        self.algorithm = algorithm

    def produce(self) -> Material:
        from .keys import generate_private_key_pem

        raw_key, pem = generate_private_key_pem(self.algorithm)
        key = cast("CertificateIssuerPrivateKeyTypes", raw_key)
        try:
            return self._issue(key, pem)
        except BaseException:
            if pem is not None:
                wipe(pem)
            raise

    def _issue(self, key: CertificateIssuerPrivateKeyTypes, pem: bytearray | None
               ) -> Material:
        from cryptography import x509

        subject, san = _names(self.common_name, self.sans)
        csr = (x509.CertificateSigningRequestBuilder().subject_name(subject)
               .add_extension(san, critical=False).sign(key, _signing_hash(key)))
        cert, chain = self.issuer.issue(csr)
        trust = tuple(getattr(self.issuer, "trust", ()) or ())
        if not trust and chain and chain[-1].subject == chain[-1].issuer:
            trust = (chain[-1],)
        intermediates = tuple(c for c in chain if c not in trust)
        validate(cert, key, intermediates, trust)
        return Material(cert, key, intermediates, trust, key_buffer=pem)


MAX_PEM_BYTES = 4 * 1024 * 1024
"""Largest certificate, key or CA bundle file read (a bigger one is an error)."""


def _read(path: str, what: str) -> bytearray:
    """A certificate/key/CA file: regular files only, opened without blocking, at most
    :data:`MAX_PEM_BYTES` (``/dev/zero`` or a FIFO named as a certificate is one clear
    error, not a hang or a MemoryError)."""
    try:
        return read_regular(path, MAX_PEM_BYTES)
    except OSError as exc:
        raise CertificateError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


_ENCRYPTED_PEM = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")
"""How an encrypted PEM private key announces itself (PKCS#8, and OpenSSL's traditional
PEM encryption): only such a key makes :func:`from_files` read its password."""

Password: TypeAlias = (Secret | SecretSource | Callable[[], bytes | bytearray | str] | bytes
                       | bytearray | str)
"""What ``password=`` takes: a :class:`~rehydrate.secrets.Secret`, a callable returning
the password, or the password itself (see :class:`~rehydrate.secrets.SecretSource`)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _password_source(password: Password, manager: TLSManager) -> SecretSource:
    source = password if isinstance(password, SecretSource) else SecretSource(
        password, what="key password")
    secret = source.secret
    if secret is not None and secret._manager.engine is not manager.engine:
        raise ValueError(f"the key password secret {secret.name!r} belongs to another "
                         "engine: its reload would not run before this certificate's "
                         "(create it with the same engine=)")
    return source


class FileCertificate(ManagedCertificate):
    """PEM files: certificate (leaf first, then intermediates), key, optional CA bundle."""

    kind = "files"
    regenerates_key = False

    def __init__(self, name: str, *, cert: str, key: str, ca: str | None = None,
                 password: Password | None = None, watch: bool = True,
                 poll: bool | None = None, poll_interval: float = 1.0,
                 debounce: float = 0.2, required: bool = True, manager: TLSManager) -> None:
        # First: a password of the wrong kind (or a Secret of another engine) is refused
        # before anything is read or kept.
        self._password = _password_source(password, manager) if password is not None \
            else None
        # A SecretSource the caller made may serve other certificates too: only one made
        # here from a plain value is this handle's to wipe.
        self._owns_password = password is not None and not isinstance(password, SecretSource)
        super().__init__(name, required=required, manager=manager)
        self.cert_path = os.fspath(cert)
        self.key_path = os.fspath(key)
        self.ca_path = os.fspath(ca) if ca is not None else None
        self.debounce = debounce
        self.poll_interval = poll_interval
        self.polling = _use_polling() if poll is None else poll
        self._observer: Any = None
        self._timer: threading.Timer | None = None
        self._logged_error: str | None = None
        self._watch = watch
        self._warned_plain = False

    def produce(self) -> Material:
        return self._read_files()

    def _read_files(self) -> Material:
        cert_data = _read(self.cert_path, "certificate file")
        try:  # wiped: it may be one bundle.pem holding the key as well
            certs = _load_pem_list(cert_data, f"certificate file {self.cert_path}")
        finally:
            wipe(cert_data)
        key_data = _key_block(_read(self.key_path, "key file"))
        encrypted = any(marker in key_data for marker in _ENCRYPTED_PEM)
        try:
            key = self._load_key(key_data, encrypted)
            trust: list[x509.Certificate] = []
            if self.ca_path is not None:
                trust = _load_pem_list(_read(self.ca_path, "CA bundle"),
                                       f"CA bundle {self.ca_path}")
            leaf, chain = certs[0], tuple(certs[1:])
            validate(leaf, key, chain, trust)
        except BaseException:
            wipe(key_data)
            raise
        if encrypted:  # contexts cannot load it without the password
            wipe(key_data)
            return Material(leaf, key, chain, tuple(trust))
        return Material(leaf, key, chain, tuple(trust), key_buffer=key_data)

    def _load_key(self, data: bytearray, encrypted: bool) -> PrivateKeyTypes:
        """The private key in ``data``; the password is read only for an encrypted key,
        lent for the load and wiped (or released) right after it. Every failure is one
        :class:`CertificateError` line naming the file — never the password or key text."""
        from cryptography.hazmat.primitives import serialization

        source, where = self._password, f"key file {self.key_path}"
        error: str | None = None
        try:
            if not encrypted:
                return serialization.load_pem_private_key(data, password=None)
            if source is None:
                error = f"{where} is encrypted and no password was given (password=)"
            else:
                with source.lend() as password:
                    if password is not None:
                        # typed bytes, but any buffer is read in place: no bytes copy
                        key = serialization.load_pem_private_key(
                            data, password=cast(bytes, password))
                        if source.kind == "plain" and not self._warned_plain:
                            self._warned_plain = True
                            log.warning("tls: certificate %s: its key password was given as "
                                        "plain bytes/str, which rehydrate keeps to re-read "
                                        "the key after a restore or a file change, so it is "
                                        "in every snapshot image; pass a "
                                        "rehydrate.secrets.Secret or a callable to keep it "
                                        "out", self.name)
                        return key
                error = (f"{where} is encrypted and its password, given as plain "
                         "bytes/str, was wiped when the certificate was closed")
        except SecretError as exc:
            error = f"password for {where}: {_one_line(exc)}"
        except TypeError as exc:  # cryptography: encrypted without a password, or not
            error = f"{where} is not a usable PEM private key ({_one_line(exc)})"
        except ValueError as exc:
            if not encrypted:
                error = f"{where} is not a usable PEM private key ({_one_line(exc)})"
            elif "password" in str(exc).lower():
                error = f"{where}: wrong password (the key could not be decrypted)"
            else:
                # A wrong password decrypts to garbage whose padding is valid about once
                # in 256 tries: cryptography then reports a parse error of the inner key,
                # not a bad decrypt; a damaged file reports the same. Say both.
                error = (f"{where}: wrong password, or not a usable PEM private key "
                         f"({_one_line(exc)})")
        # raised out here, not in an except block: no chained exception carries the
        # source's or cryptography's error along
        raise CertificateError(error)

    # -- watching ------------------------------------------------------------------

    def start_watching(self) -> None:
        """Follow the files (inotify, or polling under gVisor): changes are re-read and,
        when valid, applied. Done by :func:`from_files` (unless ``watch=False``); call it
        in a child of ``fork()`` that serves the certificate, which does not watch
        otherwise. Idempotent; nothing happens for a handle made with ``watch=False``."""
        if not self._watch or self._observer is not None:
            return
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        if self.polling:
            from watchdog.observers.polling import PollingObserver

            observer: Any = PollingObserver(timeout=self.poll_interval)
        else:
            from watchdog.observers import Observer

            observer = Observer()
        handle = self

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in READ_ONLY_EVENTS:
                    return
                handle._schedule_reload()

        dirs = {os.path.dirname(os.path.abspath(p)) for p in
                (self.cert_path, self.key_path, self.ca_path) if p is not None}
        for d in sorted(dirs):
            observer.schedule(_Handler(), d, recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def stop_watching(self) -> None:
        """Stop following the files (they are still re-read on restore and ``renew()``)."""
        obs, self._observer = self._observer, None
        if self._timer is not None:
            self._timer.cancel()
        if obs is not None:
            obs.stop()
            obs.join(timeout=5)

    def _forget_watcher_in_child(self) -> None:
        """In a child of ``fork()``: the parent's watcher threads did not come along, so
        the inherited observer watches nothing here (``status()`` said it did). It is
        forgotten, not stopped: its inotify instance and wake-up pipe are the parent's
        too, and stopping it (``close()`` in the child) removed the parent's watches, so
        the parent stopped following its files. No watcher is started here: a fork
        handler runs in every child (a ``subprocess`` with ``preexec_fn``, each worker of
        a ``multiprocessing`` pool), and a thread and an inotify instance per child and
        certificate would run into the per-user inotify limit. A child that serves
        (a pre-fork server's worker) calls :meth:`start_watching` to follow the files;
        otherwise they are re-read on its restores and ``renew()``."""
        # Dropped, not cancelled: its thread stayed in the parent, and cancel() takes a
        # lock that thread may have held at the fork.
        self._observer = self._timer = None

    def _schedule_reload(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.debounce, self.reload_if_changed)
            self._timer.daemon = True
            self._timer.start()

    def _cancel_pending(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def reload_if_changed(self) -> bool:
        """Re-read the files; apply them when they hold new, valid material. A rejected
        change keeps the previous material and logs one line (once per distinct error).
        Returns True when new material was applied — also when a listener then failed to
        take it (one line saying so). Unchanged files get the listeners that failed to
        take them called again (one line while one still fails; see
        :meth:`~ManagedCertificate.subscribe`), and count as a recovery of the restore
        hook when none fails (one that failed for another reason too: the files now hold
        what is in use). Does nothing between the before-snapshot pass and the next
        restore/resume (the restore re-reads the files), nor once :meth:`close` began
        to take effect (one INFO line when it did so during the re-read).
        """
        with self._renew_lock:  # read, validate and apply as one step (watcher vs restore)
            if self._manager.frozen or self._closed:
                return False
            epoch = self._manager.epoch
            try:
                new = self.produce()
            except Exception as exc:
                self._rejected(exc)
                return False
            self._logged_error = None
            if self._unchanged(new):
                new.wipe_key()
                self.last_error = None
                try:  # the listeners that failed to take these files get another go
                    self._retry_listeners()
                except CertificateError as exc:  # last_error set by _notify()
                    log.warning("tls: %s", exc)
                return False
            try:
                self.apply(new, epoch=epoch)
            except CertificateError as exc:
                return self._not_applied(exc, new)
            log.info("tls: certificate %s reloaded from files (serial %x)", self.name,
                     new.serial)
            return True

    def _rejected(self, exc: Exception) -> None:
        """:meth:`reload_if_changed` could not read the files: say so (once per error)."""
        if self._closed:  # closed meanwhile (its password wiped): nothing was rejected
            log.info("tls: certificate %s was closed: not reloaded", self.name)
            return
        msg = str(exc) if isinstance(exc, CertificateError) else (
            f"{type(exc).__name__}: {exc}")
        self.last_error = msg
        if msg != self._logged_error:
            self._logged_error = msg
            prev = self._material
            log.warning("tls: certificate %s: rejected new files (%s); keeping %s",
                        self.name, msg,
                        f"serial {prev.serial:x}" if prev and not self.key_dropped
                        else "no certificate (placeholder)")

    def _not_applied(self, exc: CertificateError, new: Material) -> bool:
        """:meth:`reload_if_changed`'s apply() raised: say so; True when ``new`` was
        applied all the same (only a listener failed to take it)."""
        if self._closed:  # closed while the files were read: apply() wiped the key
            log.info("tls: certificate %s was closed: not reloaded", self.name)
            return False
        if exc._in_use:
            log.warning("tls: certificate %s reloaded from files (serial %x) but: %s",
                        self.name, new.serial,
                        str(self.last_error).removeprefix("renewed but: "))
            return True
        self.last_error = str(exc)
        log.warning("tls: %s; keeping %s", exc, f"serial {self._material.serial:x}"
                    if self._material is not None and not self.key_dropped
                    else "no certificate (placeholder)")
        return False

    def close(self) -> None:
        self.stop_watching()
        try:
            super().close()
        finally:
            # After the closed flag: a restore hook's produce() that then fails for want
            # of the password finds the handle closed (nothing failed), not a failed
            # renewal.
            self._wipe_password()

    def _discard(self) -> None:
        super()._discard()
        self._wipe_password()

    def _wipe_password(self) -> None:
        if self._password is not None and self._owns_password:
            self._password.wipe()  # a plain password is kept until then

    def status(self) -> dict[str, Any]:
        out = super().status()
        out["watching"] = ("poll" if self.polling else "inotify") if self._observer else None
        return out


def _use_polling() -> bool:
    forced = _config.choice("REHYDRATE_WATCH")
    if forced in ("poll", "polling"):
        return True
    if forced in ("inotify", "native"):
        return False
    from ._gvisor import running_under_gvisor

    return running_under_gvisor()


class TLSManager:
    """The managed certificates of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.enabled = True
        self._lock = threading.Lock()
        self._certs: dict[str, ManagedCertificate] = {}
        self._busy: dict[str, tuple[int, object]] = {}
        """Names an :meth:`add` or a :meth:`remove` is working on (by this lock), with the
        ident of the thread doing it and a token of that very call: another add of the
        name waits for it to finish, and only the call that claimed it releases it."""
        self._idle = threading.Condition(self._lock)
        """Notified when a name leaves :attr:`_busy`."""
        fresh_lock_after_fork(self, "_lock", "_idle", after=_forget_others_busy)

        self.frozen = engine.snapshot_pending
        """True between the before-snapshot pass and the next restore/resume: private keys
        are dropped, renewals are refused and certificates added meanwhile get their first
        material on restore."""
        self.epoch = 0
        """+1 at every before-snapshot pass and restore/resume run: a renewal that began
        before one of them (an issuer that took long) has its material discarded."""
        engine.builtins.register(self._on_snapshot, event="snapshot", phase=Phase.SECRETS,
                                 order=100, name="rehydrate.tls", timeout=60.0)
        engine.builtins.register(self._on_restore, phase=Phase.SECRETS, order=99,
                                 name="rehydrate.tls", timeout=5.0)
        engine.add_status("tls", lambda: {c.name: c.status() for c in self.certificates()})

    @property
    def active(self) -> bool:
        return self.enabled and not is_disabled("tls", "secrets")

    def _on_snapshot(self) -> None:
        if not self.active:
            log.info("tls disabled: certificate private keys NOT dropped before snapshot")
            return
        with self._lock:  # set first: add() checks it under this lock
            self.frozen = True
            self.epoch += 1
        placeholders: dict[str, Material] = {}  # one per key type for this pass
        errors: list[str] = []
        for cert in self.certificates():
            try:
                cert._drop(placeholders)
            except CertificateError as exc:
                errors.append(str(exc))
        if errors:
            raise CertificateError("; ".join(errors))

    def _on_restore(self) -> None:
        # before the certificates' own hooks (order 100), which renew them
        with self._lock:
            self.frozen = False
            self.epoch += 1

    def certificates(self) -> list[ManagedCertificate]:
        with self._lock:
            return list(self._certs.values())

    def get(self, name: str) -> ManagedCertificate | None:
        with self._lock:
            return self._certs.get(name)

    def add(self, cert: ManagedCertificate) -> ManagedCertificate:
        """Produce the first material (raises :class:`CertificateError` when unusable),
        register the restore hook, start watching files — or return the handle that
        already exists under the name (a :class:`ValueError` naming it when it is of
        another kind; ``cert`` is then discarded).

        One name at a time: a call for a name another thread is adding (or closing)
        waits until that is done, then returns that handle (or makes its own when that
        add failed, or the name was closed). A handle is handed out only once it is set
        up (restore hook registered, watcher started); a failure on the way leaves
        nothing registered under the name."""
        # Checked before any material is made: a name the hook registry refuses used to
        # leave a stored certificate without a restore hook (never renewed after it).
        if not isinstance(cert.name, str) or not cert.name or not cert.name.isprintable():
            raise TypeError(f"certificate name must be a non-empty string of printable "
                            f"characters, not {_config.shown(cert.name)}")
        name = cert.name
        token = object()
        set_up = False
        # The claim inside the try: an exception between it and the setup (a
        # KeyboardInterrupt delivered there) left the name busy for ever, and every
        # later add of it waited without a timeout. Released by this call's token: a
        # nested add of the name (an issuer adding it again) fails without releasing
        # the outer call's claim.
        try:
            with self._lock:
                existing = self._claim(name, token)
                frozen = self.frozen
            if existing is not None:
                cert._discard()
                if type(existing) is not type(cert):
                    raise ValueError(f"certificate {name!r} already exists as "
                                     f"{existing.kind}")
                return existing
            set_up = True
            return self._set_up(cert, frozen)
        except BaseException:
            if not set_up:  # _set_up discards it itself when it fails
                cert._discard()
            raise
        finally:
            with self._lock:
                self._release(name, token)

    def _claim(self, name: str, token: object) -> ManagedCertificate | None:
        """With the lock held: the handle under ``name`` once no other thread is adding
        or closing it, or None after marking the name busy for the caller (its
        ``token``). Another thread's add used to return this thread's handle before its
        restore hook was registered — or one whose setup then failed."""
        me = threading.get_ident()
        while (owner := self._busy.get(name)) is not None:
            if owner[0] == me:  # waiting would wait for ourselves (produce() adding it again)
                raise RuntimeError(f"certificate {name!r} is already being added or "
                                   "closed by this thread")
            self._idle.wait()
        existing = self._certs.get(name)
        if existing is None:
            self._busy[name] = (me, token)
        return existing

    def _release(self, name: str, token: object) -> None:
        """With the lock held: free ``name`` if the call of ``token`` claimed it."""
        owner = self._busy.get(name)
        if owner is not None and owner[1] is token:
            del self._busy[name]
        self._idle.notify_all()

    def _set_up(self, cert: ManagedCertificate, frozen: bool) -> ManagedCertificate:
        """The rest of :meth:`add`, with ``cert.name`` claimed by this thread."""
        began = time.monotonic()  # before the material is made: see recovered(since=)
        if frozen:  # a key made now would be written into the image: wait for the restore
            log.info("tls: certificate %s added after the before-snapshot pass: its first "
                     "material is produced on restore/resume", cert.name)
        try:
            if not frozen:
                with cert._renew_lock:
                    cert._renew_locked()
            cert._hooks = (self.engine.builtins.register(
                cert._on_restore, phase=Phase.SECRETS, order=100,
                name=f"rehydrate.tls:{cert.name}", required=cert.required, timeout=60.0),)
            if isinstance(cert, FileCertificate):
                cert.start_watching()
        except BaseException:
            # Nothing of it stays: no hook that renews a handle nobody holds, no watcher.
            for h in cert._hooks:
                self.engine.builtins.unregister(h)
            cert._hooks = ()
            if isinstance(cert, FileCertificate):
                cert.stop_watching()
            cert._discard()
            raise
        with self._lock:
            self._certs[cert.name] = cert
            dropped_meanwhile = self.frozen and not frozen
        if dropped_meanwhile:  # the snapshot pass ran while the first material was made
            cert._drop({})
        elif not frozen:
            # Made again under the name of one closed after its restore hook failed: its
            # material in use mends that failure (see Lifecycle.recovered), which no
            # renewal of the closed one can (its hook is gone).
            self.engine.recovered(cert._hooks[0], since=began)
        return cert

    def remove(self, cert: ManagedCertificate) -> None:
        """Unregister ``cert``'s hook and forget it. A failure of that hook is left for
        a certificate made again under its name to mend (see
        :meth:`~rehydrate.Lifecycle.recovered`), or for the next restore run: closing is
        no sign that what failed works. An :meth:`add` of the name meanwhile waits, then
        makes a new handle (it never returns this one)."""
        name, me, token = cert.name, threading.get_ident(), object()
        with self._lock:
            # Busy while closing: an add of the name waits, rather than returning a handle
            # whose hook is being unregistered (never renewed, its key never dropped).
            while (managed := self._certs.get(name) is cert) and \
                    (owner := self._busy.get(name)) is not None and owner[0] != me:
                self._idle.wait()
            managed = managed and name not in self._busy
            if managed:
                self._busy[name] = (me, token)
        try:
            # The hook first: once the name is free, a certificate made under it must
            # find the failure it takes over unregistered.
            for h in cert._hooks:
                self.engine.builtins.unregister(h)
            cert._hooks = ()
        finally:
            if managed:
                with self._lock:
                    if self._certs.get(name) is cert:
                        del self._certs[name]
                    self._release(name, token)


_HANDLES: weakref.WeakSet[ManagedCertificate] = weakref.WeakSet()
"""Every certificate handle of this process, for the fork handler."""


def _forget_others_busy(m: TLSManager) -> None:
    """In a child of ``fork()``: another thread's add or close of a name is not going on
    here (an add of that name would wait for it for ever); the forking thread's own
    finishes as it unwinds."""
    me = threading.get_ident()
    m._busy = {n: owner for n, owner in m._busy.items() if owner[0] == me}


def _after_fork_in_child() -> None:
    # A parent thread renewing a certificate at fork() (an issuer's round trip, under the
    # renew lock) does not exist in the child: its restore hook timed out and renew()
    # blocked for ever. That renewal is abandoned here: the child keeps the material it
    # had, and its next renewal or restore makes its own. (Not through
    # fresh_lock_after_fork: the abandoned renewal is recorded, so this must see which
    # lock was held.)
    for cert in list(_HANDLES):
        # Not the forking thread's own hold (a renewal listener that forks): it is
        # released as the child unwinds.
        if held_by_another_thread(cert._renew_lock):
            cert._renew_lock = threading.RLock()
            cert.last_error = "a renewal running at fork() was abandoned in this process"
        if isinstance(cert, FileCertificate):
            cert._forget_watcher_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def manager(engine: Engine | None = None) -> TLSManager:
    """The TLS manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("tls", TLSManager)


key = "tls"


def probe() -> Probe:
    """Always usable (certificates need ``cryptography``, a dependency)."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the tls manager to ``engine`` now (its functions also do on first use)."""
    manager(engine)


def self_signed(name: str, *, common_name: str = "localhost",
                sans: Sequence[str] = ("localhost", "127.0.0.1"), algorithm: str = "ec-p256",
                valid_for: _dt.timedelta = _dt.timedelta(days=7), required: bool = True,
                engine: Engine | None = None) -> SelfSignedCertificate:
    """A self-signed certificate renewed (key, serial, validity) on every restore.
    The same ``name`` returns the same handle."""
    m = manager(engine)
    return cast(SelfSignedCertificate, m.add(SelfSignedCertificate(
        name, common_name=common_name, sans=sans, algorithm=algorithm, valid_for=valid_for,
        required=required, manager=m)))


def issued(name: str, issuer: Issuer, *, common_name: str, sans: Sequence[str] = (),
           algorithm: str = "ec-p256", required: bool = True,
           engine: Engine | None = None) -> IssuedCertificate:
    """A certificate for a fresh key, issued by ``issuer`` now and after every restore.
    Raises :class:`CertificateError` when the first issuance fails."""
    m = manager(engine)
    return cast(IssuedCertificate, m.add(IssuedCertificate(
        name, issuer, common_name=common_name, sans=sans, algorithm=algorithm,
        required=required, manager=m)))


def from_files(name: str, *, cert: str | os.PathLike[str], key: str | os.PathLike[str],
               ca: str | os.PathLike[str] | None = None, password: Password | None = None,
               watch: bool = True, poll: bool | None = None, poll_interval: float = 1.0,
               required: bool = True, engine: Engine | None = None) -> FileCertificate:
    """A certificate read from PEM files, re-read on restore and when its directory
    changes. ``poll``: force polling (default: poll under gVisor, inotify elsewhere;
    ``REHYDRATE_WATCH=poll|inotify`` overrides). Raises :class:`CertificateError` when the
    files are unusable now.

    ``password`` (for an encrypted key file; read only when the key file is encrypted):

    * a :class:`rehydrate.secrets.Secret` (of the same engine) — read at every load of
      the key, straight from the secret's buffer; the secret is wiped before a snapshot
      and reloaded after restore before this certificate re-reads its key. Nothing of
      the password is kept in between: the way to keep it out of snapshot images;
    * a callable returning ``bytes``, ``bytearray`` or ``str`` — called at every load;
      its result is wiped right after (a returned ``bytearray`` in place; the immutable
      ``bytes``/``str`` it returns cannot be);
    * ``bytes``, ``bytearray`` or ``str`` — copied into a buffer rehydrate keeps to
      re-read the key (file change, restore) and wipes on close; the caller's object is
      not kept (and cannot be wiped by rehydrate). That copy survives the snapshot, so
      the password is in every image: one warning line at the first load says so.

    A wrong password, a missing one or a broken key file is one :class:`CertificateError`
    line naming the file, never the password or the key."""
    m = manager(engine)
    return cast(FileCertificate, m.add(FileCertificate(
        name, cert=os.fspath(cert), key=os.fspath(key),
        ca=os.fspath(ca) if ca is not None else None, password=password, watch=watch,
        poll=poll, poll_interval=poll_interval, required=required, manager=m)))
