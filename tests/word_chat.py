"""A word-level ChatML tokenizer and verl-shaped rows of its words, for the dataset tests.

Every word is one token, so a prompt of k content words is k + 5 tokens (<|im_start|> user ...
<|im_end|> <|im_start|> assistant), plus 5 + one per tool for the tools block.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(60)]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %} {{ t.function.name }}{% endfor %} </tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OVERHEAD = 5


def word_tokenizer() -> PreTrainedTokenizerFast:
    tokens = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "<tools>", "</tools>"]
    vocab = {t: i for i, t in enumerate([*tokens, "calc", "search", *WORDS])}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=model,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = TEMPLATE
    return tok


def row(i: int, words: int = 3, tools: dict | None = None, **extra) -> dict:
    content = " ".join(WORDS[j % len(WORDS)] for j in range(i, i + words))
    extra_info = {"index": 100 + i, **({"tools_kwargs": tools} if tools is not None else {})}
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "toy",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": extra_info,
        **extra,
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
