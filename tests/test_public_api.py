"""The public API: ``__all__`` everywhere, ``lb.attention`` as a plain function, registration in any order.

Each import-order check runs in a fresh interpreter (a subprocess), because what matters is what
an import does to an empty ``sys.modules``: ``import lightning_bytescale`` and the pure command
lines must not load torch or Lightning, and ``Trainer(strategy="bytescale")`` must work whether
Lightning or this package is imported first.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = (
    "cli",
    "data",
    "engine",
    "hf",
    "lightning",
    "models",
    "offload",
    "packed_attention",
    "parallel",
    "planner",
    "profiler",
    "recipes",
    "sim",
)


def fresh(code: str, timeout: float = 240) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON line last, returned parsed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LT_", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


LOADED = "json.dumps({'torch': 'torch' in sys.modules, 'lightning': 'lightning' in sys.modules})"


def test_import_lightning_bytescale_and_the_pure_command_lines_load_neither_torch_nor_lightning():
    out = fresh(f"import json, sys\nimport lightning_bytescale\nprint({LOADED})")
    assert out == {"torch": False, "lightning": False}
    out = fresh(
        f"import json, sys\nimport lightning_bytescale.planner, lightning_bytescale.sim\nprint({LOADED})"
    )
    assert out == {"torch": False, "lightning": False}
    for cli in ("plan", "sim"):
        code = (
            "import contextlib, io, json, sys\n"
            f"from lightning_bytescale.cli.{cli} import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            f"print({LOADED})"
        )
        assert fresh(code) == {"torch": False, "lightning": False}, f"bytescale-{cli} --help"


def test_bytescale_train_answers_help_and_config_errors_without_torch_or_lightning():
    """``bytescale-train --help`` and a config that does not compose answer in about a second:
    torch and Lightning load only once a run is built (``cli/train.py``'s docstring)."""
    for argv, fails in ((["--help"], False), (["strategy.plannr=balance"], True)):
        out = fresh(
            "import contextlib, io, json, sys\n"
            f"sys.argv = ['bytescale-train', *{argv!r}]\n"
            "from lightning_bytescale.cli.train import main\n"
            "out, err = io.StringIO(), io.StringIO()\n"
            "try:\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "        main()\n"
            "    code = 0\n"
            "except SystemExit as e:\n"
            "    code = e.code or 0\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'lightning': 'lightning' in sys.modules,\n"
            "    'code': code, 'said': out.getvalue() + err.getvalue()}))"
        )
        assert (out["torch"], out["lightning"], out["code"] != 0) == (False, False, fails), (argv, out)
    assert "plannr" in out["said"], out["said"]


def test_attention_is_a_plain_function_from_import_lightning_bytescale_alone():
    code = (
        "import inspect, json, sys\n"
        "import lightning_bytescale as lb\n"
        "import torch\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(6, 4, 8, dtype=torch.float64) for _ in range(3))\n"
        "out = lb.attention(q, k, v, scale=None)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(\n"
        "    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)\n"
        "from lightning_bytescale import attention\n"
        "import lightning_bytescale.packed_attention as pa\n"
        "print(json.dumps({'close': bool(torch.allclose(out, ref, rtol=0, atol=1e-12)),\n"
        "    'function': inspect.isfunction(attention), 'same': attention is lb.attention is pa.attention,\n"
        "    'package_callable': callable(pa), 'module_type': type(pa).__name__,\n"
        "    'params': list(inspect.signature(attention).parameters)}))"
    )
    out = fresh(code)
    assert out == {
        "close": True,
        "function": True,
        "same": True,
        "package_callable": False,
        "module_type": "module",
        "params": ["q", "k", "v", "scale"],
    }


TRAINER = (
    "t = pl.Trainer(strategy='{name}', accelerator='cpu', devices=1, logger=False,\n"
    "    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
)


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_bytescale\nimport lightning.pytorch as pl\n",
        "import lightning.pytorch as pl\nimport lightning_bytescale\n",
        "from lightning_bytescale import ByteScaleStrategy\nimport lightning.pytorch as pl\n",
        "import lightning_bytescale\nimport lightning as L\npl = L\n",
    ],
    ids=["package-first", "lightning-first", "strategy-class", "top-level-lightning"],
)
def test_strategy_names_register_in_either_import_order(imports):
    code = "import json\n" + imports
    for name in ("bytescale", "bytescale_spawn", "bytescale_fork"):
        code += (
            TRAINER.format(name=name) + f"{name} = (type(t.strategy).__name__, t.strategy._start_method)\n"
        )
    code += "print(json.dumps([bytescale, bytescale_spawn, bytescale_fork]))"
    out = fresh(code)
    assert out == [
        ["ByteScaleStrategy", "popen"],
        ["ByteScaleStrategy", "spawn"],
        ["ByteScaleStrategy", "fork"],
    ]


def test_registration_uses_no_import_finder_of_our_own():
    code = (
        "import json, sys\nimport lightning_bytescale\n"
        "print(json.dumps([type(f).__module__ for f in sys.meta_path]))"
    )
    assert not [m for m in fresh(code) if m.startswith("lightning_bytescale")]


def test_the_top_level_all_resolves_and_dir_lists_it():
    import lightning_bytescale as lb

    assert len(lb.__all__) == len(set(lb.__all__))
    for name in lb.__all__:
        assert getattr(lb, name) is not None, name
    assert set(lb.__all__) <= set(dir(lb))
    for name in ("ByteScaleStrategy", "ByteScaleDataModule", "attention", "attention_context", "token_loss"):
        assert name in lb.__all__
    assert issubclass(lb.ConfigError, lb.ByteScaleError)
    assert isinstance(lb.__version__, str)
    with pytest.raises(AttributeError, match="no attribute 'attentoin'"):
        _ = lb.attentoin


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_every_subpackage_declares_all_and_every_name_resolves(sub):
    if sub == "hf":
        pytest.importorskip("transformers")
    module = importlib.import_module(f"lightning_bytescale.{sub}")
    assert isinstance(module, types.ModuleType) and not callable(module)
    assert isinstance(getattr(module, "__all__", None), list), f"lightning_bytescale.{sub} has no __all__"
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"lightning_bytescale.{sub}.{name} has no docstring"
