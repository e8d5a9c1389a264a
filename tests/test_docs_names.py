"""What the docs name in backticks exists: a file or folder path, a dotted name in one of our
packages, a function or class written as a call (`name(...)`) defined in our source, and a
bare snake_case or CamelCase name found in it. The
docs are maps; the code's names and docstrings complete them, and this keeps the maps true."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("*/README.md")])
PACKAGES = ("device", "models", "server", "spyre_torch", "deploy", "benchmarks")
SOURCES = [p for pkg in (*PACKAGES, "scripts") for p in (ROOT / pkg).rglob("*.py")]
# callables of other projects the docs name as calls
# (torch's tensor methods, CUDA's runtime; `entry(...)`: the ABI every program entry has)
EXTERNAL = {"data_ptr", "cpu", "copy_", "cudaMemcpyAsync", "replay", "entry",
            "kubernetes_sd_configs"}   # (and Prometheus's config key)

_TICKS = re.compile(r"`([^`\n]+)`")
# a path: folders, then a file with an extension or a trailing slash (k8s annotation keys such
# as prometheus.io/scrape are not: their first part has a dot)
_PATH = re.compile(r"^(?:\.\./)*(?:[\w-]+/)+(?:[\w-]+\.\w+)?$")
_DOTTED = re.compile(r"^(?:spyre_serve\.)?(" + "|".join(PACKAGES) + r")(?:\.\w+)+$")
LAYERS = ("device", "models", "server", "deploy")   # installed as spyre_serve.<folder>
_CALL = re.compile(r"^([A-Za-z_][\w.]*)\(")


_NAME = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$|^(?:[A-Z][a-z0-9]+){2,}$")  # snake_case, CamelCase


def _words() -> set[str]:
    """Every identifier in our source, tests and deployment files, and their file names (a bare
    name in the docs must be one of them)."""
    files = [p for d in (*PACKAGES, "tests", "scripts") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".conf", ".yaml", ".yml", ".json", ".sh", ".toml", ".j2")]
    return ({w for p in files for w in re.findall(r"\w+", p.read_text(errors="replace"))}
            | {p.stem for p in files})


def _defined() -> set[str]:
    names = set()
    for p in SOURCES:
        names.update(re.findall(r"^\s*(?:def|class)\s+(\w+)", p.read_text(), re.M))
        names.update(re.findall(r"^(\w+)\s*=", p.read_text(), re.M))
        names.update(re.findall(r"\bimport \w+ as (\w+)", p.read_text()))
    return names


def _mentions():
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for text in _TICKS.findall(line):
                yield doc, line_no, text.strip()


def _resolves(dotted: str) -> bool:
    """A dotted name the docs give by its folder (`models.step.program.X`) or by its installed
    name (`spyre_serve.models.step.program.X`) is looked up under the installed name."""
    if dotted.split(".")[0] in LAYERS:
        dotted = "spyre_serve." + dotted
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _problems() -> list[str]:
    defined = _defined()
    words = _words()
    out = []
    for doc, line_no, text in _mentions():
        where = f"{doc.relative_to(ROOT)}:{line_no}: `{text}`"
        if _PATH.match(text) and not text.startswith(("http", "/", "~")) and "*" not in text:
            path = (doc.parent / text) if text.startswith("../") else ROOT / text
            if "/" in text and not path.exists() and not (ROOT / text).exists() \
                    and not (doc.parent / text).exists():
                out.append(f"{where}: no such file or folder")
        elif _DOTTED.match(text) and not re.search(r"\.(py|md|json|toml|sh)$", text) \
                and not _resolves(text):
            out.append(f"{where}: not importable")
        elif (m := _CALL.match(text)) and "/" not in text:
            name = m.group(1)
            last = name.split(".")[-1]
            if last not in EXTERNAL and last not in defined:
                out.append(f"{where}: {last} is defined nowhere in our source")
        elif _NAME.match(text) and text not in words and text not in EXTERNAL:
            out.append(f"{where}: no identifier {text} in our source")
    return out


def test_every_name_the_docs_give_in_backticks_exists():
    problems = _problems()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text,ok", [("device/kernels/gemm/packed.py", True), ("device/nope.py", False),
                                     ("models.step.program.SAMPLE_ROW", True),
                                     ("models.step.program.NOPE", False)])
def test_the_check_itself_tells_a_name_that_exists_from_one_that_does_not(text, ok):
    if "/" in text:
        assert (ROOT / text).exists() == ok
    else:
        assert _resolves(text) == ok
