"""Standard streams that cannot stop the server: where stdout and stderr go (a log file on a
full disk, `/dev/full`, a pipe whose reader has gone) may refuse a write, and a write that
raises in the middle of serving (a progress bar, a `print`) would end a request or the process.

``LossyStream`` writes each piece straight to its file descriptor, unbuffered (nothing is held
back to be written again, so memory does not grow while the disk is full), drops what the
descriptor refuses and counts it; the first write that gets through again is preceded by one
line saying how much was lost. ``install()`` puts one in place of ``sys.stdout`` and
``sys.stderr``, before logging is configured, in every process of the server.
"""

from __future__ import annotations

import io
import os
import sys


class LossyStream(io.TextIOBase):
    """A text stream over ``fd`` that drops the writes the descriptor refuses (``OSError``)."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd, self._name = fd, name
        self.lost_writes = 0
        self.lost_bytes = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def encoding(self) -> str:
        return "utf-8"

    @property
    def errors(self) -> str:
        return "backslashreplace"

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "backslashreplace")
        if self.lost_writes:
            notice = (f"[{self._name}: {self.lost_writes} writes ({self.lost_bytes} bytes) were lost: "
                      f"the file refused them]\n").encode()
            if not self._write_all(notice):
                self._lose(data)
                return len(text)
            self.lost_writes = self.lost_bytes = 0
        if not self._write_all(data):
            self._lose(data)
        return len(text)

    def flush(self) -> None:
        pass            # nothing is buffered

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            return False
        return True

    def _lose(self, data: bytes) -> None:
        self.lost_writes += 1
        self.lost_bytes += len(data)


def install() -> None:
    """``sys.stdout`` and ``sys.stderr`` as ``LossyStream``s over their descriptors (where
    they have one: under a test runner's capture they are left alone)."""
    for attr in ("stdout", "stderr"):
        stream = getattr(sys, attr)
        if isinstance(stream, LossyStream):
            continue
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        setattr(sys, attr, LossyStream(fd, f"<{attr}>"))
