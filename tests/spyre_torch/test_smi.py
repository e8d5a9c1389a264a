"""spyre-smi against a real spyre-serve (uvicorn on 127.0.0.1, started here) and in-process."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from spyre_torch import smi

SMI = str(Path(sys.executable).parent / "spyre-smi")


@pytest.fixture(scope="module")
def server():
    from spyre_serve.server.launch.cli import build
    from tests.server.servers import ServerThread, real_settings

    built = build(real_settings(max_num_seqs=4), progress=False)
    with ServerThread(built.app) as s:
        s.built = built
        # one request first: its step programs compile now (a cold Numba cache takes a while),
        # not during the interval smi samples
        r = httpx.post(f"{s.url}/v1/completions", timeout=600,
                       json={"prompt": "The river", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        yield s
    built.engine.shutdown()


def _busy(url: str, stop: threading.Event) -> None:
    """Completions one after another until `stop`: the card has work while smi samples."""
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            r = c.post("/v1/completions", json={"prompt": "The river", "max_tokens": 32,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text


def _columns(line: str) -> dict:
    f = line.split()
    return {"card": f[1], "busy": float(f[2].rstrip("%")), "used": float(f[3][:-3]),
            "peak": float(f[4][:-3]), "total": float(f[5][:-3]), "launch_s": float(f[6]),
            "h2d": float(f[7]), "d2h": float(f[8]), "compiles": int(f[9])}


def test_once_prints_one_line_for_the_servers_card_while_it_works(server):
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(server.url, stop))
    worker.start()
    try:
        r = subprocess.run([SMI, "--url", server.url, "--once", "--interval", "1.0"],
                           capture_output=True, text=True, timeout=60)
    finally:
        stop.set()
        worker.join()
    assert r.returncode == 0, r.stderr
    header, line = r.stdout.splitlines()
    assert header.split()[1:4] == ["time", "card", "busy%"]
    c = _columns(line)
    card = server.built.card
    assert c["card"] == "0" and c["total"] == pytest.approx(card.capacity / (1 << 20), abs=0.1)
    assert 0 < c["used"] <= c["peak"] <= c["total"]
    assert c["launch_s"] > 0 and 0 < c["busy"] <= 100 and c["h2d"] > 0 and c["d2h"] > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'spyre_compiles_after_warmup{{model_name="granite-tiny"}} {c["compiles"]}.0' in metrics


def test_the_server_exports_what_smi_reads(server):
    text = httpx.get(f"{server.url}/metrics").text
    (sample,) = smi.parse_metrics(text, 0.0)
    assert sample.mem_total == server.built.card.capacity
    assert sample.h2d_bytes >= 0 and sample.d2h_bytes >= 0 and sample.launches >= 0


def test_count_prints_that_many_lines():
    stats = "\n".join([
        'spyre_launches_total{model_name="a"} 10', 'spyre_launches_total{model_name="b"} 20',
        'spyre_device_compute_seconds_total{model_name="a"} 1', 'spyre_device_compute_seconds_total{model_name="b"} 2',
        'spyre_device_memory_used_bytes{model_name="a"} 3', 'spyre_device_memory_used_bytes{model_name="b"} 4', ""])
    cards = smi.parse_metrics(stats, 0.0)  # two label sets: two cards, one line each
    assert [c.card for c in cards] == ["0", "1"] and [c.launches for c in cards] == [10, 20]


def test_an_unreachable_server_is_an_error_naming_the_url():
    r = subprocess.run([SMI, "--url", "http://127.0.0.1:9", "--once", "--interval", "0.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read http://127.0.0.1:9" in r.stderr


def test_a_server_without_spyre_series_is_refused():
    with pytest.raises(ValueError, match="spyre-serve"):
        smi.parse_metrics("other_metric 1\n", 0.0)


def test_in_process_monitor_prints_a_line_per_interval():
    out = io.StringIO()
    a = torch.randn(256, 256).to("spyre")
    with smi.monitor(interval=0.2, out=out):
        for _ in range(40):
            (a @ a).sum().item()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("# ") and len(lines) >= 2
    c = _columns(lines[-1])
    assert c["total"] == pytest.approx(torch.spyre.get_device_properties().total_memory / (1 << 20), abs=0.1)
    assert sum(_columns(line)["launch_s"] for line in lines[1:]) > 0
