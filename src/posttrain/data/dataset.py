"""Tokenize once, cache beside the data, memory-map afterwards.

:func:`load_tokenized` turns a JSONL / JSON file or a ``datasets`` ``save_to_disk`` folder into a
:class:`TokenizedDataset`: every record encoded by :func:`~posttrain.data.formats.encode_record`,
stored as Arrow files (through ``datasets``) with the lengths the balancer needs. Tokenizing runs
over several processes with a progress bar; the result is cached in ``.posttrain-cache/`` next to
the data (or under ``~/.cache/posttrain`` when that folder is not writable), keyed by the data
file (path, size, modification time), the tokenizer (its vocabulary, merges, special tokens and
chat template) and the masking option, so a second run opens the cache at once. The Arrow files
are memory-mapped: a dataset larger than RAM works, and ranks on one host share the pages.

Errors name where: ``file:line`` for JSONL, ``file[row]`` for JSON arrays and ``datasets`` folders.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain._files import work_dir
from posttrain.errors import RunError, disk_full, no_space

from .formats import IGNORE_INDEX, encode_record

__all__ = ["TokenizedDataset", "load_tokenized", "tokenizer_fingerprint"]

_CACHE_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides a tokenizer's output: its vocabulary and merges, special tokens and
    chat template (``"none"`` without a tokenizer)."""
    if tokenizer is None:
        return "none"
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _line_shards(path: str, num_shards: int) -> list[tuple[int, int, int]]:
    """``(start_byte, end_byte, first_line)`` ranges of about equal size, cut at line ends."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, num_shards):
            f.seek(max(cuts[-1], size * k // num_shards))
            f.readline()
            pos = f.tell()
            if cuts[-1] < pos < size:
                cuts.append(pos)
    cuts.append(size)
    out, line = [], 1
    with open(path, "rb") as f:
        for a, b in itertools.pairwise(cuts):
            out.append((a, b, line))
            f.seek(a)
            line += f.read(b - a).count(b"\n")
    return out


#: The pid of this process while it tokenizes with worker processes (0 otherwise).
_TOKENIZING = 0


def _die_with_parent() -> None:
    """In a process forked while this one tokenizes (a ``datasets`` worker): have the kernel kill
    it when its parent dies, even by SIGKILL (Linux), and end at once if that already happened.
    Runs right after the fork, before the worker waits for its first task."""
    if _Forking.stopping:  # forked while the tokenizing process stops (its pool replacing the workers
        os._exit(0)         # the interrupt killed): nothing for it to do, and nobody would end it
    if not _TOKENIZING or os.getppid() != _TOKENIZING:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the command's handler: the pool's terminate() ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tokenizing process's to handle
    # A worker's errors reach the tokenizing process through datasets (named by file and line);
    # what it would print itself is the noise of being stopped mid-record on an interrupt.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != _TOKENIZING:
        os._exit(1)


os.register_at_fork(after_in_child=_die_with_parent)


class _Forking:
    """Interrupts around ``os.fork`` in the tokenizing process. An interrupt raised inside a fork
    callback is lost ("Exception ignored in: ...", logging's and filelock's callbacks were both
    seen) and can leave logging's lock held; and a worker forked while the pool stops (its
    replacements) can take the pool's SIGTERM inside its own callbacks, under a handler it
    inherited. So while this process tokenizes or stops, SIGINT and SIGTERM are blocked from the
    first ``before`` callback to the last ``after_*`` one (:meth:`install` registers these after
    every library's own, so they run outermost): the parent handles a pending one as the mask
    comes back (the stop handler holds it and has it sent again once the fork is done); the child
    gets it only after ``_die_with_parent`` set its own dispositions (or ended it)."""

    active = False
    held: list[int] = []  # noqa: RUF012 - one process's fork state, reset in every child
    #: an interrupt stops this tokenizing process: a process forked from now on ends at once
    stopping = False
    _mask: set | None = None
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Register the callbacks now, after the libraries imported so far (``datasets``,
        ``filelock``, ``multiprocess``): ``before`` callbacks run newest first, ``after_*`` ones
        oldest first, so these enclose theirs. Once per process."""
        if cls._installed:
            return
        cls._installed = True
        os.register_at_fork(before=cls.before, after_in_parent=cls.after_in_parent, after_in_child=cls.after_in_child)

    @classmethod
    def before(cls) -> None:
        cls.active = True
        if _TOKENIZING == os.getpid() or cls.stopping:
            cls._mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    @classmethod
    def after_in_parent(cls) -> None:
        if cls._mask is not None:
            mask, cls._mask = cls._mask, None
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (a pending interrupt is handled here: held)
        cls.active = False
        if cls.held:
            signum = cls.held.pop()
            cls.held.clear()
            # (sent from a thread a moment later: sent from here, it would be handled here)
            _daemon_timer(0.01, lambda: os.kill(os.getpid(), signum))

    @classmethod
    def after_in_child(cls) -> None:
        cls.active = False
        cls.held = []
        if cls._mask is not None:
            mask, cls._mask = cls._mask, None
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _encode_row(record: Any, where: str, tokenizer, train_on_prompt: bool) -> dict:
    try:
        enc = encode_record(record, tokenizer, train_on_prompt=train_on_prompt)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return {"input_ids": enc.input_ids, "labels": enc.labels, "length": len(enc.input_ids),
            "trained": enc.trained, "where": where, "max_id": max(enc.input_ids)}


def _jsonl_rows(shards: list[tuple[int, int, int]], path: str, tokenizer_path: str | None, tokenizer_obj,
                train_on_prompt: bool) -> Iterator[dict]:
    tokenizer = tokenizer_obj if tokenizer_obj is not None else (_load_tokenizer(tokenizer_path) if tokenizer_path else None)
    for start, end, first_line in shards:
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(end - start)
        for k, raw in enumerate(chunk.split(b"\n")):
            if not raw.strip():
                continue
            where = f"{path}:{first_line + k}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
            yield _encode_row(record, where, tokenizer, train_on_prompt)


def _record_rows(records: list, path: str, tokenizer_path: str | None, tokenizer_obj, train_on_prompt: bool,
                 offset: int = 0) -> Iterator[dict]:
    tokenizer = tokenizer_obj if tokenizer_obj is not None else (_load_tokenizer(tokenizer_path) if tokenizer_path else None)
    for k, record in enumerate(records):
        yield _encode_row(record, f"{path}[{offset + k}]", tokenizer, train_on_prompt)


def _source_identity(path: Path) -> dict:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path.resolve()), "files": [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                                                       for p in files]}
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_dir(path: Path, key: str) -> Path:
    beside = path.parent / ".posttrain-cache"
    try:
        beside.mkdir(exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=beside, delete=True)
        probe.close()
        root = beside
    except OSError:
        root = Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))
        root.mkdir(parents=True, exist_ok=True)
    return root / f"{path.name}-{key}"


@dataclass
class TokenizedDataset:
    """Encoded records, memory-mapped.

    Attributes:
        source: the data file or folder.
        table: the ``datasets.Dataset`` (columns ``input_ids``, ``labels``, ``length``, ``trained``,
            ``where``, ``max_id``).
        lengths: every record's token count (numpy).
        max_id: the largest token id.
        cache: the cache folder it was read from.
    """

    source: str
    table: Any
    lengths: np.ndarray
    max_id: int
    cache: str

    def __len__(self) -> int:
        return len(self.lengths)

    def where(self, i: int) -> str:
        """``file:line`` (or ``file[row]``) of record ``i``."""
        return self.table[int(i)]["where"]

    def example(self, i: int, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``i``'s token ids and labels, the first ``max_len`` tokens if given."""
        row = self.table[int(i)]
        ids, labels = row["input_ids"], row["labels"]
        if max_len is not None:
            ids, labels = ids[:max_len], labels[:max_len]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)

    def examples(self, indices: list[int], max_len: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`example` of each of ``indices`` (in that order), read in one batched lookup
        (about 8x faster than one lookup a record: a step's minibatch is read between steps)."""
        if not indices:
            return []
        rows = self.table[[int(i) for i in indices]]
        out = []
        for ids, labels in zip(rows["input_ids"], rows["labels"]):
            if max_len is not None:
                ids, labels = ids[:max_len], labels[:max_len]
            out.append((torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)))
        return out

    def trained(self) -> np.ndarray:
        """Every record's number of trained targets."""
        return np.asarray(self.table["trained"], dtype=np.int64)


def load_tokenized(source: str | os.PathLike, tokenizer=None, *, tokenizer_path: str | None = None,
                   train_on_prompt: bool = False, num_proc: int | None = None, progress: bool = True,
                   log=print) -> TokenizedDataset:
    """Encode ``source`` (cached; see the module docstring).

    Args:
        source: a ``.jsonl`` file (one record per line), a ``.json`` file (a list of records, or
            JSON lines), or a folder written by ``datasets``' ``save_to_disk`` (its ``train``
            split if it holds several).
        tokenizer: a ``transformers`` tokenizer (or ``None`` for ``input_ids`` records).
        tokenizer_path: where ``tokenizer`` was loaded from: worker processes load it from there
            (without it, tokenizing runs in this process).
        train_on_prompt: train every token.
        num_proc: tokenizing processes (default: up to 8 for files over 4 MB, else 1).
        progress: show ``datasets``' progress bar.
        log: where the one line about tokenizing goes.

    Raises:
        ValueError: a missing or unreadable source, or a bad record (named by file and line).
    """
    import datasets

    path = Path(source)
    if not path.exists():
        raise ValueError(f"`data` {path}: no such file or directory")
    is_folder = path.is_dir()
    if is_folder and not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        raise ValueError(f"`data` {path} is a directory but not a `datasets` save_to_disk folder; give a .jsonl file")
    key_src = {"v": _CACHE_VERSION, "source": _source_identity(path), "tokenizer": tokenizer_fingerprint(tokenizer),
               "train_on_prompt": bool(train_on_prompt)}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    cache = _cache_dir(path, key)
    if not (cache / "posttrain.json").exists():
        try:
            _build_cache(path, is_folder, cache, tokenizer, tokenizer_path, train_on_prompt, num_proc, progress, log)
        except Exception as e:
            if no_space(e):
                raise RunError(disk_full(f"the tokenized cache of `data` {path}", cache.parent)) from None
            raise
    if not progress:
        datasets.disable_progress_bars()
    table = datasets.load_from_disk(str(cache / "table"))
    with open(cache / "posttrain.json") as f:
        meta = json.load(f)
    lengths = np.asarray(table["length"], dtype=np.int64)
    return TokenizedDataset(source=str(path), table=table, lengths=lengths, max_id=int(meta["max_id"]), cache=str(cache))


def _build_cache(path: Path, is_folder: bool, cache: Path, tokenizer, tokenizer_path: str | None, train_on_prompt: bool,
                 num_proc: int | None, progress: bool, log) -> None:
    import datasets

    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")), "labels": datasets.Sequence(datasets.Value("int64")),
        "length": datasets.Value("int64"), "trained": datasets.Value("int64"), "where": datasets.Value("string"),
        "max_id": datasets.Value("int64"),
    })
    progress = progress and sys.stderr.isatty()  # a bar only where a person watches (a log file gets no \r lines)
    if progress:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if is_folder else path.stat().st_size
    if num_proc is None:
        num_proc = min(8, os.cpu_count() or 1) if size > 4 << 20 else 1
    shared = tokenizer_path if tokenizer is not None and tokenizer_path else None
    if shared is None:
        num_proc = 1  # the tokenizer object stays in this process
    tok_obj = None if shared else tokenizer
    log(f"tokenizing {path} ({size / 2**20:.1f} MiB, {num_proc} process{'es' if num_proc > 1 else ''}) into {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    work = work_dir(cache.parent, f".{cache.name}.", orphans=".")  # (and those of any killed tokenizing run)
    try:
        if is_folder:
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            records: list | None = None
            n = len(loaded)
            if not n:
                raise ValueError(f"`data` {path}: the dataset holds no records")
            bounds = [(n * k // num_proc, n * (k + 1) // num_proc) for k in range(num_proc)]
            gen, kwargs = _folder_rows, {"shards": bounds, "folder": str(path), "tokenizer_path": shared,
                                          "tokenizer_obj": tok_obj, "train_on_prompt": train_on_prompt}
        else:
            if not _has_content(path):
                raise ValueError(f"`data` {path}: the file is empty" + (" (blank lines only)" if size else ""))
            records = _json_array(path)
            if records is not None:
                if not records:
                    raise ValueError(f"`data` {path}: the file holds an empty list, no records")
                n = len(records)
                parts = [(records[n * k // num_proc: n * (k + 1) // num_proc], n * k // num_proc) for k in range(num_proc)]
                gen, kwargs = _array_rows, {"shards": parts, "path": str(path), "tokenizer_path": shared,
                                             "tokenizer_obj": tok_obj, "train_on_prompt": train_on_prompt}
            else:
                gen, kwargs = _jsonl_rows, {"shards": _line_shards(str(path), max(1, num_proc)), "path": str(path),
                                             "tokenizer_path": shared, "tokenizer_obj": tok_obj,
                                             "train_on_prompt": train_on_prompt}
        nproc = min(num_proc, len(kwargs["shards"])) if num_proc > 1 else None
        global _TOKENIZING
        _Forking.install()  # (datasets and its libraries are imported by now: see _Forking)
        _TOKENIZING = os.getpid()  # the workers forked now die with this process
        try:
            with _stopped_at_once(work):
                table = datasets.Dataset.from_generator(gen, gen_kwargs=kwargs, features=features, num_proc=nproc,
                                                        cache_dir=str(work / "build"), keep_in_memory=False)
        except datasets.exceptions.DatasetGenerationError as e:
            cause = e.__cause__ or e.__context__
            raise (cause if isinstance(cause, ValueError) else ValueError(str(e))) from None
        except Exception as e:  # an interrupt met while waiting on the workers may surface as another error
            stop = _interrupt_in(e)
            if stop is not None:
                raise stop from None
            raise
        finally:
            _TOKENIZING = 0
        if len(table) == 0:
            raise ValueError(f"{path}: no records")
        max_id = int(max(table["max_id"]))
        datasets.disable_progress_bars()  # one bar for the phase: the generating one above
        try:
            table.save_to_disk(str(work / "table"))
        finally:
            if progress:
                datasets.enable_progress_bars()
        with open(work / "posttrain.json", "w") as f:
            json.dump({"source": str(path), "records": len(table), "max_id": max_id}, f)
        shutil.rmtree(work / "build", ignore_errors=True)
        try:
            os.replace(work, cache)
        except OSError:  # another process built it first: theirs is as good
            if not (cache / "posttrain.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: Seconds an interrupted tokenizing process has to unwind before it ends itself (see
#: :func:`_stopped_at_once`).
STOP_GRACE_S = 10.0


@contextlib.contextmanager
def _stopped_at_once(work: Path) -> Iterator[None]:
    """While tokenizing with worker processes, SIGINT and SIGTERM first kill the workers and
    remove the half-built cache ``work``, then unwind as the command's own handlers do. Should
    the unwinding hang (an interrupt raised while the worker pool's machinery holds one of its
    locks can leave its shutdown waiting forever: seen twice in CI, not reproduced in 16 tries
    here), a watchdog prints the command's one line and ends the process after
    :data:`STOP_GRACE_S` seconds: there is nothing left to clean by then. An unwinding that gets
    out of the pool in time cancels the watchdog."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from posttrain.launch import Interrupted

    olds: dict[int, Any] = {}
    timers: list = []
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:
            # A worker being forked inherits this handler until its fork hook resets it; a signal
            # in that window (the pool's terminate() sends SIGTERM) does what the worker's would.
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        old = olds.get(signum)
        if old == signal.SIG_IGN:
            return
        _Forking.stopping = True
        if _Forking.active:  # inside os.fork's callbacks: an interrupt raised there is lost
            _Forking.held.append(signum)
            return
        _kill_children()
        shutil.rmtree(work, ignore_errors=True)

        def end() -> None:
            print(Interrupted(signum).line, file=sys.stderr, flush=True)
            os._exit(128 + signum)

        timers.append(_daemon_timer(STOP_GRACE_S, end))
        if callable(old):
            old(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        olds[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, old in olds.items():
            signal.signal(sig, old)
        for t in timers:  # the unwinding got out of the pool: the caller takes it from here
            t.cancel()


def _daemon_timer(seconds: float, fn):
    import threading

    t = threading.Timer(seconds, fn)
    t.daemon = True
    t.start()
    return t


def _kill_children() -> None:
    """SIGKILL every process this one started (the tokenizing workers)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _interrupt_in(exc: BaseException) -> BaseException | None:
    """The SIGINT/SIGTERM interrupt that ``exc`` was raised while handling, if any (``datasets``
    raises its own errors while stopping its workers)."""
    from posttrain.launch import Interrupted

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (Interrupted, KeyboardInterrupt)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _has_content(path: Path) -> bool:
    """Whether the file holds anything but whitespace (read until the first such byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _json_array(path: Path) -> list | None:
    """The records of a file holding one JSON array, or ``None`` (JSON lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    return data


def _array_rows(shards, path, tokenizer_path, tokenizer_obj, train_on_prompt) -> Iterator[dict]:
    for records, offset in shards:
        yield from _record_rows(records, path, tokenizer_path, tokenizer_obj, train_on_prompt, offset)


def _folder_rows(shards, folder, tokenizer_path, tokenizer_obj, train_on_prompt) -> Iterator[dict]:
    import datasets

    loaded = datasets.load_from_disk(folder)
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    for a, b in shards:
        for start in range(a, b, 1000):  # a batch at a time: the folder may not fit in memory
            rows = loaded.select(range(start, min(b, start + 1000))).to_list()
            yield from _record_rows(rows, folder, tokenizer_path, tokenizer_obj, train_on_prompt, start)


__all__ += ["IGNORE_INDEX"]
