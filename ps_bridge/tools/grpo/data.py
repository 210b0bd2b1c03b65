"""What `make grpo` trains on, built locally and deterministically from a seed (no model hub, no dataset
download):

- a byte-level BPE tokenizer trained with `tokenizers` on the arithmetic text below, saved as a Hugging
  Face fast tokenizer with Qwen's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and a
  Qwen-style chat template, so verl's `RLHFDataset` (`apply_chat_template`) and vLLM load it as they load
  Qwen2.5's;
- a tiny Qwen2.5 (`Qwen2ForCausalLM`: hidden 128, 2 layers, 4 query / 2 key-value heads of size 32, the
  smallest head vLLM's CPU attention takes), vocabulary = the tokenizer's size rounded up to a multiple of
  128 as Qwen's checkpoints and Megatron pad it; random weights from `ps_bridge.tools.tiny_checkpoints`, then
  fitted for `fit_steps` Adam steps to the answers' format behind both prompt forms (see `fit_to_format`
  for why); or with `model="qwen3.5"` a tiny Qwen3.5 (`Qwen3_5ForConditionalGeneration`, the architecture
  vLLM serves: hidden 128, Gated DeltaNet / Gated DeltaNet / softmax attention / Gated DeltaNet, heads of
  32, a one-layer vision tower that the text-only prompts never use, its image and video token ids the
  vocabulary's last ids, above the tokenizer's), fitted the same way;
- GSM8K-format train/test parquet files in the layout of verl's `examples/data_preprocess/gsm8k.py`
  (`data_source` "openai/gsm8k", the prompt as chat messages, `reward_model.ground_truth`, `extra_info`),
  whose answers end in `#### <number>`, the line verl's GSM8K reward (`verl/utils/reward_score/gsm8k.py`,
  strict mode) reads; and the same problems behind one shared system prompt (the prefix-tree run).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2, build_tiny_qwen35

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-Instruct's roles: <|endoftext|> pads and starts, <|im_end|> ends a turn (the sampling's stop token)
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# Qwen's chat layout without its default system prompt: a system message is there only when the data has one
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenization: single digits, runs of letters, runs of punctuation, newlines, spaces
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# the sentence verl's GSM8K preprocessing appends to every question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

SYSTEM_PROMPT = (
    "You are a careful assistant for small arithmetic word problems. Read the question, write the one "
    "calculation it needs as a short equation, then give the final answer as a whole number on its own "
    "line after four hash signs, for example: 2 + 3 = 5 then #### 5. Do not add any other text."
)

DATA_SOURCE = "openai/gsm8k"

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon")
ITEMS = ("apple", "book", "coin", "egg", "pen", "shell", "stamp", "card")

# model shape (vLLM's CPU attention refuses head sizes below 32)
MODEL_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
# the Qwen3.5 model: the same width and heads; 4 layers, 3 of them Gated DeltaNet with heads of 32 as well
QWEN35_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_key_head_dim=32, linear_value_head_dim=32,
)
MODELS = ("qwen2.5", "qwen3.5")
VOCAB_MULTIPLE = 128

# bump when the files built here change for the same arguments (the cache key)
FORMAT_VERSION = 3


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # GSM8K's `answer` field: the working, then "#### <answer>"
    answer: str


def make_problems(count: int, seed: int) -> List[Problem]:
    """`count` one-step word problems (+, -, x on small numbers), deterministic from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            q = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?"
            c, op = a + b, "+"
        elif kind == 1:
            a = rng.randint(2, 18)
            b = rng.randint(1, a - 1)
            q = f"{name} has {a} {item}s and gives {b} away. How many {item}s are left?"
            c, op = a - b, "-"
        else:
            a, b = rng.randint(2, 5), rng.randint(2, 5)
            q = f"{name} buys {a} boxes with {b} {item}s in each box. How many {item}s does {name} buy?"
            c, op = a * b, "*"
        out.append(Problem(q, f"{a} {op} {b} = {c}\n#### {c}", str(c)))
    return out


def messages(problem: Problem, system_prompt: bool) -> List[Dict[str, str]]:
    """The chat messages of one prompt, as verl's GSM8K preprocessing writes them."""
    user = {"role": "user", "content": f"{problem.question} {INSTRUCTION}"}
    return ([{"role": "system", "content": SYSTEM_PROMPT}] if system_prompt else []) + [user]


def render(msgs: List[Dict[str, str]], answer: Optional[str] = None) -> str:
    """CHAT_TEMPLATE in Python, for the tokenizer's training text and the fit (the saved tokenizer's own
    `apply_chat_template` is checked against it in the tests)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    text += "<|im_start|>assistant\n"
    return text if answer is None else text + f"{answer}<|im_end|>\n"


def train_tokenizer(texts: List[str], vocab_size: int):
    """A byte-level BPE trained on `texts`, special tokens first (ids 0-2), never split."""
    # imported here: tokenizers is heavy
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, path: Path):
    """Save as a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json with the chat template)."""
    # imported here: transformers is heavy
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None, unk_token=None,
        additional_special_tokens=[SPECIAL_TOKENS[1]], model_max_length=MODEL_SHAPE["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE, padding_side="left", clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(path))
    return hf


def padded_vocab(tokenizer_size: int) -> int:
    return -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


ANSWER_LINE = re.compile(r"#### (\-?[0-9\.\,]+)")


def correct(response: str, answer: str) -> bool:
    """The fit's own check: the last `#### <number>` line equals the answer (the line verl's strict GSM8K
    reward reads)."""
    found = ANSWER_LINE.findall(response)
    return bool(found) and found[-1].replace(",", "") == answer


@dataclass(frozen=True)
class FitSummary:
    steps: int
    final_loss: Optional[float]
    sampled: int  # responses sampled on test prompts after the fit (temperature 1), without a system prompt
    formatted: int  # of those, with a `#### <number>` line
    correct: int  # of those, with the right answer
    system_sampled: int = 0  # the same behind SYSTEM_PROMPT (the prefix-tree run's prompts)
    system_formatted: int = 0
    system_correct: int = 0


def fit_to_format(model, tokenizer, problems: List[Problem], steps: int, seed: int,
                  batch_size: int = 16, lr: float = 2e-3,
                  progress: Optional[Callable[[int, float], None]] = None) -> Optional[float]:
    """Adam on the answers' tokens (the prompt's tokens carry no loss) for `steps` steps.

    A random model never writes `#### <answer>`: every reward would be 0, every GRPO advantage 0, the weights
    would never move, and a rollout engine left with stale weights would go unnoticed. After the fit the
    model writes the format and is right on a part of the problems, so rewards vary inside each group.

    The learning rate decides how large that part is. At 5e-3 the fit learns the format but not the
    arithmetic (loss 0.8 after 300 steps, 2-6 of 64 sampled answers right, seed 1): a 3-step run of 8
    responses per step then draws no right answer at all on some machines (their float rounding fits a
    slightly different model), and its weights never move. At 2e-3: loss 0.25, about 20 of 64 right.

    The fit sees every problem in both prompt forms, without and behind SYSTEM_PROMPT: a model fitted on one
    form only writes the format after that form's prompt; behind the unseen system prompt it then draws no
    right answer, the first steps' advantages are all 0, and the only gradient left is the KL term between a
    policy and a reference that differ by float32 rounding, which Adam's per-parameter scaling turns into a
    full-size update in a direction set by rounding."""
    if steps <= 0:
        return None
    gen = random.Random(seed)
    rows = []
    for p in problems:
        ids_answer = tokenizer(f"{p.solution}<|im_end|>", add_special_tokens=False)["input_ids"]
        for system_prompt in (False, True):
            prompt = render(messages(p, system_prompt=system_prompt))
            ids_prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            rows.append((ids_prompt + ids_answer, len(ids_prompt)))
    pad = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_value = None
    for step in range(steps):
        batch = gen.sample(rows, min(batch_size, len(rows)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (ids, n_prompt) in enumerate(batch):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            labels[r, n_prompt: len(ids)] = torch.tensor(ids[n_prompt:])
            mask[r, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
        if progress is not None:
            progress(step + 1, loss_value)
    model.eval()
    return loss_value


@torch.no_grad()
def sample_rate(model, tokenizer, problems: List[Problem], seed: int, n: int = 4, max_new_tokens: int = 24,
                system_prompt: bool = False):
    """Sample `n` responses per problem at temperature 1; count formatted and correct ones."""
    torch.manual_seed(seed)
    formatted = right = total = 0
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    for p in problems:
        ids = tokenizer(render(messages(p, system_prompt=system_prompt)), add_special_tokens=False,
                        return_tensors="pt")
        out = model.generate(
            **ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
            num_return_sequences=n, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, ids["input_ids"].shape[1]:]:
            text = tokenizer.decode(row, skip_special_tokens=True)
            total += 1
            formatted += bool(ANSWER_LINE.search(text))
            right += correct(text, p.answer)
    return total, formatted, right


def parquet_rows(problems: List[Problem], split: str, system_prompt: bool) -> List[dict]:
    """verl's GSM8K row layout (examples/data_preprocess/gsm8k.py)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": messages(p, system_prompt),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i, "answer": p.solution, "question": p.question},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(rows: List[dict], path: Path) -> None:
    # imported here: pyarrow is not a ps-bridge dependency; verl's stack has it (datasets reads parquet with it)
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


@dataclass(frozen=True)
class GrpoData:
    model: str  # HF checkpoint directory (weights, config, tokenizer)
    data_dir: str  # train.parquet, test.parquet
    system_data_dir: str  # the same problems behind SYSTEM_PROMPT (the prefix-tree run)
    max_prompt_tokens: int  # the longest prompt after the chat template, in tokens (verl's max_prompt_length)
    system_max_prompt_tokens: int
    max_answer_tokens: int  # the longest reference answer with its <|im_end|>
    vocab_size: int
    tokenizer_size: int
    fit: FitSummary

    def dir(self, system_prompt: bool = False) -> str:
        return self.system_data_dir if system_prompt else self.data_dir

    def files(self) -> List[Path]:
        model = Path(self.model)
        return [model / name for name in ("config.json", "model.safetensors", "tokenizer.json")] + [
            Path(d) / f"{split}.parquet" for d in (self.data_dir, self.system_data_dir) for split in ("train", "test")]


def _key(**params) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def _build_model(model: str, path: Path, seed: int, vocab: int, eos: int, pad: int, tokenizer_size: int):
    if model == "qwen2.5":
        return build_tiny_qwen2(str(path), seed=seed, vocab_size=vocab, bos_token_id=pad, eos_token_id=eos,
                                pad_token_id=pad, tie_word_embeddings=False, **MODEL_SHAPE)
    # image, video, vision start and end: the vocabulary's last 4 ids, which no text token reaches
    image = vocab - 4
    if tokenizer_size > image:
        raise ValueError(f"the tokenizer's {tokenizer_size} tokens reach the image token id {image}: "
                         f"pad the vocabulary further (VOCAB_MULTIPLE)")
    return build_tiny_qwen35(str(path), seed=seed, conditional=True, vocab_size=vocab, bos_token_id=pad,
                             eos_token_id=eos, pad_token_id=pad, special_token_ids=(image, image + 1, image + 2, image + 3),
                             **QWEN35_SHAPE)


def build(out_dir, seed: int = 0, n_train: int = 512, n_test: int = 64, tokenizer_vocab: int = 1024,
          fit_steps: int = 300, dtype: str = "float32", model: str = "qwen2.5",
          progress: Optional[Callable[[str, int, int], None]] = None) -> GrpoData:
    """Write the tokenizer, the model (`model`: one of MODELS) and the parquet files under `out_dir` (model/,
    data/, data_system/), or reuse them when `out_dir/data.json` records the same arguments and they are all
    there. `progress(what, done, total)` is called as it goes."""
    if model not in MODELS:
        raise ValueError(f"model={model!r}: use one of {MODELS}")
    out = Path(out_dir)
    params = dict(seed=seed, n_train=n_train, n_test=n_test, tokenizer_vocab=tokenizer_vocab,
                  fit_steps=fit_steps, dtype=dtype, version=FORMAT_VERSION,
                  shape=MODEL_SHAPE if model == "qwen2.5" else {"model": model, **QWEN35_SHAPE})
    key = _key(**params)
    stamp = out / "data.json"
    if stamp.exists():
        recorded = json.loads(stamp.read_text())
        if recorded.get("key") == key:
            fields = recorded["data"]
            fields["fit"] = FitSummary(**fields["fit"])
            data = GrpoData(**fields)
            if all(Path(f).exists() for f in data.files()):
                return data
    report = progress or (lambda what, done, total: None)

    # train and test problems come from separate streams of the seed, so the test set is not the train set
    train = make_problems(n_train, seed)
    test = make_problems(n_test, seed + 1_000_003)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    report("tokenizer", 0, 1)
    corpus = [render(messages(p, s), p.solution) for p in train for s in (False, True)]
    tok = save_tokenizer(train_tokenizer(corpus, tokenizer_vocab), model_dir)
    report("tokenizer", 1, 1)

    eos, pad = tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)
    vocab = padded_vocab(len(tok))
    kind = model
    model = _build_model(kind, model_dir, seed, vocab, eos, pad, len(tok))
    # one thread: on a loaded 2-core machine torch's second thread waits for CPU time at every small op
    # (a tiny model's step took 30x longer on 2 threads than on 1 while other processes ran)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        final_loss = fit_to_format(model, tok, train, fit_steps, seed,
                                   progress=lambda s, loss: report("fit", s, fit_steps))
        rates = [sample_rate(model, tok, test[:16], seed, system_prompt=s) if fit_steps > 0 else (0, 0, 0)
                 for s in (False, True)]
    finally:
        torch.set_num_threads(threads)
    fit = FitSummary(fit_steps, final_loss, *rates[0], *rates[1])

    model.to(getattr(torch, dtype))
    model.generation_config.bos_token_id = pad
    # Qwen2.5-Instruct stops on either; vLLM reads generation_config.json's eos ids
    model.generation_config.eos_token_id = [eos, pad]
    model.generation_config.pad_token_id = pad
    model.save_pretrained(str(model_dir))

    def longest(problems, system_prompt):
        return max(len(tok.apply_chat_template(messages(p, system_prompt), add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for p in problems)

    data_dir, system_dir = out / "data", out / "data_system"
    for problems, split in ((train, "train"), (test, "test")):
        write_parquet(parquet_rows(problems, split, system_prompt=False), data_dir / f"{split}.parquet")
        write_parquet(parquet_rows(problems, split, system_prompt=True), system_dir / f"{split}.parquet")
    data = GrpoData(
        model=str(model_dir), data_dir=str(data_dir), system_data_dir=str(system_dir),
        max_prompt_tokens=longest(train + test, False), system_max_prompt_tokens=longest(train + test, True),
        max_answer_tokens=max(len(tok(p.solution + EOS_TOKEN, add_special_tokens=False)["input_ids"])
                              for p in train + test),
        vocab_size=vocab, tokenizer_size=len(tok), fit=fit,
    )
    stamp.write_text(json.dumps({"key": key, "params": params, "data": asdict(data)}, indent=1))
    return data
