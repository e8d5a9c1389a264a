"""Layout: a table of fields -> offsets, sizes, named host views and program bindings."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device import STICK
from spyre_serve.models.step.buffer_layout import Field, Layout, length_slot

TABLE = Layout("t", [
    Field("ids", np.int32, ("T",)),
    Field("starts", np.int32, ("S+1",)),
    Field("table", np.int32, ("S", "MB")),
    Field("mix", np.float32, ("QD+2*KD",)),
    Field("seeds", np.int64, ("S",)),
])
DIMS = {"T": 5, "S": 3, "MB": 4, "QD": 8, "KD": 2}


def test_shapes_come_from_the_dim_expressions():
    p = TABLE.place(DIMS)
    assert p.shapes == {"ids": (5,), "starts": (4,), "table": (3, 4), "mix": (12,), "seeds": (3,)}
    assert p.count("table") == 12


def test_fields_follow_each_other_in_table_order_on_stick_boundaries():
    p = TABLE.place(DIMS)
    offsets = [p.offsets[f.name] for f in TABLE.fields]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(o % STICK == 0 for o in offsets)
    assert p.nbytes % STICK == 0
    assert p.nbytes >= offsets[-1] + 3 * 8


def test_views_tile_the_buffer_without_overlap_and_with_the_declared_dtype():
    p = TABLE.place(DIMS)
    buf = np.zeros(p.nbytes, np.uint8)
    views = p.views(buf)
    for i, f in enumerate(TABLE.fields):
        views[f.name][...] = i + 1
        assert views[f.name].dtype == f.dtype and views[f.name].shape == p.shapes[f.name]
    for i, f in enumerate(TABLE.fields):
        assert (views[f.name] == i + 1).all()            # no later field wrote over it


def test_bindings_give_each_field_its_address_and_length():
    p = TABLE.place(DIMS)
    b = p.bindings(4096)
    assert b["ids"] == 4096 and b[length_slot("ids")] == 5
    assert b["table"] == 4096 + p.offsets["table"] and b[length_slot("table")] == 12
    assert len(b) == 2 * len(TABLE.fields)


def test_a_missing_dim_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="field table needs dim 'MB'"):
        TABLE.place({"T": 1, "S": 1, "QD": 1, "KD": 1})


def test_duplicate_field_names_are_refused():
    with pytest.raises(ValueError, match=r"duplicate fields \['a'\]"):
        Layout("bad", [Field("a", np.int32, ("T",)), Field("a", np.float32, ("T",))])


def test_a_buffer_smaller_than_the_placement_is_refused():
    p = TABLE.place(DIMS)
    with pytest.raises(ValueError, match=f"uint8\\[>= {p.nbytes}\\]"):
        p.views(np.zeros(p.nbytes - 1, np.uint8))
