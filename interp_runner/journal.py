"""The journal of a run: its finished units of work, what a resumed run takes instead of running them again.

One folder per run (``StoreTarget.journal``), per unit ``stage{S}-unit{K}.json`` (the results' structure and
scalars, ``interp_runner.result_codec``) and ``stage{S}-unit{K}.npz`` (their arrays, pooled by dtype), and
``index.json`` listing the finished units with the sha256 of each unit's JSON (which holds the sha256 of its
arrays). A unit counts as finished once it is in the index, which is rewritten atomically after the unit's files
are in place. Nothing is ever unpickled: the arrays are read with ``allow_pickle=False``. A unit whose files
fail their sha256 check, or a file in the folder that the journal did not write, refuses the resume
(``ConfigError`` at ``resume``); a listed unit whose files were deleted runs again.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import numpy as np

from .config import ConfigError
from .engine import RequestResult
from .result_codec import CodecError, decode, encode

INDEX = "index.json"
FORMAT = "interp-runner-journal/2"
UNIT_FILE = re.compile(r"stage\d+-unit\d+\.(json|npz)")  # a unit's file


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class Journal:
    def __init__(self, folder: Path):
        self.dir = Path(folder)
        self.units: dict[str, dict] = {}  # unit name -> {"sha256": of its JSON, "requests": count}

    def open(self, resume: bool) -> int:
        """Start empty (the folder must not exist yet), or check and keep what an earlier attempt finished;
        returns the number of finished units. Every unit is verified here, before any engine starts."""
        if not resume:
            self.dir.mkdir(parents=True)
            self._write_index()
            return 0
        index = self.dir / INDEX
        if not index.is_file():
            raise self._refused(f"{self.dir} has no {INDEX}: it is not a journal this runner wrote")
        doc = _document(index.read_bytes())
        if doc is None or not isinstance(doc.get("units"), dict):
            raise self._refused(f"{index} is not a journal index of format {FORMAT}")
        self.units = doc["units"]
        known = {INDEX} | {f"{u}{ext}" for u in self.units for ext in (".json", ".npz")}
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(".tmp"):  # an interrupted write of this journal
                path.unlink()
            elif path.name not in known and not UNIT_FILE.fullmatch(path.name):  # unlisted: written again
                raise self._refused(f"{path} was not written by the journal (pickles and other files are never "
                                    "loaded): remove it to resume")
        for name in sorted(self.units):
            self._read(name)  # verify each one now; results are read again when used
        return sum(1 for name in self.units if (self.dir / f"{name}.json").exists())

    def load(self, stage: int, unit: int) -> dict[str, RequestResult] | None:
        """The unit's results, or None if it has not finished (or its files were removed to run it again)."""
        name = _unit_name(stage, unit)
        return self._read(name) if name in self.units else None

    def record(self, stage: int, unit: int, results: dict[str, RequestResult]) -> None:
        name = _unit_name(stage, unit)
        doc, arrays = encode(results)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        npz = buffer.getvalue()
        text = json.dumps({"format": FORMAT, "arrays_sha256": _sha256(npz), "results": doc}).encode()
        _write_atomic(self.dir / f"{name}.npz", npz)
        _write_atomic(self.dir / f"{name}.json", text)
        self.units[name] = {"sha256": _sha256(text), "requests": len(results)}
        self._write_index()

    def _write_index(self) -> None:
        _write_atomic(self.dir / INDEX, json.dumps({"format": FORMAT, "units": self.units}, indent=1).encode())

    def _read(self, name: str) -> dict[str, RequestResult] | None:
        doc_path, npz_path = self.dir / f"{name}.json", self.dir / f"{name}.npz"
        if not doc_path.exists() and not npz_path.exists():
            return None
        try:
            text, npz = doc_path.read_bytes(), npz_path.read_bytes()
        except OSError as err:
            raise self._refused(f"unit {name}: {err}") from None
        listed = self.units[name]
        if not isinstance(listed, dict) or _sha256(text) != listed.get("sha256"):
            raise self._damaged(doc_path)
        doc = _document(text)
        if doc is None or _sha256(npz) != doc.get("arrays_sha256"):
            raise self._damaged(npz_path)
        try:  # numpy raises ValueError for a pickle or an object array, and for a damaged zip
            arrays = np.load(io.BytesIO(npz), allow_pickle=False)
            if not isinstance(arrays, np.lib.npyio.NpzFile):
                raise CodecError("its arrays are not an .npz")
            with arrays:
                return decode(doc.get("results"), arrays)
        except (ValueError, TypeError, OSError) as err:
            raise self._refused(f"unit {name} cannot be read ({err})") from None

    def _damaged(self, path: Path) -> ConfigError:
        return self._refused(f"{path} fails its sha256 check (it changed after it was written): delete "
                             f"{path.with_suffix('.json').name} and {path.with_suffix('.npz').name} to run that unit "
                             "again")

    def _refused(self, why: str) -> ConfigError:
        return ConfigError.at("resume", f"the journal cannot be used: {why}")


def _unit_name(stage: int, unit: int) -> str:
    return f"stage{stage}-unit{unit:05d}"


def _document(data: bytes) -> dict | None:
    """A JSON object of this journal's format, or None."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None
