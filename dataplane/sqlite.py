"""SQLite catalog backend (embedded default): a file in WAL mode, synchronous=FULL; write transactions
(execution option `dp_write`) take the lock up front (BEGIN IMMEDIATE) and wait for it up to
`busy_timeout`; reads use plain BEGIN and never wait for writers (WAL)."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import LargeBinary, cast, create_engine, event, func, make_url
from sqlalchemy.dialects.sqlite import insert as _insert

from core import fileio

COLLATION = "BINARY"  # bytewise order, same as PostgreSQL's "C"


def make_engine(url: str, namespace: str | None = None, busy_timeout_s: float = 60.0):
    path = make_url(url).database or ""  # a quoted path ('?', '%XX') decoded as SQLAlchemy opens it
    if path and path != ":memory:":
        fileio.makedirs(Path(path).parent)  # durably; the database file itself is SQLite's to sync
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("dp_write") else "BEGIN")

    return engine


def insert_ignore(table):
    return _insert(table).on_conflict_do_nothing()


def drop_namespace(url: str, namespace: str) -> None:  # one file per catalog: nothing shared to drop
    return None


def join_numbers(col):
    """A numeric column of the selected rows as one text, values joined by ',' (select's bulk transfer)."""
    return func.group_concat(col, ",")


def join_bytes(col):
    """A blob column of the selected rows concatenated with no separator, as one blob: group_concat keeps
    a blob's bytes as they are, NUL bytes included."""
    return cast(func.group_concat(col, ""), LargeBinary)


def byte_length(col):
    return func.length(col)


def cursor(dbapi_conn):
    return dbapi_conn.cursor()
