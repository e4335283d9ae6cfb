"""Write the benchmark prompt sets to ``benchmarks/prompts/`` (deterministic).

* ``code``: the opening lines of functions and classes from the held-out
  standard-library files (never seen in training), cut at a line end;
* ``text``: prose — the first lines of docstrings of held-out modules;
* ``repetitive``: code with repeated structure (``elif`` chains, argparse
  options, table rows) where n-gram lookup has material to copy;
* ``mixed``: code and prose prompts alternating (the K-sweep's short setting);
* ``long``: about ``LONG_TOKENS`` tokens of held-out source each, starting at
  a top-level definition and cut at a line end (the K-sweep's long setting).

No set repeats one prompt, and none asks the model to echo its prompt.

    python benchmarks/make_prompts.py
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from vllm_loopspec.training.data import split_files

OUT = Path(__file__).resolve().parent / "prompts"
PER_SET = 32
LONG_TOKENS = 512


def _parsed(files):
    """(source, module AST) of every file that parses, in order."""
    for path in files:
        src = path.read_text(encoding="utf-8", errors="ignore")
        try:
            yield src, ast.parse(src)
        except SyntaxError:
            continue


def _code_prompts(files) -> list[str]:
    prompts = []
    for src, tree in _parsed(files):
        lines = src.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.end_lineno - node.lineno >= 6:
                prompt = "".join(lines[node.lineno - 1 : node.lineno + 3])
                if prompt not in prompts:
                    prompts.append(prompt)
                    break
        if len(prompts) == PER_SET:
            break
    return prompts


def _text_prompts(files) -> list[str]:
    prompts = []
    for _, tree in _parsed(files):
        doc = ast.get_docstring(tree)
        prompt = '"""' + doc[:200].rsplit(" ", 1)[0] if doc and len(doc) > 80 else None
        if prompt and prompt not in prompts:
            prompts.append(prompt)
        if len(prompts) == PER_SET:
            break
    return prompts


def _repetitive_prompts() -> list[str]:
    prompts = []
    for i in range(PER_SET):
        names = [f"opt_{i}_{j}" for j in range(4)]
        if i % 3 == 0:
            body = "".join(f"    elif kind == '{n}':\n        return handle_{n}(value)\n" for n in names)
            prompts.append(f"def dispatch_{i}(kind, value):\n    if kind is None:\n        return None\n{body}")
        elif i % 3 == 1:
            body = "".join(f"parser.add_argument('--{n}', type=int, default={j}, help='{n} value')\n"
                           for j, n in enumerate(names))
            prompts.append(f"import argparse\n\nparser = argparse.ArgumentParser()\n{body}")
        else:
            body = "".join(f"    ({j}, '{n}', {j * i}),\n" for j, n in enumerate(names))
            prompts.append(f"TABLE_{i} = [\n{body}")
    return prompts


def _mixed_prompts(code: list[str], text: list[str]) -> list[str]:
    n = min(len(code), len(text), PER_SET // 2)
    return [p for pair in zip(code[:n], text[:n]) for p in pair]


def _long_prompts(files, tokenizer) -> list[str]:
    """One prompt per held-out file, from its first top-level definition."""
    prompts = []
    for src, tree in _parsed(files):
        starts = [n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if not starts:
            continue
        lines = src.splitlines(keepends=True)[starts[0] - 1 :]
        prompt, count = "", 0
        for line in lines:
            count += len(tokenizer.encode(line, add_special_tokens=False))
            if count > LONG_TOKENS:
                break
            prompt += line
        if count > LONG_TOKENS and prompt not in prompts:
            prompts.append(prompt)
        if len(prompts) == PER_SET:
            break
    return prompts


def main() -> None:
    from transformers import AutoTokenizer

    _, held_out = split_files()
    OUT.mkdir(exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-stdlib")
    code, text = _code_prompts(held_out), _text_prompts(held_out)
    sets = {"code": code, "text": text, "repetitive": _repetitive_prompts(),
            "mixed": _mixed_prompts(code, text), "long": _long_prompts(held_out, tokenizer)}
    for name, prompts in sets.items():
        assert len(set(prompts)) == len(prompts)
        with open(OUT / f"{name}.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
        print(f"{name}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
