"""Signal detector: a POSIX signal (default ``SIGUSR2``) means "you were restored".

For platforms or wrappers that can signal the process after a restore (``kill -USR2``,
a supervisor, an orchestrator's post-restore step). Off unless asked for
(``start(detectors=[..., "signal"])``): installing a handler replaces the Python handler
the application had installed for that signal (until :meth:`~SignalDetector.stop`).
A handler installed outside Python (``faulthandler.register()``, a C extension) is not
replaced: ``signal.getsignal()`` reports it as ``SIG_DFL``, so :meth:`start` reads the
real one with ``sigaction(2)`` (ctypes, imported then) and refuses to start, naming the
signal; ``stop()`` putting ``SIG_DFL`` back made the next such signal kill the process.
One detector per signal: :meth:`start` refuses a second for a signal another one
watches (the second saved the first's handler as the application's, and only one of
them heard the signal). A handler the application installs after :meth:`start` is
reported by :meth:`failure` (one installed outside Python until a signal comes through
it to the detector) and left in place by :meth:`stop`; under one installed
outside Python, Python's table still gets the application's handler back, which one
that chains (``faulthandler.register(chain=True)``) hands the signal to. With none to
put back (``SIG_DFL``, ``SIG_IGN``), the detector's inert handler stays in Python's
table there (also in a child of ``fork()``): a signal left to ``SIG_DFL`` no longer
takes its default action (a ``SIGTERM`` chained on, or arriving after
``faulthandler.unregister()``, no longer ends the process) until the application calls
``signal.signal()`` for it (or, with the outside handler gone, a detector for it is
started and stopped). SIGKILL, SIGSTOP, SIGCHLD (every child's exit), SIGPIPE (every
write to a closed pipe or socket), SIGWINCH (every terminal resize), SIGTTIN, SIGTTOU
and SIGTSTP (the terminal's job control: a background job using its terminal, Ctrl-Z),
SIGURG (urgent socket data) and the fault signals (SIGSEGV, SIGBUS, SIGFPE, SIGILL) are
refused; real-time signals are taken (``SIGRTMIN+1``, ``35``).

Python runs signal handlers in the main thread between bytecodes. The handler here does
the least possible: it notes the time and does one non-blocking ``write()`` of a byte to
a pipe. A worker thread
blocked in ``read()`` on that pipe runs the restore hooks, so hooks never run inside the
handler or on the interrupted main thread (and a hook may itself block). ``set_wakeup_fd``
is not used: there is only one per process and asyncio owns it.

Handlers can only be installed from the main thread: :meth:`start` from another thread
fails with that reason, and :meth:`probe` says so when asked from another thread. A
:meth:`stop` from another thread leaves the detector's inert handler installed; the
next :meth:`start` for that signal takes the application's handler over from it (no
warning) and puts it back on its own :meth:`stop`.

Each signal is one notice. A restore already handled in the ``window`` seconds before
the signal arrived (default 2, ``REHYDRATE_SIGNAL_WINDOW``; dated by the handler, not
when the worker gets to it after hooks still running) is taken to be the restore the
signal is about, so a signal sent right after a restore another detector already saw
runs nothing twice. From the moment the handler ran until the worker has handed the
signal to the engine, the engine's readiness says no (``add_arrival_check``): the worker
may wait for the GIL a while, and a main thread checking ``is_ready()`` right after the
signal was told ready in the clone the signal was about. ``REHYDRATE_SIGNAL`` picks
the signal (``USR2``, ``SIGUSR1``, ``12``); ``REHYDRATE_SIGNAL_KIND`` is ``restore``
(default) or ``resume``.

:meth:`stop` waits up to 5 s for the worker; one still running a hook then keeps its
read end of the pipe and closes it when the hook returns (closed under it, the number
could be reused by the application, whose bytes the worker would read as signals), and
runs nothing more. A child made with ``fork()`` does not keep the handler: it would
write into the pipe the *parent's* worker reads, so a signal sent to the child alone
would run the parent's restore hooks. In the child the application's previous handler
(or ``SIG_DFL``) is back and the inherited pipe ends are closed, as after :meth:`stop`;
``rehydrate.start()`` in the child installs its own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import _config
from .._contract import Probe, refuse_another_engine
from .._threads import fresh_lock_after_fork
from . import Detector
from ._util import checked_kind, env_kind

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["SignalDetector", "parse_signal"]

log = logging.getLogger("rehydrate")


def parse_signal(value: str | int | signal.Signals) -> int:
    """``"USR2"``, ``"SIGUSR2"``, ``"12"``, ``12`` or ``signal.SIGUSR2`` -> ``SIGUSR2``.

    Any signal in ``signal.valid_signals()`` is taken; a real-time signal also as
    ``"SIGRTMIN+n"`` / ``"SIGRTMAX-n"``, and it stays a plain ``int`` where
    ``signal.Signals`` has no member for it. ``ValueError`` for a number or name of no
    signal, ``TypeError`` for a ``bool`` (``True`` is not ``SIGHUP``)."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"a signal is a name or a number, not {type(value).__name__}")
    if isinstance(value, int):
        return _config.signal_number(value, value)
    return _config.signal_from_text(value)


def _configured_signal() -> int:
    # _config refuses names of no signal and those refused_signal() names, with a warning.
    return parse_signal(_config.signal_name("REHYDRATE_SIGNAL"))


STOP_WAIT = 5.0
"""Seconds :meth:`SignalDetector.stop` waits for a worker that is running a hook."""


class _Run:
    """One start()..stop() of a detector: its pipe, engine and stop flag. The worker
    owns the read end and closes it when it ends."""

    def __init__(self, read_fd: int, write_fd: int, engine: Engine) -> None:
        self.read_fd = read_fd
        self.write_fd: int | None = write_fd
        self.engine = engine
        self.pid = os.getpid()
        self.stopped = False
        self.arrived = 0.0
        """When the latest signal reached the handler (time.monotonic())."""
        self.rung = 0
        """Signals that reached the handler (only the handler writes it)."""
        self.taken = 0
        """Of those, the ones the worker has handed to the engine (only it writes it)."""
        self.check = self._arriving
        """The engine's readiness check (one bound method: removed by equality)."""
        self.chained_through: int | None = None
        """The address of the handler installed outside Python that was in force when
        the worker last read a signal: that handler hands the signal on."""

    def _arriving(self) -> bool:
        """A signal reached the handler and the worker has not reported it yet: not ready
        (the worker may wait for the GIL a while after the handler woke it)."""
        return not self.stopped and self.rung != self.taken


class SignalDetector(Detector):
    """Signal: a POSIX signal (default SIGUSR2) announces a restore; off unless asked."""

    key: ClassVar[str] = "signal"
    specificity: ClassVar[int] = 60
    auto: ClassVar[bool] = False

    def __init__(
        self,
        signum: str | int | signal.Signals | None = None,
        *,
        kind: Literal["restore", "resume"] | None = None,
        window: float | None = None,
    ) -> None:
        self.signum = parse_signal(signum) if signum is not None else _configured_signal()
        refused = _config.refused_signal(self.signum)
        if refused is not None:
            raise ValueError(refused)
        self.label = _config.signal_label(self.signum)
        """The signal's name (``SIGUSR2``, ``SIGRTMIN+1``)."""
        self.kind: Literal["restore", "resume"] = (
            checked_kind(kind) if kind is not None else env_kind("REHYDRATE_SIGNAL_KIND"))
        self.window = _config.seconds(window if window is not None
                               else _config.number("REHYDRATE_SIGNAL_WINDOW"), "window",
                               zero_ok=True)
        self.received = 0
        self._previous: Any = None
        self._python_handler: int | None = None
        """The C handler Python installed for ours (read with sigaction), if readable."""
        self._run: _Run | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # a parent thread may hold it at fork(), also while the detector is not running (a
        # stop() after it was forgotten, a start() before it is): the child's start() hung
        fresh_lock_after_fork(self)

    @classmethod
    def probe(cls) -> Probe:
        if threading.current_thread() is not threading.main_thread():
            return Probe(False, "signal handlers can only be installed from the main thread; "
                         "call rehydrate.start() from the main thread to use this detector")
        return Probe(True)

    def describe(self) -> str:
        return f"{self.label} -> {self.kind}"

    def start(self, engine: Engine) -> None:
        with self._lock:
            if self._thread is not None:
                refuse_another_engine(self, self._run.engine if self._run else None, engine)
                return
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    f"cannot install a {self.label} handler from thread "
                    f"{threading.current_thread().name!r}: Python allows signal handlers "
                    "only in the main thread; call rehydrate.start() from the main thread")
            with _RUNNING_LOCK:
                if any(d.signum == self.signum for d in _RUNNING if d is not self):
                    # two handlers for one signal: the second saved the first's as the
                    # application's, and only one of them heard the signal
                    raise RuntimeError(
                        f"{self.label} is already watched by another signal detector; "
                        "give this one another signal (SignalDetector(\"SIGUSR1\"))")
            before = _sigaction(self.signum)
            if before is not None and _foreign(before, signal.getsignal(self.signum)):
                raise RuntimeError(_outside_python(self.label))
            r, w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(w, False)
            run = _Run(r, w, engine)
            self._run = run
            try:
                previous = signal.signal(self.signum, self._handler)
                self._python_handler = _handler_address(self.signum)
                if (before is not None and self._python_handler is not None
                        and _handler_of(before) not in (_SIG_DFL, _SIG_IGN,
                                                        self._python_handler)):
                    # Python's table named a handler of its own, but one installed
                    # outside Python had replaced it: put both back as they were, the
                    # application's handler for the inert one of a detector stopped off
                    # the main thread (which the outside handler may chain to)
                    owner = _detector_of(previous)
                    if owner is not None and callable(owner._previous):
                        previous = owner._previous
                    signal.signal(self.signum, previous
                                  if previous is not None else signal.SIG_DFL)
                    _sigaction(self.signum, before)
                    raise RuntimeError(_outside_python(self.label))
            except BaseException:
                self._run = None
                os.close(r)
                os.close(w)
                raise
            owner = _detector_of(previous)
            if owner is not None:
                # the inert handler of a detector stopped off the main thread: the
                # application's is the one that detector saved, to put back on stop()
                previous = owner._previous
            elif previous not in (signal.SIG_DFL, signal.SIG_IGN, None):
                log.warning("signal detector: replaced the application's %s handler "
                            "(restored on stop())", self.label)
            self._previous = previous
            thread = threading.Thread(target=self._work, args=(run,),
                                      name="rehydrate-signal", daemon=True)
            try:
                thread.start()
            except BaseException:
                # ("can't start new thread") nothing would read the pipe: the
                # application's handler back, as stop() would have put it
                signal.signal(self.signum, previous if previous is not None
                              else signal.SIG_DFL)
                self._run = None
                self._previous = None
                os.close(r)
                os.close(w)
                raise
            self._thread = thread
            # Once the worker runs: a thread that could not start ("can't start new
            # thread") left a check that a signal then turned True for good.
            add_check = getattr(engine, "add_arrival_check", None)  # an engine of its own
            if add_check is not None:
                add_check(run.check)
            with _RUNNING_LOCK:
                _RUNNING.add(self)

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            run, self._run = self._run, None
            with _RUNNING_LOCK:
                _RUNNING.discard(self)
            if thread is None or run is None:
                return
            run.stopped = True  # a notice read from now on runs nothing
            _forget_check(run)
            self._restore_handler(stopping=True)
            w, run.write_fd = run.write_fd, None
            if w is not None:
                os.close(w)  # EOF ends the worker's read()
        thread.join(STOP_WAIT)
        if thread.is_alive():
            # Its read end stays open until it ends: closed here, the number could be
            # reused by the application and the worker would read that as signals.
            log.warning("signal detector: stop() did not wait for its worker, still "
                        "running a restore hook after %gs; it runs nothing more and ends "
                        "when the hook returns", STOP_WAIT)

    def failure(self) -> str | None:
        """The application installed its own handler after :meth:`start`: with
        ``signal.signal()`` (the signal no longer reaches this detector), or outside
        Python (it may no longer). One installed outside Python that chains, as
        ``faulthandler.register(chain=True)`` does, still hands the signal on: that
        cannot be told before a signal comes, and once one has reached this detector
        through that handler (the same C function) this is ``None`` again — until a call
        sees no outside handler in force. One removed and installed again between two
        calls (``faulthandler`` uses one C function with or without ``chain``) is not
        seen: the answer is then as trustworthy as the last signal."""
        if self._thread is None:
            return None
        if signal.getsignal(self.signum) != self._handler:
            return (f"the application replaced the {self.label} handler; {self.label} no "
                    "longer reaches the signal detector")
        outside = self._outside_handler()
        run = self._run
        if outside is None and run is not None:
            run.chained_through = None  # gone: a handler installed again must prove itself
        if outside is not None and (run is None or run.chained_through != outside):
            return (f"a handler installed outside Python (faulthandler.register() or a C "
                    f"extension) replaced the {self.label} handler; {self.label} may no "
                    "longer reach the signal detector (unless that handler chains)")
        return None

    def _replaced_outside_python(self) -> bool:
        """Whether the C handler is no longer the one Python installed for ours."""
        return self._outside_handler() is not None

    def _outside_handler(self) -> int | None:
        """The C handler in force (its address) when it is no longer the one Python
        installed for ours, else ``None``. Only the address: libc leaves most of the
        ``struct sigaction`` it reads back undefined (glibc copies the kernel's 8-byte
        mask into a 128-byte one)."""
        ours = self._python_handler
        if ours is None:
            return None
        current = _handler_address(self.signum)
        return None if current in (None, ours) else current

    def _restore_handler(self, *, stopping: bool) -> None:
        try:
            if signal.getsignal(self.signum) != self._handler:
                return  # the application's own since start(): it stays
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            if not self._replaced_outside_python():
                signal.signal(self.signum, previous)
            elif callable(previous):
                # A handler installed outside Python since start() stays in force, and
                # Python's table gets the application's back (as start() does when it
                # refuses): one that chains (faulthandler.register(chain=True)) hands
                # the signal to Python's table, whose inert handler swallowed it.
                outside = _sigaction(self.signum)
                signal.signal(self.signum, previous)
                if outside is not None:
                    _sigaction(self.signum, outside)
            # else the inert handler stays in Python's table: the outside handler chains
            # to Python's C handler, which with SIG_DFL or SIG_IGN in the table prints
            # "Signal N ignored due to race condition" to stderr for every signal. The
            # cost: SIG_DFL's action (ending the process) is gone until the application
            # calls signal.signal(), also after the outside handler is removed
        except (ValueError, OSError):  # not the main thread: leave the (inert) handler
            if stopping:
                log.warning("signal detector stopped outside the main thread; the %s "
                            "handler stays installed but does nothing (until a signal "
                            "detector started for it puts the application's back on "
                            "its stop())", self.label)

    def _after_fork_in_child(self) -> None:
        """In a child of ``fork()``: the worker stayed in the parent. Forget the run
        without touching the parent's (the pipe ends here are copies)."""
        run, self._run, self._thread = self._run, None, None
        if run is None:
            return
        run.stopped = True
        w, run.write_fd = run.write_fd, None
        for fd in (run.read_fd, w):
            if fd is not None:
                with contextlib.suppress(OSError):  # closed by the application already
                    os.close(fd)
        self._restore_handler(stopping=False)

    # -- handler and worker ------------------------------------------------------------

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        run = self._run
        if run is None or run.pid != os.getpid():
            return  # stopped, or a forked child whose handler could not be restored
        w = run.write_fd
        if w is None:
            return
        # Dated here, not when the worker reads it: a signal sent while the hooks of the
        # restore it is about still run must fall in that restore's window, however long
        # the hooks take. Set before the write, so the worker never reads a byte whose
        # time is not there yet.
        run.arrived = time.monotonic()
        # Counted before the write: a byte the worker reads always has its count here.
        # From now on readiness says no until the worker has reported it.
        run.rung += 1
        try:
            os.write(w, b"s")
        except OSError as exc:  # pipe full: a notice is already pending, which suffices
            if exc.errno not in (errno.EAGAIN, errno.EBADF):
                raise

    def _work(self, run: _Run) -> None:
        r = run.read_fd
        try:
            while True:
                try:
                    data = os.read(r, 64)
                except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                    continue
                except OSError:
                    return
                if not data:
                    return  # stop() closed the write end
                # The latest of the signals read (several are one notice): a restore
                # announced after the window of the one running must still run.
                received = run.arrived
                upto = run.rung  # every byte read has its count in (the handler counts first)
                self.received += len(data)
                # Read while a handler installed outside Python is in force: it chained
                # the signal to ours (the signal might also have come just before that
                # handler was installed, a window failure() may then miss).
                outside = self._outside_handler()
                if outside is not None:
                    run.chained_through = outside
                if run.stopped:
                    return
                log.info("signal detector: %s received", self.label)
                def counted(upto: int = upto) -> None:
                    # the engine counts the notice: not ready from here on by its count,
                    # so the run's listeners see ready once it is over
                    run.taken = upto

                try:
                    if hasattr(run.engine, "add_arrival_check"):
                        run.engine.restore_detected("signal", kind=self.kind,
                                                    since=received - self.window,
                                                    counted=counted)
                    else:  # an engine of its own, written to the protocol before it
                        run.engine.restore_detected("signal", kind=self.kind,
                                                    since=received - self.window)
                except BaseException:  # a listener's sys.exit(): the worker must live on
                    log.exception("signal detector: running the restore hooks failed")
                finally:
                    run.taken = upto  # also when the notice was refused before it counted
                    _handed(run)
        finally:
            os.close(r)


def _forget_check(run: _Run) -> None:
    remove = getattr(run.engine, "remove_arrival_check", None)
    if remove is not None:
        remove(run.check)


def _handed(run: _Run) -> None:
    """Wake the engine's ``wait_ready()``: the arrival check may have turned False."""
    handed = getattr(run.engine, "arrival_handed", None)
    if handed is not None:
        handed()


def _detector_of(handler: object) -> SignalDetector | None:
    """The detector whose own handler ``handler`` is, else ``None``."""
    owner = getattr(handler, "__self__", None)
    if isinstance(owner, SignalDetector) and handler == owner._handler:
        return owner
    return None


_RUNNING: weakref.WeakSet[SignalDetector] = weakref.WeakSet()
"""Started signal detectors of this process, forgotten in the child after ``fork()``;
one per signal."""
_RUNNING_LOCK = threading.Lock()
"""Guards :data:`_RUNNING`: stop() may run on any thread."""


def _forget_in_child() -> None:
    global _RUNNING_LOCK
    _RUNNING_LOCK = threading.Lock()  # a parent thread may have held it at fork()
    for detector in list(_RUNNING):
        detector._after_fork_in_child()
    _RUNNING.clear()


# -- the kernel's view of a signal's handler -------------------------------------------
# signal.getsignal() knows only handlers set through Python: it reports SIG_DFL (or None)
# for one installed in C (faulthandler.register(), a C extension). sigaction(2) reads
# the real one, through ctypes, imported only when a signal detector starts.

_SIG_DFL = 0
_SIG_IGN = 1
_SIGACTION_SIZE = 512
"""Bytes enough for any libc's ``struct sigaction`` (glibc's is 152 on x86-64)."""
_libc: Any = None


def _sigaction(signum: int, new: Any = None) -> Any:
    """``sigaction(signum, new, &old)``: the ``struct sigaction`` in force before (a
    ctypes buffer), or ``None`` where libc's ``sigaction`` cannot be called (the checks
    that need it are then skipped). ``new``: a buffer this returned, to put back."""
    global _libc
    try:
        import ctypes

        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        call = _libc.sigaction
    except (ImportError, OSError, AttributeError):
        return None
    old = ctypes.create_string_buffer(_SIGACTION_SIZE)
    if call(signum, new, old) != 0:
        return None
    return old


def _handler_of(action: Any) -> int:
    """``sa_handler`` of a ``struct sigaction`` read by :func:`_sigaction` (its first
    member, except on MIPS, where ``sa_flags`` comes first)."""
    import ctypes
    import platform

    offset = ctypes.sizeof(ctypes.c_void_p) if platform.machine().startswith("mips") else 0
    return ctypes.c_void_p.from_buffer(action, offset).value or _SIG_DFL


def _handler_address(signum: int) -> int | None:
    action = _sigaction(signum)
    return None if action is None else _handler_of(action)


def _foreign(action: Any, python_handler: object) -> bool:
    """A C handler in force while Python's table names none of its own (SIG_DFL, SIG_IGN
    or None): installed outside Python."""
    return (_handler_of(action) not in (_SIG_DFL, _SIG_IGN)
            and not callable(python_handler))


def _outside_python(label: str) -> str:
    other = "SIGUSR1" if label != "SIGUSR1" else "SIGUSR2"
    return (f"{label} has a handler installed outside Python (faulthandler.register() or a "
            f"C extension), which the signal detector will not replace; choose another "
            f"signal (REHYDRATE_SIGNAL={other.removeprefix('SIG')})")


os.register_at_fork(after_in_child=_forget_in_child)
