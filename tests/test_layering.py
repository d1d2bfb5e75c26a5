"""The package's rooms and floors (docs/ARCHITECTURE.md): every module imports only from its own floor or below, the
data path and the kernels do not know each other, and no chain of imports comes back to where it started.

Imports are read from the source (``ast``), at a module's top and inside its functions alike, so a lazy import is held
to the same rule as an eager one.
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
    ("models", ("unpack_trainer.models",)),
    ("decision and configs", ("unpack_trainer.decision", "unpack_trainer.configs")),
    ("trainers", ("unpack_trainer.trainers",)),
    ("public face", ("unpack_trainer",)),
    ("command line", ("unpack_trainer.cli",)),
]
# Rooms on one floor that stand side by side: neither imports the other.
SIDE_BY_SIDE = [("unpack_trainer.data", "unpack_trainer.patches")]
# The few files the root holds besides its face (``__init__.py``).
ROOT_FILES = {
    "_compat.py", "_lazy.py", "_logging.py", "_trl_compat.py", "configs.py", "decision.py", "packed_seq_info.py",
}  # fmt: skip


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


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports (``from x import y`` counts ``x.y`` when that is a module, else the
    module ``x`` resolves ``y`` from)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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


def test_the_root_holds_only_its_face_configs_decision_and_the_cross_cutting_modules():
    files = {path.name for path in PACKAGE.glob("*.py")} - {"__init__.py"}
    assert files == ROOT_FILES
