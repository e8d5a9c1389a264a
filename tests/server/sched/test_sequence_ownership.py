"""A Sequence's fields are written only by their owners (server/sched/sequence.py WRITERS): the
scheduler its scheduling state, the open requests how it ended, the output processor its text,
logprobs, grammar and timing, the updates what was sent. Read from every server module's
syntax tree: each assignment, augmented assignment, item assignment or mutating call on a
sequence's field (a name `seq`, `s`, or an attribute `.seq`, as the server's code names them)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from spyre_serve.server.sched.sequence import WRITERS, Sequence

SERVER = Path(__file__).resolve().parents[3] / "server"
FIELDS = {f.name for f in dataclasses.fields(Sequence)}
OWNER = {name: modules for names, modules in WRITERS.items() for name in names}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove"}


def _is_sequence(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("seq", "s")) or \
        (isinstance(node, ast.Attribute) and node.attr == "seq")


def _field(node: ast.expr) -> str | None:
    """The Sequence field `node` writes (seq.f, seq.f[i]), or None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS and _is_sequence(node.value):
        return node.attr
    return None


def writes(tree: ast.AST) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                name = _field(el)
                if name is not None:
                    out.append((name, node.lineno))
    return out


def test_every_field_but_the_requests_own_has_writers():
    request = {"seq_id", "request_id", "index", "prompt_ids", "params", "arrival"}
    assert set(OWNER) == FIELDS - request


def test_only_a_fields_writers_write_it():
    bad, seen = [], set()
    for path in sorted(SERVER.rglob("*.py")):
        rel = str(path.relative_to(SERVER))
        for name, line in writes(ast.parse(path.read_text())):
            seen.add(name)
            if rel not in OWNER[name]:
                bad.append(f"server/{rel}:{line} writes seq.{name} (its writers: {OWNER[name]})")
    assert not bad, "\n".join(bad)
    assert {"token_ids", "text", "num_tokens_sent", "error"} <= seen   # the scan sees writes


def test_the_scan_finds_each_kind_of_write():
    src = ("seq.text = 'a'\nseq.num_pending += 1\nc.seq.token_ids.append(3)\n"
           "seq.prompt_logprobs[0] = 1\nx.text = 1\n")
    assert sorted(n for n, _ in writes(ast.parse(src))) == ["num_pending", "prompt_logprobs", "text", "token_ids"]
