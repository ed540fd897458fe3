"""The tree's architecture, held: the four stages never import each other, core/ imports no stage, and no
product module imports itself back through others (every import counted, those inside functions too, so a
circle cannot hide in a late import). Functions stay short enough to read in one pass."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("data_gen", "extract", "train", "eval")
PRODUCT = ("core", *STAGES)
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PRODUCT:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The product modules `path` imports, anywhere in it (`from core.x import y` counts core.x, or core.x.y where
    y is a module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def test_stages_never_import_each_other_and_core_imports_no_stage():
    bad = [(a, b) for a, deps in graph().items() for b in deps
           if a.split(".")[0] != b.split(".")[0] and b.split(".")[0] in STAGES]
    assert not bad, bad


def test_no_import_circle_in_the_product():
    g, state, circles = graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(g[node]):
            if state.get(dep) == "open":
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_the_checker_sees_a_circle_through_a_late_import(tmp_path):
    """The graph counts an import inside a function: core.run.plan <-> core.target.model was one."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from core.run.plan import format_plan\n")
    assert imports(path, "core.target.model", set(modules())) == {"core.run.plan"}


def test_product_functions_fit_in_one_read():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long
