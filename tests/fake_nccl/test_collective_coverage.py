"""Every collective and point-to-point call site of the package runs under the fake-NCCL tier.

:func:`_fake_nccl.call_sites` reads the package's source and finds every use of a
``torch.distributed`` collective (object collectives, ``batch_isend_irecv`` and ``P2POp``
included), of a DTensor call that communicates (``full_tensor``, ``redistribute``,
``parallelize_module``, ``distribute_tensor``), of the functional collectives and of
``torch.distributed.checkpoint``'s state-dict functions, each named
``module:function:call``.  A site is covered when a test of this folder names it in
``@pytest.mark.covers(...)`` -- and ``conftest.py`` fails that test unless the site really ran a
collective of its kind from that function under the tier -- or when it is on
:data:`_fake_nccl.ALLOWED` (gloo on host tensors by design, each with its reason).  A new call
site without such a test fails here, naming it; so does a mark or an allowance naming a site that
no longer exists (moved or renamed: update the name).

The scan itself can fail: a module written for it holds one site of every shape the package may
use (and a ``distribute_tensor(..., src_data_rank=None)``, which cuts locally and is no site), and the qualified names the scan gives must be the ones the frames of those functions report
at run time (how a collective is matched to its site).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import _fake_nccl
from _fake_nccl import ALLOWED, CallSite, call_sites

TIER = Path(__file__).resolve().parent


def declared_sites(folder: Path = TIER) -> dict[str, str]:
    """Every site named by a ``covers(...)`` mark in the tier's test files -> the file that names it."""
    out: dict[str, str] = {}
    for path in sorted(folder.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "covers"
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        out.setdefault(arg.value, path.name)
    return out


def coverage_problems(sites: dict[str, CallSite], declared: dict[str, str], allowed: set[str]) -> list[str]:
    """What keeps the tier from covering every site: uncovered sites, and marks or allowances naming none."""
    problems = [
        f"{key} (lightning_bytescale/{s.module}:{s.line}) is a collective call site that no fake-NCCL test "
        "covers; add a test in "
        "tests/fake_nccl/ that runs it under fake_nccl() and mark it @pytest.mark.covers("
        f"{key!r}) (CONTRIBUTING.md, 'The fake-NCCL tier'), or, for gloo on host tensors by design, "
        "add it to ALLOWED in tests/_fake_nccl.py with the reason"
        for key, s in sorted(sites.items())
        if key not in declared and key not in allowed
    ]
    problems += [
        f"{where} marks @pytest.mark.covers({key!r}), but the package has no such call site (moved or renamed?)"
        for key, where in sorted(declared.items())
        if key not in sites
    ]
    problems += [
        f"ALLOWED names {key!r}, which is no call site of the package" for key in sorted(allowed - set(sites))
    ]
    return problems


def test_every_collective_call_site_runs_under_the_fake_nccl_tier():
    sites = call_sites()
    assert len(sites) >= 30  # the scan sees the package (sanity: a broken scan finds nothing)
    problems = coverage_problems(sites, declared_sites(), ALLOWED)
    assert not problems, "\n".join(problems)


SAMPLE = """
import sys
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_gather_object as gather_objects
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import distribute_tensor


def here():
    return sys._getframe(1).f_code.co_qualname  # the caller's frame, as the tier's records name it


def plain(t=None, run=False):
    return dist.all_reduce(t) if run else here()


class Owner:
    def method(self, t=None, run=False):
        return t.full_tensor() if run else here()

    def nested(self):
        def inner(t=None, run=False):
            return funcol.all_reduce(t, "sum", None) if run else here()

        return inner


def in_a_comprehension(ts=(None,), run=False):
    return [dist.broadcast(t, 0) if run else here() for t in ts][0]


def passed_on():
    together = dist.barrier  # a collective handed to someone else is a site too
    return here()


def imported_by_name(objs=None, run=False):
    return gather_objects(objs, 1) if run else here()


def state(module=None, run=False):
    return get_model_state_dict(module) if run else here()


def scattered(t=None, run=False):
    return distribute_tensor(t, None, []) if run else here()


def cut_locally(t=None, run=False):  # src_data_rank=None: each rank keeps its own data, no site (its argument is one)
    return distribute_tensor(t.full_tensor(), None, [], src_data_rank=None) if run else here()


handler = lambda t=None, run=False: dist.send(t, 1) if run else here()  # noqa: E731
"""


def _sample(tmp_path: Path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "mod.py").write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("_coverage_sample", root / "mod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return root, module


def test_the_scan_finds_every_shape_of_call_site_under_the_name_its_frame_reports(tmp_path):
    root, module = _sample(tmp_path)
    sites = call_sites(root)
    assert set(sites) == {
        "mod.py:plain:all_reduce",
        "mod.py:Owner.method:full_tensor",
        "mod.py:Owner.nested.<locals>.inner:all_reduce",
        "mod.py:in_a_comprehension:broadcast",
        "mod.py:passed_on:barrier",
        "mod.py:imported_by_name:all_gather_object",
        "mod.py:state:get_model_state_dict",
        "mod.py:scattered:distribute_tensor",
        "mod.py:cut_locally:full_tensor",
        "mod.py:<lambda>:send",
    }
    # each site's function is what the frame at that call reports (a comprehension's folded into
    # its function: Python 3.11 gives it a frame of its own, 3.12 inlines it)
    frames = [
        module.plain(),
        module.Owner().method(),
        module.Owner().nested()(),
        module.in_a_comprehension(),
        module.passed_on(),
        module.imported_by_name(),
        module.state(),
        module.scattered(),
        module.cut_locally(),
        module.handler(),
    ]
    assert sorted(_fake_nccl._fold(f) for f in frames) == sorted(s.function for s in sites.values())


def test_an_uncovered_site_a_stale_mark_and_a_stale_allowance_fail(tmp_path):
    root, _ = _sample(tmp_path)
    sites = call_sites(root)
    declared = {key: "test_x.py" for key in sites if key != "mod.py:passed_on:barrier"}
    assert not coverage_problems(sites, {**declared, "mod.py:passed_on:barrier": "test_x.py"}, set())
    problems = coverage_problems(sites, declared, set())
    assert (
        len(problems) == 1
        and problems[0].startswith("mod.py:passed_on:barrier (")
        and "no fake-NCCL test" in problems[0]
    )
    assert not coverage_problems(sites, declared, {"mod.py:passed_on:barrier"})
    stale = coverage_problems(
        sites, {**declared, "mod.py:gone:all_reduce": "test_x.py"}, {"mod.py:passed_on:barrier"}
    )
    assert len(stale) == 1 and "no such call site" in stale[0]
    stale = coverage_problems(sites, declared, {"mod.py:passed_on:barrier", "mod.py:old:barrier"})
    assert len(stale) == 1 and "ALLOWED names 'mod.py:old:barrier'" in stale[0]
