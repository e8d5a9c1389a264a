"""Device benchmark: machine limits, GEMM against peers, host time per launch.

All figures come from one run on this machine, printed as tables and written
to benchmarks/results/device.json:

1. machine limits (benchmarks/limits.py): memory read bandwidth (GB/s), and the FMA rate of
   the GEMM's microkernel on data in L1 on every core (GFLOP/s);
2. GEMM GFLOP/s at SmolLM2-135M and Granite 3.3 8B layer shapes: the card's packed GEMM
   (weights placed once in panels, fp32 and bf16), BLAS's sgemm, torch's matmul and torch's
   oneDNN linear with the weight reordered once, all at the same thread count; best of a
   few runs each;
3. host time per launch of a 10-kernel program (patching included) against
   the same 10 kernels as 10 one-kernel programs, and as 10 direct calls from
   Python with the bindings turned into arena views on every step.

    .venv/bin/python benchmarks/card.py [--quick]

Run it as a script only: its njit entries are cached by Numba under the module
name `__main__`, and loading that cache into the file imported under another
name crashed (seen once, with importlib). The repository root goes first on sys.path (for
`benchmarks.limits`); the project itself is imported by its installed name, `spyre_serve`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spyre_serve.device.process import configure  # noqa: E402

configure()   # threads, ISA level, compile cache: before any kernel is imported

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from benchmarks.limits import bandwidth, best_of, blas_gemm, fma_peak  # noqa: E402
from spyre_serve.device import Card, Program, Slot  # noqa: E402
from spyre_serve.device.abi import f32_at  # noqa: E402
from spyre_serve.device.kernels.activation import swiglu  # noqa: E402
from spyre_serve.device.kernels.formats import FMT_BF16, FMT_F32, packed_size  # noqa: E402
from spyre_serve.device.kernels.gemm.inputs import ACT_F32  # noqa: E402
from spyre_serve.device.kernels.gemm.packed import gemm_packed  # noqa: E402
from spyre_serve.device.kernels.norm import rmsnorm  # noqa: E402
from spyre_serve.device.kernels.residual import residual_add  # noqa: E402
from spyre_serve.device.layout import pack  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "device.json"
GEMM_M = (1, 8, 32, 512)
GEMM_KN = {
    # SmolLM2-135M (the real model of the serving benchmark): hidden 576, 3 KV heads x 64, MLP 1536
    "smollm2 qkv 576x960": (576, 960),
    "smollm2 gate_up 576x3072": (576, 3072),
    "smollm2 down 1536x576": (1536, 576),
    "smollm2 lm_head 576x49152": (576, 49152),
    # Granite 3.3 8B: hidden 4096, 8 KV heads x 128, MLP 12800
    "granite8b attn_out 4096x4096": (4096, 4096),
    "granite8b qkv 4096x6144": (4096, 6144),
    "granite8b gate_up 4096x25600": (4096, 25600),
    "granite8b down 12800x4096": (12800, 4096),
}


def best_of_each(fns, *, budget):
    """Best wall time of each fn in `fns` (name -> fn), one after the other. Between peers the
    machine idles 0.2 s: BLAS and OpenMP pools spin after a call, and on a small machine a
    spinning pool of one library steals the cores of the next (interleaving them measured that)."""
    best = {}
    for name, fn in fns.items():
        time.sleep(0.2)
        best[name] = best_of(fn, budget=budget)
    return best


# ---- 2. GEMM -------------------------------------------------------------------------


def bench_gemm(threads, quick):
    """GFLOP/s of out = a @ W at each shape and M: the card's packed GEMM on float32 and on
    bf16 weights (W placed once, never repacked), BLAS's sgemm (repacks W on every call for
    M >= 2), torch's matmul, and torch's oneDNN linear with W reordered once for the batch
    (mkldnn._reorder_linear_weight / _linear_pointwise: the fastest stationary-weight path
    torch has on the CPU)."""
    import torch

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    rows = []
    kns = {k: v for k, v in GEMM_KN.items() if "qkv" in k} if quick else GEMM_KN
    for label, (k, n) in kns.items():
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        w32, w16 = pack(w, FMT_F32).reshape(-1), pack(w, FMT_BF16).reshape(-1)
        wt = torch.from_numpy(np.ascontiguousarray(w.T))                       # [N, K]
        for m in GEMM_M:
            if m * n > 512 * 25600 and k * n > 4096 * 25600 // 2:
                continue                         # the 8B gate_up at M=512: minutes on 2 cores
            a = rng.standard_normal((m, k), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            a_t = torch.from_numpy(a)
            reordered = torch.ops.mkldnn._reorder_linear_weight(wt, m)
            def run(name, out=out, a=a, a_t=a_t, w=w, w32=w32, w16=w16, wt=wt, r=reordered, k=k, n=n):
                return {"packed_f32": lambda: gemm_packed(out, a, w32, k, n, FMT_F32, ACT_F32),
                        "packed_bf16": lambda: gemm_packed(out, a, w16, k, n, FMT_BF16, ACT_F32),
                        "blas": lambda: blas_gemm(out, a, w),
                        "torch": lambda: torch.nn.functional.linear(a_t, wt),
                        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(a_t, r, None, "none",
                                                                             [], "")}[name]
            names = ("packed_f32", "packed_bf16", "blas", "torch", "onednn")
            secs = best_of_each({name: run(name) for name in names}, budget=0.6 if quick else 1.2)
            flops = 2.0 * m * k * n
            row = {"shape": label, "M": m, "K": k, "N": n}
            row.update({f"{name}_gflops": flops / t / 1e9 for name, t in secs.items()})
            row["packed_f32_weight_gbs"] = 4.0 * k * n / secs["packed_f32"] / 1e9
            row["packed_over_blas"] = secs["blas"] / secs["packed_f32"]
            row["packed_over_onednn"] = secs["onednn"] / secs["packed_f32"]
            rows.append(row)
            print(f"  {label:28s} M={m:4d}  packed f32 {row['packed_f32_gflops']:6.1f}  bf16 "
                  f"{row['packed_bf16_gflops']:6.1f}  blas {row['blas_gflops']:6.1f}  torch "
                  f"{row['torch_gflops']:6.1f}  onednn {row['onednn_gflops']:6.1f} GFLOP/s",
                  flush=True)
    return rows


# ---- 3. host time per launch ---------------------------------------------------------
# A 10-kernel program: two MLP blocks (norm, up, swiglu, down, residual) on small tensors.
# slots: 8 addresses, then T, H, I
LAUNCH_SLOTS = [Slot(n, "address") for n in ("x", "wn", "h", "w1", "gu", "act", "w2", "y")] + [
    Slot("T", "dim"), Slot("H", "dim"), Slot("I", "dim")]
EPS = 1e-5


@njit(nogil=True, cache=True)
def _views(f32, table):
    t, h, i = table[8], table[9], table[10]
    x = f32_at(f32, table[0], t * h).reshape((t, h))
    wn = f32_at(f32, table[1], h)
    hh = f32_at(f32, table[2], t * h).reshape((t, h))
    w1 = f32_at(f32, table[3], packed_size(h, 2 * i))              # packed W [h, 2i]
    gu = f32_at(f32, table[4], t * 2 * i).reshape((t, 2 * i))
    act = f32_at(f32, table[5], t * i).reshape((t, i))
    w2 = f32_at(f32, table[6], packed_size(i, h))                  # packed W [i, h]
    y = f32_at(f32, table[7], t * h).reshape((t, h))
    return x, wn, hh, w1, gu, act, w2, y


@njit(nogil=True, cache=True)
def ten_kernel_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    for _ in range(2):  # 5 kernels per block, 2 blocks
        rmsnorm(hh, x, wn, EPS)
        gemm_packed(gu, hh, w1, hh.shape[1], gu.shape[1], FMT_F32, ACT_F32)
        swiglu(act, gu)
        gemm_packed(y, act, w2, act.shape[1], y.shape[1], FMT_F32, ACT_F32)
        residual_add(x, y, 0.22)


@njit(nogil=True, cache=True)
def rmsnorm_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    rmsnorm(hh, x, wn, EPS)


@njit(nogil=True, cache=True)
def up_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    gemm_packed(gu, hh, w1, hh.shape[1], gu.shape[1], FMT_F32, ACT_F32)


@njit(nogil=True, cache=True)
def swiglu_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    swiglu(act, gu)


@njit(nogil=True, cache=True)
def down_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    gemm_packed(y, act, w2, act.shape[1], y.shape[1], FMT_F32, ACT_F32)


@njit(nogil=True, cache=True)
def residual_entry(f32, i32, i64, u16, table):
    x, wn, hh, w1, gu, act, w2, y = _views(f32, table)
    residual_add(x, y, 0.22)


def bench_launch(card, steps):
    t_, h_, i_ = 4, 64, 128
    rng = np.random.default_rng(1)
    shapes = {"x": (t_, h_), "wn": (h_,), "h": (t_, h_), "w1": (h_, 2 * i_), "gu": (t_, 2 * i_),
              "act": (t_, i_), "w2": (i_, h_), "y": (t_, h_)}
    tensors = {}
    for name, shape in shapes.items():
        host = rng.standard_normal(shape, dtype=np.float32) * 0.1
        if name in ("w1", "w2"):
            host = pack(host, FMT_F32).reshape(-1)        # weights in the GEMM's panel layout
        tensors[name] = card.empty(host.shape, np.float32)
        tensors[name].numpy()[:] = host
    bindings = dict(tensors, T=t_, H=h_, I=i_)
    stream = card.new_stream("bench", depth=10 * steps + 16)  # deep enough that launch never waits

    def host_and_total(launch_step):
        """(host us/step median, mean) with the stream held by a gate, so only the host runs;
        then total us/step with host and device running freely (overlapped)."""
        for _ in range(20):
            launch_step()
        stream.synchronize()
        gate = threading.Event()
        stream.enqueue(gate.wait, compute=False)
        host = []
        for _ in range(steps):
            h0 = time.perf_counter()
            launch_step()
            host.append(time.perf_counter() - h0)
        gate.set()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            launch_step()
        stream.synchronize()
        total = (time.perf_counter() - t0) / steps
        return float(np.median(host)) * 1e6, float(np.mean(host)) * 1e6, total * 1e6

    prog = Program(card, "ten_kernels", ten_kernel_entry, LAUNCH_SLOTS).prepare()
    one_entries = (rmsnorm_entry, up_entry, swiglu_entry, down_entry, residual_entry) * 2
    singles = [Program(card, f"k{j}", e, LAUNCH_SLOTS).prepare() for j, e in enumerate(one_entries)]

    res = {}
    c0 = card.counters.snapshot()
    res["program_10_kernels"] = host_and_total(lambda: prog.launch(stream, bindings))
    c1 = card.counters.snapshot()
    res["counters_launch_host_us"] = 1e6 * (c1["launch_host_seconds"] - c0["launch_host_seconds"]) / (
        c1["launches"] - c0["launches"])

    def ten_programs():
        for p in singles:
            p.launch(stream, bindings)

    res["ten_one_kernel_programs"] = host_and_total(ten_programs)

    def direct_calls():  # synchronous on the host thread; the gate does not hold it
        v = {name: t.numpy() for name, t in tensors.items()}  # bindings -> views, every step
        for _ in range(2):
            rmsnorm(v["h"], v["x"], v["wn"], EPS)
            gemm_packed(v["gu"], v["h"], v["w1"], h_, 2 * i_, FMT_F32, ACT_F32)
            swiglu(v["act"], v["gu"])
            gemm_packed(v["y"], v["act"], v["w2"], i_, h_, FMT_F32, ACT_F32)
            residual_add(v["x"], v["y"], 0.22)

    res["direct_python_calls"] = host_and_total(direct_calls)
    # a compiled call of the entry itself, no stream: the device time of one step
    table = prog._h2d_dst
    ep = prog._compute.fn
    res["device_us_per_step"] = best_of(lambda: ep(card.f32, card.i32, card.i64, card.u16, table), min_reps=200,
                                        max_reps=2000, budget=0.3) * 1e6
    stream.close()
    return res


def main():
    quick = "--quick" in sys.argv
    threads = numba.get_num_threads()
    t_start = time.perf_counter()
    card = Card(memory_bytes=1 << 30)
    print(f"device benchmark: {os.cpu_count()} CPUs, numba {numba.__version__} threads={threads}, "
          f"numpy {np.__version__}", flush=True)

    print("1. machine limits: memory read bandwidth, the microkernel's FMA rate in L1", flush=True)
    bw = bandwidth(64 << 20 if quick else 512 << 20)
    fma = fma_peak()
    print(f"  numpy sum {bw['numpy_sum_gbs']:.1f} GB/s, njit read {bw['njit_read_gbs']:.1f} GB/s "
          f"-> machine {bw['machine_gbs']:.1f} GB/s; FMA peak {fma:.1f} GFLOP/s", flush=True)

    print(f"2. GEMM GFLOP/s ({threads} threads everywhere)", flush=True)
    rows = bench_gemm(threads, quick)

    print("3. host time per step of 10 kernels (small tensors: T=4, H=64, I=128)", flush=True)
    launch = bench_launch(card, 500 if quick else 3000)
    threading_layer = numba.threading_layer()
    import torch

    report = {
        "machine": {"cpus": os.cpu_count(), "numba_threads": threads, "threading_layer": threading_layer,
                    "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "numba": numba.__version__, "torch": torch.__version__},
        "memory_bandwidth": bw,
        "fma_peak_gflops": fma,
        "gemm": rows,
        "launch": launch,
        "targets": {
            "gemm_packed_over_onednn_min_M_ge_8": min(
                (r["packed_over_onednn"] for r in rows if r["M"] >= 8), default=None),
            "gemm_packed_over_blas_min_M_ge_8": min(
                (r["packed_over_blas"] for r in rows if r["M"] >= 8), default=None),
            "launch_host_us_median": launch["program_10_kernels"][0],
            "launch_target_us": 50.0,
        },
        "seconds": time.perf_counter() - t_start,
        "quick": quick,
    }
    print_tables(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS} ({report['seconds']:.0f} s)")
    card.close()


def print_tables(r):
    bw = r["memory_bandwidth"]
    print("\n| measurement | value |\n| --- | --- |")
    print(f"| memory read bandwidth, numpy sum | {bw['numpy_sum_gbs']:.1f} GB/s |")
    print(f"| memory read bandwidth, njit parallel read | {bw['njit_read_gbs']:.1f} GB/s |")
    print(f"| FMA peak (microkernel, data in L1, every core) | {r['fma_peak_gflops']:.1f} GFLOP/s |")
    print("\n| shape (KxN) | M | packed f32 | packed bf16 | BLAS | torch | oneDNN reordered | "
          "packed / BLAS | packed / oneDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in r["gemm"]:
        print(f"| {g['shape']} | {g['M']} | {g['packed_f32_gflops']:.1f} | {g['packed_bf16_gflops']:.1f} | "
              f"{g['blas_gflops']:.1f} | {g['torch_gflops']:.1f} | {g['onednn_gflops']:.1f} | "
              f"{g['packed_over_blas']:.2f} | {g['packed_over_onednn']:.2f} |")
    la = r["launch"]
    print("\n| 10 kernels per step, launched as | host us/step, median (stream held) | host us/step, mean | "
          "total us/step (host and device free-running) |")
    print("| --- | --- | --- | --- |")
    names = {
        "program_10_kernels": "one 10-kernel program (Program.launch, 11 slots patched)",
        "ten_one_kernel_programs": "10 one-kernel programs (10 Program.launch)",
        "direct_python_calls": "10 direct njit calls from Python, views rebuilt per step (synchronous)",
    }
    for key, label in names.items():
        med, mean, total = la[key]
        print(f"| {label} | {med:.1f} | {mean:.1f} | {total:.1f} |")
    print(f"\ndevice time of one 10-kernel step (compiled entry called directly): {la['device_us_per_step']:.1f} us;"
          f" counters say {la['counters_launch_host_us']:.1f} us host per launch")
    t = r["targets"]
    print(f"packed f32 GEMM for M >= 8, the worst shape: {t['gemm_packed_over_blas_min_M_ge_8']:.2f}x BLAS, "
          f"{t['gemm_packed_over_onednn_min_M_ge_8']:.2f}x oneDNN; host per launch "
          f"{t['launch_host_us_median']:.1f} us (want <= 50)")


if __name__ == "__main__":
    main()
