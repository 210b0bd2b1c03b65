"""Version differences are adapted in `ps_bridge/compat/` only: an AST scan of
`models/`, `providers/` and `ps_bridge/` (minus `compat/`) for the ways code probes a dependency's
version or its symbols:

- `version`: reading a version (`x.__version__`, `sys.version_info`, `importlib.metadata.version`,
  `packaging.version`), outside the files whose job is to report versions (`VERSION_REPORTERS`);
- `module probe`: `getattr(m, "name", default)` / `hasattr(m, "name")` on a name imported from a
  dependency (a module or one of its classes);
- `private probe`: the same on another object's private attribute (`getattr(type(manager), "_x", None)`);
- `inherited probe`: `getattr(self, "name", default)` / `hasattr(self, "name")` in a class built on a
  dependency's class, for an attribute the file never sets (one the base class may or may not have),
  except those in `NOT_VERSION_DEPENDENT` (a reason each);
- `signature probe`: `inspect.signature(f)` of a callable not defined or imported from our own code;
- `import fallback`: `try: import a / except ImportError: import b`.

Attribute reads with a default on our own objects (configs, packed-sequence parameters, providers)
are none of these. `test_scan_finds_each_probe` shows each rule on a snippet, flagged and not.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("models", "providers", "ps_bridge")
ADAPTERS = "ps_bridge/compat/"
OURS = {"ps_bridge", "models", "providers"}

# files whose job is to report versions, not to branch on them
VERSION_REPORTERS = {
    "ps_bridge/tools/cli/doctor.py": "`ps-bridge doctor` compares installed versions with compat/tested_stacks.py",
    "ps_bridge/tools/bench/report.py": "a bench report records the versions it ran with",
    "ps_bridge/tools/bench/moe_layer.py": "the MoE layer bench records the torch version it ran with",
}

# (file, attribute) read from `self` with a default where the attribute is not set in the file, and
# why that is not a version difference (the same on every tested release)
NOT_VERSION_DEPENDENT = {
    ("models/token_permutation.py", "drop_and_pad"):
        "megatron's alltoall token dispatcher has it, its allgather one does not (both megatron-core 0.18 and 0.19)",
    ("models/token_permutation.py", "shared_experts"):
        "megatron's dispatchers set it only where the MoE layer has shared experts (both releases)",
    ("providers/qwen35.py", "hf_pretrained"):
        "Megatron-Bridge's AutoBridge sets it on a bridge that loaded a checkpoint (0.5.0 and 0.6.2)",
    ("ps_bridge/checkpoint_engine.py", "checkpoint_mananager"):
        "verl's engine (0.8.0 and 0.9.1, its spelling) sets it only where it builds a checkpoint manager",
}


def _root_name(node: ast.AST) -> Optional[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _imports(tree: ast.Module) -> Dict[str, str]:
    """Local name -> the module path it was imported from (relative imports start with '.')."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for a in node.names:
                names[a.asname or a.name] = f"{module}.{a.name}"
    return names


def _is_ours(module: str) -> bool:
    return module.startswith(".") or module.split(".")[0] in OURS


def _probe_call(node: ast.AST) -> Optional[Tuple[ast.AST, str]]:
    """(object, attribute) of `getattr(obj, "name", default)` or `hasattr(obj, "name")`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
        return None
    name = node.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
        return node.args[0], name.value
    return None


def _set_in_file(tree: ast.Module) -> set:
    """Attribute names the file sets on `self`, defines in a class body, or passes to setattr."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return names


def _classes_on_dependencies(tree: ast.Module, imports: Dict[str, str]) -> List[ast.ClassDef]:
    def from_dependency(base):
        root = _root_name(base)
        return root in imports and not _is_ours(imports[root])

    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and any(from_dependency(b) for b in n.bases)]


def probes_in_source(source: str, rel: str) -> List[str]:
    """Every version probe in one file's `source` (`rel`: its path under the repository root)."""
    tree = ast.parse(source)
    imports = _imports(tree)
    dependency_names = {name for name, module in imports.items() if not _is_ours(module)}
    own_names = {name for name, module in imports.items() if _is_ours(module)}
    own_names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    found = []

    def flag(node, rule, what):
        found.append(f"{rel}:{node.lineno}: {rule}: {what}")

    reporter = rel in VERSION_REPORTERS
    metadata_version = {n for n, m in imports.items() if m in ("importlib.metadata.version",)}
    metadata_modules = {n for n, m in imports.items() if m in ("importlib.metadata", "importlib")}
    for node in ast.walk(tree):
        # versions read
        if not reporter:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr == "__version__":
                flag(node, "version", ast.unparse(node))
            if isinstance(node, ast.Attribute) and node.attr == "version_info" and _root_name(node) == "sys":
                flag(node, "version", ast.unparse(node))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    f"{node.module}.{a.name}" for a in node.names]
                if any(m == "packaging.version" or m.startswith("packaging.version.") for m in modules):
                    flag(node, "version", "packaging.version")
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id in metadata_version) or (
                        isinstance(f, ast.Attribute) and f.attr == "version" and _root_name(f) in metadata_modules):
                    flag(node, "version", ast.unparse(f))
        # attribute probes
        probe = _probe_call(node)
        if probe is not None:
            obj, attr = probe
            root = _root_name(obj)
            if root in dependency_names:
                flag(node, "module probe", ast.unparse(node))
            elif attr.startswith("_") and not attr.startswith("__") and not (isinstance(obj, ast.Name) and obj.id in ("self", "cls")):
                flag(node, "private probe", ast.unparse(node))
        # signature probes
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signature" \
                and _root_name(node.func) == "inspect" and node.args:
            if _root_name(node.args[0]) not in own_names:
                flag(node, "signature probe", ast.unparse(node))
        # import fallbacks
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                caught = ast.unparse(handler.type) if handler.type is not None else ""
                if ("ImportError" in caught or "ModuleNotFoundError" in caught) and any(
                        isinstance(n, (ast.Import, ast.ImportFrom)) for stmt in handler.body for n in ast.walk(stmt)):
                    flag(handler, "import fallback", caught)
    # attributes a dependency's base class may or may not have
    set_here = _set_in_file(tree)
    for cls in _classes_on_dependencies(tree, imports):
        for node in ast.walk(cls):
            probe = _probe_call(node)
            if probe is None or not (isinstance(probe[0], ast.Name) and probe[0].id == "self"):
                continue
            attr = probe[1]
            if attr not in set_here and (rel, attr) not in NOT_VERSION_DEPENDENT:
                flag(node, "inherited probe", ast.unparse(node))
    return found


def scanned_files(root: Path) -> Iterator[Tuple[str, Path]]:
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(ADAPTERS):
                yield rel, path


def version_probes(root: Path = ROOT) -> List[str]:
    """Every version probe outside `ps_bridge/compat/` in the tree at `root`."""
    return [p for rel, path in scanned_files(root) for p in probes_in_source(path.read_text(), rel)]


def test_no_version_probe_outside_compat():
    probes = version_probes()
    assert not probes, (
        "version probes outside ps_bridge/compat/ (move each into the adapter of the dependency it adapts, "
        "as a named function saying which versions differ):\n" + "\n".join(probes)
    )


def test_exemptions_name_existing_files():
    files = {rel for rel, _ in scanned_files(ROOT)}
    assert set(VERSION_REPORTERS) <= files
    assert {rel for rel, _ in NOT_VERSION_DEPENDENT} <= files


CASES = [
    # (snippet, rule it is flagged under, or None)
    ("import torch\nf = getattr(torch.nn.functional, 'grouped_mm', None)", "module probe"),
    ("from megatron.core import dist_checkpointing\nf = getattr(dist_checkpointing, 'load', None)", "module probe"),
    ("from verl.x import Engine\nok = hasattr(Engine, '_routed_num_tokens')", "module probe"),
    ("def f(manager):\n    return getattr(type(manager), '_build_optimizer_state_dict', None)", "private probe"),
    ("import triton\nv = triton.__version__", "version"),
    ("from packaging.version import Version", "version"),
    ("import importlib.metadata\nv = importlib.metadata.version('verl')", "version"),
    ("from importlib.metadata import version\nv = version('verl')", "version"),
    ("import sys\nnew = sys.version_info >= (3, 12)", "version"),
    ("import inspect\nfrom verl.x import f\nok = 'vp' in inspect.signature(f).parameters", "signature probe"),
    ("try:\n    from a.b import f\nexcept ImportError:\n    from a import f", "import fallback"),
    ("from megatron.core.transformer.moe.experts import TEGroupedMLP\nclass E(TEGroupedMLP):\n"
     "    def f(self):\n        return getattr(self, 'offload_fused_group_mlp', False)", "inherited probe"),
    # not probes
    ("def f(config):\n    return getattr(config, 'softmax_scale', None)", None),
    ("def f(psp):\n    return getattr(psp, 'moe_token_weights', None)", None),
    ("import torch\nf = getattr(torch, 'float32')", None),
    ("try:\n    import matplotlib\nexcept ImportError:\n    raise RuntimeError('pip install matplotlib')", None),
    ("import inspect\ndef g(a, b=1):\n    pass\nok = 'b' in inspect.signature(g).parameters", None),
    ("from megatron.core.transformer.module import MegatronModule\nclass M(MegatronModule):\n"
     "    def f(self, key):\n        if getattr(self, '_key', None) != key:\n            self._key = key", None),
    ("class M:\n    def f(self):\n        return getattr(self, 'anything', None)", None),
    ("import verl\nv = verl.__version__", "version"),
]


@pytest.mark.parametrize("source, rule", CASES)
def test_scan_finds_each_probe(source, rule):
    found = probes_in_source(source, "models/example.py")
    if rule is None:
        assert found == []
    else:
        assert len(found) == 1 and f": {rule}: " in found[0], found


def test_version_reporters_may_read_versions():
    assert probes_in_source("import torch\nv = torch.__version__", "ps_bridge/tools/bench/report.py") == []
