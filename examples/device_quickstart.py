"""The device API in one page: allocate, copy in, launch one program twice
with different tensors, read back, print the card's counters.

    .venv/bin/python examples/device_quickstart.py
"""

from spyre_serve.device.process import configure

configure()   # threads, ISA level, compile cache: before any kernel is imported

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from spyre_serve.device import Card, Program, Slot  # noqa: E402
from spyre_serve.device.abi import f32_at  # noqa: E402


@njit(nogil=True, cache=True)
def scale_add(f32, i32, i64, u16, table):
    # the ABI: arena views + this program's operand table
    # slots: 0 x, 1 y, 2 out (addresses), 3 n (dim); out[n] = 2 * x[n] + y[n]
    n = table[3]
    x, y, out = f32_at(f32, table[0], n), f32_at(f32, table[1], n), f32_at(f32, table[2], n)
    for i in range(n):
        out[i] = 2.0 * x[i] + y[i]


def main():
    card = Card(memory_bytes=64 << 20)  # 64 MiB arena
    stream = card.new_stream("compute")
    n = 4
    x1, y1, x2, y2, out = (card.empty((n,), np.float32) for _ in range(5))
    stream.copy_h2d(x1, np.arange(n, dtype=np.float32))  # enqueued; host arrays snapshotted
    stream.copy_h2d(y1, np.ones(n, np.float32))
    stream.copy_h2d(x2, np.full(n, 10, np.float32))
    stream.copy_h2d(y2, np.full(n, -1, np.float32))

    prog = Program(card, "scale_add", scale_add,
                   slots=[Slot("x", "address"), Slot("y", "address"), Slot("out", "address"), Slot("n", "dim")],
                   shapes={"x": (n,), "y": (n,), "out": (n,)})
    prog.prepare()  # compiles once (or loads Numba's disk cache), places the operand table

    first, second = np.empty(n, np.float32), np.empty(n, np.float32)
    prog.launch(stream, {"x": x1, "y": y1, "out": out, "n": n}, readback=[(first, out)])
    handle = prog.launch(stream, {"x": x2, "y": y2, "out": out, "n": n}, readback=[(second, out)])
    handle.wait()  # both launches ran in order; readbacks are filled

    print("first launch: ", first)  # [1. 3. 5. 7.]
    print("second launch:", second)  # [19. 19. 19. 19.]
    print("counters:", card.counters.snapshot())
    print("memory:", card.allocator.stats())
    card.close()


if __name__ == "__main__":
    main()
