"""Folders and files that hold secrets: API keys, private keys, a cluster's workdir.

Owns two rules, so that another local user can neither read a secret nor hand us a file to write it into:

- a secret's folder is a real directory (not a symlink), owned by this process's user, mode 0700:
  ``private_folder`` makes one so, and refuses an existing one that is not, saying which and why;
- a secret is written to a new file of a random name in that folder (``O_CREAT|O_EXCL``, mode 0600)
  and renamed over its name: whatever lay at the name before (a file someone else made, mode 0666) is
  replaced by a new inode, never opened and reused. ``touch(mode=0o600)`` and
  ``open(O_CREAT|O_TRUNC, 0o600)`` keep an existing file's owner and mode, so neither is used here.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_MODE = 0o600
FOLDER_MODE = 0o700


def runtime_folder() -> str:
    """This user's folder for a host's runtime files (sockets, the engine ports' cursor), unless a setting names
    another: ``$XDG_RUNTIME_DIR/kvpool`` (that folder is 0700, by systemd-logind), else ``/tmp/kvpool-UID``.
    Short, because a socket's path holds at most 107 bytes; make or check it with :func:`private_folder`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return f"{runtime}/kvpool" if runtime.startswith("/") else f"/tmp/kvpool-{os.geteuid()}"


class UnsafeFolder(ValueError):
    """A folder for secrets that another user could read or replace; the message says which and why."""


def private_folder(path: Path | str, what: str = "folder") -> Path:
    """``path`` as a folder for secrets: made (with its parents) mode 0700 when missing, else checked.

    Raises :class:`UnsafeFolder` for a symlink, something not a directory, a folder another user owns,
    or one with any group or other permission bit; ``what`` names the folder in the message (e.g.
    ``"workdir"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolder(f"{what} {path} is a symlink: whoever can change it chooses where secrets go; "
                           "give the real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeFolder(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
                           "its owner could read or replace the secrets written there; remove it or choose "
                           "another folder")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise UnsafeFolder(f"{what} {path} has mode {mode:04o}: other users could read or plant files there; "
                           f"it must be {FOLDER_MODE:04o} (chmod 700 {path}) or a new folder")
    return path


def write_secret(path: Path | str, data: bytes | str, mode: int = SECRET_MODE) -> Path:
    """Write ``data`` to ``path`` as a new file of ``mode`` (0600 unless a public file such as a
    certificate asks for more), renamed into place; the folder must pass :func:`private_folder`."""
    path = Path(path)
    private_folder(path.parent)
    payload = data.encode() if isinstance(data, str) else data
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)  # the umask may have taken bits a public file asks for
            fh.write(payload)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path
