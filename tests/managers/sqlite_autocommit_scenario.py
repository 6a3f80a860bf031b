"""A managed SQLite connection in Python 3.12's ``autocommit=False`` mode (PEP 249: a
transaction is open at all times) through a snapshot and a restore. Run by
test_files.py in this interpreter with :class:`EmulatedAutocommitOff` (Python 3.11 has no
``autocommit``) and, where one is installed, in a Python 3.12+ child with the real
``autocommit=False`` (``python sqlite_autocommit_scenario.py DIR``)."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from rehydrate import Lifecycle, files


class EmulatedAutocommitOff(sqlite3.Connection):
    """``autocommit=False`` as Python 3.12 documents it, for 3.11: a transaction is begun
    at connect and again after every commit and rollback; setting ``autocommit`` to True
    commits the open one, back to False begins one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["isolation_level"] = None  # the statements are ours, none implicit
        super().__init__(*args, **kwargs)
        self._autocommit = False
        self.execute("BEGIN")

    @property
    def autocommit(self) -> bool:
        return self._autocommit

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        if value and self.in_transaction:
            self.execute("COMMIT")
        self._autocommit = value
        if not value and not self.in_transaction:
            self.execute("BEGIN")

    def commit(self) -> None:
        super().commit()
        if not self._autocommit:
            self.execute("BEGIN")

    def rollback(self) -> None:
        super().rollback()
        if not self._autocommit:
            self.execute("BEGIN")


def _hook_error(report: Any, name: str) -> str:
    return str(next(h for h in report.hooks if h.name == name).error)


def run(directory: Path, **connect: Any) -> None:
    """The scenario; asserts as it goes."""
    engine = Lifecycle()
    try:
        db_path, other = directory / "app.db", directory / "other.db"
        sqlite3.connect(other).close()
        db = files.sqlite(db_path, engine=engine, **connect)
        assert db.autocommit is False and db.in_transaction
        # Statements that cannot run inside the open transaction, as Python's docs say.
        db.autocommit = True
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("ATTACH DATABASE ? AS other", (str(other),))
        db.autocommit = False
        db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        db.execute("CREATE TABLE child (p INTEGER REFERENCES parent(id))")
        db.execute("INSERT INTO parent VALUES (1)")
        db.commit()
        assert db.execute("SELECT id FROM parent").fetchall() == [(1,)]  # a read, in it

        report = engine.simulate_snapshot()
        assert report.ok, _hook_error(report, "rehydrate.files.close")
        assert not Path(f"{db_path}-wal").exists(), "the WAL was checkpointed"
        assert engine.simulate_restore().ok
        assert db.autocommit is False and db.in_transaction
        assert db.execute("PRAGMA foreign_keys").fetchone() == (1,), "set again"
        schemas = [r[1] for r in db.execute("PRAGMA database_list")]
        assert "other" in schemas, f"attached again: {schemas}"
        try:
            db.execute("INSERT INTO child VALUES (2)")
        except sqlite3.IntegrityError:
            pass
        else:
            raise AssertionError("foreign keys not enforced after the restore")

        db.execute("INSERT INTO parent VALUES (2)")  # uncommitted
        report = engine.simulate_snapshot()
        assert not report.ok
        error = _hook_error(report, "rehydrate.files.close")
        assert str(db_path) in error and "uncommitted writes" in error, error
        assert db.execute("SELECT count(*) FROM parent").fetchone() == (2,), "kept"
        db.rollback()
        assert engine.simulate_restore(kind="resume").ok

        cursor = db.execute("SELECT id FROM parent")  # left half read: still refused
        report = engine.simulate_snapshot()
        assert "a statement still running" in _hook_error(report, "rehydrate.files.close")
        assert db.autocommit is False and db.in_transaction, "as it was"
        cursor.close()
        assert engine.simulate_restore(kind="resume").ok
        assert engine.simulate_snapshot().ok
        assert engine.simulate_restore().ok
        assert db.execute("SELECT id FROM parent").fetchall() == [(1,)]
    finally:
        engine.close()


if __name__ == "__main__":
    assert sys.version_info >= (3, 12), sys.version
    run(Path(sys.argv[1]), autocommit=False)
    print("ok", os.getpid())
