"""Reading small files that an attacker or a broken platform may have replaced.

Private: nothing here is public API.

Every file rehydrate reads on its own (environment files, certificates and keys, CA
bundles, marker files, secrets) goes through :func:`read_regular`: the open never waits
(``O_NONBLOCK``: a FIFO at the path would otherwise block until a writer appears), only a
regular file is read (``/dev/zero`` as a certificate would otherwise fill the memory), and
no more than ``limit`` bytes are read. The bytes land in a ``bytearray`` the caller can
wipe; growing it wipes the smaller copy, so key material leaves no stray copies behind.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["READ_ONLY_EVENTS", "kind_name", "open_regular", "read_regular", "wipe"]

READ_ONLY_EVENTS = frozenset({"opened", "closed_no_write"})
"""watchdog event types that reading a watched file fires: a watcher that reads the file
when woken must ignore them, or its own read wakes it again and it spins a core."""

_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
          | getattr(os, "O_NOCTTY", 0))

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFDIR: "a directory"}


def kind_name(kind: int) -> str:
    """What a ``stat.S_IFMT`` value that is not a regular file is, for a message
    ("a FIFO", "a directory" …)."""
    return _KINDS.get(kind, "not a regular file")


def wipe(buf: bytearray) -> None:
    """Overwrite ``buf`` with zeros in place."""
    buf[:] = bytes(len(buf))


def open_regular(path: str | os.PathLike[str]) -> int:
    """Open ``path`` for reading without blocking; ``OSError`` unless it is a regular file.

    The error's ``strerror`` is one readable phrase ("not a regular file (a FIFO)").
    """
    fd = os.open(path, _FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = kind_name(stat.S_IFMT(mode))
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int, *,
                 truncate: bool = False) -> bytearray:
    """The content of the regular file ``path``, at most ``limit`` bytes.

    A larger file raises ``OSError`` (``EFBIG``), or with ``truncate=True`` returns its
    first ``limit`` bytes. Reads straight into the returned buffer (no intermediate
    ``bytes``), so wiping it leaves no copy of the content in this process.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size  # 0 for /proc files: grow as needed
        buf = bytearray(min(max(size, 4095), limit) + 1)
        got = 0
        while True:
            if got == len(buf):
                if got > limit:
                    break
                bigger = bytearray(min(len(buf) * 2, limit + 1))
                bigger[:got] = buf
                wipe(buf)
                buf = bigger
            with memoryview(buf) as view:
                n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
    if got > limit:
        if not truncate:
            wipe(buf)
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        got = limit
    exact = bytearray(got)  # a copy through a view, then the big buffer is wiped
    with memoryview(buf) as view:
        exact[:] = view[:got]
    wipe(buf)
    return exact
