"""Secret: wiped before a snapshot, reloaded after restore/resume, block-or-raise, repr."""

from __future__ import annotations

import gc
import logging
import pickle
import threading

import pytest

from rehydrate.secrets import Secret, SecretError, SecretUnavailable


@pytest.fixture
def secret_file(tmp_path):
    p = tmp_path / "db-password"
    p.write_bytes(b"hunter2-original\n")
    return p


def test_file_secret_is_wiped_and_reloaded(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    assert s.get() == b"hunter2-original"
    buf = s._buf
    report = rehydrate_engine.simulate_snapshot()
    assert report.ok
    assert [h.name for h in report.hooks] == ["rehydrate.secret:db-password",
                                              "rehydrate.files.audit"]
    assert buf == bytearray(len(buf)) and len(buf) > 0  # the very buffer was zeroed
    assert not s.available

    secret_file.write_bytes(b"rotated-value\n")
    report = rehydrate_engine.simulate_restore()
    assert report.ok
    assert s.get() == b"rotated-value"
    assert s.loads == 2


def test_an_empty_value_is_a_load_error_unless_allowed(rehydrate_engine, secret_file,
                                                      monkeypatch):
    """A secret file caught half-written (truncated, not yet written) at the restore, or
    a variable set to nothing: the secret served b"" and the process said ready, every
    request going out with an empty token."""
    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    secret_file.write_bytes(b"\n")  # stripped: nothing left
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [hook] = [h for h in report.hooks if h.name == "rehydrate.secret:db-password"]
    assert "gave an empty value" in str(hook.error) and "allow_empty=True" in str(hook.error)
    with pytest.raises(SecretUnavailable, match="gave an empty value"):
        s.get()
    secret_file.write_bytes(b"written-now\n")  # the writer finished: the next restore
    assert rehydrate_engine.simulate_restore().ok
    assert s.get() == b"written-now"
    # a rotation that reads it empty keeps the value it had
    secret_file.write_bytes(b"")
    assert s.reload() is False
    assert "gave an empty value" in s.last_error
    assert s.get() == b"written-now"

    monkeypatch.setenv("EMPTY_TOKEN", "")
    with pytest.raises(SecretError, match="env:EMPTY_TOKEN gave an empty value"):
        Secret.from_env("EMPTY_TOKEN", engine=rehydrate_engine)
    assert Secret.from_env("EMPTY_TOKEN", allow_empty=True,
                           engine=rehydrate_engine).get() == b""


def test_env_secret_follows_the_restored_environment(rehydrate_engine, monkeypatch):
    monkeypatch.setenv("API_TOKEN", "old-token")
    s = Secret.from_env("API_TOKEN", engine=rehydrate_engine)
    assert s.get() == b"old-token"
    rehydrate_engine.simulate_snapshot()
    # ENVIRONMENT runs before SECRETS: the secret sees the new spec environment
    assert rehydrate_engine.simulate_restore(env={"API_TOKEN": "new-token"}).ok
    assert s.get_str() == "new-token"


def test_callable_secret_is_called_again(rehydrate_engine):
    values = iter([b"one", bytearray(b"two")])
    s = Secret.from_callable(lambda: next(values), name="vault", engine=rehydrate_engine)
    assert s.get() == b"one"
    rehydrate_engine.simulate_snapshot()
    rehydrate_engine.simulate_restore(kind="resume")
    assert s.get() == b"two"


def test_repr_and_str_never_show_the_value(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    for text in (repr(s), str(s), f"{s}", str(rehydrate_engine.status().to_dict())):
        assert "hunter2" not in text
    assert "db-password" in repr(s)
    with pytest.raises(TypeError):
        pickle.dumps(s)


def test_view_is_the_buffer_itself(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    with s as view:
        assert isinstance(view, memoryview) and view.readonly
        assert view.obj is s._buf  # no copy
        assert bytes(view[:7]) == b"hunter2"
        with pytest.raises(TypeError):
            view[0] = 0
    with s.view() as view2:
        assert view2.tobytes().startswith(b"hunter2")


def test_wipe_waits_for_open_views(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    entered, release = threading.Event(), threading.Event()
    seen = []

    def reader():
        with s as view:
            entered.set()
            release.wait(10)
            seen.append(bytes(view[:7]))

    t = threading.Thread(target=reader)
    t.start()
    assert entered.wait(10)
    snap = threading.Thread(target=rehydrate_engine.simulate_snapshot)
    snap.start()
    snap.join(0.3)
    assert snap.is_alive()  # the wipe waits for the reader …
    release.set()
    snap.join(10)
    t.join(10)
    assert seen == [b"hunter2"]  # … which read the value intact
    assert not s.available


def test_block_mode_waits_for_the_reload(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, strip=True, timeout=30, engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    got = []
    started = threading.Event()

    def reader():
        started.set()
        got.append(s.get())

    t = threading.Thread(target=reader)
    t.start()
    started.wait(10)
    rehydrate_engine.simulate_restore()
    t.join(30)
    assert got == [b"hunter2-original"]


def test_block_mode_times_out_clearly(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, timeout=0.05, engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    with pytest.raises(SecretUnavailable, match="wiped before a snapshot"):
        s.get()


def test_raise_mode(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, on_wiped="raise", engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    with pytest.raises(SecretUnavailable, match="'db-password' is unavailable: wiped"):
        s.get()
    with pytest.raises(SecretUnavailable), s:
        pass


def test_unreadable_file_at_creation(tmp_path):
    with pytest.raises(SecretError, match="cannot read secret file"):
        Secret.from_file(tmp_path / "missing")
    with pytest.raises(SecretError, match="cannot read secret file"):
        Secret.from_file(tmp_path)  # a directory


def test_unreadable_file_after_restore_degrades(rehydrate_engine, secret_file, caplog):
    s = Secret.from_file(secret_file, timeout=5, engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    secret_file.unlink()
    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [res] = [h for h in report.hooks if h.name == "rehydrate.secret:db-password"]
    assert res.outcome == "failed" and "cannot read secret file" in str(res.error)
    assert rehydrate_engine.status().state == "degraded"
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "cannot read secret file" in lines[0].getMessage()
    # a blocked reader does not wait for the timeout: the reload already failed
    with pytest.raises(SecretUnavailable, match="cannot read secret file"):
        s.get()
    secret_file.write_bytes(b"back")
    assert rehydrate_engine.simulate_restore().ok
    assert s.get() == b"back"
    assert rehydrate_engine.status().state == "ready"


def test_optional_secret_does_not_degrade(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, required=False, engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    secret_file.unlink()
    report = rehydrate_engine.simulate_restore()
    assert report.ok
    assert report.failed[0].name == "rehydrate.secret:db-password"
    assert not s.available


def test_manual_reload_keeps_previous_value(rehydrate_engine, secret_file, caplog):
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    secret_file.unlink()
    caplog.set_level(logging.WARNING, logger="rehydrate")
    assert s.reload() is False
    assert s.get().startswith(b"hunter2")
    assert len(caplog.records) == 1
    assert "hunter2" not in caplog.text
    assert "keeping the previous value" in caplog.text and str(secret_file) in caplog.text


def test_a_clone_whose_reload_fails_does_not_serve_the_snapshots_value(
        rehydrate_engine, monkeypatch):
    """No before-snapshot pass (a platform that only checkpoints): the clone still holds
    the image's value. When the new environment drops the variable, that value (revoked,
    perhaps) must not be served; the original resuming keeps its own."""
    monkeypatch.setenv("RHT_TOKEN", "image-token")
    s = Secret.from_env("RHT_TOKEN", engine=rehydrate_engine, on_wiped="raise")
    resumed = rehydrate_engine.simulate_restore(env={"RHT_TOKEN": None}, kind="resume")
    assert not resumed.ok and s.get() == b"image-token"
    monkeypatch.setenv("RHT_TOKEN", "image-token")
    restored = rehydrate_engine.simulate_restore(env={"RHT_TOKEN": None})
    assert not restored.ok and not s.available
    with pytest.raises(SecretUnavailable, match="RHT_TOKEN is not set"):
        s.get()


def test_missing_env_var(rehydrate_engine, monkeypatch):
    monkeypatch.delenv("NOPE_NOT_SET", raising=False)
    with pytest.raises(SecretError, match="NOPE_NOT_SET is not set"):
        Secret.from_env("NOPE_NOT_SET", engine=rehydrate_engine)


def test_source_error_message_never_leaks_the_value(rehydrate_engine):
    def bad():
        raise RuntimeError("token=hunter2 rejected")

    with pytest.raises(SecretError) as info:
        Secret.from_callable(bad, engine=rehydrate_engine)
    assert "hunter2" not in str(info.value)


def test_disabled_secrets_are_not_wiped(rehydrate_engine, secret_file, monkeypatch):
    monkeypatch.setenv("REHYDRATE_DISABLE", "secrets")
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    rehydrate_engine.simulate_snapshot()
    assert s.get().startswith(b"hunter2")


def test_collected_secret_unregisters_its_hooks(rehydrate_engine, secret_file):
    s = Secret.from_file(secret_file, engine=rehydrate_engine)
    assert any(h.name.startswith("rehydrate.secret:") for h in rehydrate_engine.hooks("restore"))
    del s
    gc.collect()
    assert not any(h.name.startswith("rehydrate.secret:")
                   for h in rehydrate_engine.hooks("restore"))


def test_a_secret_created_while_a_snapshot_is_pending_loads_only_after_restore(
        rehydrate_engine, tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"late-secret")
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.snapshot_pending
    late = Secret.from_file(path, engine=rehydrate_engine, on_wiped="raise")
    assert not late.available  # nothing loaded into memory that the image would keep
    with pytest.raises(SecretUnavailable, match="snapshot was pending"):
        late.get()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert not rehydrate_engine.snapshot_pending
    assert late.get() == b"late-secret"


def test_a_fifo_or_device_as_secret_file_is_one_clear_error(rehydrate_engine, tmp_path):
    """Like certificates and markers: a FIFO at the path would block the load for good,
    /dev/zero would fill the memory; both are one SecretError line."""
    import os

    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    for path, why in ((fifo, r"not a regular file \(a FIFO\)"),
                      ("/dev/zero", r"not a regular file \(a character device\)")):
        with pytest.raises(SecretError, match=r"cannot read secret file .*: " + why):
            Secret.from_file(path, engine=rehydrate_engine)


def test_from_callable_refuses_what_it_cannot_call(rehydrate_engine):
    with pytest.raises(TypeError, match="from_callable needs a callable"):
        Secret.from_callable("literal-value", engine=rehydrate_engine)  # type: ignore[arg-type]


def test_reload_between_the_snapshot_pass_and_the_restore_loads_nothing(rehydrate_engine,
                                                                       caplog):
    """reload() then put the value back into memory, and so into the image."""
    from rehydrate.secrets import Secret

    values = iter([b"one", b"two", b"three"])
    s = Secret.from_callable(lambda: next(values), name="rl", engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok and not s.available
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert s.reload() is False
    assert not s.available
    assert "secret rl: not reloaded: a snapshot is pending" in caplog.text
    assert rehydrate_engine.simulate_restore().ok
    assert s.get() == b"two"  # loaded by the restore, not before it


def test_a_load_overtaken_by_the_snapshot_pass_keeps_nothing(rehydrate_engine):
    from rehydrate.secrets import Secret

    def load() -> bytes:
        if s_holder:  # the reload: a before-snapshot pass comes while it reads
            assert rehydrate_engine.simulate_snapshot().ok
        return b"value"

    s_holder: list[object] = []
    s = Secret.from_callable(load, name="race", engine=rehydrate_engine)
    s_holder.append(s)
    assert s.reload() is False
    assert not s.available


def test_a_bad_or_duplicate_secret_name_is_refused_before_anything_is_loaded(
        rehydrate_engine):
    """A name the hooks refuse used to leave the loaded value in an orphan buffer that
    was never wiped; a duplicate name hid one of the two from status()."""
    from rehydrate.secrets import Secret

    loads = []

    def loader() -> bytes:
        loads.append(1)
        return b"value"

    with pytest.raises(TypeError, match="secret name must be a non-empty string"):
        Secret.from_callable(loader, name="bad\nname", engine=rehydrate_engine)
    first = Secret.from_callable(loader, name="dup", engine=rehydrate_engine)
    with pytest.raises(ValueError, match="a secret named 'dup' is already managed"):
        Secret.from_callable(loader, name="dup", engine=rehydrate_engine)
    assert loads == [1] and first.get() == b"value"


def test_a_failed_load_keeps_no_trace_of_the_sources_exception(rehydrate_engine):
    """``SecretError(...) from None`` still carried the loader's exception — message
    included — as ``__context__``, for any tool that walks it."""
    def leaky() -> bytes:
        raise ValueError("could not parse token=SECRET-VALUE")

    with pytest.raises(SecretError) as info:
        Secret.from_callable(leaky, name="leaky", engine=rehydrate_engine)
    err: BaseException | None = info.value
    while err is not None:
        assert "SECRET-VALUE" not in str(err)
        err = err.__cause__ or err.__context__


def test_reload_waits_for_open_views_of_the_previous_value(rehydrate_engine):
    """reload() zeroed the previous buffer at once, under a reader's open view; wipe()
    already waited up to ``wipe_wait`` for readers."""
    values = iter([b"one", b"two"])
    s = Secret.from_callable(lambda: next(values), name="views", wipe_wait=5,
                             engine=rehydrate_engine)
    entered, release = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def reader() -> None:
        with s as view:
            entered.set()
            release.wait(5)
            seen.append(bytes(view))

    t = threading.Thread(target=reader)
    t.start()
    assert entered.wait(5)
    reloading = threading.Thread(target=s.reload)
    reloading.start()
    reloading.join(0.2)
    assert reloading.is_alive()  # waiting for the reader, not zeroing under it
    release.set()
    t.join(5)
    reloading.join(5)
    assert seen == [b"one"] and s.get() == b"two"


@pytest.mark.parametrize("snapshot_pass", [True, False])
def test_a_reload_that_outlives_the_restore_keeps_the_clone_s_value(rehydrate_engine,
                                                                    snapshot_pass):
    """Before: a ``reload()`` whose source answered only after the snapshot *and the
    restore* stored the value it fetched before — the snapshot's, every clone's —
    over the value the restore had just loaded; only ``snapshot_pending`` was checked."""
    source = {"value": b"parent-token", "stall": False}
    entered, release = threading.Event(), threading.Event()

    def fetch() -> bytes:
        value = source["value"]
        if source["stall"]:
            source["stall"] = False
            entered.set()
            release.wait(30)
        return value

    secret = Secret.from_callable(fetch, name="vault", engine=rehydrate_engine)
    source["stall"] = True
    worker = threading.Thread(target=secret.reload, daemon=True)
    worker.start()
    assert entered.wait(5)
    if snapshot_pass:
        assert rehydrate_engine.simulate_snapshot().ok
    source["value"] = b"clone-token"  # what the source answers the clone
    try:
        assert rehydrate_engine.simulate_restore().ok
        assert secret.get() == b"clone-token"
    finally:
        release.set()  # the stale reload comes back only now
        worker.join(10.0)
    assert secret.get() == b"clone-token"
    assert "a restore happened while this load ran" in (secret.last_error or "")


def test_a_secret_dropped_without_close_is_wiped(rehydrate_engine):
    """Before: only ``close()`` and the before-snapshot pass wiped the value; a Secret
    that was simply garbage-collected left it in freed heap memory — and in every
    snapshot image taken later."""
    import weakref

    secret = Secret.from_callable(lambda: b"s3cr3t-token-value", name="dropped",
                                  engine=rehydrate_engine)
    buffer = secret._buf  # the memory the value lives in
    assert bytes(buffer) == b"s3cr3t-token-value"
    alive = weakref.ref(secret)
    del secret
    gc.collect()
    assert alive() is None
    assert bytes(buffer) == bytes(len(buffer))


# -- SecretSource: a value lent only while it is used ----------------------------------------


@pytest.mark.parametrize("text", ["", "ascii pass", "pässwörd", "пароль", "密码", "🔑key🔑",
                                  "\x00\x7f\x80\u07ff\u0800\uffff\U00010000\U0010ffff"])
def test_utf8_into_is_str_encode_without_an_immutable_copy(text):
    from rehydrate.secrets import utf8_into

    out = utf8_into(text)
    assert isinstance(out, bytearray) and out == text.encode("utf-8")


def test_utf8_into_refuses_a_lone_surrogate_without_the_text():
    from rehydrate.secrets import SecretSource, utf8_into

    with pytest.raises(ValueError, match="lone surrogate") as caught:
        utf8_into("secret\ud800")
    assert "secret" not in str(caught.value)
    with pytest.raises(ValueError, match="^key password: text with a lone surrogate"):
        SecretSource("secret\ud800", what="key password")


def test_a_plain_source_is_copied_lent_at_every_use_and_wiped_on_wipe():
    from rehydrate.secrets import SecretSource

    value = bytearray(b"hunter2-plain")
    source = SecretSource(value)
    buf = source._plain
    assert buf is not value and value == b"hunter2-plain"  # the caller's object untouched
    for _ in range(2):
        with source.lend() as view:
            assert bytes(view) == b"hunter2-plain" and view.readonly
    assert buf == b"hunter2-plain" and not source.spent  # kept for the next use
    source.wipe()
    assert buf == bytearray(len(buf)) and source.spent
    with source.lend() as view:
        assert view is None
    assert "hunter2" not in repr(source)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(SecretSource(b"x"))


def test_a_callable_source_is_called_at_every_use_and_its_bytearray_wiped():
    from rehydrate.secrets import SecretSource

    returned: list[bytearray] = []

    def fetch() -> bytearray:
        returned.append(bytearray(b"from-the-vault"))
        return returned[-1]

    source = SecretSource(fetch)
    for n in (1, 2):
        with source.lend() as view:
            assert bytes(view) == b"from-the-vault"
        assert len(returned) == n and returned[-1] == bytearray(len(b"from-the-vault"))
    assert not source.spent


def test_a_failing_callable_source_is_one_line_without_its_message():
    from rehydrate.secrets import SecretSource

    def fetch() -> bytes:
        raise RuntimeError("token hunter2 rejected")

    with pytest.raises(SecretError) as caught, SecretSource(fetch).lend():
        pass
    assert str(caught.value) == "the password callable failed: RuntimeError"
    assert caught.value.__context__ is None and caught.value.__cause__ is None


def test_a_secret_source_lends_the_secret_buffer_itself(rehydrate_engine, secret_file):
    from rehydrate.secrets import SecretSource

    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    source = SecretSource(s)
    with source.lend() as view:
        assert view.obj is s._buf  # no copy
    assert rehydrate_engine.simulate_snapshot().ok
    s.on_wiped = "raise"
    with pytest.raises(SecretUnavailable), source.lend():
        pass


def test_a_closed_secret_says_it_is_closed_at_once(rehydrate_engine):
    """After close() a read said "wiped before a snapshot; reloaded after restore/resume",
    and a blocking read waited its whole timeout for a reload that never comes."""
    s = Secret.from_callable(lambda: b"v", name="closing", timeout=600.0,
                             engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok  # wiped: a blocking read now waits
    errors: list[BaseException] = []

    def read() -> None:
        try:
            s.get()
        except SecretUnavailable as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()  # blocked on the wiped value, or about to be: either way it must fail
    s.close()
    reader.join(30.0)  # far below its 600 s timeout: close() woke it
    assert not reader.is_alive(), "a read of a closed secret waited for a reload"
    assert len(errors) == 1 and "closed" in str(errors[0]) and "wiped" not in str(errors[0])
    with pytest.raises(SecretUnavailable, match=r"secret 'closing' is unavailable: closed"):
        s.get()
    with pytest.raises(SecretUnavailable, match="closed"), s.view():
        pass
    s.close()  # idempotent


def test_a_closed_secret_is_never_loaded_again(rehydrate_engine):
    """reload() after close() filled a buffer no hook would ever wipe (its hooks are
    gone): the value went into every later snapshot image."""
    calls = []

    def source() -> bytes:
        calls.append(1)
        return b"value"

    s = Secret.from_callable(source, name="gone", engine=rehydrate_engine)
    s.close()
    assert s.reload() is False
    assert not s.available and s.loads == 1 and len(calls) == 1
    assert "closed" in s.last_error
    with pytest.raises(SecretUnavailable, match="closed"):
        s.get()


def test_a_load_that_was_running_when_the_secret_closed_is_discarded(rehydrate_engine):
    release = threading.Event()
    entered = threading.Event()
    first = [True]

    def source() -> bytearray:
        if first[0]:
            first[0] = False
            return bytearray(b"first")
        entered.set()
        release.wait(30.0)
        return bytearray(b"second")

    s = Secret.from_callable(source, name="racing", engine=rehydrate_engine)
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(s.reload()))
    t.start()
    assert entered.wait(30.0)
    s.close()
    release.set()
    t.join(30.0)
    assert results == [False]
    assert not s.available and s.loads == 1
    with pytest.raises(SecretUnavailable, match="closed"):
        s.get()


def test_a_secret_missing_at_restore_then_reloaded_makes_the_process_ready_again(
        rehydrate_engine, secret_file):
    """A clone restored before its Secret mount was filled: the required secret's hook
    fails (degraded); once the file is there and the secret reloads, the process is ready
    again — not out of rotation until the next restore."""
    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    secret_file.unlink()
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    assert rehydrate_engine.status().state == "degraded"
    assert not s.reload()  # still missing: nothing changes
    assert rehydrate_engine.status().state == "degraded"
    secret_file.write_bytes(b"mounted-late\n")
    assert s.reload()
    assert s.get() == b"mounted-late"
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()


def test_a_reload_begun_before_a_failed_resume_does_not_take_back_its_failure(
        rehydrate_engine):
    """A reload still fetching when a resume run (which keeps the generation) fails the
    secret's hook: what that reload fetched predates the run, so the process stays
    degraded instead of being made ready by it."""
    calls = [0]
    gate, entered = threading.Event(), threading.Event()

    def source() -> bytes:
        calls[0] += 1
        n = calls[0]
        if n == 1:
            return b"v1"
        if n == 2:  # the slow reload begun before the resume
            entered.set()
            assert gate.wait(10)
            return b"old"
        raise RuntimeError("source down")  # the resume's own load

    s = Secret.from_callable(source, name="tok", engine=rehydrate_engine)
    reload = threading.Thread(target=s.reload)
    reload.start()
    try:
        assert entered.wait(10)
        assert not rehydrate_engine.simulate_restore(kind="resume").ok
    finally:
        gate.set()
        reload.join(10)
    assert rehydrate_engine.status().state == "degraded"
    assert not rehydrate_engine.is_ready()


def test_a_secret_reloaded_while_later_hooks_run_makes_the_run_end_ready(
        rehydrate_engine, secret_file):
    """The Secret volume is filled while the restore's later hooks still run, and the
    secret reloads then: the run ends ready (the reload fires once; refused as "a run in
    progress", the process stayed degraded for good)."""
    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    secret_file.unlink()

    @rehydrate_engine.registry.after_restore(name="app.warm-up")
    def warm_up() -> None:
        secret_file.write_bytes(b"mounted-meanwhile\n")
        assert s.reload()

    report = rehydrate_engine.simulate_restore()
    assert not report.ok  # the secret's own hook failed
    assert s.get() == b"mounted-meanwhile"
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()


def test_a_secret_reload_does_not_clear_a_user_hook_that_shares_its_hook_name(
        rehydrate_engine, secret_file):
    """recovered() went by name: a user hook named like a secret's built-in hook
    (``rehydrate.secret:db-password``) that failed was cleared by any successful reload
    of that secret, and the process said ready with the user's hook still broken. The
    managers now recover their own hook by its record; a name still works for the user,
    and takes the user's hook before the built-in one."""
    s = Secret.from_file(secret_file, strip=True, engine=rehydrate_engine)
    name = "rehydrate.secret:db-password"
    broken = [True]

    @rehydrate_engine.registry.after_restore(name=name)
    def lookalike() -> None:
        if broken[0]:
            raise ConnectionError("the user's own job failed")

    # Only the user's hook failed: the secret's reloads have nothing to recover.
    report = rehydrate_engine.simulate_restore()
    assert [h.name for h in report.failed] == [name]
    assert s.reload()
    assert rehydrate_engine.status().state == "degraded" and not rehydrate_engine.is_ready()
    assert rehydrate_engine.recovered(name) is True
    assert rehydrate_engine.status().state == "ready"

    # Both failed: the secret's reloads, however many, recover the secret's alone.
    secret_file.unlink()
    assert not rehydrate_engine.simulate_restore().ok
    secret_file.write_bytes(b"mounted-late\n")
    assert s.reload() and s.reload()
    assert rehydrate_engine.status().state == "degraded"
    assert rehydrate_engine.recovered(name) is True
    assert rehydrate_engine.status().state == "ready"

    # The user's call by name first: it takes the user's failure, not the secret's,
    # which the secret's own reload then clears (taking the secret's left the user's
    # for good: no reload recovers a user hook).
    secret_file.unlink()
    assert not rehydrate_engine.simulate_restore().ok
    assert rehydrate_engine.recovered(name) is False
    assert rehydrate_engine.status().state == "degraded"
    secret_file.write_bytes(b"mounted-again\n")
    assert s.reload()
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()
    broken[0] = False
    assert rehydrate_engine.simulate_restore().ok


def test_a_secret_made_again_after_its_failed_one_was_closed_makes_the_process_ready(
        rehydrate_engine, secret_file, tmp_path):
    """The restore could not read the secret; the application closed it and made it again
    under the same name from another file, which loads. Before, the failure held the
    closed secret's hook record, which no load could name any more: degraded until the
    next restore. The new secret's loads (its first one included) now mend it; closing
    alone does not."""
    s = Secret.from_file(secret_file, name="db", strip=True, engine=rehydrate_engine)
    secret_file.unlink()
    assert not rehydrate_engine.simulate_restore().ok
    s.close()
    assert rehydrate_engine.status().state == "degraded"  # closing fixed nothing
    moved = tmp_path / "mounted-elsewhere"
    moved.write_bytes(b"s3cret\n")
    s2 = Secret.from_file(moved, name="db", strip=True, engine=rehydrate_engine)
    assert s2.get() == b"s3cret"
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()

    # made again while still unreadable: nothing to mend with; its first good reload does
    moved.unlink()
    assert not rehydrate_engine.simulate_restore().ok
    s2.close()
    s3 = Secret.from_file(moved, name="db", engine=rehydrate_engine, load=False)
    assert rehydrate_engine.status().state == "degraded"
    moved.write_bytes(b"back\n")
    assert s3.reload()
    assert rehydrate_engine.status().state == "ready"
    assert rehydrate_engine.simulate_restore().ok


# -- a before-snapshot pass while a secret is being made ---------------------------------


def _make_in_thread(make):  # type: ignore[no-untyped-def]
    """``make()`` in a thread of its own; returns the thread, its result and error lists."""
    made: list[Secret] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            made.append(make())
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, made, errors


def test_a_snapshot_pass_while_the_constructor_runs_wipes_the_value_it_stored(
        rehydrate_engine, monkeypatch):
    """The constructor loaded the value, then registered the wipe hook: a pass that
    another thread ran in between found no hook for it, and the value went into the
    image. The hooks now come first, so that pass wipes the buffer."""
    stored, release = threading.Event(), threading.Event()
    buffers: list[bytearray] = []
    load = Secret._load

    def load_then_wait(self, **kwargs):  # type: ignore[no-untyped-def]
        ok = load(self, **kwargs)
        if not stored.is_set():  # the constructor's load: the value is in its buffer
            buffers.append(self._buf)
            stored.set()
            assert release.wait(10)
        return ok

    monkeypatch.setattr(Secret, "_load", load_then_wait)
    t, made, errors = _make_in_thread(lambda: Secret.from_callable(
        lambda: bytearray(b"hunter2-token"), name="token", on_wiped="raise",
        engine=rehydrate_engine))
    assert stored.wait(10)
    assert bytes(buffers[0]) == b"hunter2-token"
    try:
        assert rehydrate_engine.simulate_snapshot().ok
    finally:
        release.set()
        t.join(10)
    assert not errors
    [s] = made
    assert not any(buffers[0])  # that very buffer zeroed: the image holds no copy
    assert not s.available
    with pytest.raises(SecretUnavailable, match="wiped before a snapshot"):
        s.get()
    assert rehydrate_engine.simulate_restore().ok
    assert s.get() == b"hunter2-token"


def test_a_snapshot_pass_while_the_constructor_reads_the_source_leaves_it_wiped(
        rehydrate_engine):
    """The load then kept nothing but the constructor raised SecretError ("a snapshot is
    pending"), and the secret was never registered: nothing loaded it after the restore.
    It is now made like one created after the pass: wiped, loaded on restore."""
    reading, release = threading.Event(), threading.Event()
    values = iter([b"before-the-image", b"the-clone-s-own"])

    def source() -> bytes:
        if not reading.is_set():
            reading.set()
            assert release.wait(10)
        return next(values)

    t, made, errors = _make_in_thread(lambda: Secret.from_callable(
        source, name="token", on_wiped="raise", engine=rehydrate_engine))
    assert reading.wait(10)
    try:
        assert rehydrate_engine.simulate_snapshot().ok
    finally:
        release.set()
        t.join(10)
    assert not errors
    [s] = made
    assert not s.available
    with pytest.raises(SecretUnavailable, match="created while a snapshot was pending"):
        s.get()
    assert rehydrate_engine.simulate_restore().ok
    assert s.get() == b"the-clone-s-own"


def test_a_second_secret_of_a_name_being_made_is_refused(rehydrate_engine):
    """The name was checked before the first secret's load and claimed after it: a second
    secret made meanwhile under the name got it too (one of them hidden from status())."""
    reading, release = threading.Event(), threading.Event()

    def source() -> bytes:
        reading.set()
        assert release.wait(10)
        return b"first"

    t, made, errors = _make_in_thread(lambda: Secret.from_callable(
        source, name="dup", engine=rehydrate_engine))
    assert reading.wait(10)
    try:
        with pytest.raises(ValueError, match="a secret named 'dup' is already managed"):
            Secret.from_callable(lambda: b"second", name="dup", engine=rehydrate_engine)
    finally:
        release.set()
        t.join(10)
    assert not errors and made[0].get() == b"first"
    from rehydrate import secrets

    assert [s.name for s in secrets.manager(rehydrate_engine).secrets()] == ["dup"]


def test_a_wipe_wait_the_hooks_refuse_leaves_nothing_loaded_or_registered(rehydrate_engine):
    """The value was loaded and the restore hook registered before the before-snapshot
    hook refused its timeout: the constructor raised, leaving that restore hook behind
    (for good: nothing unregistered it) and a loaded buffer. Now nothing stays."""
    loads: list[int] = []

    def source() -> bytes:
        loads.append(1)
        return b"value"

    with pytest.raises(ValueError, match="^wipe_wait must be a number of seconds"):
        Secret.from_callable(source, name="w", wipe_wait=float("nan"),
                             engine=rehydrate_engine)
    assert not loads
    assert not [h for event in ("restore", "snapshot")
                for h in rehydrate_engine.hooks(event) if h.name == "rehydrate.secret:w"]
    assert Secret.from_callable(source, name="w", engine=rehydrate_engine).get() == b"value"


@pytest.mark.parametrize(("wipe_wait", "error", "shown"), [
    (float("nan"), ValueError, "not nan"),
    (4e7, ValueError, "not 40000000.0"),  # was reported as "timeout … not 40000005.0"
    (-1, ValueError, "not -1"),
    ("2", TypeError, "not str"),
])
def test_a_bad_wipe_wait_is_named_with_the_value_given(rehydrate_engine, wipe_wait, error,
                                                       shown):
    with pytest.raises(error) as caught:
        Secret(lambda: b"pw", name="db", wipe_wait=wipe_wait, engine=rehydrate_engine)
    message = str(caught.value)
    assert message.startswith("wipe_wait must be a number of seconds >= 0") and \
        message.endswith(shown), message
    assert not [h for event in ("restore", "snapshot")
                for h in rehydrate_engine.hooks(event) if h.name == "rehydrate.secret:db"]


def test_the_longest_wipe_wait_is_accepted(rehydrate_engine):
    """A year: the wipe hook's timeout (wipe_wait + 5 s) is held to the registry's limit."""
    s = Secret(lambda: b"pw", name="db", wipe_wait=31_536_000, engine=rehydrate_engine)
    assert s.wipe_wait == 31_536_000.0 and s.get() == b"pw"


@pytest.mark.parametrize("snapshot_pass", [False, True])
def test_a_restore_while_the_constructor_reads_the_source_keeps_the_restore_s_load(
        rehydrate_engine, snapshot_pass):
    """The secret's restore hook (registered before the constructor's load) loaded the
    clone's value, yet the constructor's load, seeing the generation change, raised
    SecretError and unregistered the secret: the object (reachable from the traceback)
    kept the clone's value, never wiped again. A restore is now covered like a pass."""
    reading, release = threading.Event(), threading.Event()

    def source() -> bytes:
        if not reading.is_set():  # the constructor's: answered once the clone runs
            reading.set()
            assert release.wait(10)
            return b"before-the-image"
        return b"the-clone-s-own"

    t, made, errors = _make_in_thread(lambda: Secret.from_callable(
        source, name="token", on_wiped="raise", engine=rehydrate_engine))
    assert reading.wait(10)
    try:
        if snapshot_pass:
            assert rehydrate_engine.simulate_snapshot().ok
        assert rehydrate_engine.simulate_restore().ok
    finally:
        release.set()
        t.join(10)
    assert not errors
    [s] = made
    assert s.get() == b"the-clone-s-own" and s.loads == 1
    from rehydrate import secrets

    assert secrets.manager(rehydrate_engine).secrets() == [s]
    assert rehydrate_engine.simulate_snapshot().ok  # managed: the next pass wipes it
    assert not s.available


def test_a_constructor_that_fails_after_its_restore_hook_loaded_keeps_no_value(
        rehydrate_engine):
    """The constructor's failure path unregistered the secret but left the value its
    restore hook had loaded meanwhile in the object (alive in the exception's traceback),
    out of reach of every later wipe. It is now closed and wiped first."""

    class Interrupted(BaseException):  # like KeyboardInterrupt: past ``except Exception``
        pass

    reading, release = threading.Event(), threading.Event()
    objects: list[Secret] = []
    load = Secret._load

    def source() -> bytes:
        if not reading.is_set():
            reading.set()
            assert release.wait(10)
            raise Interrupted
        return b"the-clone-s-own"

    def record(self, **kwargs):  # type: ignore[no-untyped-def]
        objects.append(self)
        return load(self, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(Secret, "_load", record):
        t, made, errors = _make_in_thread(lambda: Secret.from_callable(
            source, name="token", engine=rehydrate_engine))
        assert reading.wait(10)
        try:
            assert rehydrate_engine.simulate_restore().ok
            buffer = objects[0]._buf
            assert buffer == b"the-clone-s-own"  # the restore hook's load
        finally:
            release.set()
            t.join(10)
    assert not made and [type(e) for e in errors] == [Interrupted]
    orphan = objects[0]
    assert orphan._buf is None and not any(buffer)
    with pytest.raises(SecretUnavailable, match="closed"):
        orphan.get()
    from rehydrate import secrets

    assert secrets.manager(rehydrate_engine).secrets() == []


@pytest.mark.parametrize("bad, error", [("10", TypeError), (-1, ValueError),
                                        (float("nan"), ValueError)])
def test_a_bad_read_timeout_is_refused_when_the_secret_is_made(rehydrate_engine, bad, error):
    """``timeout`` (how long a read waits for a wiped value) was not checked: a bad one
    raised at the first blocked read, inside the application's request, as a TypeError
    from the clock arithmetic or a wait that returned at once."""
    with pytest.raises(error, match=r"^timeout must be a number of seconds >= 0"):
        Secret.from_callable(lambda: b"value", name="t", timeout=bad,
                             engine=rehydrate_engine)
    assert "t" not in rehydrate_engine.status().extra.get("secrets", {})


def test_get_str_of_a_value_that_does_not_decode_never_carries_the_value(rehydrate_engine):
    s = Secret.from_callable(lambda: b"TOPSECRET-\xff-binary-token", name="bin",
                             engine=rehydrate_engine)
    with pytest.raises(SecretError) as info:
        s.get_str()
    exc = info.value
    assert str(exc) == "secret 'bin' is not valid utf-8 (byte at offset 10)"
    assert exc.__context__ is None and exc.__cause__ is None
    assert "TOPSECRET" not in repr(exc) and "TOPSECRET" not in repr(exc.args)
    assert s.get_str("latin-1") == "TOPSECRET-\xff-binary-token"
