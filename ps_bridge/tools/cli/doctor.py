"""`ps-bridge doctor`: will ps-bridge work in this environment, and how will it run here?

In the spirit of `python -m torch.utils.collect_env`: every relevant package's version against the
tested range (`ps_bridge.compat.tested_stacks`), the device, the attention and Gated DeltaNet
backends `auto` takes on it (asked from the kernel registries), what an installed Transformer Engine
means, the provider a checkpoint resolves to (`--hf-path`), the verl settings the integration needs,
and a self-test (a tiny random model, prefix-shared vs unshared vs Hugging Face, on this machine's
device): under a second once the stack is imported; importing torch, transformers, megatron-core
and Megatron-Bridge is most of doctor's time (docs/install.md).

Each finding is an error (ps-bridge will not work: exit status 1, with the fix), a warning (a
version between the tested endpoints or beyond them: expected, not tested) or a note.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import time
import traceback
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Dict, List, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ps_bridge.compat.te_placeholder import import_megatron_bridge
from ps_bridge.compat.tested_stacks import COMPANIONS, PACKAGES, pinned_versions, version_range
from ps_bridge.tools.cli import demo
from ps_bridge.tools.cli.errors import UsageError

ERROR, WARNING, NOTE = "error", "warning", "note"

# The settings of verl's trainer config the integration needs (docs/verl.md, "Turning it on").
VERL_SETTINGS = (
    "ENABLE_PREFIX_SHARING=1 (environment) and actor_rollout_ref.model.external_lib=ps_bridge.verl",
    "actor_rollout_ref.actor.megatron.use_mbridge=True and actor_rollout_ref.actor.megatron.vanilla_mbridge=False",
    "actor_rollout_ref.model.use_fused_kernels=False",
)

# The self-test's bound on every difference it reports: float32 on one device, where the demo and
# the tests see about 1e-6 (docs/install.md).
SELF_TEST_TOLERANCE = 1e-4


@dataclass
class Finding:
    level: str  # ERROR, WARNING or NOTE
    topic: str  # a package name, "device", "attention", "gdn", "checkpoint", "self-test", ...
    message: str


def add_parser(sub) -> None:
    dp = sub.add_parser("doctor", help="check this environment: versions vs the tested stacks, device, backends, self-test")
    dp.add_argument("--hf-path", default=None, help="also report the provider this HF checkpoint resolves to")
    dp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    dp.add_argument("--no-self-test", action="store_true", help="skip the self-test (a tiny model; it imports the whole stack)")
    dp.set_defaults(func=run_doctor)


# ---- versions --------------------------------------------------------------------------------------


def installed_version(name: str) -> Optional[str]:
    """The installed version of distribution `name` ("python": the interpreter), or None when absent.
    The one place doctor reads versions (the tests replace it)."""
    if name == "python":
        return platform.python_version()

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _module_present(module: str) -> bool:
    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _comparable(name: str, version: str):
    """`version` as a `packaging` Version (Python: major.minor only); None when it does not parse."""
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return Version(f"{v.major}.{v.minor}") if name == "python" else Version(v.public)


def check_package(package, version: Optional[str], device_type: str) -> tuple:
    """(status, finding or None) of `package` (a `tested_stacks.Package`) at `version`."""
    name = package.name
    if version is None:
        if package.needed == "required":
            return "missing", Finding(ERROR, name, f"{name} is not installed; ps-bridge needs it ({package.role}). "
                                      "Install the stack: docs/install.md gives the lines")
        level = WARNING if package.needed == "gpu" and device_type == "cuda" else NOTE
        return "absent", Finding(level, name, f"{name} {package.absent}")
    v = _comparable(name, version)
    if v is None:
        return "unknown", Finding(WARNING, name, f"{name} {version}: not a version doctor can compare; not tested")
    floor, ceiling = package.floor, package.ceiling
    # a package only the GPU kernels use cannot break a run on a machine without CUDA
    level, where = (ERROR, "") if package.needed != "gpu" or device_type == "cuda" else (WARNING, " (on a CUDA machine)")
    if floor is not None and v < _comparable(name, floor.version):
        return "refused", Finding(level, name, f"{name} {version} is below {floor.version}{where}: {floor.reason}. Fix: {floor.fix}")
    if ceiling is not None and v >= _comparable(name, ceiling.version):
        return "refused", Finding(level, name, f"{name} {version} is not below {ceiling.version}{where}: {ceiling.reason}. Fix: {ceiling.fix}")
    rng = version_range(name)
    if rng is None:
        return "installed", None
    oldest, newest = (_comparable(name, x) for x in rng)
    if any(v == _comparable(name, pin) for pin in pinned_versions(name)):
        return "tested", None
    span = f"tested: {rng[0]}" + (f" to {rng[1]}" if rng[0] != rng[1] else "")
    if v > newest:
        return "newer", Finding(WARNING, name, f"{name} {version} is newer than tested ({span}): not tested")
    if v < oldest:
        return "older", Finding(WARNING, name, f"{name} {version} is older than tested ({span}): not tested")
    return "expected", Finding(WARNING, name, f"{name} {version} lies between the tested endpoints ({span}): expected, not tested")


def check_versions(device_type: str) -> tuple:
    """(rows for the table, findings)."""
    rows, findings = [], []
    for package in PACKAGES:
        version = installed_version(package.name)
        if version is None and _module_present(package.module):
            version = "?"  # importable without package metadata (e.g. a source tree on PYTHONPATH)
        if version == "?":
            status, finding = "unknown", Finding(WARNING, package.name, f"{package.name} is importable but has no "
                                                 "package metadata: its version cannot be checked")
        else:
            status, finding = check_package(package, version, device_type)
        rng = version_range(package.name)
        rows.append(dict(package=package.name, installed=version, tested=list(rng) if rng else None, status=status))
        if finding:
            findings.append(finding)
    refused = {r["package"] for r in rows if r["status"] == "refused"}
    return rows, findings + check_companions(skip=refused)


def check_companions(skip=()) -> List[Finding]:
    """Packages a stack package imports without declaring them (`tested_stacks.COMPANIONS`); not for
    the packages in `skip` (refused already)."""
    findings = []
    for c in COMPANIONS:
        version = installed_version(c.when)
        if c.when in skip or version is None or _comparable(c.when, version) is None:
            continue
        if _comparable(c.when, version) in SpecifierSet(c.versions) and installed_version(c.package) is None \
                and not _module_present(c.module):
            findings.append(Finding(ERROR, c.package, f"{c.package} is not installed, and {c.when} {version} needs it: "
                                    f"{c.reason}. Fix: {c.fix}"))
    return findings


# ---- device and backends ---------------------------------------------------------------------------


def detect_device() -> dict:
    # imported here: torch is heavy (not loaded for argument parsing)
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return dict(type="cuda", name=torch.cuda.get_device_name(index), capability=f"{major}.{minor}",
                    count=torch.cuda.device_count(), cuda=torch.version.cuda)
    if _module_present("torch_npu"):
        # imported here: torch_npu exists on Ascend machines only (importing it registers torch.npu)
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return dict(type="npu", name=torch.npu.get_device_name(0), count=torch.npu.device_count())
    return dict(type="cpu", name=platform.processor() or platform.machine())


def describe_device(d: dict) -> str:
    if d["type"] == "cuda":
        return f"CUDA: {d['count']} x {d['name']} (compute capability {d['capability']}, CUDA {d['cuda']})"
    if d["type"] == "npu":
        return f"NPU: {d['count']} x {d['name']}"
    return f"CPU ({d['name']}; no CUDA or NPU device)"


def check_backends(device_type: str) -> tuple:
    """What `auto` takes on this device, asked from the registries: (dict, findings)."""
    # imported here: torch is heavy (not loaded for argument parsing)
    import torch

    # imported here: these import torch, which is heavy (not loaded for argument parsing)
    from ps_bridge.kernels.attention.registry import BACKENDS, choose_attention_backend
    from ps_bridge.kernels.backend import AUTO
    from ps_bridge.kernels.gdn.registry import GDN_BACKENDS, check_gdn_backend_usable, choose_gdn_backend

    device = torch.device(device_type)
    findings: List[Finding] = []
    attention = {}
    for label, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        name = choose_attention_backend(device, dtype, 128)
        attention[label] = dict(backend=name, description=BACKENDS[name].description)
    attention["rule"] = BACKENDS[AUTO].description
    if device_type == "cuda":
        # imported here: torch is heavy
        from ps_bridge.kernels.attention.kernel_choice import kernel_for

        try:
            attention["varlen_kernels"] = kernel_for(device).name
        except Exception as e:  # a broken flash-attn install
            findings.append(Finding(ERROR, "attention", f"the varlen flash kernels cannot be set up: {_one_line(e)}"))
    if device_type == "npu":
        findings.append(Finding(NOTE, "attention", "`auto` takes torch_ref on an NPU; the NPU launch scripts select "
                                "flash_atten_npu (PS_BRIDGE_BACKEND=flash_atten_npu), which is UNVERIFIED (no NPU here)"))
    gdn_name = choose_gdn_backend(device)
    gdn = dict(backend=gdn_name, description=GDN_BACKENDS[gdn_name].description, rule=GDN_BACKENDS[AUTO].description)
    try:
        check_gdn_backend_usable(AUTO, device, training=True)
    except (RuntimeError, ValueError) as e:
        gdn["problem"] = str(e)
        findings.append(Finding(ERROR, "gdn", f"Qwen3.5 training here: {e}"))
    return dict(attention=attention, gdn=gdn), findings


def transformer_engine_line(version: Optional[str]) -> str:
    """What an installed (or absent) Transformer Engine means for the prefix-shared path."""
    if version is None:
        return next(p.absent for p in PACKAGES if p.name == "transformer-engine")
    return (f"{version} installed: the prefix-shared path builds megatron's local layer spec, so TE's fused "
            "layers and FP8 are not used on it (runs with prefix sharing off keep what verl configures)")


# ---- checkpoint, self-test -------------------------------------------------------------------------


def check_checkpoint(hf_path: str) -> tuple:
    """(dict, findings) for `--hf-path`: the provider its architectures resolve to."""
    # imported here: torch is heavy
    from ps_bridge.providers.registry import resolve_provider
    from ps_bridge.tools.runtime import read_hf_config

    try:
        hf_config = read_hf_config(hf_path)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    archs = list(hf_config.get("architectures") or [])
    try:
        entry = resolve_provider(None, archs)
    except ValueError as e:
        return dict(path=hf_path, architectures=archs, provider=None), [Finding(ERROR, "checkpoint", str(e))]
    return dict(path=hf_path, architectures=archs, provider=entry.name, description=entry.description), []


def _import_the_stack() -> None:
    """What the self-test runs on: transformers' Qwen2, megatron-core, Megatron-Bridge (with its TE
    placeholder) and our runtime. On a 2-core CPU this is nearly all of the self-test's time
    (docs/install.md): the test itself is a few tenths of a second."""
    # imported here: transformers is heavy (importing the stack is what this function measures)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import_megatron_bridge()
    # imported here: ps_bridge.tools.runtime imports torch, which is heavy
    import ps_bridge.tools.runtime  # noqa: F401


def self_test() -> tuple:
    """The demo's comparison on a tiny random Qwen2.5 model on this machine's default device, on one
    CPU thread: the model is tiny, and torch's intra-op threads only add their synchronisation
    (on a loaded 2-core machine, seconds of it)."""
    # imported here: torch is heavy (not loaded for argument parsing)
    import torch

    start = time.perf_counter()
    _import_the_stack()
    imported = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = demo.demo_result(model="qwen2.5", prompts=2, n=4, backend="auto")
    finally:
        torch.set_num_threads(threads)
    keys = ("max_logprob_diff_shared_vs_unshared", "max_rel_grad_diff_shared_vs_unshared",
            "max_logprob_diff_shared_vs_hf", "max_logprob_diff_unshared_vs_hf")
    out = {k: result[k] for k in keys}
    out.update(model="tiny qwen2.5 (random, float32)", backend="auto", tolerance=SELF_TEST_TOLERANCE,
               import_seconds=round(imported - start, 2), seconds=round(time.perf_counter() - imported, 2))
    bad = [k for k in keys if not result[k] <= SELF_TEST_TOLERANCE]
    out["passed"] = not bad
    findings = [Finding(ERROR, "self-test", f"self-test failed: {', '.join(f'{k} = {result[k]:.2e}' for k in bad)} "
                        f"(tolerance {SELF_TEST_TOLERANCE:g}); run `ps-bridge -v doctor` and report it")] if bad else []
    return out, findings


# ---- the report ------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _guarded(doc: dict, key: str, findings: List[Finding], verbose: bool, fn, *args):
    """doc[key] = fn(*args)'s first value, its findings added; an exception becomes an error finding."""
    try:
        value, more = fn(*args)
    except UsageError:
        raise
    except Exception as e:
        if verbose:
            traceback.print_exc()
        doc[key] = dict(error=_one_line(e))
        findings.append(Finding(ERROR, key, f"{key} check failed: {_one_line(e)} (details: ps-bridge -v doctor)"))
        return
    doc[key] = value
    findings.extend(more)


def build_report(hf_path: Optional[str] = None, run_self_test: bool = True, verbose: bool = False) -> dict:
    findings: List[Finding] = []
    doc: Dict[str, object] = {}
    try:
        device = detect_device()
    except Exception as e:  # no (working) torch
        if verbose:
            traceback.print_exc()
        device = dict(type="unknown", error=f"torch does not work here: {_one_line(e)}")
        findings.append(Finding(ERROR, "device", device["error"]))
    doc["device"] = device
    rows, more = check_versions(device["type"])
    doc["packages"] = rows
    findings.extend(more)
    by_name = {r["package"]: r for r in rows}
    stack_ok = device["type"] != "unknown" and all(
        by_name[p.name]["status"] not in ("missing", "refused") for p in PACKAGES if p.needed == "required"
    )
    te = by_name["transformer-engine"]["installed"]
    doc["transformer_engine"] = transformer_engine_line(te)
    if device["type"] != "unknown":
        _guarded(doc, "backends", findings, verbose, check_backends, device["type"])
    doc["verl_settings"] = list(VERL_SETTINGS)
    if hf_path is not None:
        if stack_ok:
            _guarded(doc, "checkpoint", findings, verbose, check_checkpoint, hf_path)
        else:
            doc["checkpoint"] = dict(path=hf_path, skipped="the stack above does not work")
    if not run_self_test:
        doc["self_test"] = dict(skipped="--no-self-test")
    elif not stack_ok:
        doc["self_test"] = dict(skipped="the stack above does not work")
    else:
        _guarded(doc, "self_test", findings, verbose, self_test)
    doc["findings"] = [asdict(f) for f in findings]
    doc["errors"] = sum(f.level == ERROR for f in findings)
    doc["warnings"] = sum(f.level == WARNING for f in findings)
    doc["ok"] = doc["errors"] == 0
    return doc


def format_report(doc: dict) -> str:
    lines = ["ps-bridge doctor", ""]
    head = ("package", "installed", "tested", "status")
    table = [head] + [
        (r["package"], r["installed"] or "-", " to ".join(dict.fromkeys(r["tested"])) if r["tested"] else "-", r["status"])
        for r in doc["packages"]
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    info = [("device", describe_device(doc["device"]) if doc["device"]["type"] != "unknown" else doc["device"]["error"])]
    backends = doc.get("backends") or {}
    if "attention" in backends:
        a = backends["attention"]
        kernels = f" (varlen kernels: {a['varlen_kernels']})" if "varlen_kernels" in a else ""
        info.append(("attention auto", f"bf16/fp16 -> {a['bfloat16']['backend']}{kernels}, float32 -> {a['float32']['backend']}"
                     f"  [{a['rule']}]"))
        g = backends["gdn"]
        info.append(("GDN auto", f"{g['backend']}  [{g['rule']}]"))
    info.append(("Transformer Engine", doc["transformer_engine"]))
    if "checkpoint" in doc:
        c = doc["checkpoint"]
        if c.get("provider"):
            text = f"{c['path']}: {', '.join(c['architectures'])} -> provider {c['provider']} ({c['description']})"
        else:
            text = f"{c['path']}: " + (c.get("skipped") or c.get("error") or "no provider (see the errors)")
        info.append(("checkpoint", text))
    info += [("verl settings" if i == 0 else "", setting) for i, setting in enumerate(doc["verl_settings"])]
    st = doc["self_test"]
    if "passed" in st:
        text = (f"{st['model']}, backend auto: max |logp| shared vs unshared {st['max_logprob_diff_shared_vs_unshared']:.1e}, "
                f"shared vs HF {st['max_logprob_diff_shared_vs_hf']:.1e}, rel. grad diff "
                f"{st['max_rel_grad_diff_shared_vs_unshared']:.1e} ({st['seconds']:.1f} s, after "
                f"{st['import_seconds']:.1f} s importing the stack): "
                + ("passed" if st["passed"] else "FAILED"))
    else:
        text = "skipped: " + st["skipped"] if "skipped" in st else st.get("error", "")
    info.append(("self-test", text))
    width = max(len(k) for k, _ in info)
    lines += [f"{k.ljust(width)}  {v}" for k, v in info]
    shown = [f for f in doc["findings"] if f["level"] != NOTE or f["topic"] not in ("transformer-engine",)]
    if shown:
        lines += ["", "findings:"] + [f"  {f['level']}: {f['message']}" for f in shown]
    verdict = "OK" if doc["ok"] else f"{doc['errors']} error(s): ps-bridge will not work here until they are fixed"
    if doc["ok"] and doc["warnings"]:
        verdict += f" ({doc['warnings']} warning(s))"
    lines += ["", f"result: {verdict}"]
    return "\n".join(lines)


def run_doctor(args) -> int:
    doc = build_report(args.hf_path, run_self_test=not args.no_self_test, verbose=args.verbose)
    print(json.dumps(doc) if args.json else format_report(doc))
    return 0 if doc["ok"] else 1
