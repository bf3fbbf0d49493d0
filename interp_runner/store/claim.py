"""Where a run writes its store, and the rules that keep whatever is already there safe.

For ``store.path`` = ``<parent>/<name>`` (the companions are named after the store's whole name, so two stores in
one folder never share one):

- ``<parent>/<name>``: the store, put there (renamed) only once it is complete;
- ``<parent>/<name>.figures/``: its figures, moved there with it (the store's ``figures`` attribute lists them);
- ``<parent>/<name>.exports/``: files its kind writes for other tools (vectors as .safetensors / .gguf, ...), moved
  there with it (its ``exports`` attribute lists them);
- ``<parent>/<name>.report.html``: its report (``interp_runner.report``), moved there with it;
- ``<parent>/<name>.log``: the libraries' log lines and the runner's (``interp_runner.run_log``), moved there with it;
- ``<parent>/.<name>.partial/``: the run while it goes: ``<name>`` (the store, status ``running`` or ``failed``),
  ``<name>.figures/``, ``<name>.exports/``, ``<name>.report.html``, ``<name>.log`` and ``journal/``
  (``interp_runner.store.journal``); what ``resume=true`` continues (moved with the store path, it resumes there: the run
  key leaves the path out);
- ``<parent>/.<name>.lock``: the lock held for the whole run (``interp_runner.store.lock``).

A run deletes or replaces nothing it did not create, unless ``store.overwrite`` is true: then an existing store
at the path (with its companions) is replaced once the new one is complete, and an unfinished run's folder is
discarded. A companion is replaced only where the store at the path lists its content (``interp_runner.store.companions``):
anything else at a companion's place, and anything at the path that is not a store of this runner, is never touched,
whatever ``store.overwrite`` says. Every check here runs before any engine starts; a refusal is a ``ConfigError``
naming ``store.path`` (or ``resume``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from interp_runner.store.companions import record, why_not_owned
from interp_runner.config import ConfigError
from interp_runner.store.journal import INDEX, Journal
from interp_runner.store.writer import STATUS_COMPLETE, STATUS_FAILED, STATUS_RUNNING, mark, open_store
from interp_runner.store.lock import StoreLock, StoreLocked, describe_holder

SCHEMA_PREFIX = "interp-runner/"  # the manifest's ``schema``: what marks a store of this runner


@dataclass(frozen=True)
class StoreTarget:
    path: Path  # absolute, its folder resolved

    @classmethod
    def at(cls, path: Path) -> StoreTarget:
        path = Path(path).expanduser().absolute()
        return cls(path.parent.resolve() / path.name)

    @property
    def work(self) -> Path:
        return self.path.parent / f".{self.path.name}.partial"

    @property
    def lock_file(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    @property
    def staged(self) -> Path:
        """Where the store is written until it is complete."""
        return self.work / self.path.name

    @property
    def journal(self) -> Path:
        return self.work / "journal"

    @property
    def figures(self) -> Path:
        return self.path.parent / f"{self.path.name}.figures"

    @property
    def exports(self) -> Path:
        return self.path.parent / f"{self.path.name}.exports"

    @property
    def report(self) -> Path:
        return self.path.parent / f"{self.path.name}.report.html"

    @property
    def log(self) -> Path:
        return self.path.parent / f"{self.path.name}.log"

    @property
    def roles(self) -> dict[str, Path]:
        """What goes beside the store and belongs to it, by role (``interp_runner.store.companions``)."""
        return {"figures": self.figures, "exports": self.exports, "report": self.report, "log": self.log}

    @property
    def companions(self) -> tuple[Path, ...]:
        return tuple(self.roles.values())

    def staging(self, final: Path) -> Path:
        """Where ``final`` (the store or a companion) is written until the store is complete."""
        return self.work / final.name


def store_attrs(path: Path) -> dict | None:
    """The root attributes of a store of this runner at ``path`` (read as plain JSON), else None."""
    try:
        meta = json.loads((Path(path) / "zarr.json").read_bytes())
        attrs = meta["attributes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    schema = attrs.get("schema") if isinstance(attrs, dict) else None
    return attrs if isinstance(schema, str) and schema.startswith(SCHEMA_PREFIX) else None


def describe(attrs: dict) -> str:
    experiment = attrs.get("experiment") or {}
    return (f"experiment {experiment.get('name')} v{experiment.get('version')}, run {str(attrs.get('run_key'))[:12]}, "
            f"started_at {attrs.get('started_at')}, status {attrs.get('status')}")


def claim_store(path: Path, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print) -> StoreClaim:
    """Check ``path`` and lock it for this run; raises ConfigError when the run may not write there."""
    target = StoreTarget.at(path)
    created = _make_folder(target)
    lock = StoreLock(target.lock_file)
    try:
        lock.acquire()
    except StoreLocked as held:
        _remove_created(target, created)
        raise ConfigError.at("store.path", f"{target.path} is in use by another run ({describe_holder(held.holder)}): "
                                           "wait for it to end, or choose another store.path") from None
    except OSError as err:
        _remove_created(target, created)
        raise ConfigError.at("store.path", f"cannot create the lock file {target.lock_file} "
                                           f"({err.strerror or err}): a run needs a folder where it can create "
                                           "files; choose another store.path") from None
    if lock.stale is not None:
        log(f"broke the stale lock on {target.path}: its holder ({describe_holder(lock.stale)}) is gone")
    try:
        _check(target, resume, overwrite)
    except BaseException:
        lock.release()
        _remove_created(target, created)
        raise
    return StoreClaim(target, lock, resume, overwrite, log)


class StoreClaim:
    """A checked and locked store path: start (or continue) the run, then ``publish`` or ``fail``; ``release``."""

    def __init__(self, target: StoreTarget, lock: StoreLock, resume: bool, overwrite: bool,
                 log: Callable[[str], None]):
        self.target, self.lock, self.resume, self.overwrite, self.log = target, lock, resume, overwrite, log
        self.journal: Journal | None = None
        self.created_work = self.publishing = False

    @property
    def staged(self) -> Path:
        return self.target.staged

    def begin(self, manifest: dict) -> Journal:
        """The store and journal of this run: new ones, or those of the unfinished run it resumes. On a refusal
        (ConfigError) or any other failure here, the claim is undone and released."""
        try:
            return self._begin(manifest)
        except BaseException:
            if self.created_work:
                shutil.rmtree(self.target.work, ignore_errors=True)
            self.release()
            raise

    def _begin(self, manifest: dict) -> Journal:
        t = self.target
        journal = Journal(t.journal)
        if self.resume:
            check_resumable(t.staged, manifest)
            finished = journal.open(resume=True)
            mark(t.staged, STATUS_RUNNING, resumed_at=manifest["started_at"])
            self.log(f"resuming {t.path}: {finished} unit(s) already done")
        else:
            if t.work.exists():  # an unfinished run's; _check allowed this only with store.overwrite
                shutil.rmtree(t.work)
                self.log(f"store.overwrite: discarded the unfinished run at {t.work}")
            t.work.mkdir()
            self.created_work = True
            open_store(t.staged, manifest)
            journal.open(resume=False)
        self.journal = journal
        return journal

    def publish(self) -> Path:
        """Move the complete store and its companions into place (old ones aside first, with store.overwrite)."""
        t = self.target
        self.publishing = True
        record(t.staged, {role: t.staging(p) for role, p in t.roles.items() if os.path.lexists(t.staging(p))})
        attrs = store_attrs(t.path)
        if os.path.lexists(t.path) and attrs is None and not _empty_folder(t.path):
            raise ConfigError.at("store.path", f"something that is not a store appeared at {t.path} while the run "
                                               f"went: the complete store stays at {t.staged}")
        problems = _not_owned(t, attrs)
        if problems:
            raise ConfigError.at("store.path", f"{problems} (found as the run ended): the complete store stays at "
                                               f"{t.staged}")
        for p in t.companions:  # an empty folder holds nothing: the new companion takes its place
            if _empty_folder(p):
                p.rmdir()
        old = [p for p in (t.path, *t.companions) if os.path.lexists(p) and not _empty_folder(p)]
        if old and not self.overwrite:
            raise ConfigError.at("store.path", f"{', '.join(map(str, old))} appeared while the run went: the "
                                               f"complete store stays at {t.staged}")
        replaced = t.work / "replaced"
        replaced.mkdir()
        try:
            for p in old:
                p.rename(replaced / p.name)
            for final in (*t.companions, t.path):  # the store last: once it is in place, the run is done
                if t.staging(final).exists():
                    t.staging(final).rename(final)  # onto an empty folder, if one is there
        except OSError:
            for p in old:  # put back what was there
                if not os.path.lexists(p) and os.path.lexists(replaced / p.name):
                    (replaced / p.name).rename(p)
            raise
        shutil.rmtree(t.work)
        if old:
            self.log(f"store.overwrite: replaced {', '.join(map(str, old))}")
        return t.path

    def fail(self, err: BaseException, **attrs) -> None:
        """Mark the store failed and keep the unfinished run for ``resume=true``; a run that created it and finished
        no unit leaves nothing behind (there is nothing to continue)."""
        t = self.target
        if t.staged.exists():
            error = "".join(traceback.format_exception_only(type(err), err)).strip()
            mark(t.staged, STATUS_FAILED, error=error, **attrs)
        nothing_done = self.journal is None or not self.journal.units
        if self.created_work and nothing_done and not self.publishing:
            shutil.rmtree(t.work, ignore_errors=True)
        elif t.work.exists():
            self.log(f"the unfinished run is kept at {t.work}: the same command with resume=true continues it")

    def release(self) -> None:
        self.lock.release()


def check_resumable(staged: Path, manifest: dict) -> None:
    """Only an unfinished store written by the same run (config, model, requests) is resumed."""
    attrs = store_attrs(staged)
    if attrs is None:
        raise ConfigError.at("resume", f"{staged} is not a store of this runner: nothing to resume")
    for key in ("run_key", "requests_sha256"):
        if attrs.get(key) != manifest[key]:
            raise ConfigError.at("resume", f"{staged} was written by a different run ({key} "
                                           f"{attrs.get(key)} != {manifest[key]}): it is never resumed into")
    if (attrs.get("model") or {}).get("weights_sha256") != manifest["model"]["weights_sha256"]:
        raise ConfigError.at("resume", f"{staged} was written with other model weights")
    if attrs.get("status") == STATUS_COMPLETE:
        raise ConfigError.at("resume", f"{staged} is already complete")


def _check(t: StoreTarget, resume: bool, overwrite: bool) -> None:
    """The rules of the module docstring, for what is at the path now."""
    attrs = store_attrs(t.path)
    foreign = os.path.lexists(t.path) and attrs is None and not _empty_folder(t.path)
    if resume:
        if t.staged.is_dir():
            pass
        elif attrs is not None:
            raise ConfigError.at("resume", f"{t.path} is a store ({describe(attrs)}) with no unfinished run beside it "
                                           f"({t.work}): nothing to resume")
        elif os.path.lexists(t.path):
            raise ConfigError.at("resume", f"{t.path} (store.path) is not a store of this runner: nothing to resume")
        else:
            raise ConfigError.at("resume", f"no store to resume at {t.path} (set store.path to it)")
    elif t.work.exists() and not overwrite:
        work = store_attrs(t.staged)
        raise ConfigError.at("store.path", f"an unfinished run is at {t.work}"
                                           + (f" ({describe(work)})" if work else "") +
                             ": continue it with resume=true, or set store.overwrite=true to discard it")
    if foreign:
        raise ConfigError.at("store.path", f"{t.path} holds something that is not a store of this runner: it is "
                                           "never deleted or written into (not even with store.overwrite); "
                                           "choose another store.path")
    problems = _not_owned(t, attrs)
    if problems:
        raise ConfigError.at("store.path", problems)
    if attrs is not None and not overwrite:
        raise ConfigError.at("store.path", f"{t.path} already holds a store ({describe(attrs)}): set "
                                           "store.overwrite=true to replace it once the new run is complete, or "
                                           "choose another store.path")


def _not_owned(t: StoreTarget, attrs: dict | None) -> str | None:
    """Why what is at the companions' places may not be replaced (None if it may): each one the store at the path
    (``attrs``) does not list as its own."""
    problems = [f"{path} is not the store's own: {why}" for role, path in t.roles.items()
                if os.path.lexists(path) and not _empty_folder(path)
                and (why := why_not_owned(role, path, t.path, attrs)) is not None]
    if not problems:
        return None
    return ("; ".join(problems) + ". A run replaces or deletes only the files the store at store.path lists as "
            "its own, whatever store.overwrite says: move them away, or choose another store.path")


def _empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _unfinished_run(folder: Path) -> bool:
    """Whether ``folder`` is the folder of an unfinished run (``StoreTarget.work``)."""
    name = re.fullmatch(r"\.(.+)\.partial", folder.name)
    return name is not None and (store_attrs(folder / name[1]) is not None or (folder / "journal" / INDEX).is_file())


def _make_folder(t: StoreTarget) -> Path | None:
    """Create the store's folder; the topmost folder this created (None if it existed)."""
    parent = t.path.parent
    existing = next(a for a in (parent, *parent.parents) if a.exists())
    if not existing.is_dir():
        raise ConfigError.at("store.path", f"{existing} is a file, not a folder: {t.path} cannot go under it")
    for ancestor in (existing, *existing.parents):
        if store_attrs(ancestor) is not None:
            raise ConfigError.at("store.path", f"{t.path} would be inside the store {ancestor}")
        if _unfinished_run(ancestor):
            raise ConfigError.at("store.path", f"{t.path} would be inside the unfinished run {ancestor} (of the "
                                               f"store {ancestor.parent / ancestor.name[1:-len('.partial')]}): "
                                               "choose a store.path outside it")
    if existing == parent:
        return None
    created = [a for a in (parent, *parent.parents) if not a.exists()][-1]
    try:
        parent.mkdir(parents=True)
    except OSError as err:
        raise ConfigError.at("store.path", f"cannot create {parent} ({err})") from None
    return created


def _remove_created(t: StoreTarget, created: Path | None) -> None:
    """Undo ``_make_folder`` after a refusal: the folders it created, while they are empty."""
    if created is None:
        return
    for folder in (t.path.parent, *t.path.parent.parents):
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return
