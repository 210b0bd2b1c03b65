"""verl's real Megatron engine vs our prefix-sharing engine, on the CPU, fp32, on whichever verl is
installed (0.9.1 on the newest stack, 0.8.0 on the oldest; `ps_bridge.compat.verl` adapts).

Same tiny checkpoint, same micro-batch built the way verl's trainer builds it (n responses per
prompt, left-padded prompts, right-padded responses, uid). The stock engine runs verl's own
forward path on a standard (unshared) model; ours packs every group once. Log-probs and entropy
(`infer_batch`) and the gradients of a policy loss (`forward_backward_batch`, then one `train_batch`
step) must agree to fp32 rounding.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import replace

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (requirements-verl*.txt)", allow_module_level=True)

import torch  # noqa: E402

import ps_bridge.tools.verl_check.side_by_side as vt  # noqa: E402

vt.prepare_side_by_side()

from ps_bridge.config import PrefixSharingConfig  # noqa: E402
from ps_bridge.layout import Sample  # noqa: E402
from ps_bridge.providers.registry import provider_names  # noqa: E402
from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, fold_into_vocabulary, grpo_like_samples  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from ps_bridge.verl.engine import PrefixSharedMegatronEngine  # noqa: E402
from ps_bridge.verl.micro_batches import group_run_length  # noqa: E402

TOL = 1e-5


def _family_param(name, core=False, slow=False):
    """`core`: in the oldest stack's subset (verl's stock engine runs that family on a CPU; the
    Qwen3.5 models on the oldest stack are the model tests' to check). `slow`: out of the default suite."""
    available = name in provider_names() and name in TINY_BUILDERS
    marks = [pytest.mark.skipif(not available, reason=f"the {name!r} provider or tiny builder is not registered on this branch")]
    return pytest.param(name, marks=marks + ([pytest.mark.core] if core else []) + ([pytest.mark.slow] if slow else []))


# Llama 3 runs the same standard-attention path as Qwen3 (providers/gpt.py): out of the default suite
FAMILIES = [_family_param("qwen2.5", core=True), _family_param("qwen3.5"), _family_param("qwen3"),
            _family_param("qwen3-moe"), _family_param("llama3", slow=True)]
# families whose stock Megatron-Bridge model runs on a CPU in verl's formats (with the reference core
# attention; Qwen3: its q/k norms from the config); Qwen3.5's stock hybrid spec needs Transformer
# Engine and fla's GPU kernels, Qwen3 MoE's stock alltoall dispatcher allocates CUDA streams
STOCK_ENGINE_ON_CPU = {"qwen2.5", "qwen3", "llama3"}
FORMATS = ["thd", "bshd"]


# Megatron-Bridge's stock Llama bridge keeps megatron-core's fixed llama3 RoPE parameters
# (rotary_pos_embedding.py `_apply_scaling`: original_max_position_embeddings 8192), so the checkpoint
# compared with the stock engine has Llama 3's own values; ours honours any (tests/test_gpt_families.py)
CHECKPOINT_OVERRIDES = {"llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                                     "rope_theta": 10000.0})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            path = str(tmp_path_factory.mktemp(family.replace(".", "_")))
            made[family] = (path, vt.tiny_checkpoint(path, family, **CHECKPOINT_OVERRIDES.get(family, {})))
        return made[family]

    return get


@pytest.fixture(scope="module")
def engines(checkpoints):
    built = {}

    def get(family, fmt, kind, forward_only=True):
        key = (family, fmt, kind, forward_only)
        if key not in built:
            path, _ = checkpoints(family)
            rmpad = fmt == "thd"
            if kind == "stock" and family in STOCK_ENGINE_ON_CPU:
                built[key] = vt.build_stock_engine(path, use_remove_padding=rmpad, forward_only=forward_only)
            elif kind == "stock":
                # verl's stock engine needs the family's stock (TE / GPU-kernel) model: compare with our
                # engine packing one sequence per sample instead, the unshared computation
                built[key] = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=rmpad,
                                             forward_only=forward_only)
                built[key].prefix_sharing_config = PrefixSharingConfig(enabled=False)
            else:
                built[key] = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=rmpad,
                                             forward_only=forward_only)
                if kind == "ours_prompt_values":  # every position computed (PS_BRIDGE_PROMPT_VALUES=1)
                    built[key].prefix_sharing_config = PrefixSharingConfig(enabled=True, prompt_values=True)
                elif kind in OUR_CONFIGS:
                    built[key].prefix_sharing_config = OUR_CONFIGS[kind]
        return built[key]

    return get


# our engine's settings beside the default (`ours`: prefix trees at the default threshold): prefix
# trees sharing every common token, the default spelled out, and one level (PS_BRIDGE_TREE=0)
OUR_CONFIGS = {
    "ours_tree": PrefixSharingConfig(enabled=True, tree=True, tree_min_shared=0),
    "ours_tree_default": PrefixSharingConfig(enabled=True, tree=True),
    "ours_one_level": PrefixSharingConfig(enabled=True, tree=False),
}


def grouped_samples(vocab, num_prompts=3, n=4, seed=0):
    """n adjacent responses per prompt, as verl's `repeat(n, interleave=True)` leaves them. The lengths
    are those drawn for a 256-token vocabulary whatever `vocab` (the budgets below are sized for them),
    the ids folded into `vocab`."""
    return fold_into_vocabulary(grpo_like_samples(256, num_prompts=num_prompts, n=n, seed=seed, shuffle=False), vocab)


def infer(engine, td):
    with vt.engine_call_on_cpu(), engine.eval_mode():
        return engine.infer_batch(td)["model_output"]


def max_row_diff(a, b, labelled_only=False, prompt_lengths=None):
    """Largest difference over all samples' rows (same nested shapes required). With
    `labelled_only`, each row's last position is left out: it has no label, and the stock engine
    fills it with the log-prob of whatever token follows in its own packing (the next sample of its
    micro-batch), which verl slices away and which differs whenever micro-batches differ. With
    `prompt_lengths` (per sample, input order) only row positions from `P - 1` on are compared, the
    ones verl's losses read: by default our engine's output layer skips the other prompt positions
    of a shared micro-batch (`PrefixSharingConfig.prompt_values`), which then hold 0 in `a`."""
    assert a.is_nested and b.is_nested
    ra, rb = a.unbind(), b.unbind()
    assert [x.shape for x in ra] == [x.shape for x in rb]
    cut = -1 if labelled_only else None
    starts = [0] * len(ra) if prompt_lengths is None else [P - 1 for P in prompt_lengths]
    return max((x[p:cut].float() - y[p:cut].float()).abs().max().item() for x, y, p in zip(ra, rb, starts))


def prompt_lengths(samples):
    return [len(s.prompt) for s in samples]


BATCHINGS = {
    "static": dict(micro_batch_size=8),     # 2 groups of 4 per micro-batch
    "dynamic": dict(max_token_len=160),     # verl's token-balanced micro-batches, groups kept whole
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batching", sorted(BATCHINGS))
def test_infer_batch_matches_stock_engine(engines, checkpoints, family, fmt, batching, caplog):
    _, hf = checkpoints(family)
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4)
    stock = infer(engines(family, fmt, "stock"), vt.grpo_micro_batch(samples, **BATCHINGS[batching]))
    caplog.clear()  # only our engine's lines below
    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        ours = infer(engines(family, fmt, "ours"), vt.grpo_micro_batch(samples, **BATCHINGS[batching]))
    # static micro-batches are the same for both engines: rows must agree everywhere; dynamic ones
    # differ (ours keeps groups whole), which only moves the stock engine's unlabelled last position
    read = prompt_lengths(samples)
    lp = max_row_diff(ours["log_probs"], stock["log_probs"], labelled_only=batching == "dynamic", prompt_lengths=read)
    ent = max_row_diff(ours["entropy"], stock["entropy"], prompt_lengths=read)
    print(f"{family} {fmt} {batching}: log_probs max diff {lp:.2e}, entropy max diff {ent:.2e}")
    assert lp < TOL and ent < TOL
    assert "PATH 5" not in caplog.text
    packed = [(int(g), int(n)) for g, n in re.findall(r"PATH 6: sharing detected \(groups=(\d+), samples=(\d+)\)", caplog.text)]
    assert len(packed) >= 2, "the batch should span several micro-batches"
    assert sum(n for _, n in packed) == len(samples)
    assert all(n == 4 * g for g, n in packed), f"a group of 4 was split across micro-batches: {packed}"


def test_split_group_is_still_exact(engines, checkpoints, caplog):
    """Static micro-batches of 6 over groups of 4: groups 1 and 2 are cut in two (and a sampling
    temperature other than 1, which both engines divide the logits by)."""
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=3, n=4, seed=1)
    td_args = dict(micro_batch_size=6, temperature=0.7)
    tds = [vt.grpo_micro_batch(samples, **td_args) for _ in range(2)]
    for td in tds:  # verl's Σπ² output too (rollout-correction metrics)
        tu.assign_non_tensor(td, calculate_sum_pi_squared=True)
    stock = infer(engines("qwen2.5", "thd", "stock"), tds[0])
    caplog.clear()  # only our engine's lines below
    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        ours = infer(engines("qwen2.5", "thd", "ours"), tds[1])
    assert "groups=2, samples=6" in caplog.text  # [4 of p0, 2 of p1] then [2 of p1, 4 of p2]
    diff = max(max_row_diff(ours[k], stock[k], prompt_lengths=prompt_lengths(samples))
               for k in ("log_probs", "entropy", "sum_pi_squared"))
    print(f"split group: max diff {diff:.2e}")
    assert diff < TOL


def test_dynamic_budget_smaller_than_a_group_still_exact(engines, checkpoints, caplog, monkeypatch):
    """Groups of 4 longer than the token budget cannot be forced whole (verl would refuse): they are
    split by verl's balancing and the results stay exact."""
    import ps_bridge.tree.split as split

    monkeypatch.setattr(split, "_warned", set())  # the warning is once per process
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4, seed=8)
    budget = max(len(s.prompt) + len(s.response) for s in samples) + 8
    stock = infer(engines("qwen2.5", "thd", "stock"), vt.grpo_micro_batch(samples, max_token_len=budget))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        ours = infer(engines("qwen2.5", "thd", "ours"), vt.grpo_micro_batch(samples, max_token_len=budget))
    assert "more than the micro-batch budget" in caplog.text
    read = prompt_lengths(samples)
    assert max_row_diff(ours["log_probs"], stock["log_probs"], labelled_only=True, prompt_lengths=read) < TOL
    assert max_row_diff(ours["entropy"], stock["entropy"], prompt_lengths=read) < TOL


def test_no_sharing_falls_back_to_unshared_packing(engines, checkpoints, caplog):
    _, hf = checkpoints("qwen2.5")
    samples = [Sample(s.prompt, s.response, uid=f"u{i}") for i, s in
               enumerate(grouped_samples(hf.config.vocab_size, num_prompts=5, n=1, seed=2))]
    stock = infer(engines("qwen2.5", "thd", "stock"), vt.grpo_micro_batch(samples, micro_batch_size=5))
    caplog.clear()  # only our engine's lines below
    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        ours = infer(engines("qwen2.5", "thd", "ours"), vt.grpo_micro_batch(samples, micro_batch_size=5))
    assert "PATH 5: no sharing detected" in caplog.text and "PATH 6" not in caplog.text
    diff = max(max_row_diff(ours[k], stock[k]) for k in ("log_probs", "entropy"))
    assert diff < TOL


@pytest.mark.parametrize("kind, reason", [("ours", "nothing to share"),
                                          ("ours_one_level", "carry different temperatures: not shared")])
def test_different_temperatures_in_a_group_are_not_shared(engines, checkpoints, caplog, kind, reason):
    """The tree's share classes keep every sample apart (nothing to share); one level finds the group,
    then packs it unshared."""
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=2, n=4, seed=6)
    tds = [vt.grpo_micro_batch(samples, micro_batch_size=8) for _ in range(2)]
    for td in tds:
        td["temperature"] = torch.linspace(0.5, 1.5, len(samples))
    stock = infer(engines("qwen2.5", "thd", "stock"), tds[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ps_bridge"):
        ours = infer(engines("qwen2.5", "thd", kind), tds[1])
    assert reason in caplog.text and "PATH 5" in caplog.text
    assert max(max_row_diff(ours[k], stock[k]) for k in ("log_probs", "entropy")) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_response_logprobs_match_hugging_face(engines, checkpoints, family):
    """Independent of verl's stock engine: the response slice verl's loss uses equals HF's."""
    from ps_bridge.tools.tiny_checkpoints import hf_sample_logprobs

    _, hf = checkpoints(family)
    samples = grouped_samples(hf.config.vocab_size, num_prompts=2, n=3, seed=3)
    td = vt.grpo_micro_batch(samples, micro_batch_size=6)
    ours = infer(engines(family, "thd", "ours"), td)
    padded = no_padding_2_padding(ours["log_probs"], td)
    with torch.no_grad():
        ref = hf_sample_logprobs(hf, samples)
    diff = max((padded[i, : len(r)] - r).abs().max().item() for i, r in enumerate(ref))
    assert diff < TOL


def output_rows_hook(engine, counts):
    model = engine.module[0]
    while hasattr(model, "module"):
        model = model.module
    return model.output_layer.register_forward_hook(lambda m, inputs, out: counts.append(int(inputs[0].shape[0])))


@pytest.mark.parametrize("prompt_values", [False, True], ids=["default", "prompt_values"])
def test_prompt_positions_by_option(engines, checkpoints, prompt_values):
    """Default: the output layer runs on each response position and each prompt's last position;
    the other prompt positions of the rows hold exactly 0 and the rest equals the stock engine.
    `PrefixSharingConfig(prompt_values=True)`: every position computed, all of it equal to stock."""
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=2, n=4, seed=9)
    td_args = dict(micro_batch_size=8, temperature=0.7)  # one micro-batch; scaled logits too
    stock = infer(engines("qwen2.5", "thd", "stock"), vt.grpo_micro_batch(samples, **td_args))
    engine = engines("qwen2.5", "thd", "ours_prompt_values" if prompt_values else "ours")
    counts = []
    handle = output_rows_hook(engine, counts)
    try:
        ours = infer(engine, vt.grpo_micro_batch(samples, **td_args))
    finally:
        handle.remove()
    read = sum(len(s.response) for s in samples) + 2
    packed = sum(len(p) for p in {tuple(s.prompt) for s in samples}) + sum(len(s.response) for s in samples)
    assert counts == ([packed] if prompt_values else [read]), counts
    for key in ("log_probs", "entropy"):
        if prompt_values:
            assert max_row_diff(ours[key], stock[key]) < TOL
        else:
            assert max_row_diff(ours[key], stock[key], prompt_lengths=prompt_lengths(samples)) < TOL
            heads = [row[: len(s.prompt) - 1] for row, s in zip(ours[key].unbind(), samples)]
            assert all(bool((h == 0).all()) for h in heads)
            stock_heads = [row[: len(s.prompt) - 1] for row, s in zip(stock[key].unbind(), samples)]
            assert any(bool((h != 0).any()) for h in stock_heads)  # stock computes them


@pytest.mark.parametrize("prompt_values", [False, True], ids=["default", "prompt_values"])
def test_policy_loss_gradients_by_option(engines, checkpoints, prompt_values):
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4, seed=4)
    g_stock = grads_after_backward(engines("qwen2.5", "thd", "stock", forward_only=False),
                                   vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    kind = "ours_prompt_values" if prompt_values else "ours"
    g_ours = grads_after_backward(engines("qwen2.5", "thd", kind, forward_only=False),
                                  vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    worst = max(((g_ours[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp(min=1e-12)).item() for n in g_stock)
    print(f"prompt_values={prompt_values}: worst relative grad diff {worst:.2e}")
    assert worst < TOL


# ---- training ----------------------------------------------------------------------------------


def policy_loss(model_output, data, dp_group=None):
    """A PPO clipped surrogate plus an entropy bonus, on verl's padded response view, token-mean
    over the whole mini-batch (`batch_num_tokens`, as verl's own losses normalise), so the total does
    not depend on how samples are cut into micro-batches."""
    batch_num_tokens = data["batch_num_tokens"]
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = no_padding_2_padding(model_output["entropy"], data)
    padded = data.select("response_mask", "old_log_probs", "advantages").to_padded_tensor()
    mask = padded["response_mask"].bool()
    ratio = torch.exp(log_prob - padded["old_log_probs"])
    adv = padded["advantages"]
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = ((surrogate - 0.01 * entropy) * mask).sum() / batch_num_tokens
    return loss, {}


def grads_after_backward(engine, td):
    with vt.engine_call_on_cpu(), engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(td, policy_loss, forward_only=False)
        grads = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
        engine.optimizer_zero_grad()
    return grads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batching", sorted(BATCHINGS))
def test_policy_loss_gradients_match_stock_engine(engines, checkpoints, family, fmt, batching):
    _, hf = checkpoints(family)
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4, seed=4)
    td_stock = vt.grpo_micro_batch(samples, **BATCHINGS[batching])
    td_ours = vt.grpo_micro_batch(samples, **BATCHINGS[batching])
    g_stock = grads_after_backward(engines(family, fmt, "stock", forward_only=False), td_stock)
    g_ours = grads_after_backward(engines(family, fmt, "ours", forward_only=False), td_ours)
    assert g_stock.keys() == g_ours.keys()
    worst = max(((g_ours[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp(min=1e-12)).item() for n in g_stock)
    nonzero = sum(int(g.abs().max() > 0) for g in g_stock.values())
    print(f"{family} {fmt} {batching}: worst relative grad diff {worst:.2e} over {len(g_stock)} tensors")
    assert nonzero == len(g_stock)
    assert worst < TOL


def test_group_run_length():
    assert group_run_length(["a", "a", "b", "b"]) == 2
    assert group_run_length(["a", "a", "b"]) == 1
    assert group_run_length(["a", "b", "a", "b"]) == 1
    assert group_run_length(["a", "b"]) == 1
    assert group_run_length([]) == 1


def smooth_adam():
    """The tests' Adam (`plain_adam`) with eps 1e-6. Its first step moves a weight by lr·g/(|g| + eps): at
    megatron's eps of 1e-8 a gradient element of about 1e-9 turns float32 summation noise, which
    differs between CPUs, into weight differences of 1e-6; at 1e-6 the step is a smooth function of
    the gradient, which is what a comparison of updated weights checks."""
    return vt.plain_adam(adam_eps=1e-6)


@pytest.mark.core
@pytest.mark.parametrize("fmt,batching", [("thd", "dynamic"), ("bshd", "static")])
def test_train_batch_step_matches_stock_engine(checkpoints, fmt, batching):
    """One full `train_batch` (zero grad, forward-backward, optimizer step) on fresh engines: the
    updated weights agree."""
    path, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4, seed=5)
    rmpad = fmt == "thd"
    stock = vt.build_stock_engine(path, use_remove_padding=rmpad, forward_only=False,
                                  optimizer_config=smooth_adam())
    ours = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=rmpad, forward_only=False,
                           optimizer_config=smooth_adam())
    before = {n: p.detach().clone() for n, p in stock.module[0].named_parameters()}
    for engine in (stock, ours):
        with vt.engine_call_on_cpu(), engine.train_mode():
            engine.train_batch(vt.grpo_micro_batch(samples, **BATCHINGS[batching]), policy_loss)
    p_stock = dict(stock.module[0].named_parameters())
    p_ours = dict(ours.module[0].named_parameters())
    moved = min((p_stock[n] - before[n]).abs().max().item() for n in before)
    diff = max((p_ours[n] - p_stock[n]).abs().max().item() for n in before)
    print(f"train_batch {fmt} {batching}: smallest update {moved:.2e}, max weight diff {diff:.2e}")
    assert moved > 1e-6  # every tensor was updated (lr 1e-3, Adam)
    assert diff < TOL * 1e-1


def ppo_loss_function(path):
    """verl's `ppo_loss` as the trainer configures it (token-mean, KL loss, entropy bonus)."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from ps_bridge.tools import verl_check as check

    settings = check.CheckSettings(model=path, n=4, overrides=["actor_rollout_ref.actor.entropy_coeff=0.01"])
    actor_cfg, _, _ = check.role_configs(check.trainer_config(settings))
    return partial(ppo_loss, config=actor_cfg)


def ppo_batch(samples, budget):
    td = vt.grpo_micro_batch(samples, max_token_len=budget)
    td["ref_log_prob"] = td["old_log_probs"] - 0.05 * td["old_log_probs"].abs()  # a KL term that is not 0
    return td


def ppo_loss_pass(engine, td, loss_fn):
    """(loss summed over micro-batches, every parameter's gradient, micro-batch count) of one
    `forward_backward_batch` with `loss_fn`."""
    with vt.engine_call_on_cpu(), engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(td, loss_fn, forward_only=False)
        grads = {n: p.main_grad.detach().clone() for n, p in engine.module[0].named_parameters()}
        engine.optimizer_zero_grad()
    return (float(sum(torch.as_tensor(x).float() for x in out["loss"])), grads,
            int(tu.get_non_tensor_data(td, key="num_micro_batch", default=0)))


@pytest.mark.core
def test_packed_budget_fewer_micro_batches_same_verl_loss_and_gradients(engines, checkpoints):
    """The same dynamic token budget: verl counts every sample's prompt, our engine counts packed tokens
    (each group's prompt once), so it forms fewer, fuller micro-batches with other boundaries. verl's
    own `ppo_loss` (token-mean over the mini-batch's `batch_num_tokens`, KL loss and entropy on) gives
    the same loss and the same gradients."""
    path, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=4, seed=6)
    budget = 2 * max(len(s.prompt) + len(s.response) for s in samples) + 4
    loss_fn = ppo_loss_function(path)
    (l_s, g_s, k_s), (l_o, g_o, k_o) = (ppo_loss_pass(engines("qwen2.5", "thd", kind, forward_only=False),
                                                      ppo_batch(samples, budget), loss_fn) for kind in ("stock", "ours"))
    print(f"micro-batches stock {k_s}, ours {k_o}; loss {l_s:.8g} vs {l_o:.8g}")
    assert k_o < k_s
    assert abs(l_o - l_s) <= TOL * abs(l_s)
    worst = max(((g_o[n] - g_s[n]).abs().max() / g_s[n].abs().max().clamp(min=1e-12)).item() for n in g_s)
    assert worst < TOL


def test_sharing_knob_forces_the_unshared_path(engines, checkpoints, caplog):
    """`PrefixSharingConfig.sharing="off"` (`PS_BRIDGE_SHARING=off`): a micro-batch with groups runs
    unshared, says so on the `[PS][prepare]` line, and equals the stock engine."""
    import dataclasses

    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=2, n=4, seed=8)
    stock = infer(engines("qwen2.5", "thd", "stock"), vt.grpo_micro_batch(samples, micro_batch_size=8))
    ours = engines("qwen2.5", "thd", "ours")
    saved = ours.prefix_sharing_config
    ours.prefix_sharing_config = dataclasses.replace(saved, sharing="off")
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ps_bridge"):
            out = infer(ours, vt.grpo_micro_batch(samples, micro_batch_size=8))
    finally:
        ours.prefix_sharing_config = saved
    assert "sharing: unshared: forced off (PS_BRIDGE_SHARING=off)" in caplog.text and "PATH 5" in caplog.text
    assert max(max_row_diff(out[k], stock[k]) for k in ("log_probs", "entropy")) < TOL


def test_measured_mode_counts_the_shared_micro_batches_and_equals_the_stock_engine(engines, checkpoints,
                                                                                  monkeypatch, caplog):
    """`PS_BRIDGE_SHARING=measured` on one rank: every shared micro-batch is timed from its forward step
    to the next (the last one to the end of the batch) and counted by the host calibration after the
    first `CALIBRATION_SKIP`; the log-probs equal the stock engine's. The reference attention on a CPU
    gets a launch cost (1 ns a layer) so that the rule applies, and every step counts as host-bound."""
    import dataclasses

    from ps_bridge import launch_rule

    calibration = launch_rule.HostCalibration()
    monkeypatch.setattr(launch_rule, "HOST_CALIBRATION", calibration)
    monkeypatch.setattr(launch_rule, "HOST_NS", {**launch_rule.HOST_NS, ("attention", "torch_ref", "cpu", False): 1})
    monkeypatch.setattr(launch_rule, "HOST_BOUND", (0, 1))
    _, hf = checkpoints("qwen2.5")
    samples = grouped_samples(hf.config.vocab_size, num_prompts=4, n=3, seed=9)
    td = vt.grpo_micro_batch(samples, micro_batch_size=3)
    stock = infer(engines("qwen2.5", "thd", "stock"), td)
    ours = engines("qwen2.5", "thd", "ours")
    layouts = []
    monkeypatch.setattr(ours, "layout_observer", lambda samples, layout: layouts.append(layout), raising=False)
    saved = ours.prefix_sharing_config
    runs = []
    try:
        for sharing in ("auto", "measured", "measured"):
            ours.prefix_sharing_config = dataclasses.replace(saved, sharing=sharing)
            runs.append(infer(ours, td))
    finally:
        ours.prefix_sharing_config = saved
    per_run = len(layouts) // 3
    assert per_run == 4 and all(layout.has_sharing for layout in layouts)
    # `auto` feeds nothing; the two `measured` batches feed each of their shared micro-batches
    assert len(calibration.ratios(False)) == 2 * per_run - launch_rule.CALIBRATION_SKIP
    assert calibration.ratios(True) == ()
    for out in runs:
        assert max(max_row_diff(out[k], stock[k], prompt_lengths=prompt_lengths(samples))
                   for k in ("log_probs", "entropy")) < TOL
    # where another rank runs the same micro-batches (TP here), nothing is measured and it says so once
    from ps_bridge.parallel.settings import ParallelSettings
    from ps_bridge.verl import engine as engine_module

    monkeypatch.setattr(ours, "prefix_sharing_config", dataclasses.replace(saved, sharing="measured"))
    monkeypatch.setattr(engine_module.ParallelSettings, "from_config",
                        classmethod(lambda cls, config: ParallelSettings(tp=2)))
    with caplog.at_level(logging.WARNING, logger="ps_bridge"):
        assert not ours._measures_host() and not ours._measures_host()
    assert caplog.text.count("PS_BRIDGE_SHARING=measured decides as auto under tensor") == 1


# ---- prefix trees ----------------------------------------------------------------------------------


def tree_batch(vocab, seed=0, n=3):
    """A system prompt of 20 tokens shared by 3 prompts of n responses each, and a 3-turn chain whose
    every turn's prompt holds the previous turn's whole sequence."""
    from ps_bridge.tools.tiny_checkpoints import system_prompt_samples

    return system_prompt_samples(vocab, system_len=20, num_prompts=3, n=n, seed=seed)


def layouts_logged(text: str):
    """(micro-batches, deepest tree) from our engine's `packed_batch_layout` lines."""
    depths = [int(d) for d in re.findall(r"packed_batch_layout: .*?depth=(\d+)", text)]
    return len(depths), max(depths, default=0)


def host_micro_batches(samples, budget, min_shared):
    """What our micro-batching forms from `samples` at `budget` (the engine's function, on the host)."""
    from ps_bridge.layout import build_layout
    from ps_bridge.verl.micro_batches import first_fit_decreasing, subtree_units

    units, cost = subtree_units(build_layout(samples, share="tree", min_shared=min_shared), budget)
    return [sorted(i for u in b for i in units[u].samples) for b in first_fit_decreasing(units, cost, budget)]


@pytest.mark.core
def test_tree_batch_rows_match_stock_engine_with_fewer_micro_batches(engines, checkpoints, caplog, monkeypatch):
    """A system prompt shared by every prompt and a multi-turn chain, dynamic budgets, temperature 0.7:
    our engine on prefix trees gives the stock engine's log-probs and entropy, packs trees deeper than
    one level, and needs fewer micro-batches than our engine sharing one level (the system prompt's
    subtree is split over micro-batches, the system prompt computed once in each). The token trie is
    built once for the batch's micro-batching and once per micro-batch (the sharing rule reads the
    tree the layout packs)."""
    from tree_cases import count_trie_builds

    _, hf = checkpoints("qwen2.5")
    samples = tree_batch(hf.config.vocab_size)
    budget = 2 * max(len(s.prompt) + len(s.response) for s in samples)
    td_args = dict(max_token_len=budget, temperature=0.7)
    stock = infer(engines("qwen2.5", "thd", "stock"), vt.grpo_micro_batch(samples, **td_args))
    tries = count_trie_builds(monkeypatch)
    counts = {}
    for kind in ("ours_one_level", "ours_tree"):
        caplog.clear()
        del tries[:]
        with caplog.at_level(logging.INFO, logger="ps_bridge"):
            ours = infer(engines("qwen2.5", "thd", kind), vt.grpo_micro_batch(samples, **td_args))
        counts[kind], depth = layouts_logged(caplog.text)
        assert len(tries) == (1 + counts[kind] if kind == "ours_tree" else 0), (kind, len(tries), counts[kind])
        read = prompt_lengths(samples)
        lp = max_row_diff(ours["log_probs"], stock["log_probs"], labelled_only=True, prompt_lengths=read)
        ent = max_row_diff(ours["entropy"], stock["entropy"], prompt_lengths=read)
        print(f"{kind}: {counts[kind]} micro-batches, depth {depth}; log_probs {lp:.2e}, entropy {ent:.2e}")
        assert lp < TOL and ent < TOL
    assert depth >= 2  # the tree: system prompt, prompt, response (and the chain below it)
    assert 1 < counts["ours_tree"] < counts["ours_one_level"], counts


def count_tree_builds(monkeypatch) -> list:
    """Patch the two deciders of a shared tree (`token_trie`, `prompt_tree`) where the layout calls
    them, to append each build's sample count to the returned list."""
    import ps_bridge.layout as layout_module

    built: list = []
    for name in ("token_trie", "prompt_tree"):
        real = getattr(layout_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            tree = _real(*args, **kwargs)
            built.append((_name, tree.num_samples))
            return tree

        monkeypatch.setattr(layout_module, name, counted)
    return built


@pytest.mark.core
@pytest.mark.parametrize("kind,decider", [("ours_tree", "token_trie"), ("ours_one_level", "prompt_tree")])
def test_one_tree_build_per_micro_batch_in_an_update(engines, checkpoints, monkeypatch, kind, decider):
    """One update (verl's `ppo_loss` through `forward_backward_batch`) builds each tree once: a mini-batch
    that fits one micro-batch is decided once (the micro-batcher's costs, the sharing rule and the
    layout read that one tree), and a mini-batch split into k micro-batches builds its own tree (the
    costs) and each micro-batch's once (k + 1 in all)."""
    path, hf = checkpoints("qwen2.5")
    loss_fn = ppo_loss_function(path)
    samples = tree_batch(hf.config.vocab_size)
    whole = sum(len(s.prompt) + len(s.response) for s in samples)
    split = 2 * max(len(s.prompt) + len(s.response) for s in samples)
    builds = count_tree_builds(monkeypatch)
    engine = engines("qwen2.5", "thd", kind, forward_only=False)
    layouts = []
    monkeypatch.setattr(engine, "layout_observer", lambda samples, layout: layouts.append(layout), raising=False)
    for budget in (whole, split):
        del builds[:], layouts[:]
        loss, grads, k = ppo_loss_pass(engine, ppo_batch(samples, budget), loss_fn)
        mine = [n for name, n in builds if name == decider]
        print(f"{kind} budget {budget}: {k} micro-batches, tree builds of {mine} samples")
        assert all(name == decider for name, _ in builds), builds
        assert len(layouts) == k and torch.isfinite(torch.tensor(loss))
        if k == 1:
            assert mine == [len(samples)]
        else:
            # the mini-batch's tree (the costs), then one per micro-batch: with trees every micro-batch's
            # (decided before the rule reads it), one level only where the rule shares (else unshared)
            shared = k if kind == "ours_tree" else sum(layout.shared for layout in layouts)
            assert mine[0] == len(samples) and len(mine) == 1 + shared, (mine, shared)
    assert k > 1  # the split budget did split


def split_group_batch(vocab):
    """`tree_batch` with groups of 6 and a budget below a group's packed tokens (a group is split
    across micro-batches, checked on the micro-batching's own output)."""
    n = 6
    samples = tree_batch(vocab, seed=1, n=n)
    budget = max(len(s.prompt) + len(s.response) for s in samples) + 4
    parts = host_micro_batches(samples, budget, min_shared=0)
    spans = [sum(1 for p in parts if set(p) & set(range(n * g, n * g + n))) for g in range(3)]
    assert max(spans) > 1, parts
    return samples, budget


def test_tree_batch_gradients_match_stock_engine(engines, checkpoints):
    """Groups split across micro-batches: verl's `ppo_loss` gives the stock engine's loss and
    gradients through our engine on prefix trees, with fewer micro-batches."""
    path, hf = checkpoints("qwen2.5")
    samples, budget = split_group_batch(hf.config.vocab_size)
    loss_fn = ppo_loss_function(path)
    (l_s, g_s, k_s), (l_o, g_o, k_o) = (ppo_loss_pass(engines("qwen2.5", "thd", kind, forward_only=False),
                                                      ppo_batch(samples, budget), loss_fn) for kind in ("stock", "ours_tree"))
    worst = max(((g_o[n] - g_s[n]).abs().max() / g_s[n].abs().max().clamp(min=1e-12)).item() for n in g_s)
    print(f"trees: micro-batches stock {k_s}, ours {k_o}; loss {l_s:.8g} vs {l_o:.8g}; grads {worst:.2e} relative")
    assert k_o < k_s
    assert abs(l_o - l_s) <= TOL * abs(l_s)
    assert worst < TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ours_tree", "ours_tree_default"])
def test_tree_batch_optimizer_step_matches_stock_engine(checkpoints, kind):
    """One `train_batch` (zero grad, forward-backward with verl's `ppo_loss`, optimizer step) on fresh
    engines, groups split across micro-batches: the updated weights agree, at threshold 0 and at the
    default threshold."""
    path, hf = checkpoints("qwen2.5")
    samples, budget = split_group_batch(hf.config.vocab_size)
    loss_fn = ppo_loss_function(path)
    stock = vt.build_stock_engine(path, use_remove_padding=True, forward_only=False)
    ours = vt.build_engine(PrefixSharedMegatronEngine, path, use_remove_padding=True, forward_only=False)
    ours.prefix_sharing_config = OUR_CONFIGS[kind]
    before = {n: p.detach().clone() for n, p in stock.module[0].named_parameters()}
    for engine in (stock, ours):
        with vt.engine_call_on_cpu(), engine.train_mode():
            engine.train_batch(ppo_batch(samples, budget), loss_fn)
    p_stock = dict(stock.module[0].named_parameters())
    p_ours = dict(ours.module[0].named_parameters())
    moved = min((p_stock[n] - before[n]).abs().max().item() for n in before)
    diff = max((p_ours[n] - p_stock[n]).abs().max().item() for n in before)
    print(f"{kind}: train_batch smallest update {moved:.2e}, max weight diff {diff:.2e}")
    assert moved > 1e-6
    assert diff < TOL * 1e-1


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt,batching", [("bshd", "dynamic"), ("thd", "static")])
def test_tree_batch_rows_and_gradients_by_format(engines, checkpoints, family, fmt, batching):
    """Trees in both of verl's formats, static micro-batches too, and Qwen3.5 (Gated DeltaNet on trees,
    `torch_ref`): rows and policy-loss gradients equal the stock engine's."""
    _, hf = checkpoints(family)
    samples = tree_batch(hf.config.vocab_size, seed=2)
    longest = max(len(s.prompt) + len(s.response) for s in samples)
    td_args = dict(max_token_len=2 * longest) if batching == "dynamic" else dict(micro_batch_size=6)
    stock = infer(engines(family, fmt, "stock"), vt.grpo_micro_batch(samples, temperature=0.7, **td_args))
    ours = infer(engines(family, fmt, "ours_tree"), vt.grpo_micro_batch(samples, temperature=0.7, **td_args))
    read = prompt_lengths(samples)
    assert max_row_diff(ours["log_probs"], stock["log_probs"], labelled_only=True, prompt_lengths=read) < TOL
    assert max_row_diff(ours["entropy"], stock["entropy"], prompt_lengths=read) < TOL
    g_stock = grads_after_backward(engines(family, fmt, "stock", forward_only=False), vt.grpo_micro_batch(samples, **td_args))
    g_ours = grads_after_backward(engines(family, fmt, "ours_tree", forward_only=False),
                                  vt.grpo_micro_batch(samples, **td_args))
    worst = max(((g_ours[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp(min=1e-12)).item() for n in g_stock)
    print(f"{family} {fmt} {batching}: worst relative grad diff {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize("buckets", ["segment", "level"])
@pytest.mark.parametrize("family", ["qwen2.5", "qwen3.5"])
def test_bucketed_micro_batches_match_stock_engine(engines, checkpoints, family, buckets, monkeypatch):
    """With CUDA graphs on the GPU the engine packs shared micro-batches bucketed (each segment of a
    tree level padded to the level's bucket, or under level buckets each level's block; every position
    computed): forced here on the CPU, the rows and every gradient equal verl's stock engine's, as the
    unbucketed packing's do."""
    import ps_bridge.verl.engine as engine_module

    made = []

    def recorded(*args, **kwargs):
        layout, decision = micro_batch_layout(*args, **kwargs)
        made.append(layout)
        return layout, decision

    micro_batch_layout = engine_module.micro_batch_layout
    monkeypatch.setattr(engine_module, "buckets_for", lambda model, config: True)
    monkeypatch.setattr(engine_module, "micro_batch_layout", recorded)
    _, hf = checkpoints(family)
    # prompts longer than the responses: the bucketed pack holds fewer tokens than the samples, so it runs
    samples = fold_into_vocabulary(grpo_like_samples(256, num_prompts=4, n=4, prompt_len=(40, 48), response_len=(5, 16),
                                                     seed=5, shuffle=False), hf.config.vocab_size)
    for forward_only in (True, False):
        ours = engines(family, "thd", "ours", forward_only=forward_only)
        config = ours._prefix_sharing()
        monkeypatch.setattr(ours, "prefix_sharing_config", replace(config, cuda_graph_buckets=buckets))
    stock = infer(engines(family, "thd", "stock"), vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    made.clear()  # Qwen3.5's baseline is our engine with sharing off
    ours = infer(engines(family, "thd", "ours"), vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    assert made and all(layout.bucketed and layout.has_sharing for layout in made)
    assert all(layout.level_buckets == (buckets == "level") for layout in made)
    assert any(layout.num_tokens > layout.tokens_shared for layout in made)  # the buckets padded something
    read = prompt_lengths(samples)
    assert max(max_row_diff(ours[k], stock[k], prompt_lengths=read) for k in ("log_probs", "entropy")) < TOL
    g_stock = grads_after_backward(engines(family, "thd", "stock", forward_only=False),
                                   vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    g_ours = grads_after_backward(engines(family, "thd", "ours", forward_only=False),
                                  vt.grpo_micro_batch(samples, **BATCHINGS["static"]))
    worst = max(((g_ours[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp(min=1e-12)).item() for n in g_stock)
    assert worst < TOL


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3.5"])
def test_cuda_graph_replays_match_stock_engine(engines, checkpoints, family, monkeypatch):
    """With CUDA graphs (the CPU standing in for CUDA, a recorded rerun for the capture), the same batch
    three times, forward-only and with gradients: each structure is captured on its second run and
    replayed from then on; the graphs hold the final hidden states, the output layer runs eagerly, and the rows and every gradient
    equal verl's stock engine's each time."""
    from test_cuda_graphs import record

    import ps_bridge.verl.engine as engine_module
    from ps_bridge import cuda_graphs

    made = {}

    def graphs_of(model):
        return made.setdefault(id(model), cuda_graphs.ModelGraphs(capture=record))

    monkeypatch.setattr(cuda_graphs, "graph_refusal", lambda *args: None)
    monkeypatch.setattr(cuda_graphs, "model_graphs", graphs_of)
    monkeypatch.setattr(engine_module, "buckets_for", lambda model, config: True)
    _, hf = checkpoints(family)
    samples = fold_into_vocabulary(grpo_like_samples(256, num_prompts=4, n=4, prompt_len=(40, 48), response_len=(5, 16),
                                                     seed=5, shuffle=False), hf.config.vocab_size)
    batch = lambda: vt.grpo_micro_batch(samples, **BATCHINGS["static"])  # noqa: E731
    for forward_only in (True, False):
        ours = engines(family, "thd", "ours", forward_only=forward_only)
        monkeypatch.setattr(ours, "prefix_sharing_config", replace(ours._prefix_sharing(), cuda_graphs=True))
    stock = infer(engines(family, "thd", "stock"), batch())
    g_stock = grads_after_backward(engines(family, "thd", "stock", forward_only=False), batch())
    read = prompt_lengths(samples)
    for _ in range(3):
        rows = infer(engines(family, "thd", "ours"), batch())
        assert max(max_row_diff(rows[k], stock[k], prompt_lengths=read) for k in ("log_probs", "entropy")) < TOL
        grads = grads_after_backward(engines(family, "thd", "ours", forward_only=False), batch())
        assert max(((grads[n] - g_stock[n]).abs().max() / g_stock[n].abs().max().clamp(min=1e-12)).item()
                   for n in g_stock) < TOL
    graphs = [entry for model_graphs in made.values() for entry in model_graphs.graphs.values()]
    hidden = hf.config.hidden_size
    assert {entry.backward is not None for entry in graphs} == {False, True}
    assert all(entry.output.shape[-1] == hidden for entry in graphs)
    # a pass's two micro-batches (two groups of 4 each) are one bucketed structure: seen six times with and
    # six times without gradients, each kind captured on its second run and replayed from then on
    assert (sum(g.captures for g in made.values()), sum(g.replays for g in made.values())) == (2, 10)
