"""tools/fit_sharing_rule.py: the sharing rule's constants are the fit of the bench rows they came from."""

import importlib.util
import pathlib
import sys

from ps_bridge import launch_rule

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("fit_sharing_rule", ROOT / "tools" / "fit_sharing_rule.py")
fit_sharing_rule = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = fit_sharing_rule  # its dataclass resolves its module by name
SPEC.loader.exec_module(fit_sharing_rule)

# the raw bench rows launch_rule's TFLOPS and HOST_NS were fitted to (docs/how-it-works.md, "The sharing rule")
FIT_SOURCE = ROOT / "docs" / "bench" / "sharing-rule-fit-h200-2026-12-01.json"


def test_the_rules_constants_are_the_fit_of_their_rows():
    rows = fit_sharing_rule.read_rows([str(FIT_SOURCE)])
    tflops, host, bound = fit_sharing_rule.fit(rows)
    assert tflops == dict(launch_rule.TFLOPS)
    cuda = {(kind, backward): v for (kind, backend, device, backward), v in launch_rule.HOST_NS.items()
            if device == "cuda"}
    assert host == cuda
    # the host-bound rows are those of short responses: at R = 256 the shared step's GPU work is most of it
    assert all(", 32, 8)" in name for names in bound.values() for name in names)


def test_the_tool_prints_the_fit_and_each_rows_decision(capsys):
    assert fit_sharing_rule.main([str(FIT_SOURCE)]) == 0
    out = capsys.readouterr().out
    assert "('gdn', 'fla', 'cuda', True): 13_100_000" in out
    # Qwen3.5-0.8B (128, 32) with the backward: sharing measured 0.71x, the rule runs it unshared
    assert "qwen3.5-0.8b (128, 32, 8) x 4 | actor | 0.71x | unshared | yes | unshared | yes" in out
    # the constants are this fit: both decide alike; (128, 256) is left unshared by the margin
    assert "launch_rule's constants 2, this fit 2, of 12" in out
