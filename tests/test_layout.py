"""The architecture as a test: the library never imports the trainers, the lab or the command line,
and trainers never import the lab or the command line. A failure names the module and the import."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent / "src" / "posttrain"
LIBRARY = ("odc", "dp", "balance", "pipeline", "sim", "models", "data", "rl", "device.py", "spans.py", "launch.py",
           "_compat.py")
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


#: Inside the trainer layer: the core is below every trainer, and trainers do not import each
#: other (the pipeline trainer builds on supervised fine-tuning's data and loss, not the reverse).
TRAINERS = {
    "train/core": ("posttrain.train.sft", "posttrain.train.rl"),
    "train/rl": ("posttrain.train.sft",),
    "train/sft": ("posttrain.train.rl", "posttrain.train.sft.pipeline"),
}


@pytest.mark.parametrize("part", list(TRAINERS))
def test_the_trainer_core_is_below_every_trainer_and_trainers_do_not_import_each_other(part):
    paths = [p for p in (ROOT / part).rglob("*.py")
             if part != "train/sft" or "pipeline" not in p.relative_to(ROOT / part).parts]
    bad = [(str(p.relative_to(ROOT)), name) for p in paths for name in _imports(p)
           if name and name.startswith(TRAINERS[part])]
    assert not bad, f"{part} imports what builds on it or beside it: {bad}"


def import_pairs(root: pathlib.Path) -> list[tuple[str, str]]:
    """The pairs of modules under ``root`` (a package folder) that import each other, wherever the
    import stands (a module's top or inside a function: a deferred import hides the same knot),
    each import resolved to the module it names (``from pkg.mod import name`` -> ``pkg.mod``)."""
    top = root.name

    def name_of(p):
        parts = p.relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in root.rglob("*.py")}

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            out |= {r for n in names if n.split(".")[0] == top and (r := resolve(n)) and r != mod}
        graph[mod] = out
    return sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})


def test_no_two_modules_import_each_other():
    """Within a package too: what two modules both need goes where both can import it."""
    assert import_pairs(ROOT) == []


def test_the_import_pair_check_finds_a_planted_pair(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from pkg.sub.a import f  # deferred: still a pair\n    return f\n")
    (pkg / "c.py").write_text("from pkg.sub import a\n")
    assert import_pairs(pkg) == [("pkg.sub.a", "pkg.sub.b")]


def test_no_trainer_tests_an_engine_name():
    """Trainers ask an engine for capabilities (posttrain.dp's interface), never which engine it is:
    no comparison of ``engine.name`` or ``cfg.engine.name`` against a string literal."""
    bad = []
    for path in (ROOT / "train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "name"
                         and "engine" in ast.unparse(s.value)]
                if names and any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides):
                    bad.append((str(path.relative_to(ROOT)), ast.unparse(node)))
    assert not bad, bad


def test_device_specific_calls_live_in_the_device_module():
    """``torch.cuda`` only in posttrain/device.py (and the pipeline's CUDA offload path, written
    before the device module and moved to the generic stream and event API with the pipeline's
    placement); the rest asks posttrain.device or ``torch.accelerator``."""
    allowed = {"device.py", "pipeline/offload.py"}
    bad = [str(p.relative_to(ROOT)) for p in _modules((*LIBRARY, "train", "lab", "cli"))
           if str(p.relative_to(ROOT)) not in allowed and "torch.cuda" in p.read_text()]
    assert not bad, bad
