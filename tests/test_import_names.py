"""The layers install under one unique name: `spyre_serve.device`, `spyre_serve.models`,
`spyre_serve.server`, `spyre_serve.deploy` (setup.py maps the folders). Nothing imports a layer
by its bare folder name, which from the checkout's root would load a second copy of it (two
module states, two compile caches), and outside the checkout names nothing of ours."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("device", "models", "server", "deploy")
TREES = (*LAYERS, "spyre_torch", "tests", "benchmarks", "examples", "scripts")


def _bare_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`import models...` / `from server... import` lines of one file (docstring snippets run as
    code are parsed too: a string holding an import statement of a layer counts)."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "import" in node.value:
            try:
                out += [f"{path.relative_to(root)}: a code string: {name}"
                        for name in _names(ast.parse(node.value))]
            except SyntaxError:
                pass
            continue
        else:
            continue
        out += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                if n.split(".")[0] in LAYERS]
    return out


def _names(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in LAYERS]


def test_no_file_imports_a_layer_by_its_folder_name():
    files = [p for t in TREES for p in (ROOT / t).rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 200
    found = [line for p in files for line in _bare_imports(p)]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_bare_import(tmp_path):
    bare = "from " + "models.config import X"        # (split: this file is scanned too)
    (tmp_path / "x.py").write_text(f'import os\n{bare}\nS = "import " + "x"\nT = "{bare}"\n')
    assert sorted(_bare_imports(tmp_path / "x.py", tmp_path)) == \
        ["x.py: a code string: models.config", "x.py:2: models.config"]


def test_outside_the_checkout_only_the_unique_names_import(tmp_path):
    code = ("import importlib.util as u\n"
            "import spyre_serve.server.launch.cli, spyre_serve.models.config, spyre_serve.device.isa\n"
            "import spyre_serve.deploy.loadtest, spyre_torch\n"
            "print([n for n in ('device', 'models', 'server', 'deploy') if u.find_spec(n)])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                      "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
