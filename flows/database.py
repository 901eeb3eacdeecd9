"""Which database the Prefect server of `lanebench serve` keeps its state in.

SQLite under PREFECT_HOME is right for one machine; a team's server (several workers, several
people launching matrices, a nightly) writes from many connections at once, where SQLite answers
503 "database is locked" and PostgreSQL does not. Prefect supports both through one setting,
`PREFECT_API_DATABASE_CONNECTION_URL`, with an async driver named in the URL (asyncpg,
aiosqlite); users write the plain `postgresql://` form and this adds the driver.
"""

from __future__ import annotations

from urllib.parse import urlsplit

ENV = "PREFECT_API_DATABASE_CONNECTION_URL"
_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg",
            "postgresql+asyncpg": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite",
            "sqlite+aiosqlite": "sqlite+aiosqlite"}


class DatabaseUrlError(ValueError):
    """A --database value Prefect cannot use; the message names the fix."""


def connection_url(url: str) -> str:
    """`postgresql://user[:pw]@host[:port]/db` -> Prefect's `postgresql+asyncpg://...` (sqlite likewise)."""
    parts = urlsplit(url)
    driver = _DRIVERS.get(parts.scheme)
    if driver is None:
        raise DatabaseUrlError(f"--database {redacted(url)}: scheme {parts.scheme or '(none)'!r} is not supported. "
                               "Fix: postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE or sqlite:////abs/path.db")
    if driver.startswith("postgresql") and (not parts.hostname or not parts.path.strip("/")):
        raise DatabaseUrlError(f"--database {redacted(url)}: needs a host and a database name. "
                               "Fix: postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE")
    if driver.startswith("sqlite") and not parts.path.strip("/"):
        raise DatabaseUrlError(f"--database {url}: needs a file path. Fix: sqlite:////abs/path/prefect.db")
    return driver + url[len(parts.scheme):]


def redacted(url: str) -> str:
    """The URL with its password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def server_env(url: str | None) -> dict[str, str]:
    """The server's environment for `url` (nothing for the SQLite default under PREFECT_HOME)."""
    return {} if not url else {ENV: connection_url(url)}
