"""Ephemeral keys: rotation per algorithm, listeners, dropped before snapshot, kernel entropy."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import random
import sys
import threading
import traceback
import weakref

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, x25519

from rehydrate import keys
from rehydrate._context import describe_error
from rehydrate.keys import KeyDroppedError

FAST = ["ed25519", "x25519", "ec-p256", "ec-p384"]
TYPES = {
    "ed25519": ed25519.Ed25519PrivateKey,
    "x25519": x25519.X25519PrivateKey,
    "ec-p256": ec.EllipticCurvePrivateKey,
    "ec-p384": ec.EllipticCurvePrivateKey,
    "rsa-2048": rsa.RSAPrivateKey,
    "rsa-3072": rsa.RSAPrivateKey,
}


def _works(algorithm: str, key) -> None:
    """The key is a real, usable key of its kind."""
    msg = b"rehydrate"
    if algorithm == "ed25519":
        key.public_key().verify(key.sign(msg), msg)
    elif algorithm == "x25519":
        peer = x25519.X25519PrivateKey.generate()
        assert key.exchange(peer.public_key()) == peer.exchange(key.public_key())
    elif algorithm.startswith("ec-"):
        sig = key.sign(msg, ec.ECDSA(hashes.SHA256()))
        key.public_key().verify(sig, msg, ec.ECDSA(hashes.SHA256()))
        assert key.curve.name == {"ec-p256": "secp256r1", "ec-p384": "secp384r1"}[algorithm]
    else:
        bits = int(algorithm[4:])
        assert key.key_size == bits
        sig = key.sign(msg, padding.PKCS1v15(), hashes.SHA256())
        key.public_key().verify(sig, msg, padding.PKCS1v15(), hashes.SHA256())
        n = key.private_numbers()
        assert n.p * n.q == n.public_numbers.n and n.p != n.q


def test_rsa_3072_is_a_valid_key():
    key = keys.generate_private_key("rsa-3072")
    _works("rsa-3072", key)


@pytest.mark.parametrize("algorithm", [*FAST, "rsa-2048"])
def test_each_algorithm_rotates_on_restore(rehydrate_engine, algorithm):
    handle = keys.ephemeral("k", algorithm, engine=rehydrate_engine)
    assert isinstance(handle.private_key, TYPES[algorithm])
    _works(algorithm, handle.private_key)
    before = handle.public_bytes_raw()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert handle.generation == 2
    assert handle.public_bytes_raw() != before
    assert handle.private_key.public_key() == handle.public_key
    _works(algorithm, handle.private_key)


def test_same_name_same_handle(rehydrate_engine):
    a = keys.ephemeral("session", engine=rehydrate_engine)
    assert keys.ephemeral("session", engine=rehydrate_engine) is a
    assert keys.get("session", engine=rehydrate_engine) is a
    with pytest.raises(ValueError, match="already exists"):
        keys.ephemeral("session", "ec-p256", engine=rehydrate_engine)
    with pytest.raises(ValueError, match="unknown key algorithm"):
        keys.ephemeral("other", "dsa", engine=rehydrate_engine)


def test_an_empty_algorithm_is_refused_not_the_default(rehydrate_engine):
    for _ in range(2):  # the same answer again: no ed25519 key was made the first time
        with pytest.raises(ValueError, match="unknown key algorithm ''"):
            keys.ephemeral("blank", "", engine=rehydrate_engine)
    assert keys.get("blank", engine=rehydrate_engine) is None


def test_same_name_without_an_algorithm_is_the_existing_key_whatever_its_algorithm(
        rehydrate_engine):
    k = keys.ephemeral("signing", algorithm="ec-p256", engine=rehydrate_engine)
    assert keys.ephemeral("signing", engine=rehydrate_engine) is k
    assert k.algorithm == "ec-p256"
    assert keys.ephemeral("fresh", engine=rehydrate_engine).algorithm == "ed25519"
    with pytest.raises(ValueError, match="already exists with algorithm 'ec-p256'"):
        keys.ephemeral("signing", "ed25519", engine=rehydrate_engine)


def test_listeners_get_the_rotated_handle(rehydrate_engine):
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    seen = []

    @handle.subscribe
    def on_rotate(h):
        seen.append((h, h.public_bytes_raw()))

    rehydrate_engine.simulate_restore()
    assert seen == [(handle, handle.public_bytes_raw())]


def test_failing_listener_fails_the_hook_but_others_run(rehydrate_engine):
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    other = keys.ephemeral("other", engine=rehydrate_engine)
    seen = []
    handle.subscribe(lambda h: 1 / 0)
    handle.subscribe(lambda h: seen.append("second"))
    other.subscribe(lambda h: seen.append("other"))
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [res] = [h for h in report.hooks if h.name == "rehydrate.keys"]
    assert res.outcome == "failed" and res.error.subgroup(ZeroDivisionError) is not None
    assert seen == ["second", "other"]
    assert rehydrate_engine.status().state == "degraded"


def test_private_key_dropped_before_snapshot(rehydrate_engine):
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    public = handle.public_bytes_raw()
    report = rehydrate_engine.simulate_snapshot()
    assert report.ok
    assert handle.dropped
    assert handle._private is None
    with pytest.raises(KeyDroppedError, match="dropped before a snapshot"):
        handle.private_key  # noqa: B018
    assert handle.public_bytes_raw() == public  # the public half stays readable
    assert rehydrate_engine.status().extra["keys"]["session"]["dropped"] is True

    rehydrate_engine.simulate_restore()
    assert not handle.dropped
    assert handle.public_bytes_raw() != public


def test_resume_after_a_snapshot_brings_a_key_back(rehydrate_engine):
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    rehydrate_engine.simulate_restore(kind="resume")
    assert isinstance(handle.private_key, ed25519.Ed25519PrivateKey)


def test_wait_blocks_until_restore(rehydrate_engine):
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    with pytest.raises(KeyDroppedError):
        handle.wait(timeout=0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(handle.wait(timeout=30)))
    waiter.start()
    rehydrate_engine.simulate_restore()
    waiter.join(timeout=30)
    assert got and got[0] is handle.private_key


@pytest.mark.parametrize("timeout", [-1, -10**5000, math.nan, "1"],
                         ids=["-1", "-1e5000", "nan", "str"])
def test_wait_refuses_a_bad_timeout_in_one_line(rehydrate_engine, timeout):
    """``handle.wait(10**5000)`` raised a bare OverflowError from inside threading and
    ``wait(-1)`` returned at once: the one seconds rule (None, infinity or more than a
    year: no limit), checked whether or not the key is there."""
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    assert handle.wait(10**5000) is handle.private_key  # no limit, not an OverflowError
    pattern = (r"^wait\(\): timeout must be a number of seconds >= 0, .*"
               r"\(None, infinity or more than a year: no limit\)$")
    with pytest.raises((TypeError, ValueError), match=pattern):
        handle.wait(timeout)  # the key is there
    rehydrate_engine.simulate_snapshot()
    with pytest.raises((TypeError, ValueError), match=pattern):
        handle.wait(timeout)  # dropped
    with pytest.raises(KeyDroppedError):
        handle.wait(0)  # 0: do not wait
    rehydrate_engine.simulate_restore()
    assert handle.wait(0) is handle.private_key


@pytest.mark.parametrize("kind", ["restore", "resume"])
def test_key_created_after_the_snapshot_pass_has_no_key_until_restore(rehydrate_engine, kind):
    """A key created between the before-snapshot pass and the restore would be written
    into the image: it starts without a key pair and gets one on restore/resume."""
    early = keys.ephemeral("early", engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    late = keys.ephemeral("late", "ec-p256", engine=rehydrate_engine)
    assert late.dropped and early.dropped
    assert late._private is None and late.generation == 0
    with pytest.raises(KeyDroppedError):
        late.private_key  # noqa: B018
    with pytest.raises(KeyDroppedError):
        late.public_key  # noqa: B018
    with pytest.raises(KeyDroppedError):
        late.rotate()  # regenerating now would also put a key into the image
    with pytest.raises(KeyDroppedError):
        late.wait(timeout=0.05)
    assert rehydrate_engine.status().extra["keys"]["late"]["dropped"] is True
    got = []
    waiter = threading.Thread(target=lambda: got.append(late.wait(timeout=30)))
    waiter.start()

    assert rehydrate_engine.simulate_restore(kind=kind).ok
    waiter.join(timeout=30)
    assert got and got[0] is late.private_key
    assert not late.dropped and late.generation == 1
    _works("ec-p256", late.private_key)
    # after the restore, new keys are generated at once again
    assert not keys.ephemeral("later", engine=rehydrate_engine).dropped


def test_key_manager_first_used_after_the_snapshot_pass(rehydrate_engine):
    """The manager did not exist during the before-snapshot pass: it still knows."""
    assert rehydrate_engine.simulate_snapshot().ok
    late = keys.ephemeral("late", engine=rehydrate_engine)
    assert late.dropped
    assert rehydrate_engine.simulate_restore().ok
    assert not late.dropped


def test_disabled_keys_are_neither_dropped_nor_rotated(rehydrate_engine, monkeypatch):
    monkeypatch.setenv("REHYDRATE_DISABLE", "secrets")
    handle = keys.ephemeral("session", engine=rehydrate_engine)
    before = handle.public_bytes_raw()
    rehydrate_engine.simulate_snapshot()
    assert not handle.dropped
    rehydrate_engine.simulate_restore()
    assert handle.public_bytes_raw() == before


def test_keys_disabled_at_restore_regenerate_dropped_keys_and_say_so(rehydrate_engine,
                                                                    caplog):
    """Before: with keys turned off only at restore, a key dropped before the snapshot got
    a new pair silently — listeners were not told and the log said "NOT regenerated"."""
    dropped = keys.ephemeral("session", engine=rehydrate_engine)
    heard: list[bytes] = []
    dropped.subscribe(lambda h: heard.append(h.public_bytes_raw()))
    before = dropped.public_bytes_raw()
    assert rehydrate_engine.simulate_snapshot().ok
    assert dropped.dropped
    with caplog.at_level("INFO", logger="rehydrate"):
        assert rehydrate_engine.simulate_restore(env={"REHYDRATE_DISABLE": "keys"}).ok
    assert not dropped.dropped and dropped.generation == 2
    assert heard == [dropped.public_bytes_raw()] and heard[0] != before
    text = caplog.text
    assert "NOT regenerated" not in text
    assert "ephemeral keys session hold no private key" in text
    assert "regenerating them anyway" in text


def test_keys_disabled_at_restore_leave_held_keys_alone(rehydrate_engine, caplog,
                                                       monkeypatch):
    """A key still holding its pair (keys were off at the snapshot too) keeps it, and the
    log names it; no listener runs."""
    monkeypatch.setenv("REHYDRATE_DISABLE", "keys")
    held = keys.ephemeral("held", engine=rehydrate_engine)
    heard: list[object] = []
    held.subscribe(heard.append)
    before = held.public_bytes_raw()
    assert rehydrate_engine.simulate_snapshot().ok
    with caplog.at_level("INFO", logger="rehydrate"):
        assert rehydrate_engine.simulate_restore().ok
    assert held.public_bytes_raw() == before and held.generation == 1 and heard == []
    assert "keys disabled: ephemeral keys NOT regenerated" in caplog.text
    assert "anyway" not in caplog.text


# -- key material comes from the kernel, not OpenSSL's generator ----------------------


def _fixed_urandom(monkeypatch, seed: int) -> None:
    rng = random.Random(seed)

    def fill(buf: bytearray) -> None:
        buf[:] = rng.randbytes(len(buf))

    monkeypatch.setattr(keys, "urandom_into", fill)
    monkeypatch.setattr(keys.os, "urandom", rng.randbytes)


@pytest.mark.parametrize("algorithm", [*FAST, "rsa-2048"])
def test_key_is_a_function_of_kernel_bytes_only(monkeypatch, algorithm):
    """With the kernel source replaced by a fixed stream, the key is reproducible: nothing
    from OpenSSL's (clonable) generator went into it."""
    _fixed_urandom(monkeypatch, 1)
    a = keys.generate_private_key(algorithm)
    _fixed_urandom(monkeypatch, 1)
    b = keys.generate_private_key(algorithm)
    _fixed_urandom(monkeypatch, 2)
    c = keys.generate_private_key(algorithm)
    assert a.public_key() == b.public_key()
    assert a.public_key() != c.public_key()


def test_urandom_into_fills_in_place():
    buf = bytearray(64)
    keys.urandom_into(buf)
    assert any(buf) and len(buf) == 64


@pytest.mark.parametrize("name", [None, 5, "", "  ", "a\nb"])
def test_a_key_name_that_cannot_name_it_is_refused(rehydrate_engine, name):
    with pytest.raises(TypeError, match="name must be a non-empty printable str"):
        keys.ephemeral(name, engine=rehydrate_engine)


def test_a_rotation_overtaken_by_the_snapshot_pass_discards_its_key(rehydrate_engine,
                                                                    monkeypatch):
    """rotate() checked "dropped" before generating (an RSA key takes a while) and stored
    the key afterwards: a before-snapshot pass in between left a private key in the
    image while the manager reported every key dropped."""
    from rehydrate import keys as keys_module

    k = keys_module.ephemeral("slow", "ed25519", engine=rehydrate_engine)
    real = keys_module.generate_private_key

    def overtaken(algorithm):
        key = real(algorithm)
        assert rehydrate_engine.simulate_snapshot().ok  # the pass runs meanwhile
        return key

    monkeypatch.setattr(keys_module, "generate_private_key", overtaken)
    with pytest.raises(keys_module.KeyDroppedError, match="its new key is discarded"):
        k.rotate()
    assert k.dropped and keys_module.manager(rehydrate_engine).dropped
    assert rehydrate_engine.status().extra["keys"]["slow"]["dropped"] is True
    monkeypatch.setattr(keys_module, "generate_private_key", real)
    assert rehydrate_engine.simulate_restore().ok and not k.dropped


@pytest.mark.parametrize("snapshot_pass", [True, False])
def test_a_rotation_that_outlives_the_restore_keeps_the_restore_s_key(rehydrate_engine,
                                                                      monkeypatch,
                                                                      snapshot_pass):
    """Before: a rotation still generating across the snapshot *and the restore* (or a
    restore with no snapshot pass) stored its key in the clone afterwards — a key made
    before the snapshot, the same in every clone (for RSA: primes two clones share) —
    replacing the restore's fresh key, and told the listeners; only ``dropped`` was
    checked, and the restore had cleared it."""
    real = keys.generate_private_key
    entered, release = threading.Event(), threading.Event()
    stale: list[bytes] = []

    def slow_once(algorithm):  # type: ignore[no-untyped-def]
        k = real(algorithm)
        if not stale:
            stale.append(k.public_key().public_bytes_raw())
            entered.set()
            release.wait(30)
        return k

    handle = keys.ephemeral("session", algorithm="ed25519", engine=rehydrate_engine)
    told: list[bytes] = []
    handle.subscribe(lambda h: told.append(h.public_key.public_bytes_raw()))
    monkeypatch.setattr(keys, "generate_private_key", slow_once)
    outcome: list[BaseException | None] = []

    def rotate() -> None:
        try:
            handle.rotate()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    worker = threading.Thread(target=rotate, daemon=True)
    worker.start()
    assert entered.wait(5)
    if snapshot_pass:
        assert rehydrate_engine.simulate_snapshot().ok
    try:  # the restore runs (and rotates) while the stale rotation still generates
        assert rehydrate_engine.simulate_restore().ok
        fresh = handle.public_key.public_bytes_raw()
    finally:
        release.set()  # the stale rotation comes back only now
        worker.join(10.0)
    assert len(outcome) == 1 and isinstance(outcome[0], KeyDroppedError), outcome
    assert handle.public_key.public_bytes_raw() == fresh != stale[0]
    assert stale[0] not in told


def test_a_failing_listener_s_error_is_logged_without_a_secret_it_quotes(
        rehydrate_engine, monkeypatch, caplog):
    from rehydrate.secrets import Secret

    value = "tok-SUPERSECRET-98765"
    monkeypatch.setenv("PUSH_TOKEN", value)
    token = Secret.from_env("PUSH_TOKEN", engine=rehydrate_engine)
    handle = keys.ephemeral("session", engine=rehydrate_engine)

    @handle.subscribe
    def push(h):  # an HTTP client refusing the header quotes it
        raise ValueError(f"Invalid header value b'Bearer {token.get().decode()}\\n'")

    with caplog.at_level("WARNING", logger="rehydrate"):
        rehydrate_engine.simulate_restore()
        errors = handle.rotate()
    assert len(errors) == 1
    lines = [r.getMessage() for r in caplog.records if "Invalid header" in r.getMessage()]
    assert len(lines) == 2  # the restore hook's failure (the engine's) and the manual one
    assert all("[redacted secret 'PUSH_TOKEN']" in line for line in lines)
    assert value not in caplog.text


@dataclasses.dataclass
class _RegistryClient:
    url: str
    token: str

    def push(self, handle: keys.EphemeralKey) -> None:
        raise ConnectionError(f"{self.url} unreachable")


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_listener_is_named_never_shown(rehydrate_engine, caplog, failing):
    """Before: the hook's error quoted the listener's repr() - a bound method's shows its
    object, here a client holding a token - in the ERROR line, report and status(); and
    with one failure the message named neither the key nor the listener (only a note,
    which none of them shows). It names both, by the listener's qualified name."""
    engine = rehydrate_engine
    client = _RegistryClient("https://keys.internal", "tok-3f9a1c7d5e2b")
    for name in ["session", "tls"][:failing]:
        keys.ephemeral(name, engine=engine).subscribe(client.push)
    with caplog.at_level("INFO", logger="rehydrate"):
        report = engine.simulate_restore()
        errors = keys.get("session", engine=engine).rotate()  # type: ignore[union-attr]
    [res] = [h for h in report.hooks if h.name == "rehydrate.keys"]
    shown = [describe_error(res.error), report.table(),
             json.dumps(engine.status().to_dict(), default=str), caplog.text]
    assert not any("tok-3f9a1c7d5e2b" in text for text in shown)
    line = ("key 'session': rotation listener _RegistryClient.push: "
            "ConnectionError: https://keys.internal unreachable")
    assert line in shown[0] and line in shown[3]
    assert "rotation listener _RegistryClient.push of key 'session' failed" in caplog.text
    assert [type(e) for e in res.error.exceptions] == [ConnectionError] * failing
    assert len(errors) == 1


class _Local:
    """Stands for a listener's local (the private key it read: no weak reference)."""


@pytest.mark.parametrize("what", ["listener", "generation"])
def test_no_frame_of_a_failed_rotation_outlives_the_snapshot_pass(rehydrate_engine,
                                                                  monkeypatch, what):
    """Before: the report kept the hook's error, and through its traceback the frames of
    the listener that raised it (the private key it read), in a reference cycle: the pass
    dropped the key's handle, not that copy, which went into the image. No gc.collect()
    may be needed: the garbage collector is off here."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    refs: list[weakref.ref[_Local]] = []

    def failing(h):  # type: ignore[no-untyped-def]
        priv = h.private_key if what == "listener" else None  # noqa: F841
        local = _Local()
        refs.append(weakref.ref(local))
        raise ConnectionError("registry down")

    if what == "listener":
        handle.subscribe(failing)
    else:
        real = keys.generate_private_key
        monkeypatch.setattr(keys, "generate_private_key",
                            lambda algorithm: failing(None) if refs == [] else real(algorithm))
    gc.disable()
    try:
        assert not engine.simulate_restore().ok
        assert engine.simulate_snapshot().ok
        assert [r() for r in refs] == [None]
        if what == "listener":  # the errors rotate() returns: lines kept, locals not
            engine.simulate_restore()
            [error] = handle.rotate()
            assert [r() for r in refs] == [None] * 3
            assert "in failing" in "".join(traceback.format_exception(error))
    finally:
        gc.enable()


def test_a_listener_s_error_gets_no_note(rehydrate_engine):
    """Before: the hook added a note to the listener's own error - one more at every
    restore for an error it raises again (a circuit breaker's), and a TypeError in its
    place for one whose __notes__ is not a list."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    again = ConnectionError("registry down (circuit open)")
    odd = ConnectionError("odd notes")
    odd.__notes__ = ("set by the listener",)  # type: ignore[attr-defined]
    raised = [again]

    def push(h):  # type: ignore[no-untyped-def]
        raise raised[0]

    handle.subscribe(push)
    for _ in range(3):
        engine.simulate_restore()
    assert getattr(again, "__notes__", []) == []
    raised[0] = odd
    [res] = [h for h in engine.simulate_restore().hooks if h.name == "rehydrate.keys"]
    assert res.error.exceptions == (odd,) and odd.__notes__ == ("set by the listener",)


def test_a_failed_listener_mends_the_restore_hook_by_a_later_rotation(rehydrate_engine, caplog):
    """Before: a listener that failed during the restore left the process degraded until
    the next restore (which a clone may never get) though a later ``rotate()`` reached it;
    the hook's error was a RuntimeError and the failure was logged twice."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    down = [True]

    @handle.subscribe
    def push(h):  # type: ignore[no-untyped-def]
        if down[0]:
            raise ConnectionError("key registry unreachable")

    with caplog.at_level("INFO", logger="rehydrate"):
        report = engine.simulate_restore()
    [res] = [h for h in report.hooks if h.name == "rehydrate.keys"]
    [error] = res.error.exceptions  # its own type, in a group naming key and listener
    assert isinstance(error, ConnectionError)
    assert [r.levelname for r in caplog.records
            if "key registry unreachable" in r.getMessage()] == ["ERROR"]
    assert engine.status().state == "degraded"

    assert len(handle.rotate()) == 1  # still down: still degraded
    assert engine.status().state == "degraded"
    down[0] = False
    assert handle.rotate() == []
    assert engine.status().state == "ready" and engine.is_ready()


def test_the_restore_hook_is_mended_only_once_every_failed_key_rotated(rehydrate_engine):
    engine = rehydrate_engine
    one = keys.ephemeral("one", engine=engine)
    two = keys.ephemeral("two", engine=engine)
    fine = keys.ephemeral("fine", engine=engine)
    down = [True]

    def push(h):  # type: ignore[no-untyped-def]
        if down[0]:
            raise ConnectionError(h.name)

    one.subscribe(push)
    two.subscribe(lambda h: push(h) if down[0] else None)
    report = engine.simulate_restore()
    [res] = [h for h in report.hooks if h.name == "rehydrate.keys"]
    # several failures: a group of the errors raised, each of its own type
    match, rest = res.error.split(ConnectionError)
    assert rest is None and sorted(str(e) for e in match.exceptions) == ["one", "two"]
    assert "key 'one': rotation listener" in str(res.error)
    down[0] = False
    assert fine.rotate() == [] and one.rotate() == []
    assert engine.status().state == "degraded"  # "two" has not reached its registry yet
    assert two.rotate() == []
    assert engine.status().state == "ready"


def _hanging_restore(engine):  # type: ignore[no-untyped-def]
    """Keys "a" (whose listener hangs in the restore hook until the returned event is
    set) and "b" (after it); the hook's timeout shortened so that the run times it out.
    Returns (a, b, unstick, b_calls)."""
    a = keys.ephemeral("a", engine=engine)
    b = keys.ephemeral("b", engine=engine)
    hook = keys.manager(engine)._restore_hook
    object.__setattr__(hook, "timeout", 0.3)  # frozen record; the real timeout is 60 s
    unstick = threading.Event()
    calls = [0]
    b_calls: list[threading.Event] = [threading.Event() for _ in range(3)]

    def hangs(h):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            assert unstick.wait(30)

    def counts(h):  # type: ignore[no-untyped-def]
        next(e for e in b_calls if not e.is_set()).set()

    a.subscribe(hangs)
    b.subscribe(counts)
    [res] = [h for h in engine.simulate_restore().hooks if h.name == "rehydrate.keys"]
    assert res.outcome == "timeout" and engine.status().state == "degraded"
    return a, b, unstick, b_calls


def test_rotations_mend_the_hook_after_it_hung_in_a_listener(rehydrate_engine):
    """Before: while the hook's thread still hung in a listener, no rotate() mended it (the
    hook's failed keys were unknown until it returned). Every key it did not get through
    counts as failed: here "b", never reached, still holds the image's key."""
    engine = rehydrate_engine
    a, b, unstick, b_calls = _hanging_restore(engine)
    [(_, hook_thread)] = engine._runner._hung.values()
    try:
        assert a.rotate() == []
        assert engine.status().state == "degraded"  # "b" is not rotated yet
        assert b.rotate() == []
        assert engine.status().state == "ready"
    finally:
        unstick.set()
    hook_thread.join(10)
    assert not hook_thread.is_alive()
    # Before: the hook went on to give "b" yet another pair, after the rotate() that
    # published its current one; had that push failed, the process stayed degraded
    # for good (or ready with an unpublished key).
    assert b_calls[0].is_set() and not b_calls[1].is_set()  # b.rotate() only
    assert engine.status().state == "ready"


def test_the_hung_hook_mends_itself_once_it_gets_through(rehydrate_engine):
    engine = rehydrate_engine
    a, b, unstick, b_calls = _hanging_restore(engine)
    unstick.set()
    assert b_calls[0].wait(10)
    assert engine.wait_ready(10)


def test_a_rotation_mends_the_hook_after_a_listener_raised_a_base_exception(
        rehydrate_engine):
    """Before: a listener's SystemExit left no key failed on record, so no rotate()
    mended the hook: degraded until the next restore."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    first = [True]

    @handle.subscribe
    def push(h):  # type: ignore[no-untyped-def]
        if first[0]:
            first[0] = False
            raise SystemExit("a library called sys.exit()")

    assert not engine.simulate_restore().ok and engine.status().state == "degraded"
    assert handle.rotate() == []
    assert engine.status().state == "ready"


def test_removing_a_failed_key_mends_the_hook_once_no_other_stands(rehydrate_engine):
    """Before: a key whose listener failed in the restore and that is then removed kept
    the process degraded until the next restore, every remaining key rotating fine."""
    engine = rehydrate_engine
    one = keys.ephemeral("one", engine=engine)
    keys.ephemeral("two", engine=engine).subscribe(lambda h: 1 / 0)
    keys.ephemeral("three", engine=engine).subscribe(lambda h: 1 / 0)
    assert not engine.simulate_restore().ok
    manager = keys.manager(engine)
    manager.remove("two")
    assert engine.status().state == "degraded"  # "three" still failed
    assert one.rotate() == [] and engine.status().state == "degraded"
    manager.remove("three")
    assert engine.status().state == "ready"


def test_a_rotation_does_not_mend_a_failure_of_a_user_hook_or_a_later_run(rehydrate_engine):
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)

    def mine() -> None:
        raise RuntimeError("the user's own hook")

    engine.registry.register(mine, name="rehydrate.keys")
    report = engine.simulate_restore()
    assert not report.ok and engine.status().state == "degraded"
    assert handle.rotate() == []
    assert engine.status().state == "degraded"  # by record: not the user's hook


def _blocking_generation(monkeypatch):  # type: ignore[no-untyped-def]
    """Make ``generate_private_key`` block until the returned event is set; returns
    (entered, release)."""
    real = keys.generate_private_key
    entered, release = threading.Event(), threading.Event()

    def slow(algorithm):  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(30)
        return real(algorithm)

    monkeypatch.setattr(keys, "generate_private_key", slow)
    return entered, release


def _in_thread(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a daemon thread; returns (thread, list that gets its result)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_restore_during_a_key_s_creation_gives_it_its_pair(rehydrate_engine, monkeypatch):
    """Before: the first pair was made outside the manager's lock, and a restore run
    starting meanwhile made the creator discard it: ephemeral() returned a handle with no
    key pair (its .private_key and .public_key raising KeyDroppedError) until the hook
    got to it. The restore now waits for the creation, then rotates the key."""
    engine = rehydrate_engine
    entered, release = _blocking_generation(monkeypatch)
    creator, made = _in_thread(lambda: keys.ephemeral("session", "ec-p256", engine=engine))
    try:
        assert entered.wait(5)
        entered.clear()
        restore, reports = _in_thread(engine.simulate_restore)
        # the restore waits for the manager's lock, which the creator holds
        assert not entered.wait(0.2) and not reports
    finally:
        release.set()
    creator.join(10)
    restore.join(10)
    [handle] = made
    assert isinstance(handle.private_key, ec.EllipticCurvePrivateKey)
    assert handle.public_key is not None
    assert reports[0].ok and handle.generation == 2  # created, then rotated by the run


def test_a_snapshot_pass_during_a_key_s_creation_drops_its_pair(rehydrate_engine,
                                                                 monkeypatch):
    """The pass waits for a creation under way (an rsa-4096 key: seconds of its 10 s
    timeout), then drops the new private key like any other."""
    engine = rehydrate_engine
    entered, release = _blocking_generation(monkeypatch)
    creator, made = _in_thread(lambda: keys.ephemeral("late", engine=engine))
    try:
        assert entered.wait(5)
        snapshot, reports = _in_thread(engine.simulate_snapshot)
    finally:
        release.set()
    creator.join(10)
    snapshot.join(10)
    [handle] = made
    assert reports[0].ok and handle.dropped and handle.generation == 1
    with pytest.raises(KeyDroppedError):
        handle.private_key  # noqa: B018
    assert engine.simulate_restore().ok and handle.generation == 2


# A KeyboardInterrupt injected into a callback the interpreter runs meanwhile (a weakref's,
# a WeakSet's clean-up) is only reported as ignored, as a real signal's would be there.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_exception_anywhere_in_ephemeral_leaves_the_name_usable(rehydrate_engine):
    """An exception from a signal handler (Ctrl-C, an alarm-based timeout) lands where the
    interpreter runs the handler: on entry to a Python function among others. Before: one
    landing after the key was registered but before its first pair was being made left
    the name "being created" for ever: every get()/ephemeral() of it, from any thread,
    blocked. Here a KeyboardInterrupt is raised on entry to each Python function that
    ephemeral() calls, in turn, until a call gets through."""
    engine = rehydrate_engine
    for n in itertools.count(1):
        calls = [0]

        def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == n:
                raise KeyboardInterrupt

        name = f"k{n}"
        sys.settrace(tracer)  # only "call" events: the tracer sets no local one
        try:
            keys.ephemeral(name, engine=engine)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        getter, got = _in_thread(lambda: keys.get(name, engine=engine))  # noqa: B023
        getter.join(5)
        assert got, f"get() of a key interrupted on function entry {n} blocks"
        assert got[0] is None or not got[0].dropped
        assert not keys.ephemeral(name, engine=engine).dropped
        if not interrupted:
            break
    assert n > 5  # the interrupts did land inside ephemeral()


def test_a_key_whose_first_generation_fails_is_not_kept(rehydrate_engine, monkeypatch):
    engine = rehydrate_engine

    def broken(algorithm):  # type: ignore[no-untyped-def]
        raise OSError("no entropy")

    monkeypatch.setattr(keys, "generate_private_key", broken)
    with pytest.raises(OSError, match="no entropy"):
        keys.ephemeral("session", engine=engine)
    assert keys.get("session", engine=engine) is None
    monkeypatch.undo()
    assert keys.ephemeral("session", engine=engine).generation == 1


def test_a_key_the_hook_fails_after_a_rotation_got_it_through_stays_failed(
        rehydrate_engine):
    """Before: a rotate() that got a key through while the hook was rotating it took it
    off the failed keys, and the hook's own failure did not put it back: the process
    stayed degraded, no later rotation of that key mending it."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    calls = [0]

    @handle.subscribe
    def push(h):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:  # the hook's call; the rotate() gets through meanwhile
            other, errors = _in_thread(handle.rotate)
            other.join(10)
            assert errors == [[]]
            raise ConnectionError("registry flaky")

    assert not engine.simulate_restore().ok and engine.status().state == "degraded"
    assert handle.rotate() == []
    assert engine.status().state == "ready"


def test_a_key_removed_during_the_restore_run_is_left_alone(rehydrate_engine):
    """Before: the run still rotated it, its listeners' failures failed the hook for good
    (remove() had already taken it off the failed keys), and the removed handle got a
    fresh private key that no before-snapshot pass drops (into the image, if the
    application still holds it)."""
    engine = rehydrate_engine
    manager = keys.manager(engine)
    keys.ephemeral("a", engine=engine).subscribe(lambda h: manager.remove("b"))
    b = keys.ephemeral("b", engine=engine)
    b_calls: list[object] = []

    @b.subscribe
    def push(h):  # type: ignore[no-untyped-def]
        b_calls.append(h)
        raise ConnectionError("b's registry is gone")

    assert engine.simulate_restore().ok and engine.status().state == "ready"
    assert b_calls == [] and b.dropped
    assert engine.simulate_snapshot().ok and b.dropped


@pytest.mark.parametrize("chain", ["cause", "context", "group"])
def test_no_frame_chained_to_a_listener_s_error_outlives_the_snapshot_pass(
        rehydrate_engine, chain):
    """Before: only the frames of the listener's own error were cleared; a transport
    error it wraps (``raise ... from``, raised in an ``except``, or in a group) kept
    its helper's frame, holding the private key, alive through the engine's report."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    refs: list[weakref.ref[_Local]] = []

    def send(priv):  # type: ignore[no-untyped-def]
        local = _Local()
        refs.append(weakref.ref(local))
        raise ConnectionError("registry down")

    @handle.subscribe
    def push(h):  # type: ignore[no-untyped-def]
        try:
            send(h.private_key)
        except ConnectionError as exc:
            if chain == "cause":
                raise RuntimeError("could not register the key") from exc
            if chain == "context":
                raise RuntimeError("could not register the key")  # noqa: B904
            raise keys._ExceptionGroup("could not register", [exc])  # noqa: B904

    gc.disable()
    try:
        assert not engine.simulate_restore().ok
        assert engine.simulate_snapshot().ok
        assert [r() for r in refs] == [None]
    finally:
        gc.enable()


def test_a_listener_returning_an_exception_succeeds(rehydrate_engine):
    """Before: a returned exception object counted as raised: the hook failed, rotate()
    returned it and logged a WARNING."""
    engine = rehydrate_engine
    handle = keys.ephemeral("session", engine=engine)
    handle.subscribe(lambda h: TimeoutError("handled by the listener"))
    assert engine.simulate_restore().ok and engine.status().state == "ready"
    assert handle.rotate() == []


class _NoWaitLock:
    """A lock that fails instead of waiting: a wait here would be the thread waiting
    for itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise AssertionError("waited for the key manager's lock")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_reading_keys_while_this_thread_creates_one_does_not_wait(rehydrate_engine,
                                                                 monkeypatch):
    """Before: keys(), get() and status() took the lock that ephemeral() holds while it
    makes the first pair (seconds for rsa-4096): a signal handler calling one of them in
    the creating thread deadlocked it."""
    engine = rehydrate_engine
    manager = keys.manager(engine)
    old = keys.ephemeral("old", engine=engine)
    manager._lock = _NoWaitLock()  # type: ignore[assignment]
    real = keys.generate_private_key
    seen: list[object] = []

    def handler_runs_here(algorithm):  # type: ignore[no-untyped-def]
        seen.extend([manager.get("old"), manager.keys(),
                     list(engine.status().extra["keys"])])
        return real(algorithm)

    monkeypatch.setattr(keys, "generate_private_key", handler_runs_here)
    new = keys.ephemeral("new", engine=engine)
    assert seen == [old, [old], ["old"]]
    assert manager.keys() == [old, new]
