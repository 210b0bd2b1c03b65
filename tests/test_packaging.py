"""pyproject.toml's metadata: ps-bridge installs into an environment that already holds a stack
without changing anything else, and our own code is not what refuses an older Python.

The stack (torch, megatron-core, Megatron-Bridge, transformers, fla-core, verl, Transformer Engine)
is not declared (pyproject.toml says why); `ps-bridge doctor` checks it (tests/test_doctor.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.core  # also run on the oldest tested stack

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SOURCE_DIRS = ("ps_bridge", "providers", "models")
# what pip must never replace in a user's environment, nor pull through another package's metadata
STACK = {"torch", "megatron-core", "megatron-bridge", "transformers", "fla-core", "flash-linear-attention", "verl",
         "transformer-engine", "flash-attn", "triton", "vllm", "tilelang"}


def requirements(extras: bool = True):
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    if extras:
        reqs += [Requirement(r) for group in PROJECT.get("optional-dependencies", {}).values() for r in group]
    return reqs


def test_dependencies_leave_the_stack_alone_and_never_cap_or_pin():
    """No stack package is declared; every requirement (extras too) is a floor, so pip can never
    downgrade or replace a package that meets it."""
    for req in requirements():
        assert canonicalize_name(req.name) not in STACK, f"{req} is part of the stack: doctor checks it, pip must not"
        for spec in req.specifier:
            assert spec.operator in (">=", ">", "!="), f"{req}: only floors, no '{spec.operator}'"


# every third-party module the package imports, and who provides it
IMPORTED = {
    "numpy": "declared", "packaging": "declared", "tqdm": "declared", "matplotlib": "the [plot] extra",
    "torch": "stack", "megatron": "stack (megatron-core, Megatron-Bridge)", "transformers": "stack",
    "tokenizers": "stack (transformers)", "fla": "stack (fla-core)", "triton": "stack (torch, CUDA)",
    "flash_attn": "optional (flash-attn)", "torch_npu": "optional (NPU)",
    "PIL": "optional (Pillow: image files in a `ps-bridge logprobs` batch)",
    "verl": "stack (verl)", "tensordict": "stack (verl)", "omegaconf": "stack (verl, Megatron-Bridge)",
    "einops": "stack (megatron-core, verl)", "safetensors": "stack (transformers)",
    "pyarrow": "stack (verl: its datasets read parquet; the grpo job writes it)",
    "vllm": "optional (verl's rollout: vLLM's CPU build in the grpo stack, read only inside vLLM's processes)",
}


def test_every_third_party_import_is_declared_or_part_of_the_stack():
    """A new third-party import must be declared in pyproject.toml, or be part of the stack that
    `ps-bridge doctor` checks (then add it to IMPORTED above and to doctor's table if it matters)."""
    import ast

    found = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    third_party = found - set(sys.stdlib_module_names) - {"ps_bridge", "__future__"}
    assert third_party <= set(IMPORTED), f"undeclared imports: {sorted(third_party - set(IMPORTED))}"
    declared = {canonicalize_name(r.name) for r in requirements()}
    for module, provider in IMPORTED.items():
        if provider == "declared" or provider.startswith("the ["):
            assert canonicalize_name(module) in declared, f"{module} is said to be declared, but pyproject.toml lacks it"


def test_dependencies_are_met_in_this_environment():
    """Fast stand-in for the resolver test below: what the wheel requires is already installed here,
    so installing it changes nothing else."""
    unmet = []
    for req in requirements(extras=False):
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req} (absent)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req} (installed {version})")
    assert not unmet, unmet


def test_every_source_folder_is_a_listed_package():
    """pyproject.toml lists the packages one by one (providers/ and models/ are mapped into
    ps_bridge): a new sub-package left off the list would be missing from the wheel (and only from
    the wheel: the editable install finds it)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {ROOT / folder for folder in setuptools["package-dir"].values()}
    listed = set()
    for package in setuptools["packages"]:
        mapped = max((p for p in setuptools["package-dir"] if package == p or package.startswith(p + ".")), key=len)
        listed.add(ROOT / setuptools["package-dir"][mapped] / package[len(mapped):].lstrip(".").replace(".", "/"))
    found = {path.parent for folder in folders for path in folder.rglob("*.py") if "__pycache__" not in path.parts}
    assert found == listed, f"not listed: {sorted(map(str, found - listed))}; listed, not found: {sorted(map(str, listed - found))}"


def _minors_allowed():
    spec = SpecifierSet(PROJECT["requires-python"])
    return [f"3.{m}" for m in range(8, 14) if spec.contains(f"3.{m}.0")]


def test_requires_python_admits_3_11():
    assert "3.11" in _minors_allowed() and "3.12" in _minors_allowed()


def _interpreter(minor: str):
    """A working python`minor` (pyenv's shims exist for versions that are not selected: run it to know)."""
    for candidate in (*sorted(Path.home().glob(f".pyenv/versions/{minor}.*/bin/python{minor}")), shutil.which(f"python{minor}")):
        if candidate and subprocess.run([str(candidate), "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return str(candidate)
    return None


COMPILE_ALL = """
import sys
from pathlib import Path
bad = []
for folder in sys.argv[1:]:
    for path in sorted(Path(folder).rglob("*.py")):
        try:
            compile(path.read_text(), str(path), "exec")
        except SyntaxError as e:
            bad.append(f"{path}:{e.lineno}: {e.msg}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("minor", [m for m in _minors_allowed() if Version(m) < Version("3.12")])
def test_our_code_compiles_on_every_older_python_the_metadata_admits(minor):
    """Every module of the package parses on the oldest Pythons requires-python admits (no pyc written)."""
    python = _interpreter(minor)
    if python is None:
        pytest.skip(f"no python{minor} on this machine")
    proc = subprocess.run([python, "-c", COMPILE_ALL, *(str(ROOT / d) for d in SOURCE_DIRS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{python}: {proc.stdout}{proc.stderr}"


# ---- the wheel, through pip's resolver -------------------------------------------------------------


def _venvs():
    """This test run's environment and the checkout's stack venvs (`make venv`, `make venv STACK=oldest`)."""
    seen, out = set(), []
    for prefix in (Path(sys.prefix), ROOT / ".venv", ROOT / ".venv-oldest"):
        python = prefix / "bin" / "python"  # a link to the base interpreter: tell venvs apart by folder
        if python.exists() and prefix.resolve() not in seen:
            seen.add(prefix.resolve())
            out.append(python)
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel, built from a copy of the sources (a stale build/ in the checkout cannot leak in)."""
    src = tmp_path_factory.mktemp("src") / "ps-bridge"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".whl", ".hypothesis",
                                  ".pytest_cache", "out", "tests")
    shutil.copytree(ROOT, src, ignore=skip, symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [whl] = out.glob("ps_bridge-*.whl")
    return whl


@pytest.mark.slow
@pytest.mark.parametrize("python", _venvs(), ids=lambda p: p.parent.parent.name)
def test_installing_the_wheel_changes_no_other_package(python, wheel):
    """pip's resolver, asked what installing the wheel into a venv holding a stack would do (offline:
    a requirement the venv does not already meet fails the resolve), installs ps-bridge alone."""
    proc = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report", "-", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]]
    assert installs == [("ps-bridge", PROJECT["version"])], installs


# ---- the wheel, installed into a venv that holds a stack, then run ---------------------------------

RUN_INSTALLED = """
import json, sys
from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2
build_tiny_qwen2(sys.argv[1])
samples = [{"prompt": [1, 2, 3, 4], "response": [5, 6, 7]}, {"prompt": [1, 2, 3, 4], "response": [8, 9]}]
open(sys.argv[2], "w").write(json.dumps({"samples": samples}))
"""


def _stack_overlay(python: Path, root: Path) -> Path:
    """A fresh venv whose site-packages sees `python`'s venv (its stack) through links, without the
    ps-bridge installed there: as if the stack had been installed into it first. Nothing is written
    to the stack's venv; pip, which leaves packages outside its own venv alone, installs into ours."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=120).stdout.strip())
    stack = root / "stack"
    stack.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().replace("-", "_").startswith(("ps_bridge", "__editable__", "__editable___ps_bridge")):
            (stack / entry.name).symlink_to(entry)
    base = subprocess.run([str(python), "-c", "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    venv = root / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True, timeout=120).stdout.strip())
    (purelib / "_stack.pth").write_text(f"import site; site.addsitedir({str(stack)!r})\n")
    return venv


@pytest.mark.slow
def test_wheel_installs_alone_into_a_stack_venv_and_its_commands_run(wheel, tmp_path):
    """The install check of a wheel, offline, for the stack this test run is on (so `make test STACK=oldest`
    runs it on the oldest, `make test-all` on the newest): pip (the stack venv's own, through its
    resolver, no index) installs the wheel into a venv holding the stack; `pip freeze` changes by
    ps-bridge alone; the installed `ps-bridge demo`, `logprobs` (a tiny local checkpoint) and `doctor`
    exit 0, run from outside the checkout with no path to it."""
    python = Path(sys.prefix) / "bin" / "python"
    venv = _stack_overlay(python, tmp_path)
    vpython = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PS_WT", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    pip = [str(python), "-m", "pip", "--python", str(vpython), "--disable-pip-version-check"]

    def freeze():
        proc = subprocess.run([*pip, "freeze", "--all"], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return set(proc.stdout.splitlines())

    before = freeze()
    proc = subprocess.run([*pip, "install", "--no-index", str(wheel)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    after = freeze()
    assert before - after == set(), f"pip changed or removed: {sorted(before - after)}"
    assert {re.split("==| @ ", line)[0] for line in after - before} == {"ps-bridge"}, sorted(after - before)

    run = dict(capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    proc = subprocess.run([str(vpython), "-c", "import ps_bridge, sys; print(ps_bridge.__file__)"], **run)
    assert proc.returncode == 0 and str(venv) in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run([str(vpython), "-c", RUN_INSTALLED, str(tmp_path / "ckpt"), str(tmp_path / "batch.json")], **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = str(venv / "bin" / "ps-bridge")
    for args in (["demo"], ["logprobs", "--hf-path", str(tmp_path / "ckpt"), "--batch", str(tmp_path / "batch.json"),
                            "--out", str(tmp_path / "out.json")], ["doctor"]):
        proc = subprocess.run([cli, *args], **run)
        assert proc.returncode == 0, f"ps-bridge {' '.join(args)}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert json.loads((tmp_path / "out.json").read_text())["groups"] == 1
