"""The package's import graph has no cycle: a module that needs another's type takes a small record instead of the
other module's class (issue 23: the monitor took the whole engine, and the two imported each other)."""

import ast
from pathlib import Path

import shardtrain

PACKAGE = Path(shardtrain.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """Modules imported at module level, ``if TYPE_CHECKING:`` blocks included (a cycle in types is still one);
    imports inside functions are deliberate late imports and are not counted. ``from pkg import sub`` names the
    submodule ``pkg.sub`` when there is one (a package's ``__init__`` importing its own submodules is no cycle)."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtrain."):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shardtrain.")}
        elif isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return found


def test_no_import_cycles():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _imports(ast.parse(p.read_text()), set(files)) - {m} for m, p in files.items()}
    cycles = []
    state: dict[str, str] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 40  # the walk saw the package
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
