"""A cache of tokenized (classification) and packed (causal LM) splits: built once per node, memory-mapped by all.

An entry is a folder ``<root>/<key>`` holding each split as ``datasets.Dataset.save_to_disk`` writes it (Arrow files,
``state.json``, ``dataset_info.json``) and ``manifest.json``, written last: the entry is complete exactly when it has
one. A rank opens a split with ``datasets.load_from_disk``, which memory-maps the Arrow files: its resident memory
does not grow with the corpus, and the pages are shared between the ranks of a node through the page cache.

The key is a SHA-256 over everything the result depends on (:func:`cache_key`): hftrain's data format
(:data:`FORMAT`), the data files' bytes (:func:`file_digest`, streamed; an embedded dataset: its name and package
version), the tokenizer (:func:`tokenizer_digest`: its vocabulary, merges, normalizer, templates and special tokens)
and every rule that changes the splits (columns, block length and long-document rule, split percentage and seed,
sample limits, label settings; the caller lists them). A change of any of them is another key, so another entry.

Writes follow ``hftrain.files``: an entry is built in a fresh staging folder beside it (``.<key>.staging``) and renamed
into place, under a :class:`~hftrain.files.FolderLock` beside the entry (``.<key>.hftrain.lock``), so two commands
(or two nodes sharing a file system) never build one entry at once: the second waits and opens what the first built.
A build killed midway leaves a staging folder (removed by the next build) and never an entry; an entry folder without
its manifest is rebuilt. An entry is data, not code: only JSON and Arrow are read from it (no pickles), through no
link; one whose manifest is there but whose files are missing or cut short is refused in one line naming the entry and
the fix.

:func:`prepared_per_node` is the collective: the first process of each node (local rank 0) computes the key and opens
or builds the entry; every rank then learns its node's key over the host group (``hftrain.parallel.host``) and opens
the entry itself. A failure on a builder reaches every rank as the same one line. Written by hand because ``datasets``'
own cache is keyed by fingerprints of Python functions and file modification times (not content), and is neither
locked across processes nor shared by node.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import DataError, HFTrainError, ProcessError
from hftrain.files import (
    FolderLock,
    UnsafePathError,
    check_own,
    fresh_folder,
    read_regular,
    remove,
    remove_quietly,
    write_json,
)

if TYPE_CHECKING:
    import datasets

FORMAT = 1
"""hftrain's data format: raised whenever the way splits are read, tokenized or packed changes, so old entries are
never opened for the new rules."""

MANIFEST = "manifest.json"
"""The entry's completeness marker and record, written last."""

CACHE_ENV = "HFTRAIN_CACHE"
"""The environment variable naming the cache folder when ``data.cache_dir`` is not set."""

_CHUNK = 1 << 20
_FIX = "set data.overwrite_cache: true to rebuild it, or delete that folder"

Build = Callable[[Path, Callable[[str], None]], tuple["datasets.DatasetDict", dict[str, Any]]]
"""``build(work_dir, log)``: the splits and the facts to keep with them (JSON values); ``work_dir`` is scratch space
inside the staging folder for ``datasets``' own files, removed after the build."""


def cache_root(configured: str | None) -> Path:
    """The cache folder: ``data.cache_dir``, else ``$HFTRAIN_CACHE``, else ``~/.cache/hftrain/data``.

    Args:
        configured: ``data.cache_dir``.
    """
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "hftrain" / "data"


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB chunks (not its size or modification time: a file rewritten in place
    with the same size and time is another file).

    Args:
        path: a data file.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


SPECIAL_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

_PER_CALL = ("truncation", "padding")


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of what a tokenizer turns text into: a fast tokenizer's whole pipeline (``backend_tokenizer.to_str()``:
    vocabulary, merges, normalizer, pre-tokenizer, template, added tokens), or a slow one's saved files; with its
    special tokens and their ids (a pad token set in code is in neither) and its truncation side.

    Args:
        tokenizer: a ``transformers`` tokenizer.
    """
    import tempfile

    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # truncation and padding are per-call states that transformers sets on the backend (a classifier's
        # tokenization leaves its max_length there), not what the tokenizer is
        pipeline = {key: value for key, value in json.loads(backend.to_str()).items() if key not in _PER_CALL}
        digest.update(json.dumps(pipeline, sort_keys=True).encode())
    else:
        with tempfile.TemporaryDirectory() as folder:
            tokenizer.save_pretrained(folder)
            for file in sorted(Path(folder).rglob("*")):
                if file.is_file():
                    digest.update(file.name.encode())
                    digest.update(file.read_bytes())
    specials = {name: [getattr(tokenizer, f"{name}_token", None), getattr(tokenizer, f"{name}_token_id", None)]
                for name in SPECIAL_TOKENS}  # fmt: skip
    extra = {
        "specials": specials,
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "vocabulary": len(tokenizer),
    }
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(inputs: dict[str, Any]) -> str:
    """The entry's name: SHA-256 of :data:`FORMAT` and ``inputs`` as canonical JSON.

    Args:
        inputs: the data sources' digests, the tokenizer's digest and the rules (JSON values).
    """
    text = json.dumps({"format": FORMAT, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Entry:
    """An opened cache entry: the splits (memory-mapped) and what the build recorded."""

    splits: datasets.DatasetDict
    facts: dict[str, Any]
    log: list[str]
    path: Path
    built: bool
    """Whether this process built it (False: it was there)."""


class _Busy(UnsafePathError):
    """The entry's lock is held by another command (its holder recorded)."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


class _EntryLock(FolderLock):
    """A :class:`FolderLock` whose refusal says it is held (:class:`_Busy`), so that the taker waits instead."""

    def _held_by(self, holder: dict[str, Any]) -> UnsafePathError:
        return _Busy(str(super()._held_by(holder)), holder)


class DataCache:
    """The entries under one cache folder.

    Args:
        root: the cache folder (:func:`cache_root`).
        overwrite: rebuild an entry even when it is complete (``data.overwrite_cache``).
        wait_s: how long to wait for another command building the same entry.
    """

    def __init__(self, root: Path, *, overwrite: bool = False, wait_s: float = 3600.0) -> None:
        self.root = Path(root)
        self.overwrite = overwrite
        self.wait_s = wait_s

    def entry(self, key: str) -> Path:
        """The folder of entry ``key``."""
        return self.root / key

    def open(self, key: str) -> Entry | None:
        """The complete entry ``key``, memory-mapped; None when there is none (or only a half-built one).

        Args:
            key: the entry's key.
        """
        import datasets

        folder = self.entry(key)
        try:
            if not check_own(folder, "data cache entry", folder=True) or not os.path.lexists(folder / MANIFEST):
                return None
            manifest = json.loads(read_regular(folder / MANIFEST, "the data cache manifest"))
        except (OSError, ValueError, UnsafePathError) as error:
            raise self._damaged(folder, f"its {MANIFEST} cannot be read: {error}") from None
        if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("format") != FORMAT:
            raise self._damaged(folder, f"its {MANIFEST} is not this entry's")
        splits = {}
        for name, record in manifest["splits"].items():
            for relative, size in record["files"].items():
                file = folder / name / relative
                try:
                    status = os.lstat(file)
                except OSError:
                    raise self._damaged(folder, f"{name}/{relative} is missing") from None
                if not os.path.isfile(file) or os.path.islink(file) or status.st_size != size:
                    raise self._damaged(folder, f"{name}/{relative} has {status.st_size} bytes, not {size}")
            try:
                split = datasets.load_from_disk(str(folder / name))
            except Exception as error:  # noqa: BLE001 - any reader failure is the same damage to report
                raise self._damaged(folder, f"split {name} cannot be read ({type(error).__name__}: {error})") from None
            if split.num_rows != record["rows"]:
                raise self._damaged(folder, f"split {name} has {split.num_rows} rows, not {record['rows']}")
            splits[name] = split
        return Entry(datasets.DatasetDict(splits), manifest["facts"], manifest["log"], folder, built=False)

    def open_or_build(self, key: str, inputs: dict[str, Any], build: Build, log: Callable[[str], None]) -> Entry:
        """The entry ``key``: opened when complete (and not ``overwrite``), else built under the entry's lock.

        Args:
            key: :func:`cache_key` of ``inputs``.
            inputs: what the key hashes, kept in the manifest.
            build: makes the splits (:data:`Build`).
            log: receives the build's lines (and the wait for another builder).
        """
        if not self.overwrite and (opened := self.open(key)) is not None:
            return opened
        entry = self.entry(key)
        lock = _EntryLock.for_folder(entry, "data.cache_dir", command="hftrain data cache")
        self._acquire(lock, entry, log)
        try:
            if not self.overwrite and (opened := self.open(key)) is not None:
                return opened  # another command built it while this one waited
            self._build(key, inputs, build, log)
        finally:
            lock.release()
        opened = self.open(key)
        if opened is None:  # renamed into place just now, under the lock
            raise self._damaged(entry, f"its {MANIFEST} vanished right after the build")
        opened.built = True
        return opened

    def _acquire(self, lock: _EntryLock, entry: Path, log: Callable[[str], None]) -> None:
        deadline = time.monotonic() + self.wait_s
        told = False
        while True:
            try:
                lock.acquire()
                return
            except _Busy as busy:
                if time.monotonic() > deadline:
                    raise
                if not told:
                    who = ", ".join(f"{k} {v}" for k, v in busy.holder.items() if k in ("host", "pid")) or "?"
                    log(f"waiting for another hftrain command ({who}) that is building the data cache entry {entry}")
                    told = True
                time.sleep(0.5)

    def _build(self, key: str, inputs: dict[str, Any], build: Build, log: Callable[[str], None]) -> None:
        entry = self.entry(key)
        staging = self.root / f".{key}.staging"
        lines: list[str] = []

        def record(line: str) -> None:
            lines.append(line)
            log(line)

        fresh_folder(staging, "the data cache staging folder")  # a killed build's leftover goes first
        try:
            work = staging / "work"
            work.mkdir()
            splits, facts = build(work, record)
            manifest: dict[str, Any] = {"format": FORMAT, "key": key, "inputs": inputs, "facts": facts, "log": lines}
            manifest["splits"] = {}
            for name, split in splits.items():
                split.save_to_disk(str(staging / name))
                files = {
                    str(file.relative_to(staging / name)): file.stat().st_size
                    for file in sorted((staging / name).rglob("*"))
                    if file.is_file()
                }
                manifest["splits"][name] = {"rows": split.num_rows, "files": files}
            del splits  # the build's datasets map files under work/
            remove(work, "the data cache scratch folder")
            manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_json(staging / MANIFEST, manifest)  # last: the entry is complete from here on
            remove(entry, "data cache entry")  # an overwritten or half-built entry (no manifest)
            os.rename(staging, entry)
        except BaseException:
            remove_quietly(staging)
            raise

    @staticmethod
    def _damaged(folder: Path, what: str) -> DataError:
        return DataError(f"data.cache_dir: the cached data '{folder}' is damaged ({what}); {_FIX}")


def prepared_per_node(
    cache: DataCache,
    *,
    inputs: Callable[[], dict[str, Any]],
    build: Build,
    log: Callable[[str], None],
    local_rank: int,
) -> Entry:
    """The entry for ``inputs``, built by the first process of each node, opened memory-mapped by every rank
    (collective over all ranks when a process group is up; else this process alone).

    1. Local rank 0 computes the key (``inputs()``: the files are hashed once per node) and opens or builds the entry
       (:meth:`DataCache.open_or_build`); the other ranks do nothing meanwhile.
    2. All-gather over the host group of one 33-byte row per rank: a status (0 done, 1 failed, 2 not a builder)
       and the 32-byte key. A failure anywhere: the first failed rank broadcasts its error's class and line, and every
       rank raises that same one line (a bug on the builder: the others raise a ``ProcessError`` pointing to it).
    3. Every other rank opens its node's entry (its key from the row of rank ``rank - local_rank``: ranks are
       numbered node by node, as the launchers number them); a rank that cannot (its node's folder not shared by it)
       fails, and all ranks learn it (``any_rank``).

    While a builder works (in a thread), every rank agrees every :data:`POLL_SECONDS` whether one still is
    (:func:`_while_building`), so a build is not bounded by a collective's timeout.

    Args:
        cache: the cache folder.
        inputs: the key's inputs (called on builders only).
        build: makes the splits (:data:`Build`).
        log: receives the build's lines, or the cached build's lines again.
        local_rank: this process's index on its node (``LOCAL_RANK``).
    """
    import torch
    import torch.distributed as dist

    from hftrain.parallel.host import any_rank, broadcast_object, gather_bytes

    several = dist.is_initialized() and dist.get_world_size() > 1
    builder = local_rank == 0 or not several
    outcome: dict[str, Any] = {"entry": None, "failure": None, "digest": bytes(32)}

    def prepare() -> None:
        try:
            key_inputs = inputs()
            key = cache_key(key_inputs)
            outcome["digest"] = bytes.fromhex(key)
            outcome["entry"] = cache.open_or_build(key, key_inputs, build, log)
        except BaseException as error:  # noqa: BLE001 - handed to every rank below
            outcome["failure"] = error

    if not several:
        prepare()
        if outcome["failure"] is not None:
            raise outcome["failure"]
        return _logged(outcome["entry"], log)
    _while_building(prepare if builder else None)
    entry, failure, digest = outcome["entry"], outcome["failure"], outcome["digest"]
    status = 2 if not builder else (1 if failure is not None else 0)
    rows = gather_bytes(torch.tensor([status, *digest], dtype=torch.uint8))
    failed = [rank for rank, row in enumerate(rows) if int(row[0]) == 1]
    if failed:
        source = failed[0]
        mine = failure if dist.get_rank() == source else None
        said = broadcast_object(_describe(mine) if mine is not None else None, group_src=source)
        if failure is not None:
            raise failure
        raise _rebuilt(said, source)
    if entry is None:
        node_first = dist.get_rank() - local_rank
        key = bytes(rows[node_first][1:].tolist()).hex()
        problem: HFTrainError | None = None
        try:
            entry = cache.open(key)
            if entry is None:
                problem = DataError(
                    f"data.cache_dir: this process does not see the data cache entry '{cache.entry(key)}' that its "
                    "machine's first process wrote; give every process of a machine the same data.cache_dir"
                )
        except HFTrainError as error:
            problem = error
        if any_rank(problem is not None):
            raise problem or ProcessError("another process could not open the cached data; see its error")
    elif any_rank(False):
        raise ProcessError("another process could not open the cached data; see its error")
    assert entry is not None
    return _logged(entry, log)


POLL_SECONDS = 2.0
"""How often, at most, the ranks agree whether the builders are done (:func:`_while_building`: from 10 ms, doubling)."""


def _while_building(work: Callable[[], None] | None) -> None:
    """Run ``work`` (a builder's; None on the other ranks) in a thread while every rank asks, every
    :data:`POLL_SECONDS`, whether any builder is still at it (one host all-reduce of a flag); return on every rank when
    none is.

    Waiting in one collective instead would bound a build by the group's timeout (gloo's 30 minutes on a CPU default
    group): tokenizing gigabytes takes longer. Each poll here completes at once, so a build may take as long as it
    takes, and a rank that died (its process gone) still ends the others' wait with the group's error.

    Args:
        work: what this rank does while the others wait; it must not raise (it records its failure itself).
    """
    import threading
    import time

    from hftrain.parallel.host import any_rank

    thread = None
    if work is not None:
        thread = threading.Thread(target=work, name="hftrain-data-build", daemon=True)
        thread.start()
    wait = 0.01  # opening an entry that is there takes milliseconds: the first polls come soon, then every 2 s
    while any_rank(thread is not None and thread.is_alive()):
        if thread is not None:
            thread.join(wait)
        else:
            time.sleep(wait)
        wait = min(2 * wait, POLL_SECONDS)


def _logged(entry: Entry, log: Callable[[str], None]) -> Entry:
    """Say where the splits come from; an entry found again repeats its build's lines (the facts a run logs)."""
    if not entry.built:
        for line in entry.log:
            log(line)
        log(f"data: opened the tokenized splits cached in {entry.path} (data.overwrite_cache: true tokenizes again)")
    else:
        log(f"data: cached the tokenized splits in {entry.path}")
    return entry


def _describe(error: BaseException) -> tuple[str, str, bool]:
    """``(class name, line, whether it is an hftrain error)`` of a builder's failure, to send to the other ranks."""
    return type(error).__name__, str(error), isinstance(error, HFTrainError)


def _rebuilt(said: tuple[str, str, bool], source: int) -> HFTrainError:
    """The error a rank raises for the builder's ``said`` (:func:`_describe`): the same class and line."""
    import hftrain.errors

    name, line, ours = said
    if not ours:
        return ProcessError(f"preparing the data failed on process {source} ({name}); see its error")
    kind = getattr(hftrain.errors, name, None)
    if isinstance(kind, type) and issubclass(kind, HFTrainError):
        try:
            return kind(line)
        except TypeError:  # an error class with other constructor arguments
            pass
    return HFTrainError(line)
