"""`ps-bridge logprobs` decides what its batch shares through `ps_bridge.plan` (the tree) and
`ps_bridge.prepare` (the sharing rule), the owners of those decisions, and runs what they decided."""

import json

import pytest
import torch
from tree_cases import tree_samples

import ps_bridge.tools.data_parallel as data_parallel
import ps_bridge.launch_rule as launch_rule
import ps_bridge.plan as plan
import ps_bridge.prepare as prepare
from ps_bridge.tools.cli import main
from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs


@pytest.mark.parametrize("tree", [True, False])
def test_logprobs_cli_runs_what_prepare_decides(tmp_path, qwen2_checkpoint, monkeypatch, capsys, tree):
    """prepare's rule is replaced by one that decides the opposite of the real rule: the CLI must
    report and run that decision (a CLI deciding on its own would report and run the real one), and
    report the tree the plan decided (`tokens_shared`, `tree_nodes`), decided once for the batch."""
    hf_path, hf_model = qwen2_checkpoint
    trees, real_shares, run_shares = [], [], []
    decide_tree, sharing_for, dp_logprob_pass = plan.decide_tree, launch_rule.sharing_for, data_parallel.dp_logprob_pass

    def recorded_tree(*args, **kwargs):
        trees.append(decide_tree(*args, **kwargs))
        return trees[-1]

    def opposite(*args, **kwargs):
        real = sharing_for(*args, **kwargs)
        real_shares.append(real.share)
        return launch_rule.SharingDecision(not real.share, "the test's opposite decision")

    def recorded_pass(loaded, micro_batches, share=None, **kwargs):
        run_shares.append(share)
        return dp_logprob_pass(loaded, micro_batches, share=share, **kwargs)

    monkeypatch.setattr(plan, "decide_tree", recorded_tree)
    monkeypatch.setattr(prepare, "sharing_for", opposite)
    monkeypatch.setattr(data_parallel, "dp_logprob_pass", recorded_pass)
    samples = tree_samples(2)
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps({"samples": [{"prompt": s.prompt, "response": s.response} for s in samples]}))
    out = tmp_path / "out.json"
    flags = ["--tree", "--tree-min-shared", "0"] if tree else ["--no-tree"]
    assert main(["logprobs", "--hf-path", hf_path, "--batch", str(batch), "--out", str(out), *flags]) == 0
    got = json.loads(out.read_text())
    assert real_shares == [True]  # the real rule shares this batch (so the opposite is a different decision)
    assert got["shared_path"] is False and got["sharing_reason"] == "the test's opposite decision"
    assert run_shares == [False]  # what every rank ran
    assert "unshared: the test's opposite decision" in capsys.readouterr().out
    # the batch's tree: the plan's, decided once (the micro-batch ran with the packing given: no other)
    assert len(trees) == 1 and got["tokens_shared"] == trees[0].trie_tokens
    assert got["tree_nodes"] == trees[0].num_nodes
    assert (got["tree_depth"] >= 2) == tree
    with torch.no_grad():
        refs = hf_sample_logprobs(hf_model, samples)
    for s, ref in zip(got["samples"], refs):
        assert max(abs(a - b) for a, b in zip(s["logprobs"], ref.tolist())) <= 2e-5
