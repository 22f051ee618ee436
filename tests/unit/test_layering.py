"""Privates stay private: no import of another subpackage's ``_name``, torch's and ipyparallel's only via compat."""

import ast
import pathlib

import pytest

import meshviz

pytestmark = pytest.mark.torch_free  # imports no torch: the test command runs it once, torch blocked

ROOT = pathlib.Path(meshviz.__file__).parent


def _subpackage(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0] if len(parts) > 1 else parts[0]


def _resolve(path: pathlib.Path, node: ast.ImportFrom) -> str | None:
    """The meshviz subpackage an import reads from, or None when it is not meshviz's."""
    if node.level == 0:
        mod = node.module or ""
        return mod.split(".")[1] if mod.startswith("meshviz.") else None
    base = path.relative_to(ROOT).parent.parts
    up = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    parts = list(up) + (node.module.split(".") if node.module else [])
    return parts[0] if parts else None


def test_no_module_imports_another_subpackages_privates():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        here = _subpackage(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(path, node)
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if src is not None and src != here and names:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {names} from meshviz.{src}")
                mod = node.module or ""
                private = any(part.startswith("_") for part in mod.split(".")) or any(
                    a.name.startswith("_") for a in node.names)
                if node.level == 0 and mod.split(".")[0] in ("torch", "ipyparallel") and private and here != "compat":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports a private {mod} symbol (use compat)")
            elif isinstance(node, ast.Attribute) and node.attr == "_local_tensor" and here != "compat":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads DTensor's ._local_tensor (use compat)")
            elif isinstance(node, ast.Attribute) and node.attr in ("_mv_name", "_mv_id"):  # DistTensor's own
                if path.relative_to(ROOT).as_posix() != "runtime/dtensor.py":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    """No module reaches itself through the imports of others (type-checking imports aside)."""
    import grimp

    graph = grimp.build_graph("meshviz", exclude_type_checking_imports=True)
    mods = sorted(m for m in graph.modules if m.startswith("meshviz"))
    deps = {m: {d for d in graph.find_modules_directly_imported_by(m) if d.startswith("meshviz")} for m in mods}
    circles = []
    for m in mods:  # a module on a circle reaches itself
        seen, todo = set(), list(deps[m])
        while todo:
            d = todo.pop()
            if d == m:
                circles.append(m)
                break
            if d not in seen:
                seen.add(d)
                todo.extend(deps[d])
    assert not circles, f"modules on import circles: {circles}"


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
