"""Proof that a file beside a store is the store's own, so that a later run may replace or delete it.

A store lists in its root attribute ``companions`` the content hash of each companion it was published with (role
-> sha256: ``report`` and ``log`` of the file's bytes, ``figures`` and ``exports`` a tree hash of the folder,
``content_sha256``). A file or folder at a companion's place is the store's own only while the store at
``store.path`` lists that very content under that role; anything else (no store there, a store that lists no such
companion, content changed since) is not the run's to touch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import zarr

RECORD = "companions"  # the root attribute
CHUNK = 1 << 20


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes; of a folder, of each entry's relative path, type and content hash, in sorted order;
    of a symbolic link, of its target (never followed)."""
    path = Path(path)
    if path.is_symlink():
        return hashlib.sha256(b"link\0" + os.fsencode(os.readlink(path))).hexdigest()
    if path.is_dir():
        tree = hashlib.sha256(b"tree\0")
        for entry in sorted(path.iterdir(), key=lambda p: p.name):
            tree.update(os.fsencode(entry.name) + b"\0" + content_sha256(entry).encode() + b"\n")
        return tree.hexdigest()
    digest = hashlib.sha256(b"file\0")
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def why_not_owned(role: str, path: Path, store: Path, attrs: dict | None) -> str | None:
    """None when the store at ``store`` (root attributes ``attrs``, None where there is no store of this runner)
    lists the content now at ``path`` as its ``role`` companion; else why it is not the store's own."""
    if attrs is None:
        return f"there is no store at {store} that wrote it"
    companions = attrs.get(RECORD)
    listed = companions.get(role) if isinstance(companions, dict) else None
    if not isinstance(listed, str):
        return f"the store at {store} lists no {role} it wrote"
    try:
        now = content_sha256(path)
    except OSError as err:
        return f"it cannot be read ({err})"
    if now != listed:
        return f"it changed after the store at {store} wrote it (sha256 {now[:12]}, listed {listed[:12]})"
    return None


def record(store: Path, companions: dict[str, Path]) -> dict[str, str]:
    """List the content of ``companions`` (role -> path) in the store's ``companions`` attribute, keeping the
    other roles it lists; the hashes listed."""
    group = zarr.open_group(str(store), mode="r+")
    listed = dict(group.attrs.get(RECORD) or {})
    listed.update({role: content_sha256(path) for role, path in companions.items()})
    group.attrs.update({RECORD: listed})
    return listed
