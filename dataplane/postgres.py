"""PostgreSQL catalog backend (cluster): `postgresql://` URLs go through psycopg 3; an optional
namespace is a PostgreSQL schema (created on open) so several catalogs can share one database."""
from __future__ import annotations

import re

from sqlalchemy import Text, cast, create_engine, func, literal, literal_column, text
from sqlalchemy.dialects.postgresql import insert as _insert

from dataplane.errors import DataPlaneError

COLLATION = "C"  # bytewise order, same as SQLite's BINARY


def normalize_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _check_namespace(namespace: str) -> str:
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", namespace):
        raise DataPlaneError(f"catalog namespace {namespace!r}: use lowercase letters, digits and _ (max 63)")
    return namespace


def make_engine(url: str, namespace: str | None = None):
    url = normalize_url(url)
    kwargs = {"pool_pre_ping": True}
    if namespace:
        ns = _check_namespace(namespace)
        with create_engine(url).connect() as conn:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{ns}"'))
            conn.commit()
        kwargs["connect_args"] = {"options": f"-csearch_path={ns}"}
    return create_engine(url, **kwargs)


def insert_ignore(table):
    return _insert(table).on_conflict_do_nothing()


def drop_namespace(url: str, namespace: str) -> None:
    ns = _check_namespace(namespace)
    engine = create_engine(normalize_url(url))
    with engine.connect() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{ns}" CASCADE'))
        conn.commit()
    engine.dispose()


def join_numbers(col):
    """A numeric column of the selected rows as one text, values joined by ',' (select's bulk transfer)."""
    return func.string_agg(cast(col, Text), ",")


def join_bytes(col):
    """A bytea column of the selected rows concatenated with no separator, as one bytea."""
    return func.string_agg(col, literal_column("''::bytea"))


def byte_length(col):
    return func.octet_length(col)


def cursor(dbapi_conn):
    """Results in PostgreSQL's binary format: bytea arrives as its bytes, not as hex text to decode."""
    return dbapi_conn.cursor(binary=True)
