"""Read the top-level Dockerfile into stages of (instruction, argument) pairs.

Enough of the format for the image test: comments, line continuations, ``FROM`` stages,
``ENV`` in key=value form and the exec (JSON) form of ``CMD``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.steps if i == instruction]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for arg in self.args("ENV"):
            for pair in shlex.split(arg):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"ENV {arg!r}: use the KEY=VALUE form")
                out[key] = value
        return out

    def cmd(self) -> list[str]:
        (arg,) = self.args("CMD")[-1:]
        return json.loads(arg)

    def runs_after_user(self) -> list[str]:
        """RUN commands that run as the image's final user (after its USER)."""
        seen_user, out = False, []
        for i, a in self.steps:
            seen_user = seen_user or i == "USER"
            if seen_user and i == "RUN":
                out.append(a)
        return out

    def copies(self) -> list[tuple[list[str], str]]:
        """COPY from the build context (not --from): (sources, destination)."""
        out = []
        for arg in self.args("COPY"):
            words = shlex.split(arg)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            out.append((words[:-1], words[-1]))
        return out


def parse(path: Path) -> list[Stage]:
    logical: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    stages: list[Stage] = []
    for line in logical:
        instruction, _, arg = line.partition(" ")
        instruction, arg = instruction.upper(), arg.strip()
        if instruction == "FROM":
            words = arg.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name))
        elif stages:
            stages[-1].steps.append((instruction, arg))
    return stages
