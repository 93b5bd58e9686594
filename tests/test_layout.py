"""The house keeps its shape (README Layout, docs/architecture.md): a dozen modules at the top of bridge/, the rest
in subpackages that say what they own; no module over 400 lines, no class over 300, no function over 50; imports
one way (no cycle between modules)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

BRIDGE = Path(__file__).resolve().parent.parent / "bridge"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 400, 300, 50


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(BRIDGE.rglob("*.py")):
        parts = path.relative_to(BRIDGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def test_at_most_a_dozen_modules_at_the_top_and_every_subpackage_says_what_it_owns() -> None:
    top = [p for p in BRIDGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 12, sorted(p.name for p in top)
    for package in (p for p in BRIDGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) <= 3, f"{package.name}/__init__.py: say in two lines what it owns"


def test_no_module_class_or_function_past_its_size() -> None:
    too_big = []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            too_big.append(f"module {name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
                too_big.append(f"class {name}.{node.name}: {size} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > FUNCTION_LINES:
                too_big.append(f"function {name}.{node.name}: {size} lines")
    assert not too_big, too_big


def test_imports_run_one_way() -> None:
    modules = _modules()
    imports: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
                imports[name].add(node.module)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        stack.append(name)
        for other in sorted(imports.get(name, ())):
            if state.get(other) == 1:
                cycles.append([*stack[stack.index(other):], other])
            elif other not in state:
                visit(other, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert not cycles, cycles
