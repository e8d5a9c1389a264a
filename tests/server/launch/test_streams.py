"""LossyStream: a write the file refuses is dropped and counted, never raised; the first write
that gets through again says how much was lost."""

from __future__ import annotations

import fcntl
import os

from spyre_serve.server.launch.streams import LossyStream


def test_writes_to_a_full_disk_are_dropped_and_counted():
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        stream = LossyStream(fd, "<stderr>")
        assert stream.write("one line\n") == len("one line\n")
        print("a progress bar", file=stream, flush=True)
        assert (stream.lost_writes, stream.lost_bytes) == (3, len("one line\n") + len("a progress bar") + 1)
    finally:
        os.close(fd)


def test_once_the_file_takes_writes_again_the_loss_is_said_first():
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    try:
        stream = LossyStream(w, "<stderr>")
        stream.write("first\n")
        filler = b"x" * 65536
        while True:                           # fill the pipe: the next writes are refused (EAGAIN)
            try:
                os.write(w, filler)
            except BlockingIOError:
                break
        stream.write("lost\n")
        stream.write("also lost\n")
        assert stream.lost_writes == 2
        received = b""
        while True:                           # the reader comes back
            try:
                os.set_blocking(r, False)
                received += os.read(r, 1 << 20)
            except BlockingIOError:
                break
        stream.write("back\n")
        os.close(w)
        w = -1
        os.set_blocking(r, True)
        rest = b""
        while chunk := os.read(r, 1 << 16):
            rest += chunk
        assert received.startswith(b"first\n")
        assert rest == b"[<stderr>: 2 writes (15 bytes) were lost: the file refused them]\nback\n"
        assert stream.lost_writes == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
