"""Byte-level BPE tokenizers trained on text every fresh machine has.

The corpus is the Python standard library's own source (code, comments and
docstrings): it ships with every CPython, so checkpoints can be rebuilt on any
machine without a download.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
SPECIAL_TOKENS = [EOS_TOKEN, *CHAT_TOKENS]

# ChatML, the convention of Ouro's own chat checkpoints.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def stdlib_files(limit: int | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (no tests, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if "site-packages" not in p.parts
        and "test" not in p.parts
        and "tests" not in p.parts
        and "idle_test" not in p.parts
    ]
    return files[:limit] if limit else files


def read_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train_bpe(texts: Iterator[str], vocab_size: int):
    """Train a byte-level BPE with the special tokens at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` plus the config files HF's AutoTokenizer reads."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2)
        + "\n"
    )
