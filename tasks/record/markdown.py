"""Markdown tables: the one writer behind report.md, bench reports, correctness and the matrix.

pandas' `to_markdown` needs tabulate, a dependency for twelve lines; this is those lines, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd


def table(header: list[str], rows: Iterable[Iterable[Any]], cell: Callable[[Any], str] = str) -> list[str]:
    """The lines of a GitHub-flavoured table; each value through `cell`."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def frame(df: pd.DataFrame, cell: Callable[[Any], str] = str) -> str:
    """A DataFrame (its columns as the header, no index) as one table."""
    return "\n".join(table([str(c) for c in df.columns], df.itertuples(index=False), cell))
