"""`make grpo`'s inputs (ps_bridge/tools/grpo/data.py): the locally trained tokenizer loads as a Hugging Face
fast tokenizer with Qwen's special tokens and chat template, the checkpoint has the shape vLLM's CPU build
takes, the parquet rows have verl's GSM8K layout and verl's GSM8K reward scores the reference answers 1;
everything is the same from the same seed."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ps_bridge.tools.grpo import data

pytestmark = pytest.mark.slow  # a tokenizer, a model and its fit: ~20 s of CPU

SMALL = dict(n_train=48, n_test=8, fit_steps=3)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("pyarrow")
    return data.build(tmp_path_factory.mktemp("grpo-data"), seed=3, **SMALL)


def test_tokenizer_is_a_qwen_style_fast_tokenizer(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model)
    assert tok.is_fast
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in data.SPECIAL_TOKENS:  # one token each, never split
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    problem = data.make_problems(1, seed=5)[0]
    for system in (False, True):
        msgs = data.messages(problem, system)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text == data.render(msgs)
        assert text.endswith("<|im_start|>assistant\n") and ("<|im_start|>system\n" in text) == system
    # byte-level: any text round-trips, digits are single tokens (Qwen's pre-tokenization)
    sample = "Zoë pays 12 * 3 = 36 €\n#### 36"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]
    assert built.tokenizer_size == len(tok)


def test_checkpoint_shape(built):
    config = json.loads((Path(built.model) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM's CPU attention
    assert config["vocab_size"] % data.VOCAB_MULTIPLE == 0 and config["vocab_size"] >= built.tokenizer_size
    assert config["vocab_size"] - built.tokenizer_size < data.VOCAB_MULTIPLE
    generation = json.loads((Path(built.model) / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
    assert built.fit.steps == SMALL["fit_steps"] and built.fit.sampled > 0


def _verl_gsm8k_reward():
    """verl's GSM8K reward module, loaded from its file: importing the `verl` package needs Ray."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed")
    path = Path(spec.submodule_search_locations[0]) / "utils" / "reward_score" / "gsm8k.py"
    module_spec = importlib.util.spec_from_file_location("verl_gsm8k_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_parquet_rows_have_verls_gsm8k_layout(built):
    import pyarrow.parquet as pq

    reward = _verl_gsm8k_reward()
    for directory, system in ((built.data_dir, False), (built.system_data_dir, True)):
        for split, count in (("train", SMALL["n_train"]), ("test", SMALL["n_test"])):
            rows = pq.read_table(Path(directory) / f"{split}.parquet").to_pylist()
            assert len(rows) == count
            for i, row in enumerate(rows):
                assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
                assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
                assert row["reward_model"]["style"] == "rule"
                assert [m["role"] for m in row["prompt"]] == (["system", "user"] if system else ["user"])
                assert row["prompt"][-1]["content"].endswith(data.INSTRUCTION)
                assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
                # verl's reward gives the reference solution full marks, a wrong answer none
                truth = row["reward_model"]["ground_truth"]
                assert reward.compute_score(row["extra_info"]["answer"], truth) == 1.0
                assert reward.compute_score(f"#### {int(truth) + 1}", truth) == 0
    system_rows = pq.read_table(Path(built.system_data_dir) / "train.parquet").to_pylist()
    assert len({r["prompt"][0]["content"] for r in system_rows}) == 1  # one system prompt shared by all


def test_prompt_lengths_fit_the_run(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model)
    longest = max(len(tok.apply_chat_template(data.messages(p, True), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
                  for p in data.make_problems(SMALL["n_train"], 3))
    assert longest <= built.system_max_prompt_tokens
    assert built.max_prompt_tokens < built.system_max_prompt_tokens


def test_same_seed_same_files_and_reuse(built, tmp_path):
    again = data.build(tmp_path / "a", seed=3, **SMALL)
    for name in ("tokenizer.json", "model.safetensors"):
        assert (Path(again.model) / name).read_bytes() == (Path(built.model) / name).read_bytes(), name
    assert (Path(again.data_dir) / "train.parquet").read_bytes() == (Path(built.data_dir) / "train.parquet").read_bytes()
    stamp = tmp_path / "a" / "data.json"
    before = stamp.stat().st_mtime_ns
    assert data.build(tmp_path / "a", seed=3, **SMALL) == again  # read back, not rebuilt
    assert stamp.stat().st_mtime_ns == before
    (Path(again.data_dir) / "test.parquet").unlink()  # a file gone: built again
    assert data.build(tmp_path / "a", seed=3, **SMALL) == again and stamp.stat().st_mtime_ns != before
    other = data.build(tmp_path / "b", seed=4, **SMALL)
    assert (Path(other.data_dir) / "train.parquet").read_bytes() != (Path(built.data_dir) / "train.parquet").read_bytes()


def test_fit_sees_both_prompt_forms(built):
    """The fit trains the answers behind the plain prompts and behind the system prompt: fitted on one form
    only, the model draws no right answer behind the other, and that run's first steps have no advantage."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model)
    system_start = tok("<|im_start|>system\n", add_special_tokens=False)["input_ids"]
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, attention_mask, labels):
            seen.extend(row[: len(system_start)].tolist() == system_start for row in input_ids)
            assert (labels[:, : len(system_start)] == -100).all()  # prompt tokens carry no loss
            return SimpleNamespace(loss=self.w * 1.0)

    data.fit_to_format(Recorder(), tok, data.make_problems(8, seed=3), steps=4, seed=3, batch_size=16)
    assert any(seen) and not all(seen)
    assert built.fit.system_sampled > 0
