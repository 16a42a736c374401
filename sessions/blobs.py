"""The store's files: uploaded images, content-addressed by the SHA-256 of their bytes, under
``images/<sha[:2]>/<sha256>``, written atomically and synced, deleted with their last reference,
and swept of leftovers; and the private modes of the data folder and database files.

Files are created and deleted inside the database's write transactions (the caller holds them),
so reference counting stays right across threads and processes.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path

import sqlite_utils

from .keys import is_sha256


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with mode ``0700``, or take group and other access away
    from an existing one (a folder that is not ours is left as it is)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    with suppress(OSError):
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)


def private_files(db_path: Path) -> None:
    """Create the database file ``0600`` before SQLite does (its WAL and shared-memory files take
    the database's mode), and take group and other access from existing ones."""
    with suppress(FileExistsError):
        os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for path in (db_path, db_path.with_name(db_path.name + "-wal"), db_path.with_name(db_path.name + "-shm")):
        with suppress(OSError):
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BlobStore:
    """Image files under ``images_dir`` (which must exist), named by their SHA-256."""

    def __init__(self, images_dir: Path):
        self.images_dir = images_dir

    def path(self, sha: str) -> Path:
        """``images/<sha[:2]>/<sha>``; only ever built from a checked hash (no traversal)."""
        assert is_sha256(sha)
        return self.images_dir / sha[:2] / sha

    def write(self, sha: str, data: bytes) -> bool:
        """Make sure ``images/<sha[:2]>/<sha>`` holds ``data``; return True if it was not there.

        The file is written and synced every time, also when it exists: skipping that for an
        image that another session had uploaded made the upload measurably faster, which told the
        uploader that someone on this server holds the image.
        """
        path = self.path(sha)
        existed = path.is_file()
        path.parent.mkdir(exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)
        return not existed

    def remove_if_unknown(self, db: sqlite_utils.Database, sha: str) -> None:
        """After a failed upload: delete the file written for it unless the database knows the image."""
        if db.execute("SELECT 1 FROM images WHERE sha256 = ?", [sha]).fetchone() is None:
            self.path(sha).unlink(missing_ok=True)

    def drop_unreferenced(self, db: sqlite_utils.Database, shas: list[str]) -> int:
        """Inside a write transaction: delete the image rows and files of ``shas`` that no session
        references; return how many files were removed."""
        removed = 0
        for sha in shas:
            referenced = db.execute("SELECT 1 FROM session_images WHERE sha256 = ? LIMIT 1", [sha]).fetchone()
            if referenced is not None:
                continue
            db.execute("DELETE FROM images WHERE sha256 = ?", [sha])
            if is_sha256(sha):
                path = self.path(sha)
                with suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
                with suppress(OSError):
                    path.parent.rmdir()  # only succeeds when empty
        return removed

    def collect_garbage(self, db: sqlite_utils.Database) -> int:
        """Inside a write transaction: delete image rows (and files) no session references,
        temporary files, and files the database does not know; return how many files went."""
        orphans = [r[0] for r in db.execute(
            "SELECT sha256 FROM images WHERE sha256 NOT IN (SELECT sha256 FROM session_images)"
        )]
        removed = self.drop_unreferenced(db, orphans)
        known = {r[0] for r in db.execute("SELECT sha256 FROM images")}
        for shard in self.images_dir.iterdir():
            if not shard.is_dir() or shard.is_symlink():
                continue
            for entry in shard.iterdir():
                if entry.name not in known or entry.name[:2] != shard.name:
                    with suppress(OSError):
                        entry.unlink()
                        removed += 1
            with suppress(OSError):
                shard.rmdir()  # only succeeds when empty
        return removed
