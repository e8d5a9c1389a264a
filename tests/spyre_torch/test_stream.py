"""torch.spyre.Stream: ops go to the current stream, FIFO, cross-stream waits, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from spyre_serve.device import DeviceCommandError
from tests.spyre_torch.processes import gate


def test_ops_go_to_the_current_stream_and_the_context_restores_it():
    s = torch.spyre.Stream()
    default = torch.spyre.default_stream()
    x = torch.ones(8, device="spyre")
    torch.spyre.synchronize()
    at_default, at_s = default._stream.position, s._stream.position
    with torch.spyre.stream(s):
        assert torch.spyre.current_stream() == s
        y = x * 2
    assert torch.spyre.current_stream() == default
    assert s._stream.position == at_s + 1 and default._stream.position == at_default
    s.synchronize()
    assert y.cpu().tolist() == [2.0] * 8


def test_work_waits_behind_earlier_work_on_its_stream():
    s = torch.spyre.Stream()
    x = torch.ones(4, device="spyre")
    torch.spyre.synchronize()
    opened = gate(s)
    with torch.spyre.stream(s):
        y = x + 1
    assert not s.query()
    opened.set()
    s.synchronize()
    assert s.query() and y.cpu().tolist() == [2.0] * 4


def test_wait_stream_orders_work_across_streams():
    s1, s2 = torch.spyre.Stream(), torch.spyre.Stream()
    x = torch.ones(4, device="spyre")
    torch.spyre.synchronize()
    opened = gate(s1)
    with torch.spyre.stream(s1):
        y = x + 1
    s2.wait_stream(s1)
    with torch.spyre.stream(s2):
        z = y * 3
    assert not s2.query()  # s2 waits for s1, which waits for the gate
    opened.set()
    s2.synchronize()
    assert z.cpu().tolist() == [6.0] * 4


def test_streams_come_from_a_pool_of_the_cards_streams():
    streams = [torch.spyre.Stream() for _ in range(9)]
    assert len({s._stream for s in streams}) == 8  # torch.cuda draws from a pool the same way
    assert streams[0]._stream.card is streams[1]._stream.card


def test_synchronize_the_card_waits_for_every_stream():
    s = torch.spyre.Stream()
    x = torch.ones(4, device="spyre")
    torch.spyre.synchronize()
    opened = gate(s)
    with torch.spyre.stream(s):
        x.mul_(5)
    threading.Timer(0.05, opened.set).start()
    torch.spyre.synchronize()
    assert s.query()
    assert x.cpu().tolist() == [5.0] * 4


def test_a_stream_of_another_device_is_refused():
    with pytest.raises(ValueError, match="spyre"):
        torch.spyre.Stream(device="cpu")


def test_a_failed_kernel_is_raised_at_the_next_synchronize_naming_the_op():
    w = torch.ones(4, 2, device="spyre")
    idx = torch.tensor([1, 9]).to("spyre")
    out = torch.nn.functional.embedding(idx, w)  # enqueued: the index is checked on the card
    with pytest.raises(DeviceCommandError, match="aten::embedding") as err:
        torch.spyre.synchronize()
    assert isinstance(err.value.__cause__, IndexError)
    assert "9" in str(err.value.__cause__) and out.shape == (2, 2)


def test_a_spyre_stream_is_a_torch_stream_of_the_device():
    s = torch.spyre.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("spyre", 0)
    assert torch.spyre.default_stream().stream_id == 0 and s.stream_id > 0
