"""What an episode leaves to read: its log file, when the spec names a directory, and the
outcome's tail of its stderr, both with isolate's own ``[isolate]`` lines between."""

from __future__ import annotations

import codecs
import fcntl
from pathlib import Path
from typing import BinaryIO

from ..model.errors import SetupProblem
from ..system import admission as _admission
from .tail import Tail


class EpisodeLog:
    """The log file (optional) and the tail (always), written together.

    Everything kept here is scrubbed already: the launcher scrubs stderr and frames where they
    enter. The log is written and flushed at once, so ``tail -f`` shows what came and a parent
    that is killed loses nothing it read. A log that cannot be written (a full disk, say) stops
    there, with a note in the tail: the episode's result does not depend on it.
    """

    def __init__(self, tail_bytes: int, cap_bytes: int | None) -> None:
        self.tail = Tail(tail_bytes)
        self.path: Path | None = None
        self._file: BinaryIO | None = None
        self._cap = cap_bytes  # limits.log_bytes
        self._written = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")

    def open(self, log_dir: Path, episode_id: str, tag: str) -> None:
        """Open ``<log_dir>/<episode_id>.log`` for appending (a retry's log goes on where the
        last try's ended). While another running episode writes that file (one with the same
        id, in any process), this one's is ``<episode_id>.<tag[:8]>.log`` instead, and its
        first line names the other. A full fd table is the caller's to wait out (the OSError
        goes on), any other failure is a :class:`SetupProblem`."""
        if self._file is not None:
            return
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            taken = (log_dir / f"{episode_id}.log").absolute()
            self.path, self._file = taken, _open_unshared(taken)
            if self._file is None:
                self.path = taken.with_name(f"{episode_id}.{tag[:8]}.log")
                self._file = _open_unshared(self.path)
        except OSError as exc:
            if _admission.exhausted(exc):
                raise
            raise SetupProblem(
                f"cannot open a log file in {log_dir}: {exc.strerror or exc}"
            ) from None
        if self._file is None:  # both taken: the tag is another running episode's too
            raise SetupProblem(f"cannot open a log file in {log_dir}: {self.path} is in use")
        if self.path != taken:
            self.note(f"another running episode writes {taken}: this one's log is {self.path}")

    def keep_stderr(self, data: bytes, *, final: bool = False) -> None:
        """Keep what the child wrote as valid UTF-8: bytes that are not are written as
        ``\\xNN``, and a character split across reads is held until it is whole, so that
        isolate's own lines between two reads cannot land inside one."""
        self.keep(self._decoder.decode(data, final).encode())

    def note(self, text: str) -> None:
        """A line from isolate itself into the log and the tail."""
        self.keep(f"[isolate] {text}\n".encode("utf-8", "backslashreplace"))

    def keep(self, data: bytes) -> None:
        if not data:
            return
        if self._file is not None:
            try:
                self._write(data)
            except OSError as exc:
                self._lose(exc)
        self.tail.write(data)

    def summary(self, line: str) -> None:
        """The outcome's one-line summary, last in the log file only."""
        if self._file is not None:
            try:
                self._file.write(f"[isolate] {line}\n".encode("utf-8", "backslashreplace"))
            except OSError as exc:
                self._lose(exc)

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass  # the outcome is out already; what is in the file stays

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        cap = self._cap
        if cap is None:
            self._file.write(data)
        else:
            room = cap - self._written
            if room > 0:
                self._file.write(data[:room])
            self._written += len(data)
            if room >= 0 and self._written > cap:
                note = (
                    f"\n[isolate] log cut at limits.log_bytes={cap}; the outcome's tail goes on\n"
                )
                self._file.write(note.encode())
        self._file.flush()

    def _lose(self, exc: OSError) -> None:
        """Stop writing the log, and say so in the tail."""
        file, self._file = self._file, None
        try:
            if file is not None:
                file.close()  # closes the file even when the flush inside fails again
        except OSError:
            pass
        problem = f"cannot write the log {self.path}: {exc.strerror or exc}"
        self.note(f"{problem}; it stops here, the outcome's tail goes on")


def _open_unshared(path: Path) -> BinaryIO | None:
    """``path`` opened for appending, with an exclusive lock (``flock``, released when it is
    closed); None while another open file holds the lock. Where the file system has no such
    locks (ENOLCK, say), the file without one."""
    file = open(path, "ab")  # noqa: SIM115 - the caller's to close
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    except OSError:
        pass
    return file
