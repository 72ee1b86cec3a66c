"""Worker output: prefixed lines on the console, log files, and a tail for error reports.

Each stream of each worker (stdout, stderr) has a :class:`StreamSink`.  The
launcher feeds it whatever it read from the pipe; complete lines go to the
console with the ``[rankN]:`` prefix, or without a prefix everything goes to the
console as it comes (a progress bar's ``\r`` updates, a prompt without a
newline), and raw to the log file when teeing or redirecting.  A prefixed
unfinished line that nothing follows for :data:`PARTIAL_DELAY` seconds (a
prompt: ``(Pdb) ``, ``input("name? ")``) is shown as far as it goes, and the
rest of that line follows without a second prefix.  The last lines are kept
for the failure report.
"""

from __future__ import annotations

import collections
import time
from typing import BinaryIO

__all__ = ["LineCopy", "StreamSink", "parse_std_spec"]

#: Lines of a worker's stderr kept for the failure report.
TAIL_LINES = 15
#: A line longer than this is written out without waiting for its end.
MAX_LINE = 64 * 1024
#: Seconds a prefixed unfinished line waits for its end before it is shown as it is.
PARTIAL_DELAY = 0.2


class LineCopy:
    """A file that gets the lines (of every worker's stream) containing one of ``needles``,
    each as ``[rankN]:line`` (torchrun's ``--duplicate-*-filters``)."""

    def __init__(self, file: BinaryIO, needles: list[str]) -> None:
        self.file = file
        self.needles = [n.encode() for n in needles]

    def take(self, rank: int, lines: list[bytes]) -> None:
        hits = [line for line in lines if any(n in line for n in self.needles)]
        if hits and not self.file.closed:
            self.file.write(b"".join(b"[rank%d]:%s\n" % (rank, line) for line in hits))
            self.file.flush()

    def close(self) -> None:
        self.file.close()


class StreamSink:
    """Where one stream of one worker goes."""

    def __init__(self, prefix: bytes, console: BinaryIO | None, log: BinaryIO | None,
                 copy: LineCopy | None = None, rank: int = 0) -> None:
        self.prefix = prefix
        self.console = console
        self.log = log
        self.copy = copy
        self.rank = rank
        self.partial = b""
        self.shown = 0  # bytes of ``partial`` already on the console (prefixed: see show_partial)
        self.partial_since = 0.0  # when ``partial`` last grew with nothing shown of it (monotonic)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)

    def feed(self, data: bytes) -> None:
        """Take bytes read from the worker's pipe."""
        if self.log is not None:
            self.log.write(data)
            self.log.flush()
        if not self.prefix:
            self._write(data)  # as the worker wrote it, unfinished lines included
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) > MAX_LINE:
            lines.append(self.partial)
            self.partial = b""
        if lines:
            self.tail.extend(lines)
            if self.copy is not None:
                self.copy.take(self.rank, lines)
            if self.prefix:
                shown, self.shown = self.shown, 0
                first = lines[0][shown:] + b"\n" if shown else self.prefix + lines[0] + b"\n"
                self._write(first + b"".join(self.prefix + line + b"\n" for line in lines[1:]))
        if self.prefix and len(self.partial) > self.shown:
            self.partial_since = time.monotonic()

    def partial_due(self) -> float | None:
        """When the unfinished line is to be shown (monotonic), or None if nothing waits."""
        if not self.prefix or len(self.partial) <= self.shown or self.console is None:
            return None
        return self.partial_since + PARTIAL_DELAY

    def show_partial(self) -> None:
        """Show the unfinished line as far as it goes (a prompt waiting for an answer)."""
        if len(self.partial) > self.shown:
            self._write((b"" if self.shown else self.prefix) + self.partial[self.shown :])
            self.shown = len(self.partial)

    def close(self) -> None:
        """Flush a last unterminated line (ended, when prefixed) and close the log file."""
        if self.partial:
            self.tail.append(self.partial)
            if self.copy is not None:
                self.copy.take(self.rank, [self.partial])
            if self.prefix:
                self._write((self.partial[self.shown :] if self.shown else self.prefix + self.partial) + b"\n")
            self.partial = b""
            self.shown = 0
        if self.log is not None:
            self.log.close()
            self.log = None

    def tail_text(self) -> list[str]:
        """The last lines seen, decoded."""
        lines = list(self.tail) + ([self.partial] if self.partial else [])
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]

    def _write(self, text: bytes) -> None:
        if self.console is None or not text:
            return
        try:
            self.console.write(text)
            self.console.flush()
        except (BrokenPipeError, ValueError):  # our own output was closed: keep running
            self.console = None


def parse_std_spec(text: str | None, flag: str) -> dict[int | None, int]:
    """torchrun's ``-r``/``-t`` value: ``3`` (every local rank) or ``0:1,1:2``.

    Bits: 1 = stdout, 2 = stderr.  Returns ``{local_rank or None: bits}``.
    """
    if text is None or text == "":
        return {}
    out: dict[int | None, int] = {}
    try:
        if ":" not in text:
            out[None] = int(text)
        else:
            for part in text.split(","):
                rank, _, bits = part.partition(":")
                out[int(rank)] = int(bits)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected 0-3, or local_rank:bits pairs like 0:1,1:2") from None
    if any(not 0 <= b <= 3 for b in out.values()):
        raise ValueError(f"{flag} {text!r}: each value must be 0 (none) to 3 (stdout and stderr)")
    return out
