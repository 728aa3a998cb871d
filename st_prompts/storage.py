"""Writing files and folders without losing anything: atomic replacement, ownership checks, locks, the umask.

Saved folders carry a manifest (:data:`MANIFEST_FILE`) of what st_prompts wrote; only such a folder holding nothing
else is ever replaced."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from st_prompts import __version__
from st_prompts.errors import ConfigurationError, DataFormatError

logger = logging.getLogger(__name__)

__all__ = ["INDEX_KIND", "MANIFEST_FILE", "STAGING_MARKER", "apply_umask", "check_destination",
           "check_model_destination", "contained_path", "folder_lock", "managed_ancestor", "manifest_problem",
           "model_ownership", "read_manifest", "replace_folder", "replaceable_kinds", "save_in_progress",
           "save_model_folder", "write_file_atomic", "write_json_atomic", "write_manifest"]

#: A file written first into every staging folder: a leftover folder holding it was written by st_prompts.
STAGING_MARKER = ".st-prompts-staging"
#: The list of files st_prompts wrote into a saved model folder (what ``--overwrite`` may replace).
MANIFEST_FILE = "st_prompts_save.json"
#: Ownership check of :func:`replace_folder`: ``None`` if st_prompts wrote the folder, else why it did not.
OwnershipCheck = Callable[[Path], "str | None"]


def current_umask() -> int:
    """The process's umask (read by setting it and restoring it at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (and everything in a folder) the permissions ``open``/``mkdir`` would give under the umask."""
    mask = current_umask()
    path = Path(path)
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)
        return
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _fsync(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. a folder on a platform that cannot open one
        return
    try:
        with suppress(OSError):  # pragma: no cover
            os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str | os.PathLike, data: bytes | str | Callable[[Any], None]) -> Path:
    """Write ``path`` atomically (its folder is created): into a temporary file beside it, flushed to disk, then
    renamed over it. ``data``: bytes, text, or a function that writes into the binary file handle it is given."""
    path = Path(path)
    if path.is_dir():
        raise ConfigurationError(f"{path} is a folder; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.st-prompts-tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float (also nested) replaced by ``None``: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int = 2, **dump_kwargs: Any) -> Path:
    """Write ``data`` as JSON (with a trailing newline) to ``path`` atomically; NaN and infinities become ``null``."""
    text = json.dumps(json_safe(data), indent=indent, allow_nan=False, **dump_kwargs) + "\n"
    return write_file_atomic(path, text)


# ---------------------------------------------------------------------------------------------- folders
def check_destination(destination: str | os.PathLike) -> Path:
    """Refuse destinations whose replacement would take the user's own files with it: the current folder, one of its
    parents, the root or the home folder, or a symbolic link. Returns the destination as an absolute path."""
    path = Path(os.path.abspath(os.path.expanduser(destination)))
    real = Path(os.path.realpath(path))
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd or real in cwd.parents:
        raise ConfigurationError(f"refusing to write to {destination}: it is the current folder or one of its "
                                 "parents; give a new folder")
    if real == Path(real.anchor) or real == Path(os.path.realpath(os.path.expanduser("~"))):
        raise ConfigurationError(f"refusing to write to {destination}: give a folder of its own")
    if path.is_symlink():
        raise ConfigurationError(f"refusing to replace {destination}: it is a symbolic link; give the real folder")
    owner = managed_ancestor(real)
    if owner is not None:
        folder, kind = owner
        raise ConfigurationError(f"refusing to write to {destination}: it is inside {folder}, {_a(kind)} saved by "
                                 "st-prompts, which must hold only what st-prompts wrote there; choose a folder "
                                 "outside it")
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigurationError(f"cannot write to {destination}: {ancestor} is a file, not a folder")
    return path


def managed_ancestor(path: str | os.PathLike) -> tuple[Path, str] | None:
    """``(folder, kind)`` of the nearest folder above ``path`` (by real path) that st_prompts saved, else ``None``.
    Nothing may be written inside such a folder: it holds only what its manifest lists."""
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        manifest = folder / MANIFEST_FILE
        if os.path.islink(manifest) or not manifest.is_file():
            continue
        try:
            raw = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and raw.get("written_by") == "st-prompts":
            return folder, str(raw.get("kind") or "a folder")
    return None


def _a(kind: str) -> str:
    """``"a prompt bank"``, ``"an index"``: a kind with its article."""
    return kind if kind.startswith(("a ", "an ")) else ("an " if kind[:1].lower() in "aeiou" else "a ") + kind


def _leftovers(destination: Path) -> list[Path]:
    """What interrupted saves of ``destination`` may have left beside it (by their names), sorted."""
    pattern = re.compile(rf"^\.{re.escape(destination.name)}\.st-prompts-(tmp|old)-[A-Za-z0-9_]+$")
    try:
        return sorted(entry for entry in destination.parent.iterdir() if pattern.match(entry.name))
    except OSError:
        return []


def _holds_marker_or_nothing(folder: Path) -> bool:
    try:
        return (folder / STAGING_MARKER).is_file() or not any(folder.iterdir())
    except OSError:
        return False


def remove_leftovers(destination: str | os.PathLike, ownership: OwnershipCheck) -> list[Path]:
    """Delete (and return) what interrupted saves of ``destination`` left beside it: staging folders holding the
    staging marker (or nothing), and set-aside old folders that ``ownership`` recognises."""
    removed = []
    for entry in _leftovers(Path(destination)):
        if entry.is_symlink() or not entry.is_dir():
            continue
        if _holds_marker_or_nothing(entry) or ownership(entry) is None:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            logger.info("removed %s, left by an interrupted save", entry)
    return removed


def interrupted_save_hint(destination: str | os.PathLike) -> str:
    """For a missing folder: a sentence naming a set-aside copy an interrupted save left beside it, or ``""``."""
    destination = Path(destination)
    old = [entry.name for entry in _leftovers(destination) if ".st-prompts-old-" in entry.name]
    if not old:
        return ""
    return (f" An interrupted save left the previous version in {destination.parent / old[-1]}: rename it back to "
            f"{destination.name} to use it.")


#: The lock files this process holds: real path -> [thread lock, file descriptor, depth].
_HELD: dict[str, list[Any]] = {}
_HELD_GUARD = threading.Lock()


def save_in_progress(destination: str | os.PathLike) -> bool:
    """Whether a save of ``destination`` may be under way (its lock file exists beside it)."""
    return _lock_path(destination).exists()


def _lock_path(destination: str | os.PathLike) -> Path:
    """``.NAME.st-prompts.lock`` beside ``destination``, in its real folder (two spellings share one lock)."""
    destination = Path(os.path.abspath(destination))
    return Path(os.path.realpath(destination.parent)) / f".{destination.name}.st-prompts.lock"


@contextmanager
def folder_lock(destination: str | os.PathLike, timeout: float = -1) -> Iterator[None]:
    """Hold the lock of ``destination`` (a lock file beside it): writers of one folder take turns, across processes
    and threads (re-entrant within a thread). ``timeout``: seconds to wait (``-1``: for ever).

    The last holder removes the lock file (``filelock`` would leave it): it unlinks it before it unlocks, and a locker
    checks that its file is still the one at the path (same inode), else retries. Windows: ``filelock``, file kept."""
    destination = Path(os.path.abspath(destination))
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"cannot create the folder {destination.parent}: {exc.strerror or exc}") from exc
    path = _lock_path(destination)
    if fcntl is None:  # pragma: no cover - Windows
        yield from _filelock(destination, path, timeout)
        return
    key = str(path)
    with _HELD_GUARD:
        entry = _HELD.setdefault(key, [threading.RLock(), None, 0])
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    if not entry[0].acquire(timeout=-1 if deadline is None else max(0.0, timeout)):
        raise ConfigurationError(f"{destination} is being written by another process; try again later")
    try:
        if entry[2] == 0:
            entry[1] = _lock_file(destination, path, deadline)
        entry[2] += 1
        try:
            yield
        finally:
            entry[2] -= 1
            if entry[2] == 0:
                fd, entry[1] = entry[1], None
                with suppress(OSError):
                    os.unlink(path)  # still ours: unlinked before it is unlocked (see above)
                os.close(fd)
    finally:
        entry[0].release()


def _lock_file(destination: Path, path: Path, deadline: float | None) -> int:
    """Open and lock the lock file at ``path`` (the protocol of :func:`folder_lock`); returns its descriptor."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:  # O_NOFOLLOW: a symbolic link planted at the lock's path fails here (ELOOP)
            fd = os.open(path, flags, 0o666 & ~current_umask())
        except OSError as exc:
            why = "is a symbolic link (remove it)" if path.is_symlink() else f"cannot be opened: {exc.strerror or exc}"
            raise ConfigurationError(f"the lock file {path} of {destination} {why}") from exc
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ConfigurationError(f"{destination} is being written by another process; try again "
                                                 "later") from None
                    time.sleep(0.05)
            with suppress(FileNotFoundError):
                current, mine = os.stat(path, follow_symlinks=False), os.fstat(fd)
                if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed it after we opened it: lock the file now at the path


def _filelock(destination: Path, path: Path, timeout: float) -> Iterator[None]:  # pragma: no cover - Windows
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=timeout, is_singleton=True, thread_local=False)
    try:
        lock.acquire()
    except Timeout as exc:
        raise ConfigurationError(f"{destination} is being written by another process; try again later") from exc
    try:
        yield
    finally:
        lock.release()


def replace_folder(destination: str | os.PathLike, write: Callable[[Path], None], *, ownership: OwnershipCheck,
                   overwrite: bool = False, what: str = "a folder",
                   overwrite_hint: str = "pass overwrite=True to replace it", lock: bool = True) -> Path:
    """Write a folder with ``write(staging_folder)`` and put it at ``destination`` atomically; return its absolute path.
    An existing non-empty ``destination`` is replaced (set aside, then deleted) only with ``overwrite`` and when
    ``ownership`` returns ``None`` for it, else :class:`ConfigurationError`. ``what`` and ``overwrite_hint`` word the
    messages; ``lock``: hold :func:`folder_lock` (``False`` when the caller holds it)."""
    destination = check_destination(destination)
    with folder_lock(destination) if lock else nullcontext():
        check_replaceable(destination, ownership, overwrite, what, overwrite_hint)
        remove_leftovers(destination, ownership)
        parent = destination.parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.st-prompts-tmp-", dir=parent))
        try:
            (staging / STAGING_MARKER).touch()
            write(staging)
            (staging / STAGING_MARKER).unlink()
            apply_umask(staging)
            for root, _dirs, files in os.walk(staging):
                for name in files:
                    _fsync(os.path.join(root, name))
            _swap(staging, destination, ownership)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return destination


def check_replaceable(destination: Path, ownership: OwnershipCheck, overwrite: bool, what: str, hint: str) -> None:
    """Refuse to write ``what`` over ``destination`` unless it is missing, empty, or (with ``overwrite``) owned."""
    if not os.path.lexists(destination):
        return
    if not destination.is_dir():
        raise ConfigurationError(f"refusing to write {what} to {destination}: it exists and is not a folder")
    if not any(destination.iterdir()):
        return
    reason = ownership(destination)
    if reason is not None:
        raise ConfigurationError(f"refusing to replace {destination}: {reason}; choose another folder")
    if not overwrite:
        raise ConfigurationError(f"{destination} already holds {what}; {hint}")


def _swap(staging: Path, destination: Path, ownership: OwnershipCheck) -> None:
    """Rename ``staging`` to ``destination``; an existing non-empty destination is set aside first (and checked again
    with ``ownership`` there: a file put into it meanwhile stays) and deleted after."""
    with suppress(OSError):
        os.rmdir(destination)  # an empty folder: nothing to keep
    if not os.path.lexists(destination):
        os.replace(staging, destination)
        return
    old = destination.parent / f".{destination.name}.st-prompts-old-{uuid.uuid4().hex[:12]}"
    os.replace(destination, old)
    try:
        reason = ownership(old)
        if reason is not None:
            raise ConfigurationError(f"refusing to replace {destination}: {reason}; choose another folder")
        os.replace(staging, destination)
    except BaseException:
        os.replace(old, destination)
        raise
    try:
        shutil.rmtree(old)
    except OSError as exc:  # the new folder is in place: the old one is a leftover the next save removes
        logger.warning("could not remove the previous version %s (%s); the next save removes it", old, exc)


# ---------------------------------------------------------------------------------------------- manifests
#: The ``kind`` a search index's manifest records (a model's records ``"model"``, ``"prompt bank"``, ...).
INDEX_KIND = "semantic index"


def _outside_reason(name: Any) -> str | None:
    """Why the file name ``name`` (read from a file) is not a relative path inside its folder, by its text alone."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "which is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return "an absolute path"
    if ".." in re.split(r"[\\/]", name):
        return "a path leading out of its folder (..)"
    return None


def contained_path(folder: str | os.PathLike, name: Any, source: str) -> Path:
    """``folder/name`` for a file name read from ``source`` (a file of ``folder``), refused with
    :class:`DataFormatError` unless it is a relative path staying inside ``folder`` (symbolic links included)."""
    reason = _outside_reason(name)
    if reason is None:
        root = os.path.realpath(folder)
        if os.path.commonpath([root, os.path.realpath(os.path.join(root, name))]) != root:
            reason = "a symbolic link leading out of its folder"
    if reason is not None:
        raise DataFormatError(f"{source} names {name!r}, {reason}; refusing to read or write outside {folder}")
    return Path(folder, name)


def _entries_below(folder: Path) -> tuple[list[str], list[str], list[str]]:
    """``(files, folders, others)`` below ``folder`` as relative POSIX paths, symbolic links not followed (others)."""
    files: list[str] = []
    folders: list[str] = []
    others: list[str] = []

    def walk(directory: Path, prefix: str) -> None:
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = prefix + entry.name
                if entry.is_symlink():
                    others.append(name)
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(name)
                    walk(Path(entry.path), name + "/")
                elif entry.is_file(follow_symlinks=False):
                    files.append(name)
                else:
                    others.append(name)

    walk(folder, "")
    return files, folders, others


def write_manifest(folder: str | os.PathLike, kind: str) -> None:
    """Record in ``folder``'s manifest every file and folder now in it: what st_prompts wrote there."""
    folder = Path(folder)
    files, folders, _others = _entries_below(folder)
    manifest = {"written_by": "st-prompts", "version": __version__, "kind": kind,
                "files": [name for name in files if name not in (MANIFEST_FILE, STAGING_MARKER)], "folders": folders}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | str | None:
    """The manifest of ``folder`` (``kind``, ``files``, ``folders``), ``None`` without one, or why it is unusable."""
    path = Path(folder) / MANIFEST_FILE
    if os.path.islink(path) or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files, folders = manifest["files"], manifest.get("folders", [])
        if not isinstance(files, list) or not isinstance(folders, list):
            raise TypeError("not lists")
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST_FILE} cannot be read"
    for name in files + folders:
        if _outside_reason(name) is not None:  # (symbolic links are refused by the folder's scan)
            return f"its {MANIFEST_FILE} lists a path outside the folder ({str(name)!r})"
    return {"kind": manifest.get("kind"), "files": set(files), "folders": set(folders)}


def manifest_problem(folder: str | os.PathLike, *, index: bool = False,
                     kinds: tuple[str, ...] | None = None) -> str | None:
    """``None`` if ``folder`` was saved by st_prompts and holds nothing its manifest does not list (no other file,
    folder or symbolic link); else why not. ``index``: it must (else must not) be a search index; ``kinds``: its
    manifest's kind must be one of these."""
    folder = Path(folder)
    what = "a semantic index" if index else (_a(kinds[0]) if kinds else "a model")
    manifest = read_manifest(folder)
    if manifest is None:
        return f"it is not {what} saved by st-prompts (it has no {MANIFEST_FILE})"
    if isinstance(manifest, str):
        return manifest
    kind = manifest["kind"]
    if (kind == INDEX_KIND) != index or (kinds is not None and kind not in kinds):
        return f"it is {_a(str(kind)) if kind else 'something else'} saved by st-prompts, not {what}"
    listed_files = manifest["files"]
    implied = {parent.as_posix() for name in listed_files for parent in Path(name).parents if parent != Path(".")}
    files, folders, others = _entries_below(folder)
    extra = [name for name in files if name not in listed_files and name not in (MANIFEST_FILE, STAGING_MARKER)]
    extra += [name + "/" for name in folders if name not in implied and name not in manifest["folders"]]
    extra += [f"{name} (a symbolic link)" if os.path.islink(folder / name) else f"{name} (not a regular file)"
              for name in others]
    if extra:
        extra.sort()
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        return f"it holds files or folders st-prompts did not write ({shown})"
    return None


# ---------------------------------------------------------------------------------------------- model folders
_MODEL_HINT = "pass --overwrite (overwrite=True) to replace it"
#: What a save of each kind may replace (besides a folder of its own kind): an exported prompt set and a training
#: run's prompts-only checkpoint are the same format.
_REPLACES = {"prompt set": ("prompt set", "prompts-only checkpoint"),
             "prompts-only checkpoint": ("prompts-only checkpoint", "prompt set")}


def replaceable_kinds(kind: str) -> tuple[str, ...]:
    """The manifest kinds a save of ``kind`` may replace."""
    return _REPLACES.get(kind, (kind,))


def model_ownership(kind: str = "model") -> OwnershipCheck:
    """The ownership check of a model folder about to be replaced by a save of ``kind``."""
    return functools.partial(manifest_problem, kinds=replaceable_kinds(kind))


def check_model_destination(path: str | os.PathLike, overwrite: bool, kind: str = "model") -> None:
    """Refuse, before any work, a destination :func:`save_model_folder` would refuse."""
    check_replaceable(check_destination(path), model_ownership(kind), overwrite, _a(kind) + " saved by st-prompts",
                      _MODEL_HINT)


def save_model_folder(path: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool = False,
                      kind: str = "model", replaces: tuple[str, ...] | None = None, lock: bool = True) -> Path:
    """Write a model folder with ``write(folder)`` and put it at ``path`` atomically, with a manifest recording
    ``kind``. An existing folder is replaced only with ``overwrite``, if st-prompts saved it as a kind this save may
    replace (``replaces``, default :func:`replaceable_kinds`); ``lock``: take the destination's lock."""
    def write_with_manifest(folder: Path) -> None:
        write(folder)
        write_manifest(folder, kind)

    ownership = model_ownership(kind) if replaces is None else functools.partial(manifest_problem, kinds=replaces)
    return replace_folder(path, write_with_manifest, ownership=ownership, overwrite=overwrite,
                          what=_a(kind) + " saved by st-prompts", overwrite_hint=_MODEL_HINT, lock=lock)
