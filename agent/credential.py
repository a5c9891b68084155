"""The app's credential kept in a file between runs (docs/service.md, "Tokens and credentials").

An admin's registration token is good once; the credential it buys is what the agent presents from
then on, so losing it means asking the admin again. It is therefore written atomically (a crash
leaves the old file or the new one, never an empty one), readable by its owner only, and an empty
or unreadable file is treated as no credential rather than as the credential "".
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CredentialFileError", "keep_credential", "read_credential"]


class CredentialFileError(ValueError):
    """The credential file exists but cannot be read as text; the message names the file."""


def read_credential(path: Path) -> str | None:
    """The credential in ``path``, or None when there is none yet (no file, or an empty one)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialFileError(f"cannot read the credential file {path}: {exc}") from exc
    return text or None


def keep_credential(path: Path, credential: str) -> None:
    """Write ``credential`` to ``path`` (mode 0600) through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(credential + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
