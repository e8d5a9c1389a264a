"""guidellm 0.8.1 (vLLM's ecosystem's load generator) pointed at this server unmodified, as a new
user would run it: its chat, completions, responses and embeddings request formats, 4 concurrent
streams of synthetic prompts (64 tokens, 32 out), every request completed with the token counts
asked for. guidellm lives in a venv of its own (benchmarks/peers/guidellm.sh makes it on first
use, ~1 min; it pins torch to the CPU build)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32


@pytest.fixture(scope="session")
def guidellm() -> str:
    out = subprocess.run(["bash", str(ROOT / "benchmarks/peers/guidellm.sh")], capture_output=True, text=True,
                         timeout=900, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
                                           **{k: v for k, v in __import__("os").environ.items()
                                              if k in ("HOME", "SPYRE_SERVE_PEERS_CACHE")}})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def run(guidellm: str, server, request_format: str, tmp_path, requests: int, output_tokens: bool = True) -> list[dict]:
    """The completed requests of one guidellm run (asserting none errored or was left incomplete)."""
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS}"
    data += f",output_tokens={OUTPUT_TOKENS}" if output_tokens else ""
    report = tmp_path / "report.json"
    cmd = [guidellm, "run",
           "--backend", f"kind=openai_http,target={server.url},model=granite-tiny,request_format={request_format}",
           "--profile", "kind=concurrent,streams=4", "--data", data,
           "--tokenizer", f"kind=hf_auto,model={server.built.model.path}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={report}", "--disable-console"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    done = json.loads(report.read_text())["benchmarks"][0]["requests"]
    assert not done["errored"] and not done["incomplete"], json.dumps(done["errored"][:1])[:2000]
    assert len(done["successful"]) == requests
    return done["successful"]


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_generation_formats_complete_with_the_token_counts_asked(guidellm, real_server, request_format, tmp_path):
    for r in run(guidellm, real_server, request_format, tmp_path, requests=8):
        assert r["output_tokens"] == OUTPUT_TOKENS, r["output_tokens"]
        # a completion's prompt is the synthetic text's tokens; a chat's adds its template
        assert (r["prompt_tokens"] == PROMPT_TOKENS if request_format == "/v1/completions"
                else r["prompt_tokens"] > PROMPT_TOKENS), r["prompt_tokens"]


def test_embeddings_format_completes(guidellm, pooling_server, tmp_path):
    for r in run(guidellm, pooling_server, "/v1/embeddings", tmp_path, requests=8, output_tokens=False):
        assert 0 < r["prompt_tokens"] <= PROMPT_TOKENS
