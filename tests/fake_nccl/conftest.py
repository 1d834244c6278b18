"""The fake-NCCL tier's one rule: a test that says it covers a call site must run it.

``@pytest.mark.covers("module:function:call", ...)`` names the package's collective call sites a
test runs under :func:`_fake_nccl.fake_nccl` (``module`` relative to ``lightning_bytescale/``,
``function`` its qualified name, ``call`` the collective's name, as
``tests/fake_nccl/test_collective_coverage.py`` lists them).  After the test, each named site
must have run a collective of its kind from that function, else the test fails: a mark can
only count for coverage when the test really reaches the site.
"""

from __future__ import annotations

import _fake_nccl
import pytest


@pytest.fixture(autouse=True)
def _covered_sites_ran(request):
    _fake_nccl.RECORDED.clear()
    yield
    named = [site for mark in request.node.iter_markers("covers") for site in mark.args]
    missing = [site for site in named if not _fake_nccl.ran(site)]
    ran = sorted({f"{c.module}:{c.function} ({c.kind})" for c in _fake_nccl.RECORDED if c.module})
    assert not missing, f"sites named by @pytest.mark.covers that ran no collective: {missing}; ran: {ran}"
