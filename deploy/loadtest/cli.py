"""`spyre-loadtest`: load-test an OpenAI-compatible server and report as vLLM does.

    spyre-loadtest --base-url http://127.0.0.1:8000 --input-len 128 --output-len 128 \\
        --num-prompts 64 --concurrency 1 8 32 --goodput ttft:500 tpot:50 \\
        --result-file run.json --plot run.png

Exit status: 0 when every request of every point completed, 1 otherwise,
2 for bad arguments or a server that cannot be asked for its model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import sys

import httpx

from .datasets import (
    jsonl_prompts,
    load_tokenizer,
    parse_id_range,
    random_prompts,
    sharegpt_prompts,
)
from .report import format_report
from .runner import Target, run_point, warm_up
from .stats import RequestResult, compute_metrics, parse_goodput


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="spyre-loadtest",
        description="Load-test an OpenAI-compatible server with streaming requests; "
                    "report TTFT, TPOT, ITL, E2EL and throughput as `vllm bench serve` does.")
    t = ap.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (default %(default)s)")
    t.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    t.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default $OPENAI_API_KEY)")
    d = ap.add_argument_group("prompts")
    d.add_argument("--dataset", choices=["random", "jsonl", "sharegpt"], default="random")
    d.add_argument("--dataset-path", help="the JSONL or ShareGPT file")
    d.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (default 128)")
    d.add_argument("--output-len", type=int, default=None,
                   help="max tokens per request (random default 128; files: per prompt)")
    d.add_argument("--token-id-range", default="100:8192",
                   help="random: ids drawn from LOW:HIGH (default %(default)s)")
    d.add_argument("--tokenizer", help="tokenizer.json (or its directory): decodes random ids "
                                       "for chat, counts ShareGPT reply lengths")
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask for exactly --output-len tokens (default: on for random prompts)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    ld = ap.add_argument_group("load (every loop is bounded in requests and time)")
    ld.add_argument("--num-prompts", type=int, default=50, help="requests per point (default 50)")
    ld.add_argument("--concurrency", type=int, nargs="+", default=[8],
                    help="max requests in flight; several values run a sweep (default 8)")
    ld.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s with gamma (Poisson at burstiness 1) arrivals (default inf)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape: <1 burstier, >1 more even (default 1)")
    ld.add_argument("--num-warmups", type=int, default=2, help="requests before measuring")
    ld.add_argument("--max-duration", type=float, default=600.0,
                    help="seconds per point before the rest is cancelled (default 600)")
    ld.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds per request (default 300)")
    o = ap.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--result-file", help="write the results as JSON")
    o.add_argument("--save-requests", action="store_true",
                   help="put every request's timings in the JSON result")
    o.add_argument("--plot", help="write a PNG of latency against throughput (needs matplotlib)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return ap


def first_model(target: Target) -> str:
    url = target.base_url.rstrip("/") + "/v1/models"
    r = httpx.get(url, headers=target.headers(), timeout=30)
    if r.status_code != 200:
        raise ValueError(f"GET {url}: HTTP {r.status_code}: {r.text[:200]} "
                         "(pass --model, or --api-key if the server wants one)")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"GET {url} lists no model; pass --model")
    return data[0]["id"]


def load_prompts(args, n: int, chat: bool, tokenizer) -> list:
    if args.dataset == "random":
        return random_prompts(n, args.input_len, args.output_len or 128,
                              parse_id_range(args.token_id_range), args.seed, tokenizer, chat)
    if not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "jsonl":
        return jsonl_prompts(args.dataset_path, n, args.output_len, chat)
    return sharegpt_prompts(args.dataset_path, n, args.output_len, chat, tokenizer)


def _request_dict(r: RequestResult) -> dict:
    return {"success": r.success, "start": r.start, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "ttft": r.ttft, "tpot": r.tpot,
            "latency": r.latency, "itl": r.itl, "finish_reason": r.finish_reason,
            "error": r.error}


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, unit="req", file=sys.stderr)


async def run(args) -> dict:
    target = Target(base_url=args.base_url, endpoint=args.endpoint, model=args.model or "",
                    api_key=args.api_key, temperature=args.temperature,
                    request_timeout=args.request_timeout)
    if not target.model:
        target.model = first_model(target)
    target.ignore_eos = args.dataset == "random" if args.ignore_eos is None else args.ignore_eos
    slos = parse_goodput(args.goodput)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts = load_prompts(args, args.num_prompts + args.num_warmups, target.chat, tokenizer)
    measured, warm = prompts[:args.num_prompts], prompts[args.num_prompts:]

    out: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                 "config": {k: v for k, v in vars(args).items() if k != "api_key"},
                 "model": target.model, "ignore_eos": target.ignore_eos, "points": []}
    out["config"]["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    if warm:
        print(f"Warming up with {len(warm)} request(s)...", file=sys.stderr)
        w = await warm_up(target, warm, args.concurrency[0])
        ok = [r for r in w.results if r.success]
        out["warmup"] = {"requests": len(warm), "completed": len(ok),
                         "prompt_tokens": sum(r.prompt_tokens for r in ok),
                         "output_tokens": sum(r.output_tokens for r in ok)}
        if len(ok) < len(warm):
            errors = sorted({r.error for r in w.results if not r.success})
            print(f"warm-up: {len(warm) - len(ok)} request(s) failed: {errors[:3]}",
                  file=sys.stderr)
    for c in args.concurrency:
        bar = _progress(len(measured), f"concurrency {c}", args.disable_tqdm)
        try:
            p = await run_point(target, measured, c, args.request_rate, args.burstiness,
                                args.seed, args.max_duration, bar)
        finally:
            bar.close()
        m = compute_metrics(p.results, p.duration_s, slos)
        print(format_report(m, c, args.request_rate, p.not_sent))
        errors = sorted({r.error for r in p.results if not r.success})
        if errors:
            print(f"errors ({len(errors)} kinds): " + "; ".join(errors[:5]))
        point = {"concurrency": c, "request_rate": out["config"]["request_rate"],
                 "burstiness": args.burstiness, "num_prompts": len(measured),
                 "not_sent": p.not_sent, "errors": errors, "metrics": m.to_dict()}
        if args.save_requests:
            point["requests"] = [_request_dict(r) for r in p.results]
        out["points"].append(point)
    return out


def validate(ap: argparse.ArgumentParser, args) -> None:
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.num_warmups < 0:
        ap.error("--num-warmups must be >= 0")
    if any(c < 1 for c in args.concurrency):
        ap.error("--concurrency values must be >= 1")
    if not args.max_duration > 0 or not args.request_timeout > 0:
        ap.error("--max-duration and --request-timeout must be > 0")
    if not args.request_rate > 0 or not args.burstiness > 0:
        ap.error("--request-rate and --burstiness must be > 0")
    try:
        parse_goodput(args.goodput)
        parse_id_range(args.token_id_range)
    except ValueError as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    validate(ap, args)
    try:
        out = asyncio.run(run(args))
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"spyre-loadtest: {e}", file=sys.stderr)
        return 2
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        from .plot import plot_sweep

        plot_sweep(out["points"], args.plot)
    all_ok = all(p["metrics"]["failed"] == 0 and p["not_sent"] == 0 for p in out["points"])
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
