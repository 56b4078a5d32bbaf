"""The ``latest`` file of a save directory: what it may name, how it moves, and how a publish that a crash
interrupted is finished.

[Note: latest names a tag inside the save directory]
``latest`` holds one tag: the name of a checkpoint directory directly inside the save directory. What it holds is
read as data, never followed as a path: an absolute path, a value with a separator (``a/b``, ``../x``), ``.`` or
``..``, a name starting with ``.`` (``.tmp-<tag>``, the directory of a save in progress, and ``.trash-<tag>``), a
tag whose directory is a symbolic link leading out of the save directory, and a ``latest`` that is itself a link
out of it or no regular file (a FIFO would block the reader) are refused by :func:`read_latest` with a
:class:`LatestError` naming the file and the value. Every reader of ``latest`` goes through it: ``open_checkpoint``,
the DeepSpeed reader (whose ``latest`` has the same form), the DeepSpeed shim, the writer's messages.

[Note: the publish journal]
A save is committed when ``latest.tmp``, naming its tag, is durable; it is published when ``latest`` names it.
Rank 0 publishes in this order (``writer._publish``):

1. ``.tmp-<tag>/manifest.json`` written and fsynced, ``.tmp-<tag>`` fsynced: the checkpoint is complete;
2. ``latest.tmp`` (tag and newline) written and fsynced, ``save_dir`` fsynced: the journal; from here the next load
   or save finishes the publish (:func:`recover`);
3. :func:`finish_publish`: an existing ``<tag>`` moved to ``.trash-<tag>``, ``.tmp-<tag>`` renamed to ``<tag>``,
   ``save_dir`` fsynced, ``latest.tmp`` renamed over ``latest``, ``save_dir`` fsynced, ``.trash-<tag>`` removed.

[Note: publish what exists]
``latest`` moves only onto a checkpoint that is there: before the journal, ``.tmp-<tag>`` must hold its manifest and
every file the manifest lists (``writer._publish``); before ``latest.tmp`` is renamed over ``latest``, ``<tag>``
must hold its manifest (:func:`finish_publish`). Otherwise (the directory was deleted, or another job's clean-up
removed it) the journal is dropped and the save fails with a :class:`PublishError`: a save that returned has a
checkpoint, and ``latest`` never names a tag without one.

Renaming the directory before any journal left, after a crash, a complete ``<tag>`` that nothing said was newer
than ``latest``: the restart resumed the older one and could not save the tag again (under ``--max-restarts``, every
restart died). :func:`recover` (rank 0; every save's prepare and ``engine.load_checkpoint`` call it first) rolls
forward: a valid journal whose tag is complete (in ``.tmp-<tag>`` or ``<tag>``) is renamed into place and ``latest``
moved; a torn journal (no final newline) or one naming nothing complete is removed. A ``.trash-<tag>`` without
``<tag>`` is moved back. Each step is a rename, so a crash inside :func:`recover` is finished next time. Scanning for
the newest complete tag (as torchtitan's ``step-N``) fails: tags are user names with no order, and a ``latest`` the
user pointed back on purpose would move forward again.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from shardtrain.checkpoint.durable import crash_point, fsync_path, naming
from shardtrain.checkpoint.format import LATEST_NAME, MANIFEST_NAME, Manifest
from shardtrain.errors import CheckpointError, PublishError

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
JOURNAL_NAME = LATEST_NAME + ".tmp"
MAX_LATEST_BYTES = 4096  # a tag is a short name; anything longer is not a `latest` file


class LatestError(CheckpointError):
    """``latest`` names something that is not a checkpoint tag inside its save directory."""


def _inside(path: Path, directory: Path) -> bool:
    try:
        return path.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a symbolic link loop
        return False


def confine_tag(save_dir: Path, value: str, source: Path) -> str:
    """``value`` if it is a tag of a directory inside ``save_dir``; raises :class:`LatestError` naming ``source``
    otherwise ([Note: latest names a tag inside the save directory]). Whether the tag exists is not checked."""

    def refuse(why: str) -> LatestError:
        return LatestError(
            f"{source} names {value!r}, {why}; {LATEST_NAME!r} must hold the tag of a checkpoint directly inside "
            f"{save_dir} (pass tag=... to open another one)"
        )

    if not value:
        raise refuse("which is empty")
    if os.path.isabs(value) or value.startswith("\\"):
        raise refuse("an absolute path")
    if any(part == ".." for part in value.replace("\\", "/").split("/")):
        raise refuse("a path leading out of the save directory")
    if "/" in value or "\\" in value or "\0" in value:
        raise refuse("a path, not a tag")
    if value.startswith(TMP_PREFIX):
        raise refuse("the temporary directory of a save that never finished")
    if value.startswith(".") or any(c in value for c in "\n\r"):
        raise refuse("not a checkpoint tag (tags do not start with '.')")
    if not _inside(save_dir / value, save_dir):
        raise refuse(f"a symbolic link to {(save_dir / value).resolve()}, outside the save directory")
    return value


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag ``save_dir/latest`` names, or None when there is no ``latest``. A ``latest`` that is damaged (not UTF-8
    text), not a regular file, a link out of ``save_dir`` or that names no tag inside it raises a
    :class:`LatestError` naming it."""
    save_dir = Path(save_dir)
    latest = save_dir / LATEST_NAME
    try:
        st = os.lstat(latest)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise LatestError(f"{latest}: cannot be read ({type(err).__name__}: {err})") from None
    if stat.S_ISLNK(st.st_mode):
        if not _inside(latest, save_dir):
            raise LatestError(
                f"{latest} is a symbolic link to {latest.resolve()}, outside {save_dir}; {LATEST_NAME!r} must be a "
                "file of the save directory"
            )
        try:
            st = os.stat(latest)
        except OSError as err:
            raise LatestError(f"{latest}: a symbolic link that leads nowhere ({err})") from None
    if not stat.S_ISREG(st.st_mode):
        raise LatestError(f"{latest} is not a regular file; {LATEST_NAME!r} must be a one-line text file")
    if st.st_size > MAX_LATEST_BYTES:
        raise LatestError(f"{latest} holds {st.st_size} bytes, not one tag; the file is damaged")
    try:
        data = latest.read_bytes()[:MAX_LATEST_BYTES]
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LatestError(f"{latest}: not UTF-8 text ({err.reason} at byte {err.start}); the file is damaged") from None
    except OSError as err:
        raise LatestError(f"{latest}: cannot be read ({type(err).__name__}: {err})") from None
    return confine_tag(save_dir, text.strip(), latest)


def complete_checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` is not a complete checkpoint (None: it is). Complete: a directory (not a link) whose manifest
    parses and whose files all exist with the sizes the manifest records (one ``stat`` each; the checksums are
    verified by the reads of a load)."""
    if ckpt.is_symlink() or not ckpt.is_dir():
        return f"{ckpt} is not a directory"
    path = ckpt / MANIFEST_NAME
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return f"{path} is not a regular file"
        manifest = Manifest.from_json(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError:
        return f"{ckpt} has no {MANIFEST_NAME}"
    except (OSError, UnicodeDecodeError, CheckpointError, RecursionError) as err:
        return f"{path}: {err}"
    for name, entry in manifest.files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            return f"{path}: file name {name!r} is not a file of the checkpoint"
        try:
            size = os.lstat(ckpt / name).st_size
        except OSError:
            return f"{ckpt / name} is missing"
        if size != entry.size:
            return f"{ckpt / name} has {size} bytes, the manifest records {entry.size}"
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_journal(save_dir: Path, tag: str) -> None:
    """Step 2 of [Note: the publish journal]: ``latest.tmp`` naming ``tag``, durable. A failed write leaves none."""
    journal = save_dir / JOURNAL_NAME
    try:
        with naming(journal), open(journal, "wb") as f:
            f.write(tag.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        journal.unlink(missing_ok=True)
        raise
    crash_point("latest_torn", journal)
    crash_point("latest_tmp_written")
    fsync_path(save_dir)


def finish_publish(save_dir: Path, tag: str) -> None:
    """Step 3 of [Note: the publish journal], for the tag the journal names; idempotent: from any state a crash
    inside it leaves, running it again ends in the same one (``<tag>`` the new checkpoint, ``latest`` naming it)."""
    tmp, final, trash = save_dir / (TMP_PREFIX + tag), save_dir / tag, save_dir / (TRASH_PREFIX + tag)
    if (tmp / MANIFEST_NAME).is_file():  # not renamed yet: the journal says this copy is complete
        if os.path.lexists(final):  # a replacement: the old copy goes aside only now that the new one is durable
            if os.path.lexists(trash):
                _remove(trash)
            os.replace(final, trash)
        os.replace(tmp, final)
        fsync_path(save_dir)
    crash_point("renamed")
    if not (final / MANIFEST_NAME).is_file():  # [Note: publish what exists]
        (save_dir / JOURNAL_NAME).unlink(missing_ok=True)
        fsync_path(save_dir)
        raise PublishError(
            f"checkpoint {final} vanished before it was published (neither it nor {tmp} holds {MANIFEST_NAME}: "
            f"deleted, or removed by another job saving into {save_dir}); {LATEST_NAME!r} was not moved"
        )
    os.replace(save_dir / JOURNAL_NAME, save_dir / LATEST_NAME)
    crash_point("latest_renamed")
    fsync_path(save_dir)
    if os.path.lexists(trash):
        _remove(trash)


def _read_journal(journal: Path, save_dir: Path) -> str | None:
    """The tag a complete journal names; None for a torn or damaged one."""
    try:
        if not stat.S_ISREG(os.lstat(journal).st_mode) or os.lstat(journal).st_size > MAX_LATEST_BYTES:
            return None
        text = journal.read_bytes().decode("utf-8")
        if not text.endswith("\n"):  # torn: the newline is written last
            return None
        return confine_tag(save_dir, text[:-1], journal)
    except (OSError, UnicodeDecodeError, LatestError):
        return None


def recover(save_dir: str | os.PathLike) -> list[str]:
    """Finish what a crash interrupted in ``save_dir`` ([Note: the publish journal]); returns one line per thing done
    (empty: nothing was needed, and nothing was written). One process at a time (rank 0), while no save runs."""
    save_dir = Path(save_dir)
    done: list[str] = []
    journal = save_dir / JOURNAL_NAME
    if os.path.lexists(journal):
        tag = _read_journal(journal, save_dir)
        where = None
        if tag is not None:
            tmp, final = save_dir / (TMP_PREFIX + tag), save_dir / tag
            where = tmp if (tmp / MANIFEST_NAME).is_file() else final
        problem = complete_checkpoint_problem(where) if where is not None else None
        if tag is not None and problem is None:
            finish_publish(save_dir, tag)
            done.append(
                f"finished the save of {save_dir / tag} that a crash interrupted after it was committed: "
                f"{LATEST_NAME!r} names it now"
            )
        else:
            journal.unlink()
            why = "torn" if tag is None else f"names {tag!r}, which is not complete ({problem})"
            done.append(f"removed {journal} ({why}): that save was never committed")
    for trash in sorted(save_dir.glob(TRASH_PREFIX + "*")):
        final = save_dir / trash.name[len(TRASH_PREFIX) :]
        if not os.path.lexists(final) and complete_checkpoint_problem(trash) is None:
            os.replace(trash, final)  # an overwrite by an older version, interrupted between its two renames
            fsync_path(save_dir)
            done.append(f"moved {trash} back to {final}: an interrupted overwrite had moved it aside")
    return done
