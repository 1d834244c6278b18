"""What a user does: ``pip install .`` (not editable), then the console scripts from any folder.

The wheel is built from a temporary copy of the checkout (no ``build/`` or egg-info left in
the checkout) with ``pip wheel --no-deps --no-build-isolation`` and installed with ``pip install
--no-deps --target``: the dependencies come from this interpreter, nothing from the network.
The wheel must carry the repository's top-level ``conf/`` as the package
``lightning_bytescale.recipes.conf`` (``pyproject.toml``'s package-dir mapping).  Every command
then runs in an unrelated temporary folder with the installed copy first on ``PYTHONPATH``, and
the test checks that this copy, not the checkout (which this interpreter may have installed
editable), is the one imported.  ``bytescale-train`` must find its YAML inside the installed
package.  The editable install (``scripts/setup.sh``) is checked from an unrelated folder too.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "lightning_bytescale"
CONF = REPO / "conf"  # the recipe configs, installed as the package lightning_bytescale.recipes.conf
CONF_PACKAGE = f"{PACKAGE}.recipes.conf"
CONF_INSTALLED = Path(PACKAGE, "recipes", "conf")  # where the wheel puts them
SCRIPTS = ("bytescale-plan", "bytescale-sim", "bytescale-profile", "bytescale-data", "bytescale-train")
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def _build_leftovers() -> dict[str, float]:
    """The checkout's build outputs (``build/``, egg-info) and when each last changed."""
    found = [REPO / "build", *REPO.glob("*.egg-info")]
    return {str(p): p.stat().st_mtime for p in found if p.exists()}


def _files(folder: Path) -> set[str]:
    """Every file under ``folder``, relative to it (compiled files left out)."""
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _checkout_files() -> set[str]:
    """What an install must hold, as paths in it: the package's files and ``conf/`` under its new name."""
    return {f"{PACKAGE}/{f}" for f in _files(REPO / PACKAGE)} | {
        (CONF_INSTALLED / f).as_posix() for f in _files(CONF)
    }


def test_pyproject_names_every_package_of_the_checkout():
    """``[tool.setuptools] packages`` is a list (the finder cannot follow conf/'s mapping): it must
    name every package folder, or a new one would be left out of the wheel without a word."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / PACKAGE).rglob("__init__.py")}
    assert set(config["packages"]) == folders | {CONF_PACKAGE}
    assert config["package-dir"] == {CONF_PACKAGE: "conf"}
    assert (CONF / "__init__.py").is_file() and (CONF / "pretrain.yaml").is_file()
    assert not (REPO / CONF_INSTALLED).exists(), "the configs live in conf/ at the top level only"


def _pip(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=180, cwd=cwd, env={**os.environ, "PIP_NO_INPUT": "1"}
    )
    assert proc.returncode == 0, f"pip {args[3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """``pip install .`` of a copy of the checkout into its own folder; returns the folders."""
    import setuptools

    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.fail(
            f"setuptools {setuptools.__version__} cannot build the wheel without build isolation "
            "(pyproject.toml asks for >= 70.1): run scripts/setup.sh, or pip install 'setuptools>=70.1'"
        )
    tmp = tmp_path_factory.mktemp("pip_install")
    source, wheels, target, work = tmp / "source", tmp / "wheels", tmp / "site", tmp / "elsewhere"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for folder in (PACKAGE, "conf"):
        shutil.copytree(REPO / folder, source / folder, ignore=SKIP)
    work.mkdir()
    before = _build_leftovers()
    pip = [sys.executable, "-m", "pip"]
    quiet = ["--no-deps", "--no-index", "--no-cache-dir", "--disable-pip-version-check"]
    _pip([*pip, "wheel", *quiet, "--no-build-isolation", "--wheel-dir", str(wheels), str(source)], work)
    assert _build_leftovers() == before, "the build wrote into the checkout"
    (wheel,) = wheels.glob("*.whl")
    _pip([*pip, "install", *quiet, "--target", str(target), str(wheel)], work)
    return {"source": source, "wheel": wheel, "site": target, "work": work, "tmp": tmp}


def _env(installed: dict[str, Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "WANDB_API_KEY"}
    env.update(
        PYTHONPATH=str(installed["site"]),  # the installed copy first, before any editable install
        PYTHONNOUSERSITE="1",
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HYDRA_FULL_ERROR="1",
        BYTESCALE_DATA_CACHE=str(installed["tmp"] / "cache"),
        NETRC=str(installed["tmp"] / "no-netrc"),
    )
    env.pop("BYTESCALE_CONF_DIR", None)  # the packaged configs, nothing else
    return env


def _run(installed: dict[str, Path], args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=installed["work"], env=_env(installed)
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    )
    return proc


def test_the_wheel_carries_the_package_and_conf(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = {n for n in wheel.namelist() if ".dist-info/" not in n}
    missing = _checkout_files() - names
    assert not missing, f"files of the checkout missing from the wheel: {sorted(missing)}"
    assert (CONF_INSTALLED / "pretrain.yaml").as_posix() in names
    assert not {n for n in names if n.startswith("conf/")}, "conf/ must ship inside the package"


def test_the_installed_copy_is_complete(installed):
    site = installed["site"]
    missing = _checkout_files() - {f for f in _files(site) if f.startswith(PACKAGE + "/")}
    assert not missing, f"files of the checkout missing from the installed copy: {sorted(missing)}"
    conf = site / CONF_INSTALLED
    assert (conf / "pretrain.yaml").is_file()
    assert {p.name for p in conf.iterdir() if p.is_dir() and p.name != "__pycache__"} >= {
        "strategy",
        "data",
        "model",
        "trainer",
        "logger",
        "experiment",
    }
    assert (site / PACKAGE / "py.typed").is_file()
    assert (site / PACKAGE / "data" / "samples" / "chat.jsonl").is_file()
    for script in SCRIPTS:
        assert (site / "bin" / script).is_file(), f"no console script {script}"


def test_the_installed_copy_is_what_gets_imported(installed):
    probe = (
        "import json, lightning_bytescale, lightning_bytescale.cli.train as t, "
        "lightning_bytescale.recipes.config as c; "
        "print(json.dumps([lightning_bytescale.__file__, t.__file__, str(c.find_conf_dir()), c.config_source()]))"
    )
    found = json.loads(_run(installed, [sys.executable, "-c", probe]).stdout.strip().splitlines()[-1])
    site = installed["site"].resolve()
    for path in found[:3]:
        assert Path(path).resolve().is_relative_to(site), f"{path} is not in the installed copy {site}"
        assert not Path(path).resolve().is_relative_to(REPO), f"{path} is the checkout, not the install"
    assert found[3] == "pkg://lightning_bytescale.recipes.conf"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_starts(installed, script):
    proc = _run(installed, [str(installed["site"] / "bin" / script), "--help"])
    assert proc.stdout.strip(), f"{script} --help printed nothing"
    if script == "bytescale-train":  # the groups come from the packaged YAML
        assert "experiment: " in proc.stdout and "cpu_smoke" in proc.stdout, proc.stdout


@pytest.mark.multiprocess  # 2 ranks (gloo on 127.0.0.1), started by the installed script's popen launcher
def test_bytescale_train_runs_from_an_unrelated_folder(installed):
    run_dir = installed["tmp"] / "run"
    proc = _run(
        installed,
        [
            str(installed["site"] / "bin" / "bytescale-train"),
            "experiment=cpu_smoke",
            "trainer.max_steps=2",
            "logger=csv",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=240,
    )
    assert "[bytescale-train] cpu_smoke: 2 steps" in proc.stdout, proc.stdout[-3000:]
    (metrics,) = run_dir.glob("csv/version_*/metrics.csv")
    steps = {row["step"] for row in csv.DictReader(metrics.open()) if row.get("train/loss")}
    assert len(steps) == 2, steps
    assert not (installed["work"] / "outputs").exists()  # hydra.run.dir was honoured
    from omegaconf import OmegaConf

    sources = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.config_sources
    main = [(s.schema, s.path) for s in sources if s.provider == "main"]
    assert main == [("pkg", "lightning_bytescale.recipes.conf")], main  # the packaged YAML


def test_the_editable_install_finds_conf_from_any_folder(tmp_path):
    """``scripts/setup.sh`` installs this checkout editable: from an unrelated folder the configs
    are the checkout's ``conf/`` (setuptools' editable finder follows the package-dir mapping)."""
    probe = (
        "import json, lightning_bytescale, lightning_bytescale.recipes.config as c; "
        "print(json.dumps([lightning_bytescale.__file__, str(c.find_conf_dir()), c.config_source()]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BYTESCALE_CONF_DIR")}
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    package, conf, source = json.loads(run.stdout.strip().splitlines()[-1])
    if not Path(package).resolve().is_relative_to(REPO):
        pytest.skip(f"this interpreter's {PACKAGE} is not an editable install of {REPO}: {package}")
    assert Path(conf).resolve() == CONF.resolve() and source == f"pkg://{CONF_PACKAGE}"
    script = Path(sys.executable).parent / "bytescale-train"
    run = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "experiment: " in run.stdout and "cpu_smoke" in run.stdout, run.stdout
