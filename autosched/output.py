"""What the command line prints: tables, JSON or CSV of rows on stdout, and the consoles for progress.

Shared by ``autosched/cli/`` and ``database/cli.py``, so that neither command module imports the other
for its output.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from autosched.artifact import MANIFEST

from .errors import UsageError

# Deferred imports: rich (imported where used: `autosched --help` stays fast).


def console(stderr: bool = False):
    """A rich console for stdout (data) or stderr (progress and logs)."""
    from rich.console import Console
    from rich.markup import escape

    class FileConsole(Console):
        """Output to a pipe or file: tables up to 220 columns wide rather than wrapped at 80, and log lines
        as long as their text (``Console.log`` pads every line to the console's width)."""

        def log(self, *objects: Any, **_: Any) -> None:
            self.print(escape(time.strftime("[%H:%M:%S]")), *objects, soft_wrap=True)

    out = Console(stderr=stderr, highlight=False, log_path=False)
    if not out.is_terminal:
        out = FileConsole(stderr=stderr, highlight=False, log_path=False, width=220)
    return out


def emit(rows: list[dict[str, Any]], fmt: str, columns: list[tuple[str, str]] | None = None,
         title: str | None = None) -> None:
    """Print ``rows`` as a table, JSON list or CSV. ``columns``: (key, header) pairs for table and CSV."""
    if fmt == "json":
        print(json.dumps(rows, indent=2, default=str))
        return
    columns = columns or [(k, k) for k in (rows[0] if rows else {})]
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow([h for _, h in columns])
        for row in rows:
            writer.writerow([plain(row.get(k)) for k, _ in columns])
        sys.stdout.write(buf.getvalue())
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title) if title else None, header_style="bold")
    for _, header in columns:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*[escape(cell(row.get(k))) for k, _ in columns])
    console().print(table)


def plain(value: Any) -> str:
    """A value as CSV writes it."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def cell(value: Any) -> str:
    """A value as a table shows it: numbers rounded for reading, missing values as ``-``."""
    if isinstance(value, float):
        if math.isinf(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return plain(value) if value is not None else "-"


def check_output_folder(path: str, what: str, build: bool = False) -> None:
    """``-o PATH`` names a folder to write ``what`` into: a UsageError in one line where PATH (or a folder above
    it) is a file. ``build``: the folder must also be new, empty, or an earlier build (it has a manifest.json),
    so that a build never mixes its files into a folder of other things."""
    out = Path(path)
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "" if folder == out else f" ({folder} is a file)"
                raise UsageError(f"-o {path} cannot be a folder{where}: give a folder path for {what}")
            break
    if build and out.is_dir() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise UsageError(f"-o {path} holds other files and is not an autosched build: give a new or empty folder "
                         f"for {what}")
