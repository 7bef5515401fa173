"""The package's shape (ARCHITECTURE.md): a root of at most 8 facade modules, imports flow one way, only
raytrain.hf imports transformers / peft / trl, no circle, small files, no reaching into another module's
private names."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "raytrain")


def _modules() -> dict[str, tuple[str, bool]]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                package = module.endswith(".__init__")
                out[module.removesuffix(".__init__")] = (path, package)
    return out


def _imports(module: str, path: str, package: bool, known: set[str]):
    """(imported module, names) for every import in the file, function-level ones included; imports under
    `if TYPE_CHECKING:` are left out (typing only)."""
    tree = ast.parse(open(path).read())
    found = []

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if package else module.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full, []) if full in known else (base, [alias.name]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(m, names) for m, names in found if m.split(".")[0] == "raytrain"]


def test_lint_imports_keeps_the_layers_and_sees_no_circle():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " kept, 0 broken." in done.stdout and "BROKEN" not in done.stdout


def test_every_module_of_the_package_has_a_layer():
    """A new top-level module or subpackage is placed in pyproject's layers contract, or lint-imports would
    not check what it may import."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers" and "containers" not in c)["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    top = {".".join(m.split(".")[:2]) for m in _modules() if m != "raytrain"}
    assert top - placed == set(), "place these in pyproject.toml's layers contract"


def test_the_root_holds_only_the_facade():
    root = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert len(root) <= 8, f"{len(root)} modules directly under raytrain/: {root}"


def test_only_the_hf_bridge_may_import_hugging_face():
    """The forbidden contract lists every top-level module but raytrain.hf; lint-imports names a
    transformers import planted in the core (a copy of the package, so the tree is untouched)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    forbidden = next(c for c in contracts if c["type"] == "forbidden")
    assert set(forbidden["forbidden_modules"]) == {"transformers", "peft", "trl"}
    top = {".".join(m.split(".")[:2]) for m in _modules() if m != "raytrain"}
    assert top - set(forbidden["source_modules"]) == {"raytrain.hf"}


def test_lint_imports_names_a_transformers_import_outside_the_bridge(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "raytrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    with open(tmp_path / "raytrain" / "optim" / "schedules.py", "a") as f:
        f.write("\n\ndef _planted():\n    import transformers  # noqa: F401\n")
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1
    assert "only raytrain.hf imports transformers, peft, trl BROKEN" in done.stdout
    assert "raytrain.optim.schedules -> transformers" in done.stdout


def test_the_import_graph_has_no_circle():
    mods = _modules()
    graph = {m: {dep for dep, _ in _imports(m, p, pkg, set(mods)) if dep in mods and dep != m}
             for m, (p, pkg) in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                walk(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_no_module_imports_another_modules_private_names():
    mods = _modules()
    bad = [f"{m} imports {dep}.{name}" for m, (p, pkg) in mods.items()
           for dep, names in _imports(m, p, pkg, set(mods)) for name in names
           if name.startswith("_") and not name.startswith("__") and dep != m]
    assert not bad, "\n".join(bad)


def test_no_file_in_the_package_is_over_500_lines():
    long = {os.path.relpath(p, ROOT): n for p, _ in _modules().values()
            if (n := sum(1 for _ in open(p))) > 500}
    assert not long, long


def test_test_files_have_unique_names():
    """tests/ has no __init__.py: pytest imports test files by their base name, so two files of one
    name in two folders fail collection (the second is not run at all)."""
    seen: dict[str, str] = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                assert name not in seen, f"{name}: in {seen.get(name)} and {folder}"
                seen[name] = folder
