"""The files of ``isolate batch``: RECORDS.jsonl, checked whole before anything runs, and
RESULTS.jsonl, append-only, one fsynced line per finished attempt, read back to resume."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._core.model.outcome import STATUSES


class BatchError(Exception):
    """A problem with the batch's files; the message is shown as is."""


@dataclass(frozen=True)
class Record:
    """A valid line of RECORDS.jsonl. The record itself is read again when it is launched, so
    tens of thousands of records cost their offsets, not their contents."""

    line: int
    offset: int
    size: int
    instance_id: str


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a record")


class Records:
    """The valid records of a JSONL file, in file order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[Record] = []
        self.errors: list[str] = []
        # Reading through the descriptor opened for the check: a file replaced meanwhile (an
        # editor's save) cannot change what runs.
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()

    def check(self, validate: Callable[[dict[str, Any]], None]) -> None:
        """Parse every line; keep the valid ones, describe the others with their line number.
        ``validate`` raises ValueError for a record that cannot become an episode."""
        seen: dict[str, int] = {}
        offset = 0
        for number, raw in enumerate(self._file, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            where = f"{self.path}:{number}"
            try:
                record = parse(raw)
                instance_id = _instance_id(record)
                validate(record)
            except ValueError as exc:
                self.errors.append(f"{where}: {exc}")
                continue
            if instance_id in seen:
                first = seen[instance_id]
                self.errors.append(
                    f"{where}: duplicate instance_id {instance_id!r} (first on line {first})"
                )
                continue
            seen[instance_id] = number
            self.items.append(Record(number, start, len(raw), instance_id))

    def read(self, record: Record) -> dict[str, Any]:
        raw = os.pread(self._file.fileno(), record.size, record.offset)
        value = parse(raw)
        if _instance_id(value) != record.instance_id:
            raise ValueError(f"{self.path}:{record.line} changed while the batch was running")
        return value

    def close(self) -> None:
        self._file.close()


def parse(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object but {type(value).__name__}")
    return value


def _instance_id(record: dict[str, Any]) -> str:
    value = record.get("instance_id")
    if value is None or value == "":
        raise ValueError('no "instance_id"')
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f'"instance_id" must be a string, not {type(value).__name__}')
    return str(value)


#: What a result line is the result of: its instance id and its sample (0 for a line without
#: one, written without ``--samples``). Resume, retries and the reports go by it.
Unit = tuple[str, int]


def unit_of(entry: dict[str, Any]) -> Unit:
    return str(entry["instance_id"]), int(entry.get("sample", 0))


def is_final(entry: dict[str, Any]) -> bool:
    """Whether the run that wrote ``entry`` took it as its unit's result (a rerun with the
    same options skips the unit). Lines written before ``final`` existed: all but a
    ``setup_error``."""
    final = entry.get("final")
    return bool(final) if final is not None else entry["status"] != "setup_error"


@dataclass
class ResultLines:
    """What a results file holds, read without a lock or a change: :func:`read_results`."""

    entries: list[dict[str, Any]]
    """Every complete line, in file order."""
    last: dict[Unit, dict[str, Any]]
    """The latest line of each unit: its result, the earlier lines its earlier attempts."""
    partial: bytes
    """A last line without its newline (a driver stopped while writing it, or writing it
    now): not a result, as :meth:`Results.open` drops it."""


def split_results(data: bytes, path: Path, hint: str = "") -> ResultLines:
    """The result lines of ``data``, the contents of ``path``; BatchError names the first
    line that is not one (``hint`` is added to its message)."""
    end = data.rfind(b"\n") + 1
    entries = [
        _result_line(line, f"{path}:{number}", hint)
        for number, line in enumerate(data[:end].splitlines(), 1)
        if line.strip()
    ]
    last = {unit_of(e): e for e in entries}
    return ResultLines(entries, last, data[end:])


def read_results(path: Path) -> ResultLines:
    """A results file as it is now, for a report: no lock (a batch may be writing it), and
    nothing changed (a partial last line is left where it is)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchError(f"cannot read {path}: {exc.strerror or exc}") from None
    return split_results(data, path)


class Results:
    """RESULTS.jsonl. Each line is written with one ``write`` and fsynced before the next
    episode's line, so a driver killed at any moment loses no finished attempt; at worst the
    line being written is cut short, and a cut last line is dropped when the file is opened
    again. An exclusive lock keeps two drivers off one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: dict[Unit, dict[str, Any]] = {}
        """The latest line of each unit (instance id and sample)."""
        self.dropped = b""
        """The partial last line found (and removed) when the file was opened."""
        self.episode_ids: set[str] = set()
        """The episode id of every line: the attempts that have a result."""
        self._fd = -1
        self._lock = threading.Lock()

    def open(self) -> None:
        existed = self.path.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BatchError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BatchError(f"another isolate batch is writing to {self.path}") from None
        self._fd = fd
        if not existed:
            _fsync_dir(self.path.parent)
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        lines = split_results(data, self.path, "; give another --out, or remove the line")
        if lines.partial:
            # Only a driver stopped in the middle of a write leaves this: drop it, so the next
            # line starts on a line of its own. Its episode has no result and runs again.
            self.dropped = lines.partial
            os.ftruncate(fd, len(data) - len(lines.partial))
            os.fsync(fd)
        self.last = lines.last
        self.episode_ids = {str(e["episode_id"]) for e in lines.entries if e.get("episode_id")}

    def _take(self, entry: dict[str, Any]) -> None:
        self.last[unit_of(entry)] = entry
        if entry.get("episode_id"):
            self.episode_ids.add(str(entry["episode_id"]))

    def append(self, entry: dict[str, Any]) -> None:
        """Write one line and fsync it. Blocking: call from a worker thread."""
        data = (json.dumps(entry, separators=(", ", ": ")) + "\n").encode()
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
            self._take(entry)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def _result_line(line: bytes, where: str, hint: str = "") -> dict[str, Any]:
    try:
        entry = json.loads(line)
    except ValueError:
        why = "not JSON"
    else:
        why = _not_a_result(entry)
    if why:
        raise BatchError(f"{where} is not a result line of isolate batch ({why}){hint}")
    result: dict[str, Any] = entry
    return result


def _not_a_result(entry: Any) -> str:
    """Why a JSON value is not a result line, in a few words; "" when it is one."""
    if not isinstance(entry, dict):
        return f"a JSON {type(entry).__name__}, not an object"
    if "instance_id" in entry and "attempt" not in entry and "status" not in entry:
        return 'no "attempt" or "status": a records file?'
    for name in ("instance_id", "attempt", "status"):
        if name not in entry:
            return f'no "{name}"'
    sample = entry.get("sample", 0)
    if not isinstance(entry["instance_id"], str):
        return '"instance_id" is not a string'
    if isinstance(entry["attempt"], bool) or not isinstance(entry["attempt"], int):
        return '"attempt" is not an integer'
    if entry["status"] not in STATUSES:
        return f'"status" {entry["status"]!r} is not one of isolate\'s'
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        return '"sample" is not an integer of 0 or more'
    return ""


def _fsync_dir(path: Path) -> None:
    # The new file's directory entry must survive a crash as well as its contents.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
