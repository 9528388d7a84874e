"""Reading a medium's bytes: a file path relative to the records file, or a base64 data: URI,
with the size limit checked before the expensive part (decoding the base64, reading the file).

A file is read only if it is a regular file inside the media root (InputLimits.media_root, by
default the directory paths are relative to), wherever the path leads after `..`, absolute
paths and symlinks: a records file cannot make a job read /etc/passwd, block on a FIFO or read
/dev/zero until memory runs out."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Any

from models.limits import DEFAULT_LIMITS, InputError, InputLimits, InputTooLarge

# The kinds whose data: URIs must declare a type of theirs (a plugin's own `what` is not checked).
TYPED_KINDS = ("image", "audio")
# Declared types that say nothing about the bytes, accepted for any kind: the decoder decides.
UNTYPED = ("", "application/octet-stream")


def read_bytes(value: Any, base_dir: Path | None, what: str, limits: InputLimits) -> bytes:
    """Bytes of a path (relative to base_dir, inside the media root) or of a base64 data: URI.
    Without a base_dir (a query in the service) a file path is refused: a client must never
    make the server read a file it names."""
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
    elif not isinstance(value, str) or not value:
        raise InputError(
            f"expected a file path or a data: URI for {what}, got {type(value).__name__}"
        )
    elif value.startswith("data:"):
        data = _data_uri(value, what, limits)
    elif base_dir is None:
        raise InputError(f"{what} must be a base64 data: URI here (file paths come from records)")
    else:
        data = _read_file(value, base_dir, what, limits)
    if len(data) > limits.max_media_bytes:
        raise InputTooLarge(
            f"{what} is {len(data)} bytes, over the limit of {limits.max_media_bytes} "
            "(max_media_bytes)"
        )
    return data


def _data_uri(value: str, what: str, limits: InputLimits) -> bytes:
    header, sep, payload = value.partition(",")
    if not sep or ";base64" not in header:
        raise InputError(f"{what} data: URI must be base64 encoded ('data:...;base64,...')")
    declared = header[len("data:") :].partition(";")[0].strip().lower()
    if what in TYPED_KINDS and declared not in UNTYPED and declared.partition("/")[0] != what:
        raise InputError(
            f"{what} data: URI declares the type {declared!r}, not {what}/* (or "
            "application/octet-stream, or no type)"
        )
    if len(payload) * 3 // 4 > limits.max_media_bytes:
        raise InputTooLarge(
            f"{what} is over the limit of {limits.max_media_bytes} bytes (max_media_bytes)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{what} data: URI holds invalid base64") from None


def _read_file(value: str, base_dir: Path, what: str, limits: InputLimits) -> bytes:
    """A regular file's bytes, at most max_media_bytes of them, if its real path (every `..`
    and symlink resolved) lies inside the media root."""
    if "\x00" in value:  # the OS cannot name it; Python would raise ValueError
        raise InputError(f"{what} file path holds a NUL character (\\u0000)")
    path = base_dir / value  # an absolute value stays itself
    root = limits.media_root or base_dir
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(root)):
        raise InputError(
            f"{what} file {path} is outside the media root {root} (it resolves to {real})"
        )
    try:
        # The resolved path, so what was checked is what is opened; O_NOFOLLOW refuses a
        # symlink put in its place since, and O_NONBLOCK keeps a FIFO from blocking the open.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"{what} file unreadable: {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} file {path} is not a regular file ({_file_type(st)})")
        if st.st_size > limits.max_media_bytes:
            raise InputTooLarge(
                f"{what} file {path} is {st.st_size} bytes, over the limit of "
                f"{limits.max_media_bytes} (max_media_bytes)"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            # One byte past the limit: a file that grew since fstat is caught by the caller.
            return f.read(limits.max_media_bytes + 1)
    except OSError as exc:
        raise InputError(f"{what} file unreadable: {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _file_type(st: os.stat_result) -> str:
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def read_media(
    value: Any, base_dir: Path | None, what: str, limits: InputLimits = DEFAULT_LIMITS
) -> bytes:
    """Bytes of a base64 data: URI, or of a file path relative to `base_dir`, for plugins: as
    read_bytes reads them (a file only inside the media root; no file without a base_dir).
    Records files always pass their directory."""
    return read_bytes(value, base_dir, what, limits)
