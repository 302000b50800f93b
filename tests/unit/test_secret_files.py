"""kvpool/secret_files.py on real folders: another user's folder, a loose mode or a symlink is refused, and a
file another user left at a secret's name is replaced by a new one of ours, never written into."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvpool.secret_files import UnsafeFolder, private_folder, write_secret

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_a_missing_folder_is_made_ours_and_0700(tmp_path: Path) -> None:
    folder = private_folder(tmp_path / "a" / "workdir")
    st = folder.lstat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, os.geteuid())
    assert private_folder(folder) == folder  # ours already: taken as it is


def test_a_folder_others_may_enter_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(UnsafeFolder, match=r"workdir .*open has mode 0755: other users could read or plant"):
        private_folder(folder, "workdir")


@needs_root
def test_a_folder_another_user_owns_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolder, match=f"is owned by uid {NOBODY}, not by this user"):
        private_folder(folder, "certs folder")


def test_a_symlink_is_refused_even_to_a_private_folder(tmp_path: Path) -> None:
    real = private_folder(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeFolder, match="link is a symlink"):
        private_folder(link)
    with pytest.raises(UnsafeFolder, match="link is a symlink"):
        write_secret(link / "api_keys", "sk-0123456789\n")
    assert list(real.iterdir()) == []


def test_a_file_is_refused_as_a_folder(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    with pytest.raises(UnsafeFolder, match="is not a directory"):
        private_folder(tmp_path / "plain")


@needs_root
def test_a_planted_file_is_replaced_by_a_new_one_of_ours(tmp_path: Path) -> None:
    folder = private_folder(tmp_path / "workdir")
    planted = folder / "api_keys"
    planted.write_text("")
    os.chown(planted, NOBODY, NOBODY)
    planted.chmod(0o666)
    planted_inode = planted.stat().st_ino
    with planted.open("r") as theirs:  # what its owner holds open sees nothing of the secret
        write_secret(planted, "alice=sk-alice-0123456789\n")
        assert theirs.read() == ""
    st = planted.lstat()
    assert st.st_ino != planted_inode
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.geteuid())
    assert planted.read_text() == "alice=sk-alice-0123456789\n"
    write_secret(planted, "bob=sk-bob-0123456789\n")  # a second write replaces ours too
    assert planted.read_text() == "bob=sk-bob-0123456789\n"
    assert sorted(p.name for p in folder.iterdir()) == ["api_keys"]  # no temporary file left behind


def test_a_public_file_gets_the_mode_it_asks_for(tmp_path: Path) -> None:
    umask = os.umask(0o077)  # a strict umask must not take a certificate's read bits
    try:
        path = write_secret(private_folder(tmp_path / "certs") / "ca.pem", b"PEM", 0o644)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
