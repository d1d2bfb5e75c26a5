"""The package's rooms and floors (docs/ARCHITECTURE.md): every module imports only from its own floor or below, the
data path and the kernels do not know each other, and no chain of imports comes back to where it started.

Imports are read from the source (``ast``), at a module's top and inside its functions alike, so a lazy import is held
to the same rule as an eager one; so are the imports that run by name: a package face's lazy table (its ``_EXPORTS`` /
``_CLASSES``, each name's module imported on first use) and ``importlib.import_module`` of a string the source spells
out (a constant, or an f-string whose constant start names a package: every module under it). A module that imports by
a name the source does not spell out is listed in [`IMPORTS_BY_NAME`], with what it imports.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
from pathlib import Path

import pytest

import unpack_trainer

PACKAGE = Path(unpack_trainer.__file__).parent

# From the ground floor up. A module belongs to the first room whose prefix its name starts with.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # cross-cutting: log-once, lazy package faces, the carrier of sample boundaries and its key names, every private
    # name of another library
    (
        "foundation",
        (
            "unpack_trainer._logging",
            "unpack_trainer._lazy",
            "unpack_trainer.packed_seq_info",
            "unpack_trainer._compat",
            "unpack_trainer._trl_compat",
        ),
    ),
    ("data path | kernels", ("unpack_trainer.data", "unpack_trainer.patches")),
    ("models the package builds | what a model is made of", ("unpack_trainer.model_zoo", "unpack_trainer.anatomy")),
    ("models", ("unpack_trainer.models",)),
    (
        "decision, self-check and configs",
        ("unpack_trainer.decision", "unpack_trainer.selfcheck", "unpack_trainer.configs"),
    ),
    ("trainers", ("unpack_trainer.trainers",)),
    ("public face", ("unpack_trainer",)),
    ("command line", ("unpack_trainer.cli",)),
]
# Rooms on one floor that stand side by side: neither imports the other.
SIDE_BY_SIDE = [
    ("unpack_trainer.data", "unpack_trainer.patches"),
    ("unpack_trainer.model_zoo", "unpack_trainer.anatomy"),
]
# The few files the root holds besides its face (``__init__.py``).
ROOT_FILES = {
    "_compat.py", "_lazy.py", "_logging.py", "_trl_compat.py", "configs.py", "decision.py", "packed_seq_info.py",
    "selfcheck.py",
}  # fmt: skip


# The modules that call ``importlib.import_module`` with a name the source does not spell out, and what they import
# that way (none of them a module of this package this test could not see otherwise).
IMPORTS_BY_NAME = {
    "unpack_trainer._lazy": "the modules of a package face's lazy table (read from the face itself)",
    "unpack_trainer._compat": "transformers' modules, by the names of its interfaces",
    "unpack_trainer.models.fixes.rope": "transformers' modeling modules of the families a fix patches",
    "unpack_trainer.cli.train": "the user's reward functions and dataset loaders named on the command line",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _lazy_names(package: str) -> dict[str, str]:
    """A lazy face's names and the modules they are resolved from (its ``_EXPORTS`` / ``_CLASSES`` tables)."""
    face = importlib.import_module(package)
    return {**getattr(face, "_EXPORTS", {}), **getattr(face, "_CLASSES", {})}


def _resolve(name: str) -> str:
    """The package module ``name`` refers to: itself, the module a lazy face resolves it from, or the module holding it
    (``unpack_trainer.models.patch.patch_model`` -> ``unpack_trainer.models.patch``)."""
    holder, _, attribute = name.rpartition(".")
    if name not in MODULES and holder in MODULES and attribute in _lazy_names(holder):
        return _lazy_names(holder)[attribute]
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (read by type checkers, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for other in node.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield node
        yield from _runtime_nodes(node)


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module-level string constants of ``tree`` (``NAME = "..."``), by name."""
    found = {}
    for node in tree.body:
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {target.id: value.value for target in targets if isinstance(target, ast.Name)}
    return {name: value for name, value in found.items() if isinstance(value, str)}


def _imported_by_name(node: ast.AST, constants: dict[str, str]) -> list[str] | None:
    """The module names an ``importlib.import_module(...)`` call ``node`` imports, as far as the source spells them
    out: ``[name]`` for a string constant (or a module-level one), ``[prefix + "*"]`` for an f-string whose constant
    start is ``prefix``; ``None`` when it does not spell the name out; ``[]`` when ``node`` is no such call."""
    if not (isinstance(node, ast.Call) and node.args):
        return []
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    if name != "import_module":
        return []
    argument = node.args[0]
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return [argument.value]
    if isinstance(argument, ast.Name) and argument.id in constants:
        return [constants[argument.id]]
    if isinstance(argument, ast.JoinedStr) and argument.values:
        head = argument.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value:
            return [head.value + "*"]
    return None


def _by_name(name: str) -> set[str]:
    """The package modules an import by ``name`` may load (``prefix*``: every module whose name starts so)."""
    if name.partition(".")[0] != "unpack_trainer":
        return set()
    if name.endswith("*"):
        return {module for module in MODULES if module.startswith(name[:-1])}
    return {_resolve(name)}


def unread_imports_by_name(module: str) -> int:
    """How many ``import_module`` calls of ``module`` take a name its source does not spell out."""
    tree = ast.parse(MODULES[module].read_text())
    constants = _constants(tree)
    return sum(_imported_by_name(node, constants) is None for node in _runtime_nodes(tree))


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports (``from x import y`` counts ``x.y`` when that is a module, else the
    module ``x`` resolves ``y`` from; a face's lazy table and ``import_module`` by a spelled-out name count too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    constants = _constants(tree)
    found = set()
    if path.name == "__init__.py":  # a lazy face imports each name's module when the name is first read
        found |= {_resolve(name) for name in _lazy_names(module).values()}
    for node in _runtime_nodes(tree):
        for name in _imported_by_name(node, constants) or ():
            found |= _by_name(name)
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            # ``from x import y``: the module ``x.y``, else the module holding y. A parent package's face runs for
            # any import of its modules; it is not counted as an import.
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {_resolve(name) for name in names if name.partition(".")[0] == "unpack_trainer"}
    found.discard(module)
    found.discard("unpack_trainer")  # the root's face itself: lazy, imports only the trainer declarations
    return found


def floor_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(FLOORS):
        if any(
            module == prefix or module.startswith(prefix + ".") for prefix in prefixes if prefix != "unpack_trainer"
        ):
            return index
    assert module == "unpack_trainer", f"{module} is on no floor: add it to FLOORS and docs/ARCHITECTURE.md"
    return next(index for index, (_, prefixes) in enumerate(FLOORS) if "unpack_trainer" in prefixes)


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_floor_above_it(module):
    floor = floor_of(module)
    above = {other: FLOORS[floor_of(other)][0] for other in imports_of(module) if floor_of(other) > floor}
    assert not above, f"{module} ({FLOORS[floor][0]}) imports from a floor above it: {above}"


def test_the_data_path_and_the_kernels_do_not_know_each_other():
    for left, right in SIDE_BY_SIDE:
        for one, other in ((left, right), (right, left)):
            for module in (m for m in MODULES if m == one or m.startswith(one + ".")):
                crossing = {m for m in imports_of(module) if m == other or m.startswith(other + ".")}
                assert not crossing, f"{module} imports {sorted(crossing)}"


def test_no_circle_of_imports():
    graph = {module: imports_of(module) for module in MODULES}
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the circle


def test_imports_by_name_are_read_or_listed():
    """Every ``import_module`` call of the package spells out the module it imports (so the tests above see it),
    except in the modules of [`IMPORTS_BY_NAME`], each of which still has one."""
    unread = {module for module in MODULES if unread_imports_by_name(module)}
    assert unread == set(IMPORTS_BY_NAME), (
        f"import_module by a name the source does not spell out: {sorted(unread - set(IMPORTS_BY_NAME))}; "
        f"listed but no longer there: {sorted(set(IMPORTS_BY_NAME) - unread)}"
    )


def test_lazy_imports_are_read():
    """The reader above sees the imports that run by name: a face's lazy table, an ``import_module`` of a constant."""
    assert "unpack_trainer.trainers.sft" in imports_of("unpack_trainer.trainers")
    assert "unpack_trainer.models.patch" in imports_of("unpack_trainer.models")
    tree = ast.parse('import importlib\nimportlib.import_module(f"unpack_trainer.trainers.{name}")')
    assert _imported_by_name(tree.body[1].value, {}) == ["unpack_trainer.trainers.*"]


def test_the_root_holds_only_its_face_configs_decision_and_the_cross_cutting_modules():
    files = {path.name for path in PACKAGE.glob("*.py")} - {"__init__.py"}
    assert files == ROOT_FILES
