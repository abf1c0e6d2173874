"""The architecture as a test: the library never imports the trainers, the lab or the command line,
and trainers never import the lab or the command line. A failure names the module and the import."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent / "src" / "posttrain"
LIBRARY = ("odc", "dp", "balance", "pipeline", "sim", "models", "data", "rl", "spans.py", "launch.py", "_compat.py")
LAYERS = {"library": LIBRARY, "train": ("train",), "lab": ("lab",)}
FORBIDDEN = {"library": ("posttrain.train", "posttrain.lab", "posttrain.cli"),
             "train": ("posttrain.lab", "posttrain.cli"), "lab": ("posttrain.cli",)}


def _modules(parts):
    for part in parts:
        path = ROOT / part
        yield from ([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))


def _imports(path: pathlib.Path):
    package = ".".join(("posttrain", *path.relative_to(ROOT).with_suffix("").parts[:-1]))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join([*base, node.module] if node.module else base)
            else:
                yield node.module


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_layer_imports_only_the_layers_below_it(layer):
    bad = [(str(p.relative_to(ROOT)), name) for p in _modules(LAYERS[layer]) for name in _imports(p)
           if name and name.startswith(FORBIDDEN[layer])]
    assert not bad, f"{layer} imports what builds on it: {bad}"


def test_no_module_imports_another_modules_private_names():
    """No ``from posttrain.x import _name`` across modules, and private torch names only in
    ``posttrain/_compat.py`` (the one fence, which checks the torch version)."""
    bad = []
    for path in ROOT.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and a.name != "_compat"]
            torch_private = node.module.startswith("torch") and any(p.startswith("_") for p in node.module.split("."))
            if (node.module.startswith("posttrain") and private) or torch_private:
                bad.append((str(path.relative_to(ROOT)), node.module, private))
    assert not bad, bad
