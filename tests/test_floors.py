"""The package's floors: every module imports only its own floor and those below it.

The floor table is read from ``docs/architecture.md`` (between its ``floors`` markers), the one
place it is written, so the rule and its documentation cannot drift apart.  Every module of
the package is parsed with :mod:`ast` and each intra-package import (top level, inside
functions, under ``TYPE_CHECKING``, absolute or relative) is checked against the table.  The
third-party rules are checked by importing the floors in fresh interpreters.
"""

from __future__ import annotations

import ast
import fnmatch
import graphlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_bytescale"
SOURCE = REPO / PACKAGE
DOC = REPO / "docs" / "architecture.md"
BEGIN, END = "<!-- floors:begin -->", "<!-- floors:end -->"


@dataclass(frozen=True)
class Floor:
    level: int
    name: str
    entries: tuple[str, ...]  # "planner/" (a folder) or "errors.py", "*/__main__.py" (file patterns)


@cache
def floors() -> tuple[Floor, ...]:
    """The rows of the floor table in docs/architecture.md."""
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lost its floor table markers {BEGIN} / {END}"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = []
    for line in table.strip().splitlines()[2:]:  # the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"(\d+) (\w+)", cells[0])
        assert match, f"{DOC}: a floor cell must read '<number> <name>', not {cells[0]!r}"
        rows.append(Floor(int(match[1]), match[2], tuple(re.findall(r"`([^`]+)`", cells[1]))))
    assert [f.level for f in rows] == list(range(len(rows))), f"{DOC}: floors must be numbered 0, 1, 2, ..."
    return tuple(rows)


def floor_of(relative: str) -> Floor | None:
    """The floor of a module file (path relative to the package folder): a file pattern wins over a folder."""
    by_pattern = [
        f for f in floors() for e in f.entries if not e.endswith("/") and fnmatch.fnmatch(relative, e)
    ]
    if by_pattern:
        return by_pattern[0]
    by_folder = [f for f in floors() for e in f.entries if e.endswith("/") and relative.startswith(e)]
    return by_folder[0] if by_folder else None


def module_files() -> list[Path]:
    return sorted(p for p in SOURCE.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> Path | None:
    """The file that defines module ``name`` of the package, or None when there is none."""
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a package module anywhere in ``path``."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", str(path))


def imports_in(code: str, name: str, is_package: bool, filename: str = "<probe>") -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a package module in the code of module ``name``."""
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(code, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if module_file(sub) else source))
    return sorted((line, mod) for line, mod in found if mod == PACKAGE or mod.startswith(PACKAGE + "."))


def target_file(module: str) -> Path | None:
    """The file an import of ``module`` runs last: the module itself, else its closest parent."""
    parts = module.split(".")
    while parts:
        found = module_file(".".join(parts))
        if found is not None:
            return found
        parts.pop()
    return None


def relative(path: Path) -> str:
    return path.relative_to(SOURCE).as_posix()


def test_the_floor_table_places_every_module_and_names_only_modules_that_exist():
    files = [relative(p) for p in module_files()]
    unplaced = [f for f in files if floor_of(f) is None]
    assert not unplaced, f"modules on no floor: {unplaced}; add them to the floor table in {DOC}"
    for floor in floors():
        for entry in floor.entries:
            if entry.endswith("/"):
                hit = any(f.startswith(entry) for f in files)
            else:
                hit = any(fnmatch.fnmatch(f, entry) for f in files)
            assert hit, f"floor {floor.level} {floor.name} names {entry!r}, which matches no module"


def test_every_import_stays_on_its_floor_or_goes_below():
    violations = []
    for path in module_files():
        mine = floor_of(relative(path))
        assert mine is not None
        for line, module in imported_modules(path):
            target = target_file(module)
            assert target is not None, f"{relative(path)}:{line} imports {module}, which does not exist"
            theirs = floor_of(relative(target))
            assert theirs is not None
            if theirs.level > mine.level:
                violations.append(
                    f"{PACKAGE}/{relative(path)}:{line} (floor {mine.level} {mine.name}) imports {module} "
                    f"(floor {theirs.level} {theirs.name})"
                )
    assert not violations, (
        "imports from a higher floor (docs/architecture.md): move the code to the right floor, "
        "or import from the module that defines the name:\n" + "\n".join(violations)
    )


def type_checking_lines(code: str) -> set[int]:
    """The lines of the imports under ``if TYPE_CHECKING:`` (for annotations only, never run)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(n.lineno for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it runs (top level and functions; not the
    ``TYPE_CHECKING`` imports, which only name types for annotations)."""
    graph: dict[str, set[str]] = {}
    for path in module_files():
        me = module_name(path)
        typing_only = type_checking_lines(path.read_text())
        targets = {target_file(module) for line, module in imported_modules(path) if line not in typing_only}
        graph[me] = {module_name(t) for t in targets if t is not None} - {me}
    return graph


def test_no_two_modules_import_each_other():
    """The imports form no cycle, not even through an import inside a function: two modules that
    need each other share a concept that wants a module of its own (or one of them is the
    other's user and the dependency goes one way)."""
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as err:
        cycle = err.args[1]
        pytest.fail(
            "an import cycle: " + " -> ".join(cycle) + "; give what they share a module of its own, "
            "or make the dependency go one way"
        )


def typed_graph(folder: str) -> dict[str, set[str]]:
    """The import graph of the modules under ``folder`` (a package subfolder), ``TYPE_CHECKING`` imports included."""
    prefix = f"{PACKAGE}.{folder}."
    graph: dict[str, set[str]] = {}
    for path in module_files():
        me = module_name(path)
        if me.startswith(prefix):
            targets = {target_file(module) for _, module in imported_modules(path)}
            graph[me] = {module_name(t) for t in targets if t is not None} - {me}
    return {m: {t for t in deps if t.startswith(prefix)} for m, deps in graph.items()}


def test_no_cycle_in_the_lightning_floor_even_through_type_checking_imports():
    """Inside ``lightning/`` an import for annotations counts too: a step loop typed with the strategy
    that imports it is one concept split over two modules (the loop declares a Protocol instead)."""
    try:
        graphlib.TopologicalSorter(typed_graph("lightning")).prepare()
    except graphlib.CycleError as err:
        pytest.fail(
            "an import cycle in lightning/ (TYPE_CHECKING imports included): " + " -> ".join(err.args[1])
        )


def test_the_typed_cycle_check_sees_a_type_checking_cycle():
    graph = typed_graph("lightning")
    step, strategy = f"{PACKAGE}.lightning.step", f"{PACKAGE}.lightning.strategy"
    assert step in graph[strategy]
    graph[step].add(strategy)  # what `if TYPE_CHECKING: from ...strategy import ByteScaleStrategy` made
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def test_the_cycle_check_sees_a_cycle():
    graph = import_graph()
    graph[f"{PACKAGE}.planner.plan"].add(f"{PACKAGE}.planner.registry")
    graph[f"{PACKAGE}.planner.registry"].add(f"{PACKAGE}.planner.plan")
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def test_the_checker_sees_every_kind_of_import():
    """Relative, in-function, TYPE_CHECKING and ``from pkg import module`` imports are all found."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "from .. import proc\n"
        "from ..lightning import strategy\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_bytescale.recipes.module import X\n"
        "def f():\n"
        "    import lightning_bytescale.cli.train\n"
        "    from lightning_bytescale import ByteScaleStrategy\n"
    )
    found = [module for _, module in imports_in(code, f"{PACKAGE}.engine.probe", is_package=False)]
    assert found == [
        f"{PACKAGE}.proc",
        f"{PACKAGE}.lightning.strategy",
        f"{PACKAGE}.recipes.module",
        f"{PACKAGE}.cli.train",
        PACKAGE,  # a name from the front door: the top floor
    ]
    targets = [target_file(m) for m in found]
    assert [floor_of(relative(t)).name for t in targets if t is not None] == [
        "base",
        "lightning",
        "recipes",
        "entry",
        "entry",
    ]


# -- third-party libraries, in fresh interpreters ------------------------------------------------

PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = sorted({m.split('.')[0] for m in sys.modules})
print(json.dumps(loaded))
"""


def loaded_top_level(*modules: str) -> dict[str, set[str]]:
    """For each module, imported in this order in one fresh interpreter: every top-level name loaded so far."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {name: set(found) for name, found in json.loads(out.stdout).items()}


def modules_of(*names: str) -> list[str]:
    """Every importable module of the named floors (``__main__`` entry points left out)."""
    wanted = [f for f in floors() if f.name in names]
    assert len(wanted) == len(names), f"no floors named {names} in {DOC}"
    return [
        module_name(p) for p in module_files() if p.name != "__main__.py" and floor_of(relative(p)) in wanted
    ]


def third_party(names: set[str]) -> set[str]:
    return {n for n in names if not n.startswith("_") and n not in sys.stdlib_module_names and n != PACKAGE}


# Every import of a package module runs the front door (lightning_bytescale/__init__.py) first;
# its one third-party import is wrapt (the post-import hook that registers the strategy names).
FRONT_DOOR = {"wrapt"}


def test_the_front_door_loads_no_torch_and_no_lightning():
    (found,) = loaded_top_level(PACKAGE).values()
    assert third_party(found) <= FRONT_DOOR, f"`import {PACKAGE}` loads {sorted(third_party(found))}"


def test_base_and_pure_floors_need_only_the_standard_library_and_numpy():
    loaded = loaded_top_level(*modules_of("base", "pure"))
    extra = third_party(set().union(*loaded.values())) - FRONT_DOOR - {"numpy"}
    assert not extra, f"floors 0-1 load {sorted(extra)}: they may use the standard library and NumPy only"
    base = loaded_top_level(*modules_of("base"))
    extra = third_party(set().union(*base.values())) - FRONT_DOOR
    assert not extra, f"floor 0 loads {sorted(extra)}: it may use the standard library only"


def test_torch_floor_never_loads_lightning():
    loaded = loaded_top_level(*modules_of("torch"))
    for name, found in loaded.items():
        assert "torch" in found
        assert not found & {"lightning", "pytorch_lightning", "lightning_fabric"}, f"{name} loads Lightning"


@pytest.mark.parametrize("command", ["plan", "sim"])
def test_pure_command_lines_load_no_torch(command):
    (found,) = loaded_top_level(f"{PACKAGE}.cli.{command}").values()
    assert not found & {"torch", "lightning", "pytorch_lightning"}, f"cli/{command}.py loads {sorted(found)}"


def test_only_type_checking_imports_are_left_out_of_the_cycle_graph():
    code = (
        "from typing import TYPE_CHECKING\n"
        "import lightning_bytescale.errors\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_bytescale.planner import plan\n"
        "def f():\n"
        "    import lightning_bytescale.proc\n"
    )
    assert type_checking_lines(code) == {4}
