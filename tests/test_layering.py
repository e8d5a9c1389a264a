"""The layers import one way, and the server reaches the model layer through one door: every
import statement of every module, read from its syntax tree (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in the folder's modules."""
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(str(path.relative_to(ROOT)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.append((str(path.relative_to(ROOT)), node.lineno, node.module))
    return out


def test_the_server_imports_only_the_models_packages_public_names():
    bad = [f"{f}:{n} imports {m}" for f, n, m in imports("server") if m.startswith("spyre_serve.models.")]
    assert not bad, "server/ reaches spyre_serve.models through its public names:\n" + "\n".join(bad)


def test_each_layer_imports_none_above_it():
    above = {"device": ("spyre_serve.models", "spyre_serve.server"), "models": ("spyre_serve.server",)}
    bad = [f"{f}:{n} imports {m}" for layer, names in above.items() for f, n, m in imports(layer)
           if m.startswith(names)]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_imports_inside_functions():
    found = {m for _, _, m in imports("server")}
    assert "spyre_serve.models" in found                       # build_runner: inside cli's functions
    assert any(m.startswith("spyre_serve.device.") for m in found)
