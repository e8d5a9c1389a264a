import numpy as np
import pytest
from numba import njit

from spyre_serve.device import DeviceCommandError, DeviceError, JobPlan, Program, Slot
from spyre_serve.device.abi import ENTRY_ARGS, f32_at, i32_at

AXPY_SLOTS = [Slot("x", "address"), Slot("y", "address"), Slot("out", "address"),
              Slot("n", "dim"), Slot("a", "dim")]


@njit(nogil=True)
def axpy_entry(f32, i32, i64, u16, table):
    # out[n] = a * x[n] + y[n]
    n = table[3]
    x = f32_at(f32, table[0], n)
    y = f32_at(f32, table[1], n)
    out = f32_at(f32, table[2], n)
    for i in range(n):
        out[i] = table[4] * x[i] + y[i]


@njit(nogil=True)
def scratch_entry(f32, i32, i64, u16, table):
    # out[n] = cumulative sum of x[n], through scratch (int32 counts there)
    n = table[2]
    x = i32_at(i32, table[0], n)
    tmp = i32_at(i32, table[3], n)
    out = i32_at(i32, table[1], n)
    acc = 0
    for i in range(n):
        acc += x[i]
        tmp[i] = acc
    out[:] = tmp


def _fresh_entry():
    @njit(nogil=True)
    def entry(f32, i32, i64, u16, table):
        f32_at(f32, table[0], 1)[0] += 1.0

    return entry


def _filled(card, values):
    t = card.empty((len(values),), np.float32)
    t.numpy()[:] = values
    return t


def test_launch_runs_the_entry_on_the_bound_tensors(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = _filled(card, [1, 2, 3]), _filled(card, [10, 20, 30]), card.empty((3,))
    prog.launch(card.default_stream, {"x": x, "y": y, "out": out, "n": 3, "a": 2}).wait()
    np.testing.assert_array_equal(out.numpy(), [12, 24, 36])


def test_same_program_with_other_tensors_does_not_recompile(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    before = card.counters.snapshot()
    overloads = len(axpy_entry.overloads)
    for k in range(5):
        x, y, out = _filled(card, [k] * 4), _filled(card, [1] * 4), card.empty((4,))
        prog.launch(None, {"x": x, "y": y, "out": out, "n": 4, "a": 3}).wait()
        np.testing.assert_array_equal(out.numpy(), [3 * k + 1] * 4)
    after = card.counters.snapshot()
    assert after["compiles"] == before["compiles"] and after["prepares"] == before["prepares"]
    assert after["launches"] - before["launches"] == 5
    assert len(axpy_entry.overloads) == overloads


def test_prepare_counts_a_compile_once_per_entry(card):
    entry = _fresh_entry()
    Program(card, "p1", entry, [Slot("x", "address")]).prepare()
    Program(card, "p2", entry, [Slot("x", "address")]).prepare()  # same entry: already compiled
    snap = card.counters.snapshot()
    assert (snap["compiles"], snap["prepares"]) == (1, 2)
    assert list(entry.overloads) == [ENTRY_ARGS]


def test_launch_works_with_compilation_disabled(card):
    entry = _fresh_entry()
    prog = Program(card, "p", entry, [Slot("x", "address")]).prepare()
    entry.disable_compile()  # any path that could compile would now raise
    x = _filled(card, [0.0])
    for _ in range(3):
        prog.launch(None, {"x": x})
    card.synchronize()
    assert x.numpy()[0] == 3.0


def test_launch_before_prepare_raises(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS)
    with pytest.raises(DeviceError, match="before prepare"):
        prog.launch(None, {})


def test_missing_bindings_are_named(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x = card.empty((3,))
    with pytest.raises(DeviceError, match=r"missing bindings for slots \['y', 'out', 'a'\]"):
        prog.launch(None, {"x": x, "n": 3})


def test_unknown_binding_is_named(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    with pytest.raises(DeviceError, match="unknown slot 'z'"):
        prog.launch(None, {"z": 1})


def test_wrong_kind_of_binding_is_refused(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x = card.empty((3,))
    with pytest.raises(DeviceError, match="dim slot 'n' needs an int"):
        prog.launch(None, {"x": x, "y": x, "out": x, "n": x, "a": 1})
    with pytest.raises(DeviceError, match="address slot 'y' needs a DeviceTensor"):
        prog.launch(None, {"x": x, "y": 1.5, "out": x, "n": 3, "a": 1})


def test_operand_table_holds_the_addresses_and_dims_of_the_last_launch(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = card.zeros((5,)), card.zeros((5,)), card.empty((5,))
    prog.launch(None, {"x": x, "y": y, "out": out, "n": 5, "a": -2}).wait()
    assert prog.table.address % 128 == 0
    assert prog.table.numpy().tolist() == [x.address, y.address, out.address, 5, -2]
    assert card.counters.snapshot()["bytes_patched"] == 5 * 8


def test_scratch_is_placed_on_the_card_and_usable_by_the_entry(card):
    slots = [Slot("x", "address"), Slot("out", "address"), Slot("n", "dim"), Slot("scratch", "address")]
    prog = Program(card, "cumsum", scratch_entry, slots, scratch_bytes=4 * 6).prepare()
    assert prog.scratch.nbytes == 24 and prog.scratch.address % 128 == 0
    prog.bind({"scratch": prog.scratch})
    x, out = card.empty((6,), np.int32), card.empty((6,), np.int32)
    x.numpy()[:] = [1, 2, 3, 4, 5, 6]
    prog.launch(None, {"x": x, "out": out, "n": 6}).wait()
    np.testing.assert_array_equal(out.numpy(), [1, 3, 6, 10, 15, 21])


def test_bound_slots_persist_and_a_launch_can_override_them(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = _filled(card, [1, 1]), _filled(card, [5, 5]), card.empty((2,))
    prog.bind({"x": x, "y": y, "a": 1, "n": 2})
    prog.launch(None, {"out": out}).wait()
    np.testing.assert_array_equal(out.numpy(), [6, 6])
    prog.launch(None, {"out": out, "a": 10}).wait()
    np.testing.assert_array_equal(out.numpy(), [15, 15])


def test_readback_copies_outputs_to_host_arrays(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = _filled(card, [1, 2]), _filled(card, [0, 0]), card.empty((2,))
    host = np.zeros(2, np.float32)
    prog.launch(None, {"x": x, "y": y, "out": out, "n": 2, "a": 4}, readback=[(host, out)]).wait()
    np.testing.assert_array_equal(host, [4, 8])


def test_readback_of_the_wrong_dtype_is_refused_at_launch(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x = card.empty((2,))
    with pytest.raises(DeviceError, match="readback into host"):
        prog.launch(None, {"x": x, "y": x, "out": x, "n": 2, "a": 1}, readback=[(np.zeros(2), x)])


def test_a_fault_in_the_entry_is_reraised_by_wait(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x = card.empty((2,))
    handle = prog.launch(None, {"x": x, "y": x, "out": x, "n": card.capacity, "a": 1})  # view past the arena
    with pytest.raises(DeviceCommandError, match="'axpy'") as info:
        handle.wait()
    assert isinstance(info.value.__cause__, IndexError)
    assert "outside the arena" in str(info.value.__cause__)


def test_entry_must_release_the_gil(card):
    @njit
    def holds_gil(f32, i32, i64, u16, table):
        pass

    with pytest.raises(DeviceError, match="nogil=True"):
        Program(card, "p", holds_gil, [])


def test_duplicate_slot_names_and_bad_kinds_are_refused(card):
    with pytest.raises(DeviceError, match="duplicate slot names \\['x'\\]"):
        Program(card, "p", axpy_entry, [Slot("x", "address"), Slot("x", "dim")])
    with pytest.raises(DeviceError, match="kind must be one of"):
        Slot("x", "pointer")


def test_release_returns_table_and_scratch_to_the_card(card):
    before = card.allocator.stats().allocated
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS, scratch_bytes=1000).prepare()
    assert card.allocator.stats().allocated == before + 128 + 1024
    prog.release()
    assert card.allocator.stats().allocated == before


def test_job_plan_runs_its_steps_in_order(card):
    seen = []

    class Step:
        def __init__(self, tag):
            self.tag = tag

        def run(self, c, tally):
            seen.append(self.tag)

    JobPlan("p", [Step("host"), Step("h2d"), Step("compute"), Step("d2h")]).run(card)
    assert seen == ["host", "h2d", "compute", "d2h"]


def test_manifest_lists_name_shapes_and_slots(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS[:2], shapes={"x": (3,)})
    assert prog.manifest() == {"name": "axpy", "shapes": {"x": (3,)},
                               "slots": [("x", "address"), ("y", "address")], "scratch_bytes": 0}


def test_launch_parts_patches_each_parts_slots_and_calls_between_after_each(card):
    """A run in parts (tensor parallelism's): one launch, the parts' slots written into the
    table in place before each compute, `between(k)` after compute k, readback after the last."""
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = _filled(card, [1, 2, 3]), _filled(card, [10, 20, 30]), card.empty((3,))
    seen = []

    def between(k):            # the output of part k, as the part left it
        seen.append((k, out.numpy().tolist()))
    host = np.empty(3, np.float32)
    before = card.counters.snapshot()["launches"]
    prog.launch_parts(card.default_stream, {"x": x, "y": y, "out": out, "n": 3},
                      [{"a": 1}, {"a": 2}, {"a": 3, "n": 2}], between, lambda: None,
                      readback=[(host, out)]).wait()
    assert seen == [(0, [11, 22, 33]), (1, [12, 24, 36]), (2, [13, 26, 36])]
    np.testing.assert_array_equal(host, [13, 26, 36])
    assert card.counters.snapshot()["launches"] - before == 1


def test_a_failing_part_calls_on_error_and_fails_the_launch(card):
    prog = Program(card, "axpy", axpy_entry, AXPY_SLOTS).prepare()
    x, y, out = _filled(card, [1]), _filled(card, [1]), card.empty((1,))
    aborted = []

    def between(k):
        if k == 1:
            raise RuntimeError("part 1's peer failed")
    handle = prog.launch_parts(card.default_stream, {"x": x, "y": y, "out": out, "n": 1},
                               [{"a": 1}, {"a": 2}, {"a": 3}], between, lambda: aborted.append(True))
    with pytest.raises(DeviceCommandError, match="part 1's peer failed"):
        handle.wait()
    assert aborted == [True] and out.numpy()[0] == 3.0      # part 2 never ran
