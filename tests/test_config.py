"""The configuration table: every REHYDRATE_* variable declared once and parsed one way."""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from pathlib import Path

import pytest

from rehydrate import Lifecycle, Registry, _config
from rehydrate._cli import main

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bREHYDRATE_[A-Z0-9][A-Z0-9_]*\b")
DECLARED = {v.name for v in _config.VARIABLES}


def _sources() -> list[Path]:
    return sorted((ROOT / "rehydrate").rglob("*.py"))


def test_every_variable_named_in_the_code_is_declared():
    undeclared = {}
    for path in _sources():
        for name in set(NAME.findall(path.read_text())) - DECLARED:
            undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert undeclared == {}, f"declare these in rehydrate/_config.py VARIABLES: {undeclared}"


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "REHYDRATE_..."`` constants (``ENV_PROC``, ``ENV_SOCKET``)."""
    out = {}
    for node in tree.body:
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({t.id: node.value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _environ_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in os.environ`` with
    X a REHYDRATE_* string (literal or module constant)."""
    consts = _string_constants(tree)
    found = []

    def name_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
        elif isinstance(node, ast.Name):
            value = consts.get(node.id, "")
        else:
            return None
        return value if value.startswith("REHYDRATE_") else None

    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv":
                key = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = name_of(node.slice)
        elif (isinstance(node, ast.Compare) and len(node.comparators) == 1
              and is_environ(node.comparators[0])):
            key = name_of(node.left)
        if key is not None:
            found.append((node.lineno, key))
    return found


def test_no_module_reads_a_variable_around_the_table():
    direct = {}
    for path in _sources():
        if path.name == "_config.py":
            continue
        reads = _environ_reads(ast.parse(path.read_text()))
        if reads:
            direct[str(path.relative_to(ROOT))] = reads
    assert direct == {}, f"read these through rehydrate._config: {direct}"


def test_the_read_check_sees_the_usual_spellings():
    tree = ast.parse('ENV = "REHYDRATE_X"\nos.environ.get(ENV)\nos.getenv("REHYDRATE_Y")\n'
                     'os.environ["REHYDRATE_Z"]\n"REHYDRATE_W" in os.environ\n'
                     'os.environ.get("HOME")\n')
    assert [k for _, k in _environ_reads(tree)] == ["REHYDRATE_X", "REHYDRATE_Y",
                                                    "REHYDRATE_Z", "REHYDRATE_W"]


def test_the_docs_list_every_variable_and_no_other():
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(REHYDRATE_[A-Z0-9_]+)` \|", page, re.M))
    assert rows == DECLARED


def test_table_entries_are_complete_and_unique():
    names = [v.name for v in _config.VARIABLES]
    assert len(names) == len(set(names))
    for v in _config.VARIABLES:
        assert v.meaning and v.meaning[0].islower(), v.name
        if v.type == "choice":
            assert v.default in v.choices, v.name


def test_undeclared_names_and_wrong_getters_fail_loudly():
    with pytest.raises(KeyError, match="REHYDRATE_NOPE is not a declared configuration"):
        _config.text("REHYDRATE_NOPE")
    with pytest.raises(TypeError, match="declared as seconds"):
        _config.flag("REHYDRATE_CLOCK_INTERVAL")


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("REHYDRATE_CLOCK_INTERVAL", "0.25", 0.25),
    ("REHYDRATE_CLOCK_INTERVAL", " 3 ", 3.0),
    ("REHYDRATE_CLOCK_INTERVAL", "", 0.5),
    ("REHYDRATE_SNAPSHOT_DEADLINE", "off", None),
    ("REHYDRATE_SNAPSHOT_DEADLINE", " OFF ", None),
    ("REHYDRATE_SNAPSHOT_DEADLINE", "none", None),
    ("REHYDRATE_SNAPSHOT_DEADLINE", "12.5", 12.5),
    ("REHYDRATE_CONNECT_DEADLINE", "2", 2.0),
    ("REHYDRATE_TELEMETRY", "off", False),
    ("REHYDRATE_TELEMETRY", "YES", True),
    ("REHYDRATE_ENV_POLICY", " Replace ", "replace"),
    ("REHYDRATE_DISABLE", "keys, ,TLS", ("keys", "TLS")),
    ("REHYDRATE_MANIFEST", "/v/m.json", "/v/m.json"),
    ("REHYDRATE_SIGNAL", "usr1", "SIGUSR1"),
    ("REHYDRATE_SIGNAL", " 12 ", "SIGUSR2"),
    ("REHYDRATE_SIGNAL", "SIGHUP", "SIGHUP"),
    # real-time signals (supervisors use them) were refused as unknown
    ("REHYDRATE_SIGNAL", "35", "SIGRTMIN+1"),
    ("REHYDRATE_SIGNAL", "rtmin+1", "SIGRTMIN+1"),
    ("REHYDRATE_SIGNAL", "SIGRTMIN", "SIGRTMIN"),
])
def test_good_values(monkeypatch, caplog, name, raw, value):
    monkeypatch.setenv(name, raw)
    var = next(v for v in _config.VARIABLES if v.name == name)
    getter = {"seconds": _config.optional_number, "flag": _config.flag,
              "choice": _config.choice, "list": _config.items, "path": _config.text,
              "signal": _config.signal_name}[var.type]
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert getter(name) == value
    assert caplog.records == []


_SIGNAL_RULE = ("a signal name or number that can be caught (not KILL, STOP, CHLD, PIPE, "
                "WINCH, TTIN, TTOU, TSTP, URG or a fault signal: SEGV, BUS, FPE, ILL)")


_FLAG_RULE = "1, true, yes, on, enabled or 0, false, no, off, disabled"


@pytest.mark.parametrize(("raw", "value"), [
    *((raw, True) for raw in ("1", "true", "YES", "On", "enabled", "Enabled")),
    *((raw, False) for raw in ("0", "False", "no", "OFF", "disabled", "DISABLED")),
])
def test_flag_spellings_are_symmetric(monkeypatch, caplog, raw, value):
    """``disabled`` turned telemetry off but ``enabled`` was a bad value, with a warning
    saying "is not 1 or 0" though true/yes/on/false/no/off were taken too."""
    monkeypatch.setenv("REHYDRATE_TELEMETRY", raw)
    monkeypatch.setenv("REHYDRATE_EXPECT_RESTORE", raw)  # default False: both ways shown
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert _config.flag("REHYDRATE_TELEMETRY") is value
        assert _config.flag("REHYDRATE_EXPECT_RESTORE") is value
    assert caplog.records == []


@pytest.mark.parametrize(("name", "raw", "expected"), [
    ("REHYDRATE_CLOCK_INTERVAL", "soon", "a finite number >= 0.001 and <= 31536000 (a year)"),
    ("REHYDRATE_CLOCK_INTERVAL", "0", "a finite number >= 0.001 and <= 31536000 (a year)"),
    ("REHYDRATE_CLOCK_INTERVAL", "inf", "a finite number >= 0.001 and <= 31536000 (a year)"),
    ("REHYDRATE_IDENTITY_INTERVAL", "1e10",  # a thread waiting that long overflows
     "a finite number >= 0.001 and <= 31536000 (a year)"),
    ("REHYDRATE_CONNECT_DEADLINE", "0", "a finite number > 0 and <= 31536000 (a year)"),
    ("REHYDRATE_SNAPSHOT_DEADLINE", "-5", "a finite number > 0 and <= 31536000 (a year) (or off)"),
    # 0 was "off" while 0.0 was a bad value, and Lifecycle(snapshot_deadline=0) refused
    ("REHYDRATE_SNAPSHOT_DEADLINE", "0", "a finite number > 0 and <= 31536000 (a year) (or off)"),
    ("REHYDRATE_SNAPSHOT_DEADLINE", "0.0", "a finite number > 0 and <= 31536000 (a year) (or off)"),
    ("REHYDRATE_TELEMETRY", "maybe", _FLAG_RULE),
    ("REHYDRATE_ENV_POLICY", "merge", "one of update, replace, off"),
    ("REHYDRATE_SIGNAL", "bogus", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "999", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "KILL", _SIGNAL_RULE),  # the detector would never hear it
    ("REHYDRATE_SIGNAL", "19", _SIGNAL_RULE),  # SIGSTOP
    ("REHYDRATE_SIGNAL", "CHLD", _SIGNAL_RULE),  # sent whenever a child ends
    # sent by the kernel on a write to a closed pipe, a terminal resize, job control, urgent data
    ("REHYDRATE_SIGNAL", "PIPE", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "SIGWINCH", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "TTIN", _SIGNAL_RULE),  # a background job reading its terminal
    ("REHYDRATE_SIGNAL", "SIGTTOU", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "TSTP", _SIGNAL_RULE),  # Ctrl-Z
    ("REHYDRATE_SIGNAL", "URG", _SIGNAL_RULE),
    ("REHYDRATE_SIGNAL", "SEGV", _SIGNAL_RULE),  # a real fault would loop
    ("REHYDRATE_SIGNAL", "RTMIN+999", _SIGNAL_RULE),
])
def test_a_bad_value_is_one_warning_naming_variable_and_value_and_the_default_is_used(
        monkeypatch, caplog, name, raw, expected):
    monkeypatch.setenv(name, raw)
    var = next(v for v in _config.VARIABLES if v.name == name)
    getter = {"seconds": _config.optional_number, "flag": _config.flag,
              "choice": _config.choice, "signal": _config.signal_name}[var.type]
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert getter(name) == var.default
    assert [r.getMessage() for r in caplog.records] == [
        f"{name}={raw!r} is not {expected}; using the default ({_config._show(var.default)})"]


def test_a_bad_value_read_at_every_event_is_one_warning_per_value(monkeypatch, caplog):
    """``REHYDRATE_TELEMETRY=nope`` was a warning at every event (telemetry reads it at
    each); docs/configuration.md promises one line."""
    from rehydrate import telemetry

    monkeypatch.setenv("REHYDRATE_TELEMETRY", "nope")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        for _ in range(5):
            assert telemetry._disabled_by_env() is False  # the default: on
        monkeypatch.setenv("REHYDRATE_TELEMETRY", "nah")  # another bad value is news
        assert _config.flag("REHYDRATE_TELEMETRY") is True
        monkeypatch.setenv("REHYDRATE_TELEMETRY", "nope")
        assert _config.flag("REHYDRATE_TELEMETRY") is True
    assert [r.getMessage() for r in caplog.records] == [
        f"REHYDRATE_TELEMETRY='nope' is not {_FLAG_RULE}; using the default (1)",
        f"REHYDRATE_TELEMETRY='nah' is not {_FLAG_RULE}; using the default (1)"]


def test_a_long_bad_value_is_shortened(monkeypatch, caplog):
    monkeypatch.setenv("REHYDRATE_ENV_POLICY", "x" * 500)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert _config.choice("REHYDRATE_ENV_POLICY") == "update"
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 200


def test_doctor_shows_the_effective_settings(monkeypatch, capsys):
    for v in _config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("REHYDRATE_CLOCK_THRESHOLD", "4")
    monkeypatch.setenv("REHYDRATE_CLOCK_INTERVAL", "soon")
    monkeypatch.setenv("REHYDRATE_SIGNAL", "SIGKILL")
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {s["name"]: s for s in data["configuration"]}
    assert set(by_name) == DECLARED
    assert by_name["REHYDRATE_CLOCK_THRESHOLD"]["value"] == "4"
    assert by_name["REHYDRATE_CLOCK_THRESHOLD"]["source"] == "environment"
    assert by_name["REHYDRATE_CLOCK_INTERVAL"]["value"] == "0.5"
    assert "'soon' is not a finite number" in by_name["REHYDRATE_CLOCK_INTERVAL"]["problem"]
    assert by_name["REHYDRATE_SIGNAL"]["value"] == "SIGUSR2"  # what the detector will use
    assert by_name["REHYDRATE_SIGNAL"]["problem"] == f"'SIGKILL' is not {_SIGNAL_RULE}"
    assert by_name["REHYDRATE_ENV_POLICY"] == {
        **by_name["REHYDRATE_ENV_POLICY"], "value": "update", "source": "default",
        "problem": None}

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "configuration: 3 REHYDRATE_* variable(s) set" in out
    assert re.search(r"REHYDRATE_CLOCK_THRESHOLD\s+4\n", out)
    assert re.search(r"REHYDRATE_CLOCK_INTERVAL\s+0.5  \(ignored 'soon' is not a finite", out)
    assert re.search(r"REHYDRATE_SIGNAL\s+SIGUSR2  \(ignored 'SIGKILL' is not a signal", out)


def test_doctor_shows_a_setting_s_control_characters_escaped(monkeypatch, capsys):
    """A value holding a newline or a terminal escape reached the terminal raw: it could
    colour the output or forge a line of doctor's report."""
    for v in _config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("REHYDRATE_GVISOR_VERSION", "abc\x1b[31mRED\nforged line")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\nforged line" not in out
    assert re.search(r"\n  REHYDRATE_GVISOR_VERSION  abc\\x1b\[31mRED\\nforged line\n", out)


def test_doctor_shows_off_for_a_setting_turned_off(monkeypatch, capsys):
    """``REHYDRATE_SNAPSHOT_DEADLINE=off`` was shown as ``unset``: as if never set."""
    for v in _config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", "off")
    assert main(["doctor", "--json"]) == 0
    by_name = {s["name"]: s for s in json.loads(capsys.readouterr().out)["configuration"]}
    assert by_name["REHYDRATE_SNAPSHOT_DEADLINE"] == {
        **by_name["REHYDRATE_SNAPSHOT_DEADLINE"], "value": "off", "source": "environment",
        "problem": None}
    assert main(["doctor"]) == 0
    assert re.search(r"REHYDRATE_SNAPSHOT_DEADLINE\s+off\n", capsys.readouterr().out)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_config, "_WARNED_ENTRIES", set(), raising=False)


_DISABLE_NAMES = "entropy, keys, tls, secrets, all"


def test_an_unknown_disable_entry_is_one_warning_once_and_the_known_ones_apply(
        monkeypatch, caplog, fresh_warnings):
    """``REHYDRATE_DISABLE=entrop`` was silently ignored: entropy stayed on."""
    from rehydrate._disable import is_disabled

    monkeypatch.setenv("REHYDRATE_DISABLE", "entrop, KEYS,foo")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert _config.items("REHYDRATE_DISABLE") == ("KEYS",)
        assert is_disabled("keys") and not is_disabled("entropy")  # read at every event
        assert is_disabled("keys")
    assert [r.getMessage() for r in caplog.records] == [
        f"REHYDRATE_DISABLE: 'entrop' is not one of {_DISABLE_NAMES}; ignored",
        f"REHYDRATE_DISABLE: 'foo' is not one of {_DISABLE_NAMES}; ignored"]
    caplog.clear()
    monkeypatch.setenv("REHYDRATE_DISABLE", "tls,foo,bar")  # only the new typo is news
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert is_disabled("tls")
    assert [r.getMessage() for r in caplog.records] == [
        f"REHYDRATE_DISABLE: 'bar' is not one of {_DISABLE_NAMES}; ignored"]


def test_doctor_says_which_disable_entries_are_ignored(monkeypatch, capsys, fresh_warnings):
    for v in _config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("REHYDRATE_DISABLE", "entrop,tls")
    assert main(["doctor", "--json"]) == 0
    by_name = {s["name"]: s for s in json.loads(capsys.readouterr().out)["configuration"]}
    assert by_name["REHYDRATE_DISABLE"]["value"] == "tls"
    assert by_name["REHYDRATE_DISABLE"]["problem"] == (
        f"'entrop' is not one of {_DISABLE_NAMES}")
    monkeypatch.setenv("REHYDRATE_DISABLE", "entrop,foo")
    assert main(["doctor"]) == 0
    assert re.search(r"REHYDRATE_DISABLE\s+none  \(ignored 'entrop', 'foo' are not one of "
                     r"entropy, keys, tls, secrets, all\)\n", capsys.readouterr().out)


def test_the_disable_choices_are_the_names_the_managers_check() -> None:
    var = next(v for v in _config.VARIABLES if v.name == "REHYDRATE_DISABLE")
    assert set(var.choices) == _disable_names_checked() | {"all"}


def _disable_names_checked() -> set[str]:
    """Every name a manager passes to ``is_disabled(...)`` in the package's source."""
    names: set[str] = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "is_disabled"):
                names.update(a.value for a in node.args
                             if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def test_rehydrate_disable_documents_exactly_the_names_the_managers_check() -> None:
    meaning = next(v.meaning for v in _config.VARIABLES if v.name == "REHYDRATE_DISABLE")
    documented = set(re.findall(r"[a-z]+", meaning.split(":", 1)[1])) & (
        _disable_names_checked() | {"all", "connections", "routes", "volumes", "files"})
    assert documented == _disable_names_checked() | {"all"}


# -- public timeout= arguments -------------------------------------------------------------


@pytest.mark.parametrize("value", [None, math.inf, _config.MAX_SECONDS + 1, 1e10, 10**30,
                                   10**5000],
                         ids=["None", "inf", "year+1", "1e10", "1e30", "1e5000"])
def test_a_public_timeout_of_infinity_or_more_than_a_year_means_no_limit(value):
    assert _config.optional_seconds(value, "wait(): timeout") is None
    assert _config.optional_seconds(value, "request(): timeout", zero_ok=False) is None


@pytest.mark.parametrize(("value", "error", "shown"), [
    (-1, ValueError, "-1"), (-math.inf, ValueError, "-inf"), (math.nan, ValueError, "nan"),
    (-10**5000, ValueError, "-1e+5000"), ("5", TypeError, "str"), (True, TypeError, "bool"),
], ids=["-1", "-inf", "nan", "-1e5000", "str", "bool"])
def test_a_public_timeout_s_error_says_what_no_limit_is_not_at_most_a_year(value, error,
                                                                         shown):
    """The error said "at most 31536000 (a year)" while infinity and ``10**30`` passed as
    no limit (what the docs and the history since have meant): now it says that."""
    with pytest.raises(error) as caught:
        _config.optional_seconds(value, "wait(): timeout")
    assert str(caught.value) == (f"wait(): timeout must be a number of seconds >= 0, not "
                                 f"{shown} (None, infinity or more than a year: no limit)")
    with pytest.raises(ValueError, match=r"^request\(\): timeout must be a number of seconds "
                                         r"> 0, not 0 \(None, infinity or more than a year"):
        _config.optional_seconds(0, "request(): timeout", zero_ok=False)
    assert _config.optional_seconds(0, "wait(): timeout") == 0.0
    assert _config.optional_seconds(_config.MAX_SECONDS, "wait(): timeout") == 31_536_000.0


def test_numpy_scalars_and_fractions_are_numbers_of_seconds():
    """``wait_ready(np.int64(5))`` (a timeout from a config array) said "timeout must be a
    number of seconds >= 0, not int64" — a number refused as not one. Any real number
    other than a bool is one now: NumPy's scalars, ``Fraction``; the rule is the same."""
    np = pytest.importorskip("numpy")
    from fractions import Fraction

    for wait in (_config.optional_seconds, _config.seconds):
        assert wait(np.int64(5), "timeout") == 5.0
        assert wait(np.float32(0.5), "timeout") == 0.5
        assert wait(Fraction(1, 4), "timeout") == 0.25
        assert type(wait(np.int64(5), "timeout")) is float
        with pytest.raises(ValueError, match=r"not np\.int64\(-1\)"):
            wait(np.int64(-1), "timeout")
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            wait(np.float64("nan"), "timeout")
        with pytest.raises(TypeError, match=r"not bool\b"):
            wait(np.bool_(True), "timeout")
        with pytest.raises(TypeError, match="not complex"):
            wait(1j, "timeout")
    assert _config.optional_seconds(np.float32("inf"), "timeout") is None
    assert _config.optional_seconds(Fraction(10**5000), "timeout") is None
    with pytest.raises(ValueError, match="at most 31536000"):
        _config.seconds(Fraction(10**5000), "timeout")
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        _config.optional_seconds(Fraction(-10**5000), "timeout")


def test_bad_env_protect_patterns_are_each_one_warning_and_doctor_s_problem(
        monkeypatch, capsys, caplog, fresh_warnings):
    """``PATH OMP_*``, ``PATH;OMP_*``, quotes, ``omp_*`` protected nothing and ``*``
    everything (the refresh then changed nothing), all without a word."""
    for v in _config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("RHT_OMP_THREADS", "8")
    monkeypatch.setenv("REHYDRATE_ENV_PROTECT",
                       "PATH RHT_OMP_*, HOME;TZ, 'LANG', rht_omp_*, *, RHT_OK_*, no_proxy")
    texts = [
        "'PATH RHT_OMP_*' has white space, ';' or quotes in it, which no key has: patterns "
        "are comma-separated (PATH,OMP_*), without quotes",
        "'HOME;TZ' has white space, ';' or quotes in it, which no key has: patterns are "
        "comma-separated (PATH,OMP_*), without quotes",
        "\"'LANG'\" has white space, ';' or quotes in it, which no key has: patterns are "
        "comma-separated (PATH,OMP_*), without quotes",
        "'rht_omp_*' matches no key, but 'RHT_OMP_THREADS' differs only in case: keys are "
        "case-sensitive",
        "'*' matches every key: the refresh changes no key from the environment file"]
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        engine = Lifecycle(Registry())
        try:  # kept as given (and the default engine's): only said
            assert engine.env.protect == ("PATH RHT_OMP_*", "HOME;TZ", "'LANG'", "rht_omp_*",
                                          "*", "RHT_OK_*", "no_proxy")
        finally:
            engine.close()
        _config.items("REHYDRATE_ENV_PROTECT")  # read again: nothing new to say
    assert [r.getMessage() for r in caplog.records] == [
        f"REHYDRATE_ENV_PROTECT: {text}" for text in texts]

    assert main(["doctor", "--json"]) == 0
    by_name = {s["name"]: s for s in json.loads(capsys.readouterr().out)["configuration"]}
    assert by_name["REHYDRATE_ENV_PROTECT"]["problem"] == "; ".join(texts)
    assert main(["doctor"]) == 0
    assert "REHYDRATE_ENV_PROTECT  PATH RHT_OMP_*,HOME;TZ,'LANG',rht_omp_*,*,RHT_OK_*," \
        "no_proxy  (warning: 'PATH RHT_OMP_*' has white space" in capsys.readouterr().out

    monkeypatch.setenv("REHYDRATE_ENV_PROTECT", "PATH, RHT_OMP_*, no_proxy")
    assert main(["doctor", "--json"]) == 0
    by_name = {s["name"]: s for s in json.loads(capsys.readouterr().out)["configuration"]}
    assert by_name["REHYDRATE_ENV_PROTECT"]["problem"] is None


@pytest.mark.parametrize("pattern", ["http_proxy", "https_proxy", "no_proxy", "all_proxy",
                                     "*_proxy"])
def test_a_lower_case_proxy_key_in_env_protect_is_no_case_mistake(
        monkeypatch, caplog, fresh_warnings, pattern):
    """``REHYDRATE_ENV_PROTECT=http_proxy`` beside ``HTTP_PROXY`` was warned about as a
    case mistake: the lower-case proxy keys are the ones curl and wget read."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("REHYDRATE_ENV_PROTECT", pattern)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert _config.items("REHYDRATE_ENV_PROTECT") == (pattern,)
    assert [r.getMessage() for r in caplog.records] == []
