"""A fleet's routing: the same replicas behind vllm-router with each policy, on a prefix workload.

``spyre-fleet`` starts --replicas granite-tiny replicas behind vllm-router with the fleet's
policy and thresholds (``deploy/fleet.py``'s ROUTER_FLAGS: cache_aware); beside it, more routers
on the same replicas: cache_aware with vllm-router's default thresholds, round_robin, and
power_of_two (the least loaded of two, by /get_load). Each round, every router in turn gets the
same shape of workload with prompts no earlier request sent (``deploy/loadtest/prefix_groups``:
--groups shared prefixes of --prefix-words words, --per-group suffixes each, shuffled), streamed
by ``spyre-loadtest`` at each --concurrency. Reported per router and concurrency (the median
over rounds): output tok/s, TTFT p50 and p99, the fleet's prefix-cache hit ratio (the replicas'
vllm:prefix_cache_hits over queries), how much of each group its most-used replica served (1.0:
every group stayed on one replica), and the busiest replica's share of the requests.

    python benchmarks/fleet.py                       # 3 replicas, c = 2 and 8, 2 rounds
    python benchmarks/fleet.py --quick               # 1 round, c = 8

Needs `make router` (vllm-router in .venv-router/). Writes a Markdown table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spyre_serve.deploy.fleet import ROUTER_FLAGS, router_command, wait_healthy  # noqa: E402
from spyre_serve.deploy.loadtest.prefix_groups import (  # noqa: E402
    GROUP_MAX_TOKENS,
    hit_ratio,
    prefix_groups,
    scrape,
    served,
)
from spyre_serve.device.isa import current  # noqa: E402

SERVE = ["--model", "granite-tiny", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
# router name -> its flags beyond --worker-urls (the fleet's own router is "fleet")
ROUTERS = {
    "cache_aware (vllm-router defaults)": ["--policy", "cache_aware"],
    "round_robin": ["--policy", "round_robin"],
    "power_of_two": ["--policy", "power_of_two"],
}


def one_run(front: str, replicas: list[str], work: Path, args, concurrency: int, seed: int) -> dict:
    data, out = work / f"w{seed}.jsonl", work / f"w{seed}.json"
    prefix_groups(data, args.groups, args.per_group, args.prefix_words, args.suffix_words, seed,
                  tuple(args.max_tokens))
    before = [scrape(u) for u in replicas]
    run = subprocess.run([sys.executable, "-m", "spyre_serve.deploy.loadtest", "--disable-tqdm", "--base-url", front,
                          "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts",
                          str(args.groups * args.per_group), "--concurrency", str(concurrency), "--num-warmups", "0",
                          "--ignore-eos", "--result-file", str(out)], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(run.stdout + run.stderr)
    after = [scrape(u) for u in replicas]
    m = json.loads(out.read_text())["points"][0]["metrics"]
    by_replica = [served(b, a, args.groups, tuple(args.max_tokens)) for b, a in zip(before, after, strict=True)]
    totals = [sum(r) for r in by_replica]
    sticky = statistics.mean(max(r[g] for r in by_replica) / args.per_group for g in range(args.groups))
    return {"output_tok_s": m["output_throughput"], "ttft_p50_ms": m["ttft_ms"]["median"],
            "ttft_p99_ms": m["ttft_ms"]["p99"], "hit_ratio": hit_ratio(before, after), "group_on_one": sticky,
            "busiest_share": max(totals) / max(1, sum(totals)), "failed": m["failed"], "by_replica": by_replica}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[2, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--suffix-words", type=int, default=16)
    p.add_argument("--max-tokens", type=int, nargs="+", default=list(GROUP_MAX_TOKENS),
                   help="each group's max_tokens, distinct 1-2-5 bucket edges (default 5 10 20 50 100 200)")
    p.add_argument("--cores-per-replica", type=int, default=0,
                   help="spyre-fleet's: pin each replica to its own cores (as separate machines)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fleet.json")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.concurrency = 1, [8]
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    port = 18400
    replicas = [f"http://127.0.0.1:{port + 1 + i}" for i in range(args.replicas)]
    fleet = subprocess.Popen([sys.executable, "-m", "spyre_serve.deploy.fleet", "--replicas", str(args.replicas),
                              "--port", str(port), "--metrics-port", "18490", "--log-dir", str(work),
                              "--cores-per-replica", str(args.cores_per_replica), "--", *SERVE],
                             cwd=ROOT)
    routers = {"fleet: " + " ".join(ROUTER_FLAGS[:8]): (f"http://127.0.0.1:{port}", None)}
    try:
        wait_healthy(routers[next(iter(routers))][0], fleet, 900)
        for i, (name, flags) in enumerate(ROUTERS.items()):
            url = f"http://127.0.0.1:{port + 50 + i}"
            proc = subprocess.Popen([router_command(), "--host", "127.0.0.1", "--port", str(port + 50 + i),
                                     "--prometheus-port", str(18491 + i), "--worker-urls", *replicas, *flags],
                                    stdout=open(work / f"router-{i}.log", "w"), stderr=subprocess.STDOUT)
            routers[name] = (url, proc)
            wait_healthy(url, proc, 900)
        results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.concurrency} for name in routers}
        seed = int(time.time())
        names = list(routers)
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in names[r % len(names):] + names[:r % len(names)]:     # a new order each round
                    seed += 1
                    results[name][c].append(one_run(routers[name][0], replicas, work, args, c, seed))
                    print(f"round {r} c={c} {name}: {results[name][c][-1]}", file=sys.stderr, flush=True)
    finally:
        for _, proc in routers.values():
            if proc is not None:
                proc.terminate()
        fleet.terminate()
        fleet.wait(120)
    isa = current().level
    summary = {name: {c: {k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "by_replica"}
                      for c, runs in per_c.items()} for name, per_c in results.items()}
    report = {"isa": isa, "cpu": platform.processor() or platform.machine(), "replicas": args.replicas,
              "cores_per_replica": args.cores_per_replica,
              "workload": {"groups": args.groups, "per_group": args.per_group, "prefix_words": args.prefix_words,
                           "max_tokens": args.max_tokens[:args.groups],
                           "suffix_words": args.suffix_words, "rounds": args.rounds},
              "summary": summary, "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    pinned = f", each pinned to {args.cores_per_replica} core(s)" if args.cores_per_replica else ", sharing the cores"
    print(f"\n{args.replicas} replicas of granite-tiny{pinned}, ISA {isa}; {args.groups} prefixes x {args.per_group} "
          f"suffixes, c = {args.concurrency}, median of {args.rounds} round(s)\n")
    print("| router | c | output tok/s | TTFT p50 ms | TTFT p99 ms | hit ratio | group on one replica | "
          "busiest replica's share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, per_c in summary.items():
        for c, s in per_c.items():
            print(f"| {name} | {c} | {s['output_tok_s']:.1f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                  f"{s['hit_ratio']:.2f} | {s['group_on_one']:.2f} | {s['busiest_share']:.2f} |")


if __name__ == "__main__":
    main()
