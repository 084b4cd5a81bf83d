"""What users write, read with errors in words: sizes and booleans in settings, and their files.

    parse_size("2GiB") -> 2147483648      sizes: plain bytes or KiB, MiB, GiB, TiB, KB, MB, GB
    parse_bool("off")  -> False           booleans: 1/0, true/false, yes/no, on/off
    read_text(path), read_toml(path, what)

Each raises ValueError saying what is wrong and how to write it (a file's errors name the file);
the caller prefixes where the value came from (a setting, a variable, a flag). ``format_size`` is
the other way: a byte count as logs and ``kvstore stats`` print it. Used by the daemon's settings
(``kvstore/daemon/config.py``, the tenants file) and by the CLI's client commands.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str | int) -> int:
    """``"2GiB"`` -> 2147483648; ints pass through."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: float) -> str:
    """2147483648 -> "2.0 GiB", 512 -> "512 B": what logs and ``kvstore stats`` print."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (use true or false)")


def read_text(path: str | os.PathLike, what: str = "") -> str:
    """The UTF-8 text of a user's file; ValueError naming the file (``what``: "config file", ...)
    when it is missing, unreadable or not UTF-8 (with the offending byte and offset)."""
    name = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def read_toml(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The TOML table in ``path``; ValueError naming the file (see :func:`read_text`), or saying
    it is not TOML (tomllib's message gives the line)."""
    text = read_text(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid TOML: {exc}") from None
