"""`ps-bridge doctor`: versions against the tested range (ps_bridge/compat/tested_stacks.py), the
device and the backends `auto` takes, the provider of a checkpoint, and the self-test.

The version lookup is one function (`doctor.installed_version`); the tests replace it to put a
package outside the tested range."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ps_bridge.tools.cli import doctor, main
from ps_bridge.compat.tested_stacks import PACKAGES, TESTED_STACKS, version_range

pytestmark = pytest.mark.core  # also run on the oldest tested stack

ROOT = Path(__file__).resolve().parent.parent


def fake_versions(monkeypatch, **overrides):
    """Installed versions as they are, except `overrides` (package name with '_' for '-'; None: absent)."""
    real = doctor.installed_version
    table = {name.replace("_", "-"): version for name, version in overrides.items()}
    monkeypatch.setattr(doctor, "installed_version", lambda name: table[name] if name in table else real(name))
    # a package reported absent must not be found by its import name either
    present = doctor._module_present
    absent_modules = {p.module for p in PACKAGES if p.name in table and table[p.name] is None}
    monkeypatch.setattr(doctor, "_module_present", lambda module: module not in absent_modules and present(module))


def run_doctor_json(capsys, *extra) -> tuple:
    rc = main(["doctor", "--json", "--no-self-test", *extra])
    return rc, json.loads(capsys.readouterr().out)


def messages(doc, level):
    return [f["message"] for f in doc["findings"] if f["level"] == level]


# ---- the tested-range table ------------------------------------------------------------------------


def test_every_pinned_package_is_described_and_ranges_are_ordered():
    names = {p.name for p in PACKAGES}
    for stack, pins in TESTED_STACKS.items():
        assert set(pins) <= names, f"stack {stack} pins packages doctor does not describe: {set(pins) - names}"
    assert version_range("megatron-core") == (TESTED_STACKS["oldest"]["megatron-core"], TESTED_STACKS["newest"]["megatron-core"])
    assert version_range("flash-attn") is None


def _requirement_pins(paths):
    pins = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
            if m:
                pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


@pytest.mark.parametrize("stack", ["newest", "oldest"])
def test_table_matches_the_requirements_files(stack):
    """The table's pins are the ones `make venv` (STACK=oldest) installs: they cannot drift apart."""
    files = sorted(p for p in ROOT.glob("requirements*.txt") if ("oldest" in p.name) == (stack == "oldest"))
    pins = _requirement_pins(files)
    if stack == "oldest" and not pins:
        pytest.skip("no requirements-oldest*.txt in this checkout")
    compared = {name: version for name, version in TESTED_STACKS[stack].items() if name in pins}
    assert compared, f"no package of the {stack} stack is pinned in {[p.name for p in files]}"
    assert compared == {name: pins[name] for name in compared}


# ---- exit status and findings ----------------------------------------------------------------------


def test_tested_stack_exits_0_and_reports_every_package(capsys):
    rc, doc = run_doctor_json(capsys)
    assert rc == 0, doc["findings"]
    assert doc["ok"] and doc["errors"] == 0
    assert [r["package"] for r in doc["packages"]] == [p.name for p in PACKAGES]
    assert doc["device"]["type"] in ("cpu", "cuda", "npu")
    assert doc["backends"]["attention"]["float32"]["backend"] == "torch_ref"
    assert any("vanilla_mbridge=False" in s for s in doc["verl_settings"])
    assert any("use_fused_kernels=False" in s for s in doc["verl_settings"])
    assert doc["self_test"] == {"skipped": "--no-self-test"}


@pytest.mark.parametrize(
    "package, version, words",
    [
        ("megatron-core", "0.16.1", ["megatron-core 0.16.1", "below 0.18.0", "safe_get_world_size", "Fix:"]),
        ("megatron-core", "0.17.1", ["megatron-core 0.17.1", "below 0.18.0"]),
        ("python", "3.11.7", ["python 3.11.7", "below 3.12", "Megatron-Bridge", "Python 3.12"]),
        ("python", "3.13.1", ["python 3.13.1", "not below 3.13", "Megatron-Bridge"]),
        ("megatron-bridge", "0.4.2", ["megatron-bridge 0.4.2", "below 0.5.0", "qwen35_bridge"]),
        ("verl", "0.7.1", ["verl 0.7.1", "below 0.8.0"]),
        ("megatron-bridge", None, ["megatron-bridge is not installed"]),
        ("torch", None, ["torch is not installed"]),
    ],
)
def test_a_version_known_not_to_work_exits_1_naming_package_version_and_range(monkeypatch, capsys, package, version, words):
    fake_versions(monkeypatch, **{package: version})
    rc = main(["doctor", "--no-self-test"])
    out = capsys.readouterr().out
    assert rc == 1
    errors = [line for line in out.splitlines() if line.strip().startswith("error:")]
    assert len(errors) == 1, out
    for word in words:
        assert word in errors[0], errors[0]
    assert "result: 1 error(s)" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("device_type, level", [("cuda", "error"), ("cpu", "warning")])
def test_a_gpu_kernel_package_below_its_floor_is_an_error_only_on_cuda(device_type, level):
    [fla] = [p for p in PACKAGES if p.name == "fla-core"]
    status, finding = doctor.check_package(fla, "0.4.1", device_type)
    assert status == "refused" and finding.level == level
    assert "fla-core 0.4.1 is below 0.4.2" in finding.message and "cu_seqlens_cpu" in finding.message


@pytest.mark.parametrize("bridge, errors", [("0.5.0", 1), ("0.6.2", 0)])
def test_megatron_bridge_0_5_needs_modelopt(monkeypatch, capsys, bridge, errors):
    fake_versions(monkeypatch, megatron_bridge=bridge, nvidia_modelopt=None)
    present = doctor._module_present
    monkeypatch.setattr(doctor, "_module_present", lambda module: module != "modelopt" and present(module))
    rc, doc = run_doctor_json(capsys)
    assert doc["errors"] == errors and rc == (1 if errors else 0)
    if errors:
        [error] = messages(doc, "error")
        assert error.startswith("nvidia-modelopt is not installed, and megatron-bridge 0.5.0 needs it") and "Fix:" in error


def test_missing_required_package_skips_the_self_test(monkeypatch, capsys):
    fake_versions(monkeypatch, megatron_core=None)
    rc = main(["doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert doc["self_test"] == {"skipped": "the stack above does not work"}


@pytest.mark.parametrize(
    "package, version, phrase",
    [
        ("megatron-core", "0.19.0", "between the tested endpoints"),
        ("torch", "2.99.0", "newer than tested"),
        ("torch", "2.9.0a0+40658a4", "older than tested"),  # an NGC build: a pre-release with a local tag
        ("transformers", "5.9.0", "expected, not tested"),
    ],
)
def test_untested_versions_warn_and_exit_0(monkeypatch, capsys, package, version, phrase):
    fake_versions(monkeypatch, **{package: version})
    rc, doc = run_doctor_json(capsys)
    assert rc == 0, doc["findings"]
    [warning] = [m for m in messages(doc, "warning") if m.startswith(f"{package} ")]
    assert version in warning and phrase in warning
    [row] = [r for r in doc["packages"] if r["package"] == package]
    assert row["installed"] == version and row["tested"] == list(version_range(package))


def test_local_build_of_a_tested_version_counts_as_tested(monkeypatch, capsys):
    fake_versions(monkeypatch, torch=TESTED_STACKS["newest"]["torch"] + "+cpu")
    rc, doc = run_doctor_json(capsys)
    [row] = [r for r in doc["packages"] if r["package"] == "torch"]
    assert rc == 0 and row["status"] == "tested"


def test_optional_packages_absent_are_notes(monkeypatch, capsys):
    fake_versions(monkeypatch, verl=None, transformer_engine=None, flash_attn=None)
    rc, doc = run_doctor_json(capsys)
    assert rc == 0
    notes = messages(doc, "note")
    assert any(m.startswith("verl not installed: needed only for training in verl") for m in notes)
    assert "not installed" in doc["transformer_engine"]


def test_transformer_engine_installed_is_explained(monkeypatch, capsys):
    fake_versions(monkeypatch, transformer_engine="2.8.0")
    rc, doc = run_doctor_json(capsys)
    assert rc == 0
    assert "local layer spec" in doc["transformer_engine"] and "FP8 are not used" in doc["transformer_engine"]


def test_a_backend_the_registry_refuses_is_an_error(monkeypatch, capsys):
    """doctor asks the GDN registry whether `auto` can train here (e.g. fla's Hopper + Triton check)."""
    import ps_bridge.kernels.gdn.registry as gdn_registry

    def refuse(name, device, training=True):
        raise RuntimeError("the fla Gated DeltaNet backward is refused here. Fix it: upgrade Triton")

    monkeypatch.setattr(gdn_registry, "check_gdn_backend_usable", refuse)
    rc, doc = run_doctor_json(capsys)
    assert rc == 1
    assert messages(doc, "error") == ["Qwen3.5 training here: the fla Gated DeltaNet backward is refused here. Fix it: upgrade Triton"]


def test_a_failing_check_is_one_line_without_traceback(monkeypatch, capsys):
    def broken(device_type):
        raise ImportError("cannot import name 'x' from 'y'\n(more lines)")

    monkeypatch.setattr(doctor, "check_backends", broken)
    rc = main(["doctor", "--no-self-test"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "error: backends check failed: ImportError: cannot import name 'x' from 'y' (details: ps-bridge -v doctor)" in captured.out
    assert "Traceback" not in captured.out + captured.err


# ---- the checkpoint --------------------------------------------------------------------------------


def test_checkpoint_resolves_to_its_provider(capsys, qwen2_checkpoint):
    path, _ = qwen2_checkpoint
    rc, doc = run_doctor_json(capsys, "--hf-path", path)
    assert rc == 0
    assert doc["checkpoint"]["provider"] == "qwen2.5"
    assert doc["checkpoint"]["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("architecture, provider", [
    ("Qwen3ForCausalLM", "qwen3"), ("Qwen3MoeForCausalLM", "qwen3-moe"), ("LlamaForCausalLM", "llama3"),
])
def test_standard_family_checkpoint_resolves_to_its_provider(tmp_path, capsys, architecture, provider):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    rc, doc = run_doctor_json(capsys, "--hf-path", str(tmp_path))
    assert doc["checkpoint"]["provider"] == provider and doc["checkpoint"]["architectures"] == [architecture]
    assert not [m for m in messages(doc, "error") if "checkpoint" in m], doc


def test_unsupported_checkpoint_exits_1(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    rc, doc = run_doctor_json(capsys, "--hf-path", str(tmp_path))
    assert rc == 1
    [error] = messages(doc, "error")
    assert "unsupported architecture GPTNeoXForCausalLM" in error and "Qwen2ForCausalLM" in error


def test_missing_checkpoint_is_a_usage_error(tmp_path, capsys):
    assert main(["doctor", "--no-self-test", "--hf-path", str(tmp_path / "nope")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


# ---- a fresh process -------------------------------------------------------------------------------


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "ps_bridge.tools.cli", *argv], capture_output=True, text=True, timeout=600)


def test_doctor_in_a_fresh_process_is_quiet():
    """The table and its verdict, no traceback or third-party warning (this environment is a tested
    stack: the newest in `make test`, the oldest in `make test STACK=oldest`)."""
    proc = run_cli("doctor", "--no-self-test")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    noisy = [line for line in (proc.stdout + proc.stderr).splitlines() if "Traceback" in line or "Warning" in line]
    assert noisy == [], noisy
    assert proc.stdout.rstrip().splitlines()[-1].startswith("result: OK")


def test_doctor_runs_where_torch_does_not_import():
    """The parser of `ps-bridge doctor` imports nothing heavy: a broken torch is a finding, not a crash."""
    code = "import sys; sys.modules['torch'] = None; from ps_bridge.tools.cli import main; sys.exit(main(['doctor', '--no-self-test']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error: torch does not work here: ModuleNotFoundError" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_self_test_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """The self-test's model is tiny: it runs on one CPU thread (torch's intra-op threads only add
    synchronisation), its time is reported apart from the stack's import, and the caller's thread
    count is restored, also when the test raises. The stack import and the demo are replaced here;
    the fresh-process test below runs the real ones."""
    import torch

    seen = []

    def fake_demo(**kwargs):
        seen.append(torch.get_num_threads())
        return dict.fromkeys(("max_logprob_diff_shared_vs_unshared", "max_rel_grad_diff_shared_vs_unshared",
                              "max_logprob_diff_shared_vs_hf", "max_logprob_diff_unshared_vs_hf"), 0.0)

    import ps_bridge.tools.cli.demo as demo

    monkeypatch.setattr(doctor, "_import_the_stack", lambda: None)
    monkeypatch.setattr(demo, "demo_result", fake_demo)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, findings = doctor.self_test()
        assert seen == [1] and torch.get_num_threads() == 2
        assert out["passed"] and not findings and {"seconds", "import_seconds"} <= out.keys()

        def failing_demo(**kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(demo, "demo_result", failing_demo)
        with pytest.raises(RuntimeError, match="boom"):
            doctor.self_test()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_doctor_self_test_in_a_fresh_process():
    """The whole doctor, self-test included, on this machine's device: exit 0, the self-test passed."""
    proc = run_cli("doctor", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    st = doc["self_test"]
    assert st["passed"], st
    assert st["max_logprob_diff_shared_vs_unshared"] <= 1e-5 and st["max_rel_grad_diff_shared_vs_unshared"] <= 1e-5
    assert st["import_seconds"] > 0 and st["seconds"] > 0

