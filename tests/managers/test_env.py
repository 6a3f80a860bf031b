"""Environment refresh at unit level: parse, diff, policies, protect list, removal,
non-UTF-8 bytes, malformed and unreadable files, and how the engine reports them."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rehydrate import EnvChanges, Lifecycle, Registry
from rehydrate.env import (
    KEEP,
    MAX_ENVIRON_BYTES,
    MAX_ENVIRON_ENTRIES,
    NEVER_FROM_FILE,
    EnvError,
    EnvRefresher,
    _matches,
    default_path,
    diff,
    parse_environ,
    read_environ,
)

SECRET = "v4lue-that-must-never-be-logged"


@pytest.fixture
def environ():
    """Snapshot and restore the whole process environment (bytes level)."""
    saved = dict(os.environb)
    yield os.environb
    for k in [k for k in os.environb if k not in saved]:
        del os.environb[k]
    for k, v in saved.items():
        if os.environb.get(k) != v:
            os.environb[k] = v


def write(path, entries: dict[bytes, bytes] | bytes) -> str:
    data = entries if isinstance(entries, bytes) else b"".join(
        k + b"=" + v + b"\0" for k, v in entries.items())
    path.write_bytes(data)
    return str(path)


# -- parse ---------------------------------------------------------------------------


def test_parse_basic_forms():
    assert parse_environ(b"A=1\0B=\0C=x=y\0") == {b"A": b"1", b"B": b"", b"C": b"x=y"}
    assert parse_environ(b"A=1") == {b"A": b"1"}  # no trailing NUL
    assert parse_environ(b"\0A=1\0\0\0B=2\0\0") == {b"A": b"1", b"B": b"2"}  # empty slots
    assert parse_environ(b"A=1\0A=2\0") == {b"A": b"2"}  # repeated key: last wins
    assert parse_environ(b"K=\xff\xfe\0\xc3(=x\0") == {b"K": b"\xff\xfe", b"\xc3(": b"x"}
    # line mode: a Windows-edited file's CRLF is no part of the values
    assert parse_environ(b"A=1\r\nB=two words\r\n") == {b"A": b"1", b"B": b"two words"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"A=1\0garbage\0", "entry 2 has no '='"),
        (b"=value\0", "entry 1 has an empty key"),
        (b"A=1\nexport B=2\n", "entry 2: the key has white space in it"),
        (b"\0\0\0\0", "no KEY=VALUE entries"),
        (b"", "no KEY=VALUE entries"),
        (b"x" * (MAX_ENVIRON_BYTES + 1), "larger than"),
        (b"".join(b"K%d=v\0" % i for i in range(MAX_ENVIRON_ENTRIES + 1)),
         f"more than {MAX_ENVIRON_ENTRIES} entries"),
    ],
)
def test_parse_rejects_malformed_input(data, message):
    with pytest.raises(EnvError, match=message):
        parse_environ(data)


def test_parse_error_never_contains_values():
    with pytest.raises(EnvError) as info:
        parse_environ(b"API_KEY=" + SECRET.encode() + b"\0" + SECRET.encode() + b"\0")
    assert SECRET not in str(info.value)


keys = st.binary(min_size=1, max_size=12).filter(lambda b: b"=" not in b and b"\0" not in b)
values = st.binary(max_size=40).filter(lambda b: b"\0" not in b)


@settings(max_examples=200)
@given(st.dictionaries(keys, values, min_size=1, max_size=20), st.booleans())
def test_parse_round_trips_any_bytes(entries, trailing_nul):
    data = b"\0".join(k + b"=" + v for k, v in entries.items())
    if trailing_nul:
        data += b"\0"
    # without any NUL the data is one entry per line (next test), where a CR ending a
    # line and a key with white space in it mean something else
    assume(b"\0" in data or (b"\n" not in data and not data.endswith(b"\r")
                             and all(k.split() == [k] and not k.startswith(b"#")
                                     and not k.startswith("\ufeff".encode())
                                     for k in entries)))
    if b"\0" in data and not data.endswith(b"\0"):  # NUL format, the last entry cut
        with pytest.raises(EnvError, match="last entry not NUL-terminated"):
            parse_environ(data)
        return
    assert parse_environ(data) == entries


@pytest.mark.parametrize("data", [b"API_KEY=new\0DB_URL=postgres://db/ne",  # cut mid-value
                                  b"API_KEY=new\0DB_",  # cut mid-key
                                  b"A=1\0B=2\0\0C"])
def test_nul_data_whose_last_entry_is_not_nul_terminated_is_refused(data):
    """A file cut short (or still being written) was applied: ``DB_URL`` got the cut
    value, and under policy update every key after the cut was removed."""
    with pytest.raises(EnvError, match=r"^last entry not NUL-terminated \(truncated, or "
                                       r"still being written\?\)$"):
        parse_environ(data)
    assert parse_environ(data[:data.rindex(b"\0") + 1])  # the part before the cut is fine


def test_a_truncated_file_is_not_applied_and_the_restore_is_not_ok(tmp_path, environ):
    spec = write(tmp_path / "spec_environ", {b"RHT_API_KEY": b"old",
                                             b"RHT_DB_URL": b"postgres://db/old",
                                             b"RHT_FEATURE": b"on"})
    environ.update({b"RHT_API_KEY": b"old", b"RHT_DB_URL": b"postgres://db/old",
                    b"RHT_FEATURE": b"on"})
    engine = Lifecycle(Registry(), env=EnvRefresher(path=spec))  # baseline: the 3 keys
    try:
        write(tmp_path / "spec_environ", b"RHT_API_KEY=new\0RHT_DB_URL=postgres://db/ne")
        report = engine.simulate_restore()
        assert not report.ok and engine.state == "degraded"
        assert report.env_changes == EnvChanges()
        assert environ[b"RHT_DB_URL"] == b"postgres://db/old"
        assert environ[b"RHT_API_KEY"] == b"old" and environ[b"RHT_FEATURE"] == b"on"
    finally:
        engine.close()


def test_a_line_file_with_a_byte_order_mark_keeps_its_first_key(tmp_path, environ):
    """An editor's BOM became part of the first key: ``\\ufeffAPI_KEY`` was added and
    ``API_KEY`` itself removed (policy update: the previous file had it)."""
    assert parse_environ("\ufeffA=1\r\nB=2\r\n".encode()) == {b"A": b"1", b"B": b"2"}
    assert parse_environ("\ufeff# note\nA=1\n".encode()) == {b"A": b"1"}
    environ[b"RHT_API_KEY"] = b"old"
    spec = write(tmp_path / "app.env", b"RHT_API_KEY=old\n")
    ref = EnvRefresher(path=spec)
    ref.baseline()
    write(tmp_path / "app.env", "\ufeffRHT_API_KEY=new\r\n".encode())
    assert ref.refresh() == EnvChanges(changed=("RHT_API_KEY",))
    assert environ[b"RHT_API_KEY"] == b"new"


def test_a_byte_order_mark_is_dropped_in_nul_format_too():
    assert parse_environ("\ufeffAPI_KEY=1\0B=2\0".encode()) == {b"API_KEY": b"1", b"B": b"2"}


def test_a_spec_environ_cut_inside_its_first_entry_is_refused(tmp_path, environ):
    """Cut inside its first entry, gVisor's file has no NUL left: read as one line, the
    cut value was applied (and every other key removed). A file named ``spec_environ``
    is NUL-separated; any other file may still be one entry per line."""
    environ.update({b"RHT_API_KEY": b"old", b"RHT_DB_URL": b"postgres://db/old"})
    spec = write(tmp_path / "spec_environ", {b"RHT_API_KEY": b"old",
                                             b"RHT_DB_URL": b"postgres://db/old"})
    ref = EnvRefresher(path=spec)
    ref.baseline()
    write(tmp_path / "spec_environ", b"RHT_DB_URL=postgres://db/ne")
    with pytest.raises(EnvError, match=r"spec_environ: no NUL-terminated entry \(truncated"):
        ref.refresh()
    assert environ[b"RHT_DB_URL"] == b"postgres://db/old"
    assert environ[b"RHT_API_KEY"] == b"old"
    line_file = write(tmp_path / "app.env", b"RHT_DB_URL=postgres://db/new")
    assert read_environ(line_file) == {b"RHT_DB_URL": b"postgres://db/new"}


def test_line_mode_skips_comments_and_blank_lines_and_keeps_quotes():
    data = b"# written by hand\n  # indented note=x\n\n   \nA=1 # not a comment\n#B=2\nQ=\"x\"\n"
    assert parse_environ(data) == {b"A": b"1 # not a comment", b"Q": b'"x"'}
    with pytest.raises(EnvError, match="no KEY=VALUE entries"):
        parse_environ(b"# only a comment\n")
    # NUL-separated data (/proc environ, spec_environ) has no comments: a key may be "#K"
    assert parse_environ(b"#K=1\0") == {b"#K": b"1"}


def test_data_without_a_nul_is_one_entry_per_line():
    assert parse_environ(b"API_KEY=new\nDB_URL=x\n") == {b"API_KEY": b"new", b"DB_URL": b"x"}
    assert parse_environ(b"A=1\n\nB=2") == {b"A": b"1", b"B": b"2"}
    with pytest.raises(EnvError, match="entry 2 has no '='"):
        parse_environ(b"PEM=-----BEGIN\nabc\n")  # never half a value
    # one NUL anywhere: the NUL format, where a value may hold newlines
    assert parse_environ(b"PEM=a\nb\0") == {b"PEM": b"a\nb"}


# -- diff -------------------------------------------------------------------------------


def test_diff_names_only_sorted():
    current = {b"A": b"1", b"B": b"2", b"C": b"3"}
    new = {b"B": b"2", b"C": b"changed", b"D": b"4", b"A0": b"x"}
    ch = diff(current, new, remove=[b"A", b"ZZ"])
    assert ch == EnvChanges(added=("A0", "D"), changed=("C",), removed=("A",))
    assert bool(ch) and "D" in ch and "B" not in ch
    assert ch.keys == {"A0", "D", "C", "A"}
    assert ch.only(("C", "nope")) == EnvChanges(changed=("C",))
    assert ch.only(()) is ch
    assert not diff(current, dict(current))


@given(st.dictionaries(keys, values, max_size=10), st.dictionaries(keys, values, max_size=10))
def test_diff_partitions_the_changed_keys(current, new):
    ch = diff(current, new, remove=list(current))
    enc = {k.decode("utf-8", "surrogateescape"): k for k in set(current) | set(new)}
    assert {enc[n] for n in ch.added} == set(new) - set(current)
    assert {enc[n] for n in ch.changed} == {k for k in new if k in current and
                                            current[k] != new[k]}
    assert {enc[n] for n in ch.removed} == set(current) - set(new)


# -- read ------------------------------------------------------------------------------


def test_read_environ_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(EnvError, match="cannot read .*missing"):
        read_environ(missing)
    with pytest.raises(EnvError, match="cannot read"):
        read_environ(tmp_path)  # a directory
    bad = write(tmp_path / "bad", b"A=1\0oops\0")
    with pytest.raises(EnvError, match=r"bad: entry 2 has no '='"):
        read_environ(bad)


def as_unprivileged(fn):
    """Run ``fn`` as uid 65534 in a forked child when we are root (root reads mode-000
    files anyway); returns what the child reported, or runs ``fn`` directly otherwise."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges for real, report, and leave without cleanup
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            result = fn()
            os.write(w, repr(result).encode())
        except BaseException as exc:
            os.write(w, f"raised {type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        out = fh.read().decode()
    os.waitpid(pid, 0)
    return out


def _expect_env_error(fn):
    def probe():
        try:
            fn()
        except EnvError as exc:
            return f"EnvError: {exc}"
        return "no error"

    return probe


@pytest.fixture
def open_dir():
    """A directory uid 65534 can reach (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="rehydrate-env-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_read_environ_permission_denied(open_dir):
    path = write(open_dir / "spec_environ", {b"A": b"1"})
    os.chmod(path, 0)
    out = as_unprivileged(_expect_env_error(lambda: read_environ(path)))
    assert "EnvError: cannot read" in out and "Permission denied" in out, out


def test_read_environ_caps_what_it_reads(tmp_path):
    path = tmp_path / "huge"
    with open(path, "wb") as fh:  # 10 MB of valid-looking entries
        chunk = b"K" * 100 + b"=" + b"v" * 1000 + b"\0"
        while fh.tell() < 10 * 1024 * 1024:
            fh.write(chunk)
    with pytest.raises(EnvError, match="larger than"):
        read_environ(path)


# -- refresher: policies ----------------------------------------------------------------


def test_update_policy_sets_changes_and_removes_only_file_keys(tmp_path, environ):
    environ[b"RHT_LOCAL"] = b"mine"  # never came from the file
    environ[b"REHYDRATE_TEST_FLAG"] = b"1"
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_A": b"1", b"RHT_B": b"2", b"RHT_C": b"3"})
    for k, v in parse_environ(spec.read_bytes()).items():
        environ[k] = v  # the process was started with the file's environment
    ref = EnvRefresher(path=str(spec))
    ref.baseline()

    write(spec, {b"RHT_A": b"1", b"RHT_B": b"two", b"RHT_D": b"4"})
    changes = ref.refresh()
    assert changes == EnvChanges(added=("RHT_D",), changed=("RHT_B",), removed=("RHT_C",))
    assert environ[b"RHT_A"] == b"1" and environ[b"RHT_B"] == b"two"
    assert environ[b"RHT_D"] == b"4" and b"RHT_C" not in environ
    assert environ[b"RHT_LOCAL"] == b"mine"
    assert environ[b"REHYDRATE_TEST_FLAG"] == b"1"
    assert os.environ["RHT_B"] == "two"  # the str view agrees

    # the next refresh diffs against the file it last applied
    write(spec, {b"RHT_A": b"1", b"RHT_B": b"two"})
    assert ref.refresh() == EnvChanges(removed=("RHT_D",))
    assert ref.refresh() == EnvChanges()  # idempotent


def test_update_without_baseline_never_removes(tmp_path, environ):
    environ[b"RHT_OLD"] = b"x"
    spec = write(tmp_path / "spec_environ", {b"RHT_NEW": b"1"})
    ref = EnvRefresher(path=spec)
    assert ref.refresh() == EnvChanges(added=("RHT_NEW",))
    assert environ[b"RHT_OLD"] == b"x"


def test_replace_policy_makes_the_environment_exactly_the_file(tmp_path, environ):
    environ[b"RHT_STRAY"] = b"1"
    environ[b"REHYDRATE_KEEP"] = b"1"
    environ[b"RHT_PROTECTED"] = b"keep"
    spec = write(tmp_path / "spec_environ",
                 {b"RHT_A": b"1", b"RHT_PROTECTED": b"overwrite?"})
    ref = EnvRefresher(path=spec, policy="replace", protect=("RHT_PROT*", "PYTEST_*"))
    kept = {k for k in environ if _matches(k, (*NEVER_FROM_FILE, *KEEP, "PYTEST_*"))}
    before = set(environ) - kept
    changes = ref.refresh()
    assert set(environ) == {b"RHT_A", b"RHT_PROTECTED"} | kept
    assert environ[b"RHT_PROTECTED"] == b"keep"  # protected: not overwritten
    assert environ[b"REHYDRATE_KEEP"] == b"1"
    assert changes.added == ("RHT_A",)
    assert set(changes.removed) == {k.decode("utf-8", "surrogateescape")
                                    for k in before - {b"RHT_PROTECTED", b"RHT_A"}}
    assert "RHT_STRAY" in changes.removed


def test_off_policy_touches_nothing(tmp_path, environ):
    environ[b"RHT_A"] = b"old"
    spec = write(tmp_path / "spec_environ", {b"RHT_A": b"new", b"RHT_B": b"1"})
    ref = EnvRefresher(path=spec, policy="off")
    snapshot = dict(environ)
    assert ref.refresh() == EnvChanges()
    assert dict(environ) == snapshot


def test_off_policy_still_applies_an_overlay_within_protect(environ):
    """``off`` is about the file: ``simulate_restore(env=...)`` under
    ``REHYDRATE_ENV_POLICY=off`` changed nothing and no ``on_env_change`` hook ran, though
    the docs say only ``protect`` applies to overlays."""
    environ[b"RHT_A"] = b"old"
    environ[b"RHT_GONE"] = b"1"
    environ[b"RHT_LOCKED"] = b"keep"
    ref = EnvRefresher(path=None, policy="off", protect=("RHT_LOCK*",))
    changes = ref.refresh({"RHT_A": "overlay", "RHT_GONE": None, "RHT_LOCKED": "x"})
    assert changes == EnvChanges(changed=("RHT_A",), removed=("RHT_GONE",))
    assert environ[b"RHT_A"] == b"overlay" and b"RHT_GONE" not in environ
    assert environ[b"RHT_LOCKED"] == b"keep"


def test_off_policy_overlay_reaches_on_env_change_hooks(environ):
    reg = Registry()
    seen = []
    reg.on_env_change("RHT_API_KEY")(lambda ctx, ch: seen.append(ch.keys))
    engine = Lifecycle(reg, env=EnvRefresher(path=None, policy="off"))
    try:
        report = engine.simulate_restore(env={"RHT_API_KEY": "x"})
        assert report.ok and seen == [{"RHT_API_KEY"}]
        assert os.environ["RHT_API_KEY"] == "x"
    finally:
        engine.close()


def test_invalid_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        EnvRefresher(path=None, policy="merge")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["RHT_SECRET_*", b"RHT_*", 5, [1], ("",), (None,)])
def test_a_protect_that_is_not_a_tuple_of_patterns_is_refused(bad, tmp_path, environ):
    """protect="DB_*" was taken as the patterns D, B, _ and * — the last protecting every
    key, so a refresh silently changed nothing; a non-str pattern failed only at the
    restore. Refused when the refresher is made, in one line."""
    with pytest.raises(TypeError, match="protect") as refused:
        EnvRefresher(path=None, protect=bad)
    assert "\n" not in str(refused.value)


def test_protect_given_as_a_list_still_works(tmp_path, environ):
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_SECRET_X": b"2", b"RHT_PLAIN": b"2"})
    environ[b"RHT_SECRET_X"] = b"1"
    ref = EnvRefresher(path=str(spec), protect=["RHT_SECRET_*"])  # type: ignore[arg-type]
    assert ref.protect == ("RHT_SECRET_*",)
    assert ref.refresh() == EnvChanges(added=("RHT_PLAIN",))
    assert environ[b"RHT_SECRET_X"] == b"1"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True, 10**400])
def test_a_read_timeout_that_is_not_seconds_is_refused(bad):
    """read_timeout=nan (or 0, -1) made every refresh fail with "no answer within nans";
    infinity an OverflowError in the hook. The seconds rule applies when it is made."""
    with pytest.raises((TypeError, ValueError), match="read_timeout must be a number"):
        EnvRefresher(path=None, read_timeout=bad)


def test_read_timeout_none_still_means_no_limit(tmp_path, environ):
    """``read_timeout=None`` (no limit) worked until the seconds rule was applied to it,
    then made every refresher a TypeError; it reads the file as before."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_NO_LIMIT": b"1"})
    refresher = EnvRefresher(path=str(spec), read_timeout=None)
    assert refresher.read_timeout is None
    refresher.baseline()
    assert refresher.refresh() == EnvChanges(added=("RHT_NO_LIMIT",))
    assert environ[b"RHT_NO_LIMIT"] == b"1"


def test_protect_list_blocks_set_and_removal(tmp_path, environ):
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_SECRET_X": b"1", b"RHT_PLAIN": b"1", b"RHT_GONE": b"1"})
    for k, v in parse_environ(spec.read_bytes()).items():
        environ[k] = v
    ref = EnvRefresher(path=str(spec), protect=("RHT_SECRET_*", "RHT_GONE"))
    ref.baseline()
    write(spec, {b"RHT_SECRET_X": b"2", b"RHT_PLAIN": b"2", b"RHT_SECRET_NEW": b"3"})
    changes = ref.refresh()
    assert changes == EnvChanges(changed=("RHT_PLAIN",))
    assert environ[b"RHT_SECRET_X"] == b"1"
    assert b"RHT_SECRET_NEW" not in environ
    assert environ[b"RHT_GONE"] == b"1"  # protected from removal too
    # overlays honour the protect list as well
    assert ref.refresh({"RHT_SECRET_X": "9", "RHT_GONE": None}) == EnvChanges()
    assert environ[b"RHT_SECRET_X"] == b"1" and environ[b"RHT_GONE"] == b"1"


def test_overlay_sets_and_removes(environ):
    environ[b"RHT_X"] = b"1"
    ref = EnvRefresher(path=None)
    changes = ref.refresh({"RHT_X": None, "RHT_Y": "2", "RHT_Z": None})
    assert changes == EnvChanges(added=("RHT_Y",), removed=("RHT_X",))
    assert b"RHT_X" not in environ and environ[b"RHT_Y"] == b"2"


@pytest.mark.parametrize("bad", [{"": "x"}, {"A=B": "x"}, {"A": "nul\0inside"},
                                 {"RHT_S": "lone \ud800 surrogate"}, {"RHT_\udfff": "x"}])
def test_invalid_overlay_is_refused_before_anything_is_applied(environ, bad):
    snapshot = dict(environ)
    with pytest.raises(EnvError):
        EnvRefresher(path=None).refresh({"RHT_FIRST": "1", **bad})
    assert dict(environ) == snapshot


def test_no_file_no_changes(tmp_path, environ):
    snapshot = dict(environ)
    assert EnvRefresher(path=None).refresh() == EnvChanges()
    assert dict(environ) == snapshot


# -- non-UTF-8 ---------------------------------------------------------------------------


def test_non_utf8_bytes_are_applied_exactly(tmp_path, environ):
    raw_key = b"RHT_\xff\xfeKEY"
    spec = write(tmp_path / "spec_environ",
                 {b"RHT_BIN": b"\x80\xc3(\xff", raw_key: b"ok", b"RHT_UTF8": "é".encode()})
    changes = EnvRefresher(path=spec).refresh()
    assert environ[b"RHT_BIN"] == b"\x80\xc3(\xff"
    assert environ[raw_key] == b"ok"
    assert os.environ["RHT_UTF8"] == "é"
    # the str view decodes with surrogateescape, as Python does for the real environment
    assert os.fsencode(os.environ["RHT_BIN"]) == b"\x80\xc3(\xff"
    name = raw_key.decode("utf-8", "surrogateescape")
    assert name in changes.added and os.environ[name] == "ok"
    # the same key again is recognised as unchanged
    assert EnvRefresher(path=spec).refresh() == EnvChanges()


# -- malformed files: nothing applied, one clear log line, report not ok ---------------


MALFORMED = {
    "no-equals": (b"RHT_GOOD=1\0RHT_NO_EQUALS_" + SECRET.encode() + b"\0", "has no '='"),
    "empty-key": (b"RHT_GOOD=1\0=" + SECRET.encode() + b"\0", "empty key"),
    "only-nuls": (b"\0" * 64, "no KEY=VALUE entries"),
    "ten-mb": (None, "larger than"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_leaves_environ_untouched_and_fails_the_report(
        tmp_path, environ, caplog, case):
    data, message = MALFORMED[case]
    spec = tmp_path / "spec_environ"
    if data is None:
        data = (b"RHT_BIG=" + b"v" * 1024 + b"\0") * (10 * 1024)  # ~10 MB
    spec.write_bytes(data)
    environ[b"RHT_EXISTING"] = b"before"
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
    ran = []
    engine.registry.after_restore(name="user-hook")(lambda: ran.append(1))
    try:
        snapshot = dict(environ)
        with caplog.at_level(logging.DEBUG, logger="rehydrate"):
            report = engine.simulate_restore()  # reads the file (no overlay)
        assert dict(environ) == snapshot
        assert not report.ok
        env_result = next(h for h in report.hooks if h.name == "rehydrate.env")
        assert env_result.outcome == "failed"
        assert isinstance(env_result.error, EnvError)
        assert message in str(env_result.error)
        assert ran == [1]  # every other hook still runs
        assert engine.state == "degraded" and not engine.is_ready()
        assert report.env_changes == EnvChanges()
        problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(problems) == 1, [r.getMessage() for r in problems]
        line = problems[0].getMessage()
        assert "\n" not in line
        assert "rehydrate.env" in line and str(spec) in line and message in line
        assert all(SECRET not in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_invalid_utf8_file_is_not_malformed(tmp_path, environ):
    """Invalid UTF-8 is legal in an environment: it is applied byte for byte."""
    spec = write(tmp_path / "spec_environ", b"RHT_LATIN1=caf\xe9\0RHT_TRUNC=\xe2\x82\0")
    engine = Lifecycle(Registry(), env=EnvRefresher(path=spec))
    try:
        report = engine.simulate_restore()
        assert report.ok
        assert environ[b"RHT_LATIN1"] == b"caf\xe9" and environ[b"RHT_TRUNC"] == b"\xe2\x82"
        assert report.env_changes.added == ("RHT_LATIN1", "RHT_TRUNC")
    finally:
        engine.close()


def test_unreadable_file_is_an_env_error(tmp_path, environ, caplog):
    target = tmp_path / "spec_environ"
    target.mkdir()  # exists, but cannot be read as a file (works as root too)
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(target)))
    try:
        snapshot = dict(environ)
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            report = engine.simulate_restore()
        assert dict(environ) == snapshot
        env_result = report.hooks[0]
        assert env_result.name == "rehydrate.env" and env_result.outcome == "failed"
        assert isinstance(env_result.error, EnvError)
        assert "cannot read" in str(env_result.error)
        assert not report.ok
        assert len(caplog.records) == 1
    finally:
        engine.close()
    with pytest.raises(EnvError):
        EnvRefresher(path=str(target)).refresh()


def test_permission_denied_is_an_env_error(environ, open_dir):
    spec = write(open_dir / "spec_environ", {b"RHT_A": b"1"})
    os.chmod(spec, stat.S_IWUSR)

    def refresh_then_look():
        out = _expect_env_error(lambda: EnvRefresher(path=spec).refresh())()
        return f"{out}; RHT_A set: {'RHT_A' in os.environ}"

    out = as_unprivileged(refresh_then_look)
    assert "EnvError: cannot read" in out and "RHT_A set: False" in out, out


def test_a_later_good_file_recovers(tmp_path, environ):
    spec = tmp_path / "spec_environ"
    spec.write_bytes(b"broken")
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
    try:
        assert not engine.simulate_restore().ok
        write(spec, {b"RHT_FIXED": b"1"})
        report = engine.simulate_restore()
        assert report.ok and engine.is_ready()
        assert report.env_changes.added == ("RHT_FIXED",)
    finally:
        engine.close()


# -- engine integration ------------------------------------------------------------------


def test_engine_reads_the_file_and_logs_names_only(tmp_path, environ, caplog):
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_TOKEN": b"old", b"RHT_DROP": b"x"})
    environ[b"RHT_TOKEN"] = b"old"
    environ[b"RHT_DROP"] = b"x"
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
    seen = []
    engine.registry.on_env_change("RHT_TOKEN")(lambda ctx, ch: seen.append(ch))
    try:
        engine.start(detectors="none")  # takes the baseline
        write(spec, {b"RHT_TOKEN": SECRET.encode()})
        with caplog.at_level(logging.DEBUG, logger="rehydrate"):
            report = engine.simulate_restore()
        assert report.ok
        assert report.env_changes == EnvChanges(changed=("RHT_TOKEN",), removed=("RHT_DROP",))
        assert seen == [EnvChanges(changed=("RHT_TOKEN",))]
        assert os.environ["RHT_TOKEN"] == SECRET and "RHT_DROP" not in os.environ
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "RHT_TOKEN" in text  # names are logged
        assert SECRET not in text  # values never
        assert SECRET not in repr(report) and SECRET not in str(report.to_dict())
    finally:
        engine.stop()
        engine.close()


def test_overlay_values_stay_out_of_reprs(rehydrate_engine):
    seen = []
    rehydrate_engine.registry.after_restore(seen.append)
    rehydrate_engine.simulate_restore(env={"RHT_API_KEY": SECRET})
    (ctx,) = seen
    assert ctx.env == {"RHT_API_KEY": SECRET}  # available to hooks
    assert SECRET not in repr(ctx)


def test_default_path(monkeypatch):
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.delenv("REHYDRATE_GVISOR_PROC", raising=False)
    assert default_path() == "/proc/gvisor/spec_environ"
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", "/tmp/fake-gvisor")
    assert default_path() == "/tmp/fake-gvisor/spec_environ"
    assert EnvRefresher().resolved_path() == "/tmp/fake-gvisor/spec_environ"
    monkeypatch.setenv("REHYDRATE_ENV_FILE", "/run/env")
    assert default_path() == "/run/env"
    assert EnvRefresher(path=None).resolved_path() is None


def test_a_file_behind_an_unreadable_directory_is_an_error_not_absent(open_dir):
    inner = open_dir / "locked"
    inner.mkdir()
    spec = write(inner / "spec_environ", {b"RHT_B": b"1"})
    inner.chmod(0o700)
    out = as_unprivileged(_expect_env_error(lambda: EnvRefresher(path=spec).refresh()))
    assert "EnvError: cannot read" in out, out


def test_update_never_removes_rehydrate_keys_the_previous_file_had(tmp_path, environ):
    spec = write(tmp_path / "spec_environ", {b"RHT_KEEP": b"1", b"REHYDRATE_RHT_SOCK": b"/s"})
    environ.update({b"RHT_KEEP": b"1", b"REHYDRATE_RHT_SOCK": b"/s"})
    refresher = EnvRefresher(path=spec)
    refresher.baseline()
    write(tmp_path / "spec_environ", {b"RHT_NEW": b"2"})
    changes = refresher.refresh()
    assert changes.removed == ("RHT_KEEP",)
    assert environ[b"REHYDRATE_RHT_SOCK"] == b"/s"


def test_an_engine_knows_the_previous_file_without_start(tmp_path, environ, monkeypatch):
    """Removal needs the previous file's keys; trigger_snapshot() and notify-only setups
    never call start(), so the engine remembers the file when created and at a snapshot."""
    spec = write(tmp_path / "spec_environ", {b"RHT_A": b"1", b"RHT_GONE": b"x"})
    environ.update({b"RHT_A": b"1", b"RHT_GONE": b"x"})
    monkeypatch.setenv("REHYDRATE_ENV_FILE", spec)
    engine = Lifecycle(Registry())
    try:
        assert engine.simulate_snapshot().ok
        write(tmp_path / "spec_environ", {b"RHT_A": b"2"})
        report = engine.restore_detected("gvisor")
        assert report.ok, report.table()
        assert report.env_changes.removed == ("RHT_GONE",)
        assert report.env_changes.changed == ("RHT_A",)
        assert b"RHT_GONE" not in environ and environ[b"RHT_A"] == b"2"
    finally:
        engine.close()


# -- trust: what an environment file may not do -------------------------------------------


def test_a_file_never_sets_rehydrate_loader_or_interpreter_keys(tmp_path, environ, caplog):
    caplog.set_level(logging.WARNING, logger="rehydrate")
    environ[b"PYTHONPATH"] = b"/app"
    spec = write(tmp_path / "spec_environ", {
        b"RHT_OK": b"1", b"REHYDRATE_NFT": b"/tmp/evil-nft", b"LD_PRELOAD": b"/tmp/evil.so",
        b"PYTHONPATH": b"/tmp/evil", b"PYTHONSTARTUP": b"/tmp/evil.py",
        b"GCONV_PATH": b"/tmp/evil"})
    for policy in ("update", "replace"):
        changes = EnvRefresher(path=spec, policy=policy).refresh()
        assert changes.added == ("RHT_OK",) and changes.changed == ()
        assert b"REHYDRATE_NFT" not in environ and "LD_PRELOAD" not in os.environ
        assert os.environ["PYTHONPATH"] == "/app"  # neither changed nor removed
        assert "PYTHONSTARTUP" not in os.environ and "GCONV_PATH" not in os.environ
        del environ[b"RHT_OK"]
    assert "ignored GCONV_PATH, LD_PRELOAD, PYTHONPATH, PYTHONSTARTUP, REHYDRATE_NFT" in \
        caplog.text
    assert "/tmp/evil" not in caplog.text  # names only
    caplog.clear()
    forged = write(tmp_path / "forged", {b"RHT_OK": b"1",
                                         b"LD_X\nrehydrate: all clear": b"x"})
    EnvRefresher(path=forged).refresh()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ignored 'LD_X\\nrehydrate: all clear'" in line and "\n" not in line
    # the same values the process already has (gVisor repeats the container's own
    # settings in spec_environ) are no attempt: no warning
    caplog.clear()
    environ[b"REHYDRATE_RHT_SOCK"] = b"/run/s"
    write(tmp_path / "spec_environ", {b"RHT_OK": b"1", b"PYTHONPATH": b"/app",
                                      b"REHYDRATE_RHT_SOCK": b"/run/s"})
    EnvRefresher(path=spec).refresh()
    assert "ignored" not in caplog.text


def test_rehydrate_configuration_in_the_file_is_not_used_in_the_same_restore(
        tmp_path, environ, monkeypatch):
    """The reviewer's case: REHYDRATE_* in the file took effect in the very restore."""
    spec = write(tmp_path / "spec_environ", {b"RHT_OK": b"1",
                                             b"REHYDRATE_ENV_POLICY": b"replace",
                                             b"REHYDRATE_CONNECT_DEADLINE": b"0.001"})
    monkeypatch.setenv("REHYDRATE_ENV_FILE", str(spec))
    engine = Lifecycle(Registry())
    try:
        seen = []
        engine.registry.after_restore(
            lambda: seen.append(os.environ.get("REHYDRATE_CONNECT_DEADLINE")))
        report = engine.simulate_restore()
        assert report.ok, report.table()
        assert seen == [None] and os.environ["RHT_OK"] == "1"
    finally:
        engine.close()


def test_replace_and_update_never_remove_process_critical_keys(tmp_path, environ):
    environ.update({b"PATH": b"/usr/bin:/bin", b"HOME": b"/root", b"LC_ALL": b"C.UTF-8",
                    b"RHT_STRAY": b"1", b"RHT_A": b"1"})
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_A": b"1", b"PATH": b"/usr/bin:/bin", b"HOME": b"/root"})
    ref = EnvRefresher(path=str(spec))
    ref.baseline()
    write(spec, {b"RHT_A": b"1"})  # the new file lacks PATH and HOME
    assert ref.refresh() == EnvChanges()
    assert environ[b"PATH"] == b"/usr/bin:/bin" and environ[b"HOME"] == b"/root"

    changes = EnvRefresher(path=str(spec), policy="replace").refresh()
    assert "RHT_STRAY" in changes.removed
    assert not {"PATH", "HOME", "LC_ALL"} & set(changes.removed)
    assert environ[b"PATH"] == b"/usr/bin:/bin" and environ[b"LC_ALL"] == b"C.UTF-8"
    # a file may still change them
    write(spec, {b"RHT_A": b"1", b"PATH": b"/opt/bin:/usr/bin"})
    assert EnvRefresher(path=str(spec), policy="replace").refresh().changed == ("PATH",)
    assert environ[b"PATH"] == b"/opt/bin:/usr/bin"


def test_a_configured_file_that_is_missing_is_an_error(tmp_path, environ, monkeypatch):
    absent = str(tmp_path / "absent")
    with pytest.raises(EnvError, match="configured environment file does not exist"):
        EnvRefresher(path=absent).refresh()
    monkeypatch.setenv("REHYDRATE_ENV_FILE", absent)
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    with pytest.raises(EnvError, match=absent):
        EnvRefresher().refresh()
    engine = Lifecycle(Registry())
    try:
        report = engine.simulate_restore()
        [env_hook] = [h for h in report.hooks if h.name == "rehydrate.env"]
        assert env_hook.outcome == "failed" and not report.ok
        assert engine.state == "degraded"
    finally:
        engine.close()
    # the gVisor default that is absent (not gVisor) is no error
    monkeypatch.delenv("REHYDRATE_ENV_FILE")
    assert EnvRefresher().refresh() == EnvChanges()
def test_a_fifo_as_the_environment_file_never_blocks_the_engine(tmp_path, environ):
    """Issue #13.7: a FIFO at the path hung Lifecycle() (baseline), simulate_snapshot()
    for ever, and every restore after. Now each is one clear error and the engine keeps
    going; once a regular file is back, the next restore applies it."""
    import threading

    spec = tmp_path / "spec_environ"
    os.mkfifo(spec)
    done: dict[str, object] = {}

    def drive() -> None:
        engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
        try:
            done["snapshot"] = engine.simulate_snapshot()
            done["restore"] = engine.simulate_restore()
            os.unlink(spec)
            write(spec, {b"RHT_FIFO_FIXED": b"1"})
            done["fixed"] = engine.simulate_restore()
        finally:
            engine.close()

    worker = threading.Thread(target=drive, daemon=True)
    worker.start()
    worker.join(20.0)  # a deadline for the whole sequence, not a timing assumption
    assert not worker.is_alive(), f"the engine blocked on a FIFO (got {sorted(done)})"
    assert done["snapshot"].ok  # type: ignore[attr-defined]
    failed = done["restore"]
    env_result = failed.hooks[0]  # type: ignore[attr-defined]
    assert env_result.name == "rehydrate.env" and env_result.outcome == "failed"
    assert "not a regular file (a FIFO)" in str(env_result.error)
    assert done["fixed"].ok and environ[b"RHT_FIFO_FIXED"] == b"1"  # type: ignore[attr-defined]


def test_a_read_stuck_on_a_hung_mount_blocks_nothing(tmp_path, environ, monkeypatch):
    """A hung mount cannot be made here: ``read_environ`` is replaced by one that blocks,
    as an open on a dead NFS server does, until the test releases it. The engine's
    constructor and a refresh give up after ``read_timeout`` with one clear error, and
    the abandoned read keeps no lock: once the file answers, the next refresh works
    (issue #13.7)."""
    import threading
    import time

    from rehydrate import env as env_module

    spec = write(tmp_path / "spec_environ", {b"RHT_AFTER_HANG": b"1"})
    real, hung = env_module.read_environ, threading.Event()
    hung.set()
    release = threading.Event()

    def hangs_while_hung(path):  # type: ignore[no-untyped-def]
        if hung.is_set():
            release.wait(30)
        return real(path)

    monkeypatch.setattr(env_module, "read_environ", hangs_while_hung)
    refresher = EnvRefresher(path=spec, read_timeout=0.3)
    started = time.monotonic()
    engine = Lifecycle(Registry(), env=refresher)  # baseline(): used to hang here
    try:
        assert time.monotonic() - started < 5.0
        report = engine.simulate_restore()
        env_result = report.hooks[0]
        assert env_result.name == "rehydrate.env" and env_result.outcome == "failed"
        assert "no answer within 0.3s (a hung mount?)" in str(env_result.error)
        hung.clear()  # the mount answers again; the stuck reads are still stuck
        assert engine.simulate_restore().ok
        assert environ[b"RHT_AFTER_HANG"] == b"1"
    finally:
        release.set()
        engine.close()


def test_a_short_run_deadline_leaves_the_read_nearly_all_of_it(tmp_path, environ,
                                                               monkeypatch):
    """Under a 1.6 s run deadline a healthy but slow mount's 1.2 s read failed: half a
    second was kept back for applying the file, which takes microseconds."""
    from rehydrate import env as env_module

    spec = write(tmp_path / "spec_environ", {b"RHT_MARGIN": b"old"})
    environ[b"RHT_MARGIN"] = b"old"
    given: list[float | None] = []
    real = env_module._read_within

    def seen(path, timeout, **kwargs):  # type: ignore[no-untyped-def]
        given.append(timeout)
        return real(path, timeout, **kwargs)

    monkeypatch.setattr(env_module, "_read_within", seen)
    engine = Lifecycle(Registry(), env=EnvRefresher(path=spec))
    try:
        write(tmp_path / "spec_environ", {b"RHT_MARGIN": b"new"})
        assert engine.restore_detected("test", deadline=1.6).ok
        assert environ[b"RHT_MARGIN"] == b"new"
        timeout = given[-1]  # the hook's read (the engine read the file when made too)
        assert timeout is not None and 1.4 < timeout <= 1.5, given
    finally:
        engine.close()


def test_a_read_answering_after_the_hook_gave_up_is_never_applied(tmp_path, environ,
                                                                   monkeypatch):
    """A slow mount answering after the ``rehydrate.env`` hook's time (here the run's 1 s
    deadline, SnapStart's kind; with the default read_timeout of 5 s) ran out: the
    abandoned refresh applied the file then, behind the failed report, and no
    ``on_env_change`` hook ever heard of it, the next restore included. The read now
    ends within the hook's time, nothing is applied late, and the next restore reports
    the change."""
    import threading
    import time

    from rehydrate import env as env_module

    spec = write(tmp_path / "spec_environ", {b"RHT_LATE": b"old"})
    environ[b"RHT_LATE"] = b"old"
    real, answered = env_module.read_environ, threading.Event()
    slow, release = threading.Event(), threading.Event()

    def slow_mount(path):  # type: ignore[no-untyped-def]
        if slow.is_set():
            release.wait(30)
            try:
                return real(path)
            finally:
                answered.set()
        return real(path)

    monkeypatch.setattr(env_module, "read_environ", slow_mount)
    registry, heard = Registry(), []
    registry.on_env_change("RHT_LATE")(lambda ctx, changes: heard.append(changes))
    engine = Lifecycle(registry, env=EnvRefresher(path=spec))
    try:
        write(tmp_path / "spec_environ", {b"RHT_LATE": b"new"})
        slow.set()
        report = engine.restore_detected("test", deadline=1.0)
        release.set()
        assert answered.wait(10)
        ends = time.monotonic() + 10  # the abandoned hook (before the fix) ends by then
        while engine.status()["hung_hooks"] and time.monotonic() < ends:
            time.sleep(0.01)
        assert environ[b"RHT_LATE"] == b"old" and heard == []
        env_result = report.hooks[0]
        assert env_result.name == "rehydrate.env" and env_result.outcome == "failed"
        assert "the time the rehydrate.env hook had left" in str(env_result.error)
        slow.clear()
        report = engine.simulate_restore()
        assert report.ok and report.env_changes.changed == ("RHT_LATE",)
        assert environ[b"RHT_LATE"] == b"new"
        assert heard == [EnvChanges(changed=("RHT_LATE",))]
    finally:
        release.set()
        engine.close()


@settings(max_examples=300)
@given(st.text(alphabet="ABCLPRTY_*?[]!-Za0é\n", max_size=12))
def test_compiled_key_patterns_match_exactly_like_fnmatchcase(name):
    """The patterns are compiled into one expression (before a snapshot, not in the
    clone); that expression matches exactly the names ``fnmatchcase`` matches."""
    import fnmatch

    patterns = (*NEVER_FROM_FILE, *KEEP, "A?[BC]*", "[!L]X")
    key = name.encode("utf-8", "surrogateescape")
    assert _matches(key, patterns) == any(fnmatch.fnmatchcase(name, p) for p in patterns)
    assert not _matches(key, ())


def test_a_clone_reads_its_environment_on_a_thread_from_before_the_snapshot(
        tmp_path, environ, monkeypatch):
    """Starting a thread right after a gVisor restore costs milliseconds: the read of the
    new environment file runs on the thread that read the file before the snapshot."""
    import threading

    from rehydrate import env as env_module
    from tests.detect_helpers import threads_started

    spec = write(tmp_path / "spec_environ", {b"RHT_THREAD": b"1"})
    readers: list[int] = []
    real = env_module.read_environ

    def recording(path):  # type: ignore[no-untyped-def]
        readers.append(threading.get_ident())
        return real(path)

    monkeypatch.setattr(env_module, "read_environ", recording)
    engine = Lifecycle(Registry(), env=EnvRefresher(path=spec))
    try:
        assert engine.simulate_snapshot().ok
        before = {t.ident for t in threading.enumerate()}
        write(tmp_path / "spec_environ", {b"RHT_THREAD": b"2"})
        with threads_started() as started:
            report = engine.simulate_restore()
        assert report.ok, report.table()
        assert environ[b"RHT_THREAD"] == b"2"  # type: ignore[attr-defined]
        assert readers[-1] in before
        assert started == []
    finally:
        engine.close()


@pytest.mark.parametrize("env", [{"DB_PASSWORD=hunter2-s3cr3t": "x"},
                                 {"DB_PASSWORD=hunter2-s3cr3t": 5}])
def test_a_whole_pair_given_as_the_key_is_refused_without_its_value(rehydrate_engine, env):
    """Before: ``simulate_restore(env={"PW=secret": ...})`` quoted the whole key — the
    value after the ``=`` — into the error (and so the logs)."""
    with pytest.raises((EnvError, TypeError)) as caught:
        rehydrate_engine.simulate_restore(env=env)
    assert "hunter2" not in str(caught.value)
    assert "'DB_PASSWORD' (followed by '=' and a value, not shown)" in str(caught.value)


HUGE = "K" * 4_000_000


@pytest.mark.parametrize("overlay", [{"RHT_" + HUGE + "\0": "x"},  # NUL in the key
                                     {"RHT_" + HUGE + "=v": "x"},  # '=' in the key
                                     {"RHT_\udfff" + HUGE: "x"}])  # not encodable
def test_a_huge_bad_overlay_key_makes_a_short_error(overlay, environ):
    """The key was quoted whole: a 4 MB key gave a 4 MB EnvError (and log line)."""
    snapshot = dict(environ)
    with pytest.raises(EnvError) as caught:
        EnvRefresher(path=None).refresh(overlay)
    message = str(caught.value)
    assert len(message) < 200, len(message)
    assert message.startswith("invalid environment entry 'RHT_")
    assert dict(environ) == snapshot


@pytest.mark.parametrize("path", [123, b"/run/env", 1.5])
def test_a_path_that_is_not_a_path_is_one_type_error(path: object) -> None:
    """``EnvRefresher(path=123)`` was taken (``os.stat`` reads an int as a file
    descriptor), and ``Lifecycle(...)`` then failed deep in ``os.open``."""
    with pytest.raises(TypeError, match=r"^path must be a file path \(str\), 'auto' or None, "
                                        r"not (int|bytes|float): "):
        EnvRefresher(path=path)  # type: ignore[arg-type]


def test_a_path_may_be_a_pathlib_path(tmp_path: Path) -> None:
    env_file = tmp_path / "environ"
    env_file.write_bytes(b"")
    assert EnvRefresher(path=env_file).resolved_path() == env_file  # type: ignore[arg-type]


# -- what a refresh resets, what every engine sees, what is shown -------------------------


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "rehydrate" and r.levelno == logging.WARNING]


def test_a_refresh_that_resets_values_the_application_changed_says_which(
        tmp_path, environ, caplog, monkeypatch):
    """The contract stands (a key in the file gets the file's value at every refresh, a
    resume included), but the application's own value is no longer lost without a word:
    one WARNING per refresh names the keys — never a value — with how to keep them."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_PATH": b"/usr/bin", b"RHT_THREADS": b"1", b"RHT_KEY": SECRET.encode(),
                 b"RHT_GONE": b"a"})
    environ.update({b"RHT_PATH": b"/opt/venv/bin:/usr/bin", b"RHT_THREADS": b"8",
                    b"RHT_KEY": SECRET.encode(), b"RHT_GONE": b"app's"})
    monkeypatch.delenv("REHYDRATE_ENV_PROTECT", raising=False)
    ref = EnvRefresher(path=str(spec))
    ref.baseline()
    write(spec, {b"RHT_PATH": b"/usr/bin", b"RHT_THREADS": b"1", b"RHT_KEY": SECRET.encode()})
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        changes = ref.refresh()
    assert changes == EnvChanges(changed=("RHT_PATH", "RHT_THREADS"), removed=("RHT_GONE",))
    assert environ[b"RHT_PATH"] == b"/usr/bin" and environ[b"RHT_THREADS"] == b"1"
    assert b"RHT_GONE" not in environ
    (line,) = _warnings(caplog)
    assert "RHT_GONE, RHT_PATH, RHT_THREADS" in line and "RHT_KEY" not in line
    # the application's own refresher: only protect= applies to it (see the test below)
    assert "EnvRefresher(protect=...)" in line and "REHYDRATE_ENV_PROTECT" not in line
    assert "/opt/venv" not in line and "app's" not in line and SECRET not in line

    caplog.clear()  # nothing changed by the application since: nothing to say
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert ref.refresh() == EnvChanges()
    assert _warnings(caplog) == []


def test_a_key_the_process_lacks_is_not_taken_for_an_application_change(
        tmp_path, environ, caplog):
    spec = write(tmp_path / "spec_environ", {b"RHT_ONLY_IN_FILE": b"1"})
    environ.pop(b"RHT_ONLY_IN_FILE", None)
    ref = EnvRefresher(path=spec)
    ref.baseline()
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert ref.refresh() == EnvChanges(added=("RHT_ONLY_IN_FILE",))
    assert _warnings(caplog) == []


def test_rehydrate_env_protect_keeps_the_application_s_value_in_the_default_engine(
        tmp_path, environ, monkeypatch, caplog):
    spec = write(tmp_path / "spec_environ", {b"RHT_PATH": b"/usr/bin", b"RHT_THREADS": b"1"})
    environ.update({b"RHT_PATH": b"/opt/venv/bin", b"RHT_THREADS": b"8"})
    monkeypatch.setenv("REHYDRATE_ENV_FILE", spec)
    monkeypatch.setenv("REHYDRATE_ENV_PROTECT", "RHT_PATH, RHT_THR*")
    engine = Lifecycle(Registry())
    try:
        assert engine.env.protect == ("RHT_PATH", "RHT_THR*")
        assert engine.simulate_snapshot().ok
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            report = engine.restore_detected("gvisor", kind="resume")
        assert report.ok and report.env_changes == EnvChanges()
        assert environ[b"RHT_PATH"] == b"/opt/venv/bin" and environ[b"RHT_THREADS"] == b"8"
        assert _warnings(caplog) == []
    finally:
        engine.close()


def test_two_engines_each_see_the_platform_s_change(tmp_path, environ):
    """The second engine's refresher found os.environ already updated by the first: its
    env_changes were empty and its on_env_change hooks skipped."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_API_KEY": b"old", b"RHT_DROPPED": b"x"})
    environ.update({b"RHT_API_KEY": b"old", b"RHT_DROPPED": b"x"})
    engines = [Lifecycle(Registry(), env=EnvRefresher(path=str(spec))) for _ in range(2)]
    seen: list[list[EnvChanges]] = [[], []]
    for engine, got in zip(engines, seen):
        engine.registry.on_env_change("RHT_*")(lambda ctx, ch, got=got: got.append(ch))
    try:
        write(spec, {b"RHT_API_KEY": b"new", b"RHT_ADDED": b"1"})
        reports = [engine.restore_detected("gvisor", kind="restore") for engine in engines]
        expected = EnvChanges(added=("RHT_ADDED",), changed=("RHT_API_KEY",),
                              removed=("RHT_DROPPED",))
        assert [r.env_changes for r in reports] == [expected, expected]
        assert seen == [[expected], [expected]]
        assert environ[b"RHT_API_KEY"] == b"new" and b"RHT_DROPPED" not in environ
        # and once applied, the next restore with the same file is no change for either
        again = [engine.restore_detected("gvisor", kind="restore") for engine in engines]
        assert [r.env_changes for r in again] == [EnvChanges(), EnvChanges()]
    finally:
        for engine in engines:
            engine.close()


@pytest.fixture
def warned_anew(monkeypatch):
    from rehydrate import env as env_module

    monkeypatch.setattr(env_module, "_warned_missing", set(), raising=False)


def test_a_gvisor_proc_directory_without_spec_environ_warns_once(
        tmp_path, environ, monkeypatch, caplog, warned_anew):
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    write(tmp_path / "spec_environ.txt", {b"RHT_API_KEY": b"for-the-clone"})  # wrong name
    environ[b"RHT_API_KEY"] = b"from-the-original"
    engine = Lifecycle(Registry())
    try:
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            reports = [engine.simulate_restore(), engine.simulate_restore(kind="resume"),
                       engine.simulate_restore(kind="resume")]
        assert all(r.ok for r in reports) and engine.state == "ready"  # not an error
        assert environ[b"RHT_API_KEY"] == b"from-the-original"
        (line,) = _warnings(caplog)  # once per process and restore, not per refresh
        assert str(tmp_path / "spec_environ") in line and "spec_environ there" in line
    finally:
        engine.close()


@pytest.mark.parametrize("proc", [None, "/proc/gvisor", "/proc/gvisor/"])
def test_the_default_gvisor_directory_without_spec_environ_says_nothing(
        environ, monkeypatch, caplog, warned_anew, proc):
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    if proc is None:
        monkeypatch.delenv("REHYDRATE_GVISOR_PROC", raising=False)
    else:
        monkeypatch.setenv("REHYDRATE_GVISOR_PROC", proc)
    if os.path.exists("/proc/gvisor/spec_environ"):  # pragma: no cover - under gVisor
        pytest.fail("this test runs outside gVisor")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert EnvRefresher().refresh() == EnvChanges()
    assert _warnings(caplog) == []


def test_huge_and_many_key_names_are_shortened_in_the_log_the_status_and_reprs(
        tmp_path, environ, caplog):
    """A key of megabytes and thousands of keys made the run's INFO line and every
    status --json megabytes long; the report itself keeps every name for the hooks."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_A": b"1"})
    environ[b"RHT_A"] = b"1"
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
    huge = b"RHT_K" + b"K" * 200_000
    many = [b"RHT_X%05d" % i for i in range(3000)]
    try:
        engine.start(detectors="none")
        write(spec, b"RHT_A=1\0" + huge + b"=v\0" + b"".join(k + b"=v\0" for k in many))
        with caplog.at_level(logging.INFO, logger="rehydrate"):
            report = engine.simulate_restore()
        assert report.ok
        assert len(report.env_changes.added) == 3001  # every name, for the hooks
        (line,) = [m for m in (r.getMessage() for r in caplog.records)
                   if "environment refreshed" in m]
        assert len(line) < 2000, len(line)
        assert "'... (+2981 more)'" in line and "RHT_KKK" in line
        shown = engine.status().to_dict()["last_report"]["env_changes"]
        assert len(shown["added"]) == 21 and shown["added"][-1] == "... (+2981 more)"
        assert all(len(name) <= 60 for name in shown["added"])
        import json

        assert len(json.dumps(engine.status().to_dict())) < 10_000
        assert len(repr(report)) < 10_000 and len(repr(engine.status())) < 10_000
    finally:
        engine.stop()
        engine.close()


def test_huge_key_names_are_shortened_in_the_reset_and_ignored_warnings(
        tmp_path, environ, caplog):
    huge = b"RHT_" + b"H" * 100_000
    spec = tmp_path / "spec_environ"
    write(spec, {huge: b"1"})
    environ[huge] = b"app"
    ref = EnvRefresher(path=str(spec))
    ref.baseline()
    write(spec, {huge: b"1", b"LD_" + b"L" * 100_000: b"x"})
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        ref.refresh()
    lines = _warnings(caplog)
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [len(x) for x in lines]
    assert any("RHT_HHH" in line for line in lines) and any("LD_LLL" in line for line in lines)


def _holds_any(root: object, needles: tuple[bytes, ...]) -> list[str]:
    """Where, among the objects ``root`` owns (its attributes, their containers and the
    objects they refer to — not classes, modules or functions), a needle's bytes appear."""
    import gc
    import types

    found: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[object, str]] = [(root, "refresher")]
    while todo:
        obj, where = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType,
                                               types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (bytes, bytearray, str)):
            data = obj.encode("utf-8", "surrogateescape") if isinstance(obj, str) else obj
            found += [where for n in needles if n in data]
            continue
        if isinstance(obj, dict):
            todo += [(k, f"{where} key") for k in obj]
            todo += [(v, f"{where}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += [(v, f"{where} item") for v in obj]
        else:
            if hasattr(obj, "__dict__"):
                todo += [(v, f"{where}.{k}") for k, v in vars(obj).items()]
            todo += [(r, f"{where} referent") for r in gc.get_referents(obj)]
    return found


def test_the_refresher_keeps_no_value_of_the_environment(tmp_path, environ):
    """It kept every value of the file (secrets too) to tell what the application changed:
    a copy in every snapshot image, even of a key the application deleted from os.environ
    to keep it out of the image. Keyed hashes are enough to tell equality."""
    secrets = tuple(b"sk-live-%d-" % i + os.urandom(8).hex().encode() for i in range(4))
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_API_KEY": secrets[0], b"RHT_DB": secrets[1]})
    environ.update({b"RHT_API_KEY": secrets[0], b"RHT_DB": secrets[1]})
    ref = EnvRefresher(path=str(spec))
    ref.baseline()
    del environ[b"RHT_API_KEY"]  # the application drops it after reading
    assert _holds_any(ref, secrets) == []
    write(spec, {b"RHT_API_KEY": secrets[0], b"RHT_DB": secrets[2]})
    environ[b"RHT_DB"] = b"the application's own"
    assert ref.refresh() == EnvChanges(added=("RHT_API_KEY",), changed=("RHT_DB",))
    ref.refresh({"RHT_DB": secrets[3].decode()})
    assert _holds_any(ref, secrets) == []
    # what the hashes are for still works: the application's change is told from the file's
    environ[b"RHT_DB"] = b"changed again"
    assert ref.refresh() == EnvChanges(changed=("RHT_DB",))
    assert environ[b"RHT_DB"] == secrets[2]


def test_an_overlay_s_value_is_not_taken_for_the_application_s_own(
        tmp_path, environ, caplog):
    """A platform's restore with an env overlay (control socket, simulate_restore(env=))
    and then a resume from the file: the warning called the overlay's value the
    application's own."""
    spec = write(tmp_path / "spec_environ", {b"RHT_API_KEY": b"a", b"RHT_REGION": b"eu"})
    environ.update({b"RHT_API_KEY": b"a", b"RHT_REGION": b"eu"})
    engine = Lifecycle(Registry(), env=EnvRefresher(path=spec))
    try:
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            first = engine.restore_detected(
                "control", kind="restore",
                env={"RHT_API_KEY": "for-this-clone", "RHT_REGION": None, "RHT_NEW": "1"})
            assert first.env_changes == EnvChanges(
                added=("RHT_NEW",), changed=("RHT_API_KEY",), removed=("RHT_REGION",))
            later = engine.restore_detected("control", kind="resume")
        assert _warnings(caplog) == []
        # the file's values again, as the policy says; the overlay-only key stays
        assert later.env_changes == EnvChanges(added=("RHT_REGION",), changed=("RHT_API_KEY",))
        assert environ[b"RHT_API_KEY"] == b"a" and environ[b"RHT_NEW"] == b"1"
    finally:
        engine.close()


def test_the_reset_warning_names_only_the_setting_that_applies(
        tmp_path, environ, monkeypatch, caplog):
    """An engine given its own EnvRefresher ignores REHYDRATE_ENV_PROTECT, yet the warning
    recommended it."""
    spec = write(tmp_path / "spec_environ", {b"RHT_THREADS": b"1"})
    monkeypatch.setenv("REHYDRATE_ENV_PROTECT", "RHT_OTHER")
    monkeypatch.setenv("REHYDRATE_ENV_FILE", spec)
    lines = []
    for env in (EnvRefresher(path=spec), None):
        environ[b"RHT_THREADS"] = b"1"
        engine = Lifecycle(Registry(), env=env)
        try:
            environ[b"RHT_THREADS"] = b"8"
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rehydrate"):
                assert engine.simulate_restore().ok
            (line,) = _warnings(caplog)
            lines.append(line)
        finally:
            engine.close()
    own, default = lines
    assert "(EnvRefresher(protect=...)); REHYDRATE_ENV_PROTECT is set but applies only " \
        "to an engine without an EnvRefresher of its own" in own
    assert default.endswith("(REHYDRATE_ENV_PROTECT)") and "protect=..." not in default


def test_the_missing_spec_environ_warning_comes_once_in_a_forked_child_and_a_clone(
        tmp_path, environ, monkeypatch, caplog, warned_anew):
    """'Once per process' was once per memory image: a forked child, or a clone restored
    from an image taken after the warning, never warned."""
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        EnvRefresher().refresh()
        assert len(_warnings(caplog)) == 1
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                caplog.clear()
                EnvRefresher().refresh()
                EnvRefresher().refresh()
                os._exit(0 if len(_warnings(caplog)) == 1 else 3)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        caplog.clear()
        engine = Lifecycle(Registry())
        try:
            assert engine.simulate_restore(kind="resume").ok  # the same process: said
            assert _warnings(caplog) == []
            assert engine.simulate_restore().ok  # a clone: once more
            assert engine.simulate_restore(kind="resume").ok
        finally:
            engine.close()
    assert len(_warnings(caplog)) == 1


def test_two_engines_each_see_a_reset_of_the_application_s_value(tmp_path, environ):
    """Only the first engine reported a key the application changed and the file reset
    (the second found os.environ already at the file's value): the second engine's
    on_env_change hooks for it were skipped."""
    spec = write(tmp_path / "spec_environ", {b"RHT_PATH": b"/usr/bin", b"RHT_KEY": b"k"})
    environ.update({b"RHT_PATH": b"/usr/bin", b"RHT_KEY": b"k"})
    engines = [Lifecycle(Registry(), env=EnvRefresher(path=spec)) for _ in range(2)]
    seen: list[list[EnvChanges]] = [[], []]
    for engine, got in zip(engines, seen):
        engine.registry.on_env_change("RHT_*")(lambda ctx, ch, got=got: got.append(ch))
    try:
        environ[b"RHT_PATH"] = b"/app/.venv/bin:/usr/bin"  # the entrypoint's
        del environ[b"RHT_KEY"]  # read, then dropped by the application
        assert all(engine.simulate_snapshot().ok for engine in engines)
        reports = [engine.restore_detected("gvisor", kind="restore") for engine in engines]
        expected = EnvChanges(added=("RHT_KEY",), changed=("RHT_PATH",))
        assert [r.env_changes for r in reports] == [expected, expected]
        assert seen == [[expected], [expected]]
        assert environ[b"RHT_PATH"] == b"/usr/bin"
        # the next restore (no snapshot between) is news to neither, and a refresher made
        # since is not told what the engines' restore did
        again = [engine.restore_detected("gvisor", kind="restore") for engine in engines]
        assert [r.env_changes for r in again] == [EnvChanges(), EnvChanges()]
        environ[b"RHT_PATH"] = b"/app/.venv/bin:/usr/bin"
        first = engines[0].restore_detected("gvisor", kind="resume")
        assert first.env_changes == EnvChanges(changed=("RHT_PATH",))
        assert EnvRefresher(path=spec).refresh() == EnvChanges()
    finally:
        for engine in engines:
            engine.close()


def test_two_engines_refreshing_at_once_each_see_the_platform_s_change(
        tmp_path, environ, monkeypatch):
    """Engine A applied the file, then recorded what it changed in a separate step: engine
    B, comparing in between, found os.environ already at the file's value and no earlier
    change recorded, and reported nothing (its on_env_change hooks skipped)."""
    import threading

    from rehydrate import env as env_module

    spec = write(tmp_path / "spec_environ", {b"RHT_PATH": b"/usr/bin"})
    environ[b"RHT_PATH"] = b"/usr/bin"
    engines = [Lifecycle(Registry(), env=EnvRefresher(path=spec)) for _ in range(2)]
    try:
        environ[b"RHT_PATH"] = b"/app/.venv/bin:/usr/bin"  # the application's own
        assert all(engine.simulate_snapshot().ok for engine in engines)
        a_applied, b_went = threading.Event(), threading.Event()
        real_record = env_module._EVENT.record
        records = []

        def record(changes: EnvChanges) -> None:
            records.append(changes)
            if len(records) == 1:  # A's, between applying and recording: B goes now
                a_applied.set()
                assert b_went.wait(30)
            real_record(changes)

        class Applying:
            """The lock over a refresh's compare, apply and record: B waiting for it
            lets A go on (without one, B's finished restore does)."""

            def __init__(self, lock: threading.Lock) -> None:
                self.lock, self.entered = lock, 0

            def __enter__(self) -> bool:
                self.entered += 1
                if self.entered == 2:
                    b_went.set()
                return self.lock.__enter__()

            def __exit__(self, *exc: object) -> None:
                self.lock.__exit__(*exc)

        monkeypatch.setattr(env_module._EVENT, "record", record)
        monkeypatch.setattr(env_module._EVENT, "applying",
                            Applying(getattr(env_module._EVENT, "applying",
                                             threading.Lock())), raising=False)
        got: dict[str, EnvChanges] = {}
        a = threading.Thread(target=lambda: got.setdefault(
            "A", engines[0].restore_detected("gvisor", kind="restore").env_changes))
        a.start()
        assert a_applied.wait(30)
        got["B"] = engines[1].restore_detected("gvisor", kind="restore").env_changes
        b_went.set()
        a.join(30)
        expected = EnvChanges(changed=("RHT_PATH",))
        assert got == {"A": expected, "B": expected}
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("shared", [False, True], ids=["two-refreshers", "one-refresher"])
def test_the_missing_spec_environ_warning_comes_once_per_restore_with_two_engines(
        tmp_path, environ, monkeypatch, caplog, warned_anew, shared):
    """Each engine's restore run emptied the "warned" set: with two engines the warning
    came twice per restore (still so with one EnvRefresher shared by both)."""
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    one = EnvRefresher()
    engines = [Lifecycle(Registry(), env=one if shared else None),
               Lifecycle(Registry(), env=one if shared else EnvRefresher())]
    try:
        assert all(engine.simulate_snapshot().ok for engine in engines)
        for _ in range(2):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rehydrate"):
                assert all(engine.simulate_restore().ok for engine in engines)
                assert all(engine.simulate_restore(kind="resume").ok for engine in engines)
            assert len(_warnings(caplog)) == 1  # the next restore: once more
    finally:
        for engine in engines:
            engine.close()


def test_a_clone_whose_original_had_no_file_imports_nothing_in_its_refresh():
    """The original had no environment file (the clones' mount): hashlib (mostly OpenSSL's
    _hashlib, 2-3 ms) was first imported in the clone's refresh, on the restore path."""
    import subprocess
    import sys

    code = """if True:
        import os, sys, tempfile
        d = tempfile.mkdtemp()
        os.environ["REHYDRATE_GVISOR_PROC"] = d
        from rehydrate import Lifecycle, Registry
        engine = Lifecycle(Registry())
        assert engine.simulate_snapshot().ok
        imported = []
        refresh = engine.env.refresh
        def watched(*args, **kwargs):
            before = set(sys.modules)
            try:
                return refresh(*args, **kwargs)
            finally:
                imported.extend(sorted(set(sys.modules) - before))
        engine.env.refresh = watched
        with open(os.path.join(d, "spec_environ"), "wb") as f:
            f.write(b"RHT_CLONE=1\\0")
        report = engine.simulate_restore()
        assert report.ok and report.env_changes.added == ("RHT_CLONE",), report
        print(" ".join(imported))
        engine.close()
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"the clone's refresh imported {out.stdout.strip()}"


def test_blake2b_comes_from_the_builtin_module_and_hashes_as_hashlib_s():
    import hashlib

    from rehydrate.env import _blake2b

    blake2b = _blake2b()
    assert blake2b.__module__ in ("_blake2", "hashlib", "_hashlib")
    assert blake2b(b"v", key=b"k" * 32, digest_size=16).digest() == hashlib.blake2b(
        b"v", key=b"k" * 32, digest_size=16).digest()


def test_a_key_an_overlay_removed_is_removed_again_by_a_file_without_it(
        tmp_path, environ, caplog):
    """An overlay removed a key of the file and the application set it again: the next
    file without it left it (update removes a key the previous file had). An overlay
    that already set a key to the next file's value is no change at that file."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_A": b"a", b"RHT_GONE": b"g", b"RHT_LEFT": b"l"})
    environ.update({b"RHT_A": b"a", b"RHT_GONE": b"g", b"RHT_LEFT": b"l"})
    engine = Lifecycle(Registry(), env=EnvRefresher(path=str(spec)))
    try:
        first = engine.simulate_restore(env={"RHT_A": "new", "RHT_GONE": None,
                                             "RHT_LEFT": None})
        assert first.env_changes == EnvChanges(changed=("RHT_A",),
                                                removed=("RHT_GONE", "RHT_LEFT"))
        environ[b"RHT_GONE"] = b"the application's"
        write(spec, {b"RHT_A": b"new"})
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            later = engine.simulate_restore()
        # RHT_LEFT, gone since the overlay, is no removal again
        assert later.env_changes == EnvChanges(removed=("RHT_GONE",))
        assert b"RHT_GONE" not in environ and environ[b"RHT_A"] == b"new"
        (line,) = _warnings(caplog)  # said, as for any application value it resets
        assert "RHT_GONE" in line
    finally:
        engine.close()


def test_a_blocking_log_handler_does_not_hold_up_another_engine_s_refresh(
        tmp_path, environ, caplog):
    """The reset warning was logged with the process-wide lock held: a handler that
    blocked (a log shipper, a full pipe) kept every other engine's refresh waiting."""
    import threading

    spec_a = write(tmp_path / "a_environ", {b"RHT_PATH": b"/usr/bin", b"RHT_SET": b"1"})
    spec_b = write(tmp_path / "b_environ", {b"RHT_B": b"old"})
    environ.update({b"RHT_PATH": b"/usr/bin", b"RHT_SET": b"1", b"RHT_B": b"old"})
    first, second = EnvRefresher(path=spec_a), EnvRefresher(path=spec_b)
    first.baseline()
    second.baseline()
    environ[b"RHT_PATH"] = b"/app/.venv/bin:/usr/bin"  # the application's: A warns
    write(tmp_path / "a_environ", {b"RHT_PATH": b"/usr/bin", b"RHT_SET": b"1",
                                    b"REHYDRATE_RHT": b"x"})  # and "ignored" too
    write(tmp_path / "b_environ", {b"RHT_B": b"new"})
    in_handler, release = threading.Event(), threading.Event()

    class Blocking(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "rehydrate" and threading.current_thread() is a:
                in_handler.set()
                release.wait(30)

    handler = Blocking(logging.WARNING)
    got: dict[str, EnvChanges] = {}
    a = threading.Thread(target=lambda: got.setdefault("A", first.refresh()))
    b = threading.Thread(target=lambda: got.setdefault("B", second.refresh()))
    logging.getLogger("rehydrate").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            a.start()
            assert in_handler.wait(30)
            b.start()
            b.join(10)  # without the fix: waits on the lock A holds until released
            assert not b.is_alive() and got["B"] == EnvChanges(changed=("RHT_B",))
            release.set()
            a.join(30)
    finally:
        release.set()
        logging.getLogger("rehydrate").removeHandler(handler)
    assert got["A"] == EnvChanges(changed=("RHT_PATH",))
    assert environ[b"RHT_B"] == b"new" and environ[b"RHT_PATH"] == b"/usr/bin"
    lines = _warnings(caplog)  # the same lines as before, each once
    assert len(lines) == 2
    assert "ignored REHYDRATE_RHT" in lines[0] and "RHT_PATH" in lines[1]
    assert "/app/.venv" not in " ".join(lines)


@pytest.mark.parametrize("shared", [True, False], ids=["one-refresher", "two-refreshers"])
def test_two_engines_warn_once_per_restore_and_each_see_the_change(
        tmp_path, environ, caplog, monkeypatch, shared):
    """Two engines sharing one EnvRefresher: the second engine's refresh counted as the
    next restore, so it repeated the "ignored" warning and was told of no change (its
    on_env_change hooks skipped). With a refresher each, the "ignored" warning came once
    per engine. The reset warning comes once: the second refresh resets nothing."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_PATH": b"/usr/bin", b"RHT_KEY": b"old", b"RHT_DROPPED": b"x"})
    environ.update({b"RHT_PATH": b"/usr/bin", b"RHT_KEY": b"old", b"RHT_DROPPED": b"x"})
    monkeypatch.delenv("REHYDRATE_RHT", raising=False)
    one = EnvRefresher(path=str(spec))
    engines = [Lifecycle(Registry(), env=one if shared else EnvRefresher(path=str(spec)))
               for _ in range(2)]
    seen: list[list[EnvChanges]] = [[], []]
    for engine, got in zip(engines, seen):
        engine.registry.on_env_change("RHT_*")(lambda ctx, ch, got=got: got.append(ch))
    try:
        environ[b"RHT_PATH"] = b"/app/.venv/bin:/usr/bin"  # the application's own
        assert all(engine.simulate_snapshot().ok for engine in engines)
        write(spec, {b"RHT_PATH": b"/usr/bin", b"RHT_KEY": b"new",
                     b"REHYDRATE_RHT": b"x", b"LD_RHT": b"y"})
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            reports = [engine.restore_detected("gvisor", kind="restore")
                       for engine in engines]
        expected = EnvChanges(changed=("RHT_KEY", "RHT_PATH"), removed=("RHT_DROPPED",))
        assert [r.env_changes for r in reports] == [expected, expected]
        assert seen == [[expected], [expected]]
        lines = _warnings(caplog)
        assert len(lines) == 2, lines
        assert "ignored LD_RHT, REHYDRATE_RHT" in lines[0]
        assert "application's own value of RHT_PATH (" in lines[1]
        # the next restore, same file: applies nothing, nothing to report; the ignored
        # keys are named once for it, whichever engine refreshes first
        for kind in ("restore", "resume"):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rehydrate"):
                again = [engine.restore_detected("gvisor", kind=kind) for engine in engines]
            assert [r.env_changes for r in again] == [EnvChanges(), EnvChanges()]
            (line,) = _warnings(caplog)
            assert "ignored LD_RHT, REHYDRATE_RHT" in line and "x" not in line.split(":")[-1]
        assert environ.get(b"REHYDRATE_RHT") is None and environ[b"RHT_KEY"] == b"new"
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("shared", [False, True], ids=["one-engine", "two-engines"])
def test_a_direct_refresh_after_the_engine_s_reports_only_its_own_changes(
        tmp_path, environ, shared):
    """An after_restore hook calling engine.env.refresh() (a file that arrives late) after
    the engine's own refresh of the restore was told that refresh's changes again: the
    direct call joined the restore's record as if it were another engine. A second
    engine sharing the refresher is still told the first one's changes, and the late
    file's too."""
    spec = tmp_path / "spec_environ"
    write(spec, {b"RHT_KEY": b"old", b"RHT_LATE": b"old"})
    environ.update({b"RHT_KEY": b"old", b"RHT_LATE": b"old"})
    one = EnvRefresher(path=str(spec))
    engines = [Lifecycle(Registry(), env=one) for _ in range(2 if shared else 1)]
    direct: list[EnvChanges] = []

    @engines[0].registry.after_restore(name="reread")
    def reread():
        direct.append(one.refresh())  # nothing changed since the engine's refresh
        write(spec, {b"RHT_KEY": b"new", b"RHT_LATE": b"new"})
        direct.append(one.refresh())
        direct.append(one.refresh())

    try:
        assert all(engine.simulate_snapshot().ok for engine in engines)
        write(spec, {b"RHT_KEY": b"new", b"RHT_LATE": b"old"})
        reports = [engine.restore_detected("gvisor", kind="restore") for engine in engines]
        assert direct == [EnvChanges(), EnvChanges(changed=("RHT_LATE",)), EnvChanges()]
        assert reports[0].env_changes == EnvChanges(changed=("RHT_KEY",))
        if shared:
            assert reports[1].env_changes == EnvChanges(changed=("RHT_KEY", "RHT_LATE"))
        assert environ[b"RHT_LATE"] == b"new"
    finally:
        for engine in engines:
            engine.close()


def test_a_direct_refresh_before_a_restore_is_not_that_restore_s_news(
        tmp_path, environ, caplog, monkeypatch):
    """A direct refresh at startup and a restore without a before-snapshot pass between
    (nothing baselined since): the engine's refresh was taken for a second engine of the
    startup call's restore, reporting what that call changed and keeping its "ignored"
    warning silent."""
    monkeypatch.delenv("REHYDRATE_RHT", raising=False)
    spec = write(tmp_path / "spec_environ", {b"RHT_KEY": b"old"})
    environ[b"RHT_KEY"] = b"old"
    one = EnvRefresher(path=spec)
    engine = Lifecycle(Registry(), env=one)
    try:
        write(tmp_path / "spec_environ", {b"RHT_KEY": b"new", b"REHYDRATE_RHT": b"x"})
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            assert one.refresh() == EnvChanges(changed=("RHT_KEY",))
            report = engine.restore_detected("gvisor", kind="restore")
        assert report.env_changes == EnvChanges()
        lines = _warnings(caplog)
        assert len(lines) == 2 and all("ignored REHYDRATE_RHT" in x for x in lines), lines
    finally:
        engine.close()
