"""Worker output: prefixed lines on the console, log files, and a tail for error reports.

Each stream of each worker (stdout, stderr) has a :class:`StreamSink`.  The
launcher feeds it whatever it read from the pipe; complete lines go to the
console with the ``[rankN]:`` prefix, or without a prefix everything goes to the
console as it comes (a progress bar's ``\r`` updates, a prompt without a
newline), and raw to the log file when teeing or redirecting.

A prefixed unfinished line that nothing follows for :data:`PARTIAL_DELAY`
seconds (a prompt: ``(Pdb) ``, ``input("name? ")``), or that grows past
:data:`MAX_LINE` bytes, is shown as far as it goes; the rest of that line
follows without a second prefix and without a line break.  Such a line is
*open* on the console until it ends: if another sink writes to the same
console (another rank, or the same rank's other stream when both go to one
terminal or file) the open line is ended there first, and its rest comes later
as a line of its own, prefixed again.  So every console line holds the text of
one worker stream.  The last lines are kept for the failure report.
"""

from __future__ import annotations

import collections
import os
import time
from typing import IO, BinaryIO

__all__ = ["LineCopy", "StreamSink", "end_open_line", "parse_std_spec"]

#: Lines of a worker's stderr kept for the failure report.
TAIL_LINES = 15
#: Bytes of an unfinished line held back at most: more are shown without waiting for its end.
#: Also the most kept of a line for the failure report and the filtered copy.
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


#: Console (see :func:`_console_id`) -> the sink whose shown line there has not ended yet.
_open_lines: dict[object, StreamSink] = {}


def _console_id(file: IO | None) -> object:
    """What ``file`` writes to: the launcher's stdout and stderr on one terminal,
    pipe or file are one console."""
    if file is None:
        return None
    try:
        st = os.fstat(file.fileno())
    except (OSError, ValueError):  # not a real file
        return id(file)
    return (st.st_dev, st.st_ino)


def end_open_line(file: IO | None) -> None:
    """End the open line on ``file``'s console, if there is one (the launcher is about to
    write a message of its own there); its rest comes later prefixed again."""
    owner = _open_lines.pop(_console_id(file), None)
    if owner is not None:
        owner._write(b"\n")


class StreamSink:
    """Where one stream of one worker goes."""

    def __init__(self, prefix: bytes, console: BinaryIO | None, log: BinaryIO | None,
                 copy: LineCopy | None = None, rank: int = 0) -> None:
        self.prefix = prefix
        self.console = console
        self.console_id = _console_id(console)
        self.log = log
        self.copy = copy
        self.rank = rank
        self.line = b""  # the unfinished line, its first MAX_LINE bytes (tail and copy)
        self.pending = b""  # prefixed: the part of the unfinished line not on the console yet
        self.pending_since = 0.0  # when ``pending`` last grew (monotonic)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)

    def feed(self, data: bytes) -> None:
        """Take bytes read from the worker's pipe."""
        if self.log is not None:
            self.log.write(data)
            self.log.flush()
        if not self.prefix:
            self._write(data)  # as the worker wrote it, unfinished lines included
        *ended, rest = data.split(b"\n")
        if ended:
            lines = [self.line + ended[0][: MAX_LINE - len(self.line)], *(e[:MAX_LINE] for e in ended[1:])]
            self.tail.extend(lines)
            if self.copy is not None:
                self.copy.take(self.rank, lines)
            if self.prefix:
                if not (self.pending or ended[0]) and self.line and _open_lines.get(self.console_id) is not self:
                    ended = ended[1:]  # all shown, and ended on the console by another sink's output
                if ended:
                    more = b"".join(self.prefix + e + b"\n" for e in ended[1:])
                    self._show(self.pending + ended[0] + b"\n" + more, stays_open=False)
            self.line = self.pending = b""
        if rest:
            self.line += rest[: MAX_LINE - len(self.line)]
            if self.prefix:
                self.pending += rest
                self.pending_since = time.monotonic()
                if len(self.pending) > MAX_LINE:  # no end in sight: show it, hold no more
                    self.show_partial()

    def partial_due(self) -> float | None:
        """When the unfinished line is to be shown (monotonic), or None if nothing waits."""
        if not self.pending or self.console is None:
            return None
        return self.pending_since + PARTIAL_DELAY

    def show_partial(self) -> None:
        """Show the unfinished line as far as it goes (a prompt waiting for an answer)."""
        if self.pending:
            self._show(self.pending, stays_open=True)
            self.pending = b""

    def close(self) -> None:
        """Flush a last unterminated line (ended, when prefixed) and close the log file."""
        if self.line:
            self.tail.append(self.line)
            if self.copy is not None:
                self.copy.take(self.rank, [self.line])
            if self.pending or _open_lines.get(self.console_id) is self:
                self._show(self.pending + b"\n", stays_open=False)
            self.line = self.pending = b""
        if self.log is not None:
            self.log.close()
            self.log = None

    def tail_text(self) -> list[str]:
        """The last lines seen, decoded."""
        lines = list(self.tail) + ([self.line] if self.line else [])
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]

    def _show(self, text: bytes, stays_open: bool) -> None:
        """Put ``text``, the rest of our unfinished line (and maybe whole lines after it), on the
        console: prefixed unless our line is open there; another sink's open line is ended first."""
        if self.console is None:
            return
        owner = _open_lines.get(self.console_id)
        if owner is not self:
            if owner is not None:
                owner._write(b"\n")
            text = self.prefix + text
        self._write(text)
        if stays_open:
            _open_lines[self.console_id] = self
        else:
            _open_lines.pop(self.console_id, None)

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
