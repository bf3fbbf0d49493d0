"""The journal of a run: its finished units of work, what a resumed run takes instead of running them again.

One folder per run (``StoreTarget.journal``), per unit ``stage{S}-unit{K}.msgpack`` (its results,
``interp_runner.store.codec``), and ``index.json`` listing the finished units with the sha256 of each unit's file.
A unit counts as finished once it is in the index, which is rewritten atomically after the unit's file is in
place. Nothing is ever unpickled: a unit is MessagePack decoded against the results' field types. A unit whose
file fails its sha256 check or cannot be decoded, or a file in the folder that the journal did not write,
refuses the resume (``ConfigError`` at ``resume``); a listed unit whose file was deleted runs again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from interp_runner.config import ConfigError
from interp_runner.engine.results import RequestResult
from interp_runner.store.codec import CodecError, decode, encode

INDEX = "index.json"
FORMAT = "interp-runner-journal/3"
SUFFIX = ".msgpack"
UNIT_FILE = re.compile(r"stage\d+-unit\d+\.msgpack")  # a unit's file


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class Journal:
    def __init__(self, folder: Path):
        self.dir = Path(folder)
        self.units: dict[str, dict] = {}  # unit name -> {"sha256": of its file, "requests": count}

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
        known = {INDEX} | {f"{u}{SUFFIX}" for u in self.units}
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(".tmp"):  # an interrupted write of this journal
                path.unlink()
            elif path.name not in known and not UNIT_FILE.fullmatch(path.name):  # unlisted: written again
                raise self._refused(f"{path} was not written by the journal (pickles and other files are never "
                                    "loaded): remove it to resume")
        for name in sorted(self.units):
            self._read(name)  # verify each one now; results are read again when used
        return sum(1 for name in self.units if (self.dir / f"{name}{SUFFIX}").exists())

    def load(self, stage: int, unit: int) -> dict[str, RequestResult] | None:
        """The unit's results, or None if it has not finished (or its files were removed to run it again)."""
        name = _unit_name(stage, unit)
        return self._read(name) if name in self.units else None

    def record(self, stage: int, unit: int, results: dict[str, RequestResult]) -> None:
        name = _unit_name(stage, unit)
        data = encode(results, FORMAT)
        _write_atomic(self.dir / f"{name}{SUFFIX}", data)
        self.units[name] = {"sha256": _sha256(data), "requests": len(results)}
        self._write_index()

    def _write_index(self) -> None:
        _write_atomic(self.dir / INDEX, json.dumps({"format": FORMAT, "units": self.units}, indent=1).encode())

    def _read(self, name: str) -> dict[str, RequestResult] | None:
        path = self.dir / f"{name}{SUFFIX}"
        if not path.exists():
            return None
        try:
            data = path.read_bytes()
        except OSError as err:
            raise self._refused(f"unit {name}: {err}") from None
        listed = self.units[name]
        if not isinstance(listed, dict) or _sha256(data) != listed.get("sha256"):
            raise self._refused(f"{path} fails its sha256 check (it changed after it was written): delete it to "
                                "run that unit again")
        try:
            return decode(data, FORMAT)
        except CodecError as err:
            raise self._refused(f"unit {name} cannot be read ({err})") from None

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
