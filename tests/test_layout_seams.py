"""The seams of the layouts, read from the source: where the package asks which layout runs, and who reads what.

Every run has a :class:`~lightning_bytescale.parallel.layout.Layout` and a step runner
(docs/architecture.md, "The layout and the step runner"); what differs between plain HDP, the
tensor-parallel mesh and pipelines is the layout's and the runner's, chosen once.  These checks
keep it so:

* **Layout branches.** A test (``if``, ``while``, a conditional expression, a comprehension's
  ``if``) that asks for the layout: whether a mesh, FSDP2, local shards or a result is there
  (``pmesh is None``, ``if fsdp``), a comparison of a size (``*_parallel_size``,
  ``dims.pipeline``, ``dims.tensor_parallel``), ``layout.kind``, or ``isinstance`` /
  ``issubclass`` with ``PipelineStepBatch`` or a layout class.  At most :data:`MOST` in the package
  (the model side, the mesh's own module, the simulator and the profiler left out), at most
  :data:`MOST_LIGHTNING` in ``lightning/``.
* **Private attributes of the strategy** are read only in ``lightning/strategy.py``: the step loop
  and the other glue get what they need through names the strategy makes public (``StepHost``).
* **Narrow inputs on the step path**: no function of the step path's modules takes more than 8
  parameters but the public ones whose signatures users call (thin wrappers over a runner).
* **The strategy is glue**: ``lightning/strategy.py`` stays at most :data:`STRATEGY_LINES` lines
  (the ``ParallelStrategy`` overrides, its constructor's arguments and their docstrings); what it
  would grow by belongs in a module of its own that takes narrow inputs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_bytescale"

MOST, MOST_LIGHTNING = 12, 2

#: Lines of ``lightning/strategy.py`` (503 when this bound was set: 961, then 848, before its concepts moved out).
STRATEGY_LINES = 510

#: Left out of the layout-branch scan: the mesh's own module, the model side (the models, the HF
#: module, the pipeline stage classes, the recipes' module that lays the reference model out on
#: the mesh, as a user's ``configure_model`` does), the simulator and the profiler.
OUTSIDE = (
    "parallel/dims.py",
    "models/",
    "hf/module.py",
    "parallel/pipeline_stage.py",
    "hf/pipeline.py",
    "recipes/module.py",
    "sim/",
    "profiler/",
)

PRESENCE = {"parallel_mesh", "pmesh", "_mesh", "mesh", "fsdp", "shards", "result"}
LAYOUT_CLASSES = {"Layout", "MeshLayout", "PipelineLayout", "PipelineStepBatch"}

STEP_PATH = (
    "engine/executor.py", "engine/runner.py", "engine/step_checks.py", "engine/grad_sync.py",
    "parallel/step.py", "parallel/pipeline_step.py", "parallel/layout.py", "parallel/zero.py",
    "lightning/step.py", "lightning/strategy.py", "lightning/checkpoint.py",
)  # fmt: skip

#: The public functions of the step path with more than 8 parameters: the signatures users call.
PUBLIC_WIDE = {
    "run_micro_batch", "run_micro_batches", "sync_step", "run_step", "run_parallel_step", "run_pipeline_step",
    "ByteScaleStrategy.__init__",
}  # fmt: skip


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _is_size(node: ast.AST) -> bool:
    """A layout size: ``*_parallel_size``, or a size of the mesh's dims or the loader's view of the layout."""
    name = _name(node) or ""
    return name.endswith("_parallel_size") or (
        isinstance(node, ast.Attribute)
        and node.attr in ("pipeline", "tensor_parallel", "pipeline_stages")
        and _name(node.value) in ("dims", "view", "loader_view")
    )


def _presence(node: ast.AST) -> bool:
    """``node`` asks whether a mesh (FSDP2, shards, a result) is there: ``x is None``, ``not x``, ``x``."""
    if isinstance(node, ast.Compare) and all(isinstance(o, (ast.Is, ast.IsNot)) for o in node.ops):
        operands = [node.left, *node.comparators]
        if any(isinstance(c, ast.Constant) and c.value is None for c in operands):
            return any(_name(o) in PRESENCE for o in operands)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _presence(node.operand)
    if isinstance(node, ast.BoolOp):
        return any(_presence(v) for v in node.values)
    return _name(node) in PRESENCE - {"result"}


def _asks_for_the_layout(test: ast.AST) -> bool:
    if _presence(test):
        return True
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and any(
            _is_size(n) for o in [node.left, *node.comparators] for n in ast.walk(o)
        ):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "kind" and _name(node.value) == "layout":
            return True
        if (
            isinstance(node, ast.Call)
            and _name(node.func) in ("isinstance", "issubclass")
            and len(node.args) == 2
            and {_name(n) for n in ast.walk(node.args[1])} & LAYOUT_CLASSES
        ):
            return True
        if isinstance(node, (ast.BoolOp, ast.UnaryOp, ast.Compare)) and _presence(node):
            return True
    return False


def layout_branches(code: str) -> list[int]:
    """The lines of the tests in ``code`` that ask which layout runs."""
    tests: list[ast.AST] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    return sorted(t.lineno for t in tests if _asks_for_the_layout(t))


def branches_by_file() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(OUTSIDE):
            lines = layout_branches(path.read_text())
            if lines:
                found[rel] = lines
    return found


def test_the_package_asks_which_layout_runs_in_few_places():
    found = branches_by_file()
    where = "; ".join(f"{rel}: lines {lines}" for rel, lines in found.items())
    total = sum(len(lines) for lines in found.values())
    lightning = sum(len(lines) for rel, lines in found.items() if rel.startswith("lightning/"))
    assert total <= MOST, (
        f"{total} layout branches (at most {MOST}): {where}; make the difference the layout's or its runner's"
    )
    assert lightning <= MOST_LIGHTNING, (
        f"{lightning} layout branches in lightning/ (at most {MOST_LIGHTNING}): {where}"
    )


def test_the_layout_branch_scan_sees_every_kind_of_branch():
    code = """
if pmesh is None: pass
group = None if self.parallel_mesh is None else pmesh.dp_group
if fsdp: pass
if strategy.pipeline_parallel_size > 1: pass
while dims.pipeline == 1: pass
x = [p for p in ps if isinstance(b, PipelineStepBatch)]
if layout.kind == "mesh": pass
if step.result is None: pass
if issubclass(cls, MeshLayout): pass
if view.tensor_parallel > 1: pass
if pmesh.hdp_rank == 0: pass
if not isinstance(layout, AttentionLayout): pass
"""
    assert layout_branches(code) == list(range(2, 12))  # the last two ask something else


def _reads_a_private_attribute_of_the_strategy(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
        return _name(node.value) in ("strategy", "_strategy")
    if (
        isinstance(node, ast.Call)
        and _name(node.func) in ("getattr", "setattr", "hasattr")
        and len(node.args) >= 2
    ):
        key = node.args[1]
        return (
            _name(node.args[0]) in ("strategy", "_strategy")
            and isinstance(key, ast.Constant)
            and isinstance(key.value, str)
            and key.value.startswith("_")
        )
    return False


def private_strategy_reads(code: str) -> list[int]:
    return sorted(
        n.lineno for n in ast.walk(ast.parse(code)) if _reads_a_private_attribute_of_the_strategy(n)
    )


def test_only_the_strategy_reads_its_private_attributes():
    found = {
        rel: lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (rel := path.relative_to(PACKAGE).as_posix()) != "lightning/strategy.py"
        and (lines := private_strategy_reads(path.read_text()))
    }
    assert not found, f"private attributes of the strategy read outside lightning/strategy.py: {found}"


def test_the_private_read_scan_sees_one():
    code = "a = strategy._loop\nb = trainer.strategy._timeout\nc = getattr(strategy, '_phase')\nd = strategy.zero\n"
    assert private_strategy_reads(code) == [1, 2, 3]


def wide_functions(code: str) -> list[str]:
    """The functions (``Class.method`` for methods) in ``code`` with more than 8 parameters, ``self`` and ``cls`` not counted."""
    wide = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [
                    p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")
                ]
                if len(params) > 8:
                    wide.append(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(code), "")
    return wide


def test_no_function_of_the_step_path_takes_more_than_eight_parameters_but_the_public_wrappers():
    found = {rel: wide_functions((PACKAGE / rel).read_text()) for rel in STEP_PATH}
    extra = {
        rel: sorted(set(names) - PUBLIC_WIDE) for rel, names in found.items() if set(names) - PUBLIC_WIDE
    }
    assert not extra, (
        f"step-path functions with more than 8 parameters: {extra}; pass records (Compute, StepChecks, ...)"
    )


def test_the_parameter_scan_sees_a_wide_function():
    code = (
        "def f(a, b, c, d, e, f, g, h, i): pass\nclass C:\n    def m(self, a, *, b, c, d, e, f, g, h): pass\n"
    )
    assert wide_functions(code) == ["f"]


def test_the_strategy_file_stays_glue():
    lines = len((PACKAGE / "lightning" / "strategy.py").read_text().splitlines())
    assert lines <= STRATEGY_LINES, (
        f"lightning/strategy.py has {lines} lines (at most {STRATEGY_LINES}): move a concept into a module of "
        "its own that takes narrow keyword inputs (docs/architecture.md, the Lightning floor), not the strategy"
    )
