"""Prompts for the correctness tests: short and long, code and prose."""

SHORT = [
    "def foo(x):",
    "import os\n",
    "class Parser:\n    def __init__(self",
    "# Copyright",
    "return self._",
    "The quick brown fox",
    "for i in range(10):\n    ",
    "x",
]

MEDIUM = [
    '"""Utilities for working with paths and files.\n\nThis module provides helpers that'
    " wrap os.path and shutil so callers do not have to.\n\"\"\"\n\nimport os\nimport shutil\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(argv)\n",
]


def long_prompt(min_tokens: int, tokenizer) -> str:
    """Text long enough to span several prefill chunks."""
    text = ""
    i = 0
    while len(tokenizer(text)["input_ids"]) < min_tokens:
        text += f"def helper_{i}(value, *, scale={i}):\n    return value * scale + {i * 7}\n\n"
        i += 1
    return text
