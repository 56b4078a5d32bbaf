"""The package's structure, checked from its imports: which package may import which (``ALLOWED``), no import
cycle, and a docstring saying what each package owns.

A module's *room* is the longest key of ``ALLOWED`` that names it or a package holding it (``shardtrain.zero.layout``
is a room of its own; ``shardtrain.zero.reducer`` belongs to ``shardtrain.zero``). An import is allowed inside a room,
or to a room its row lists; a room carved out of a package is open to whoever may import the package, and to the
package itself. The room ``shardtrain`` is the package's ``__init__`` alone: a row listing it may import the public
names, not every room of the package. Every import counts: at module level, ``if TYPE_CHECKING:`` blocks included
(a dependency in types is still one), and inside functions and methods (a late import is still a dependency, only a
deferred one). The no-cycle check, too, covers every import.
"""

import ast
import functools
from pathlib import Path

import shardtrain

PACKAGE = Path(shardtrain.__file__).parent

LEAVES = {
    "shardtrain.errors",
    "shardtrain.tree",
    "shardtrain.between_graphs",
    "shardtrain.host_read",
    "shardtrain.models",
}

# Top to bottom, as docs/architecture.md draws them. Each row: what the room may import besides the leaves.
ALLOWED: dict[str, set[str]] = {
    "shardtrain.__main__": {"shardtrain.cli"},
    "shardtrain.cli": {
        "shardtrain",
        "shardtrain.checkpoint",
        "shardtrain.config",
        "shardtrain.debug",
        "shardtrain.estimate",
    },
    # the public names of compat modules (they replace themselves with them)
    "shardtrain.deepspeed": {"shardtrain.compat"},
    "shardtrain.integrations": {"shardtrain.compat"},
    # the package's own __init__: the public names
    "shardtrain": {"shardtrain.compat", "shardtrain.config", "shardtrain.engine"},
    "shardtrain.compat": {
        "shardtrain.engine",
        "shardtrain.optim",  # deepspeed.runtime.lr_schedules: DeepSpeed's schedulers are shardtrain.optim's
        "shardtrain.checkpoint",
        "shardtrain.runtime",
        "shardtrain.weights",
        "shardtrain.construction",
        "shardtrain.zero",
        "shardtrain.config",
        "shardtrain.plan",
        "shardtrain.pipeline_parallel",  # deepspeed.pipe: PipelineEngine's grid
        "shardtrain.distributed",
    },
    # initialize: the plan applied to the model, one step per axis (engine/parallelize.py)
    "shardtrain.engine": {
        "shardtrain.activations",
        "shardtrain.pipeline_parallel",
        "shardtrain.expert_parallel",
        "shardtrain.graph",
        "shardtrain.runtime",
        "shardtrain.weights",
        "shardtrain.checkpoint",
        "shardtrain.sequence_parallel",
        "shardtrain.tensor_parallel",
        "shardtrain.construction",
        "shardtrain.zero",
        "shardtrain.offload",
        "shardtrain.precision",
        "shardtrain.optim",
        "shardtrain.config",
        "shardtrain.plan",
        "shardtrain.distributed",
        "shardtrain.estimate",  # activation checkpointing by budget: the planner's fake run chooses the blocks
    },
    "shardtrain.estimate": {
        "shardtrain.activations",
        "shardtrain.tensor_parallel",
        "shardtrain.sequence_parallel",
        "shardtrain.expert_parallel",
        "shardtrain.pipeline_parallel",
        "shardtrain.precision",
        "shardtrain.zero",
        "shardtrain.offload",
        "shardtrain.config",
        "shardtrain.optim.deepspeed_muon",  # DeepSpeed's Muon split: which matrices the owners gather
        "shardtrain.plan",
        "shardtrain.distributed",  # calibrate: collectives measured through the Communicator
        "shardtrain.testing",  # calibrate: the ranks it measures at (run_distributed)
    },
    "shardtrain.graph": {
        "shardtrain.debug",
        "shardtrain.tensor_parallel",
        "shardtrain.runtime",
        "shardtrain.zero",
        "shardtrain.offload",
        "shardtrain.plan",
        "shardtrain.distributed",
    },
    # the runtime interface and its eager implementation (stage 3's unit hooks); graph mode is the other one
    "shardtrain.runtime": {"shardtrain.zero", "shardtrain.offload", "shardtrain.plan", "shardtrain.distributed"},
    # full weights into the sharded model: reads the layout and the optimizer wrapper's masters
    "shardtrain.weights": {"shardtrain.zero", "shardtrain.distributed"},
    "shardtrain.debug": set(),
    "shardtrain.checkpoint": {"shardtrain.distributed"},
    "shardtrain.sequence_parallel": {"shardtrain.tensor_parallel", "shardtrain.plan", "shardtrain.distributed"},
    "shardtrain.tensor_parallel": {"shardtrain.distributed"},
    "shardtrain.expert_parallel": {"shardtrain.distributed"},
    # pipeline stages cut from the model and run by torch.distributed.pipelining's schedules
    "shardtrain.pipeline_parallel": set(),
    # ZeRO means sharding: it takes policies, never the config
    "shardtrain.zero": {
        "shardtrain.zero.layout",
        "shardtrain.zero.units",
        "shardtrain.zero.guarded",
        "shardtrain.construction",
        "shardtrain.offload",
        "shardtrain.precision",
        "shardtrain.optim",
        "shardtrain.plan",
        "shardtrain.distributed",
    },
    # sharded construction (public as shardtrain.zero.Init): builds one-parameter units; Init(config) reads a config
    "shardtrain.construction": {
        "shardtrain.zero.layout",
        "shardtrain.zero.units",
        "shardtrain.zero.guarded",
        "shardtrain.config",
        "shardtrain.distributed",
    },
    # activation checkpointing by policy and the host offload of the inputs kept: torch's checkpoint, given blocks
    "shardtrain.activations": {"shardtrain.plan"},
    # offload reads the layout's buckets (the plain data every part reads); the rest of zero is above it
    "shardtrain.offload": {"shardtrain.zero.layout", "shardtrain.plan", "shardtrain.distributed"},
    "shardtrain.zero.guarded": {"shardtrain.zero.units"},
    "shardtrain.zero.units": {"shardtrain.zero.layout", "shardtrain.distributed"},
    "shardtrain.zero.layout": {"shardtrain.plan"},
    # the LR schedulers take the config's validated scheduler sections
    "shardtrain.optim": {"shardtrain.config"},
    # the config maps an optimizer section onto a class, DeepSpeedAdam included, and a config onto the plan
    "shardtrain.config": {"shardtrain.optim.adam", "shardtrain.optim.deepspeed_muon", "shardtrain.plan"},
    "shardtrain.optim.adam": set(),
    # DeepSpeed's Muon type (built from the config) on shardtrain's Muon + AdamW, which ZeRO's owners serve
    "shardtrain.optim.deepspeed_muon": {"shardtrain.optim.muon"},
    "shardtrain.optim.muon": set(),
    "shardtrain.precision": {"shardtrain.plan"},
    "shardtrain.distributed": {"shardtrain.plan"},
    # the typed plan: parallel dimensions and policies, plain data below every package that takes them
    "shardtrain.plan": set(),
    "shardtrain.testing": set(),
    # the parity harness trains through the public API, as a user's check does, on the ranks of run_distributed
    "shardtrain.testing.parity": {"shardtrain", "shardtrain.testing"},
    **{leaf: set() for leaf in LEAVES},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, modules: set[str]) -> dict[str, int]:
    """Every module the file imports, with the line of its first import: at module level, under ``if
    TYPE_CHECKING:``, in class bodies and inside functions and methods, nested anywhere. ``from pkg import sub``
    names the submodule ``pkg.sub`` when there is one (a package's ``__init__`` importing its own submodules is no
    cycle)."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardtrain":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.setdefault(sub if sub in modules else node.module, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "shardtrain":
                    found.setdefault(alias.name, node.lineno)
    return found


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    """Each module's imports, each with the line of its first import (parsed once for all the tests)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _imports(ast.parse(p.read_text()), set(files)) for m, p in files.items()}
    return {m: {dep: line for dep, line in deps.items() if dep != m} for m, deps in graph.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ALLOWED and (n > 1 or module == "shardtrain"):
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no room of ALLOWED: add a row for it")


def _carved(target: str, room: str) -> bool:
    """``target`` is a room carved out of ``room``; not of the package's own room ``shardtrain``, its ``__init__``
    (the public names), which holds every room and opens none of them."""
    return room != "shardtrain" and target.startswith(room + ".")


def test_imports_follow_the_table():
    graph = lines = _graph()
    wrong = []
    for module, deps in sorted(graph.items()):
        room = _room(module)
        for dep in sorted(deps):
            target = _room(dep)
            if not any(target == a or _carved(target, a) for a in {room} | ALLOWED[room] | LEAVES):
                wrong.append(f"{module} -> {dep} (line {lines[module][dep]}: {room} may not import {target})")
    assert len(graph) > 40  # the walk saw the package
    assert not wrong, "imports the table does not allow:\n" + "\n".join(wrong)


def test_every_row_is_a_room_and_every_room_is_used():
    """No stale row: each key names a module or package that exists, and each listed target is a row."""
    graph = _graph()
    for room, targets in ALLOWED.items():
        assert any(m == room or m.startswith(room + ".") for m in graph), f"{room} is not in the package"
        assert targets <= set(ALLOWED), f"{room} lists unknown rooms: {targets - set(ALLOWED)}"


def test_the_table_is_layered():
    """The table itself has no cycle between rooms, so it is a stack of layers."""
    state: dict[str, str] = {}

    def visit(room: str, stack: list[str]) -> None:
        state[room] = "open"
        for dep in sorted(ALLOWED[room]):
            assert state.get(dep) != "open", "the table has a cycle: " + " -> ".join([*stack, dep])
            if dep not in state:
                visit(dep, [*stack, dep])
        state[room] = "done"

    for room in ALLOWED:
        if room not in state:
            visit(room, [room])


def test_no_import_cycles():
    """Every import counts, late ones included: a cycle closed inside a function is still one."""
    graph = _graph()
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
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_package_says_what_it_owns():
    missing = [
        str(init.relative_to(PACKAGE.parent))
        for init in sorted(PACKAGE.rglob("__init__.py"))
        if not ast.get_docstring(ast.parse(init.read_text()))
    ]
    assert not missing, f"packages without a docstring: {missing}"


def test_class_names_are_unique():
    """One meaning per name (issue 34): no two classes of the package share a name; a public name that must repeat
    another's (``deepspeed.zero.Init``) is an alias of a class named apart."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


CORE = (
    "zero",
    "offload",
    "graph",
    "runtime",
    "precision",
    "tensor_parallel",
    "sequence_parallel",
    "expert_parallel",
    "activations",
    "pipeline_parallel",
)


def test_core_packages_take_policies_not_the_config():
    """Issue 47: the core packages read typed policies (``shardtrain.plan``), never ``shardtrain.config``; every
    import counts, late ones included."""
    graph = _graph()
    readers = sorted(
        f"{m} -> {dep}"
        for m, deps in graph.items()
        if m.split(".")[1:2] and m.split(".")[1] in CORE
        for dep in deps
        if dep == "shardtrain.config" or dep.startswith("shardtrain.config.")
    )
    assert not readers, readers
    assert all("shardtrain.config" not in ALLOWED[f"shardtrain.{room}"] for room in CORE)
