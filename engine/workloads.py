"""Prompt workloads: built-in code, prose, chat and math prompts every user has, or FastChat JSONL files.

Built-in prompts come from the Python standard library (function headers with their docstrings,
HumanEval-style) and `pydoc_data.topics` (English paragraphs), chosen deterministically. A FastChat
question file (`{"question_id", "category", "turns": [...]}` per line) gives one prompt per question
(first turn); HumanEval-style `{"prompt": ...}` lines are read too.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_CODE_FILES = (
    "textwrap.py",
    "json/encoder.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "statistics.py",
    "shlex.py",
    "colorsys.py",
    "difflib.py",
    "calendar.py",
    "string.py",
    "glob.py",
    "fnmatch.py",
    "base64.py",
    "csv.py",
    "random.py",
)


@dataclass
class Prompt:
    text: str
    category: str


def code_prompts(n: int = 16, per_file: int = 3) -> list[Prompt]:
    """Function headers + docstrings from the stdlib, HumanEval-style (the model completes the body).

    Round-robin over the modules in a fixed order: the first function of every module, then the second...
    (up to `per_file` each), so the first 16 prompts stay the same whatever n is."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    per_module: list[list[Prompt]] = []
    for name in _CODE_FILES:
        f = stdlib / name
        if not f.is_file():
            continue
        src = f.read_text(encoding="utf-8", errors="replace")
        lines = src.splitlines()
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        found = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.body:
                end = node.body[0].end_lineno or node.body[0].lineno
                found.append(Prompt("\n".join(lines[node.lineno - 1 : end]) + "\n", "code"))
            if len(found) >= per_file:
                break
        per_module.append(found)
    out = [m[i] for i in range(per_file) for m in per_module if i < len(m)]
    return out[:n]


def prose_prompts(n: int = 16, chars: int = 400) -> list[Prompt]:
    """Opening paragraphs of `pydoc_data.topics` entries (English technical prose)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics)[:: max(1, len(topics) // (n * 2))]:
        text = topics[key].strip()
        if len(text) > 100:
            out.append(Prompt(text[:chars], "prose"))
        if len(out) >= n:
            break
    return out


def chat_prompts(n: int = 16) -> list[Prompt]:
    """Chat-style questions about Python built from `pydoc_data.topics` titles and their first sentence."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    out = []
    for key in keys[1 :: max(1, len(keys) // (n * 2))]:
        first = topics[key].strip().split("\n\n")[0].replace("\n", " ")[:160]
        if len(first) > 40:
            out.append(Prompt(f'User: Can you explain {key} in Python? I read: "{first}"\nAssistant:', "chat"))
        if len(out) >= n:
            break
    return out


def math_prompts(n: int = 16, seed: int = 0) -> list[Prompt]:
    """GSM8K-style arithmetic word problems, generated deterministically (answer left to the model)."""
    import random

    rng = random.Random(seed)
    items = ("apples", "books", "marbles", "tickets", "pencils", "coins", "stamps", "cookies")
    names = ("Ada", "Grace", "Alan", "Linus", "Guido", "Barbara", "Ken", "Edsger")
    out = []
    for _ in range(n):
        a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(1, 15)
        who, what = rng.choice(names), rng.choice(items)
        q = (
            f"Question: {who} has {a} {what}. {who} buys {b} bags with {c} {what} in each bag, then gives "
            f"away half of the new {what}. How many {what} does {who} have now?\nAnswer: Let's think step by step."
        )
        out.append(Prompt(q, "math"))
    return out


BUILTIN = {"code": code_prompts, "prose": prose_prompts, "chat": chat_prompts, "math": math_prompts}


def load_jsonl(path: str | Path, n: int | None = None) -> list[Prompt]:
    """FastChat questions (first turn) or HumanEval-style {"prompt"} lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file {path} does not exist")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i + 1}: not JSON: {err}") from err
        if "turns" in row and row["turns"]:
            out.append(Prompt(str(row["turns"][0]), str(row.get("category", "chat"))))
        elif "prompt" in row:
            out.append(Prompt(str(row["prompt"]), "code"))
        elif "question" in row:
            out.append(Prompt(str(row["question"]), "math"))
        else:
            raise ValueError(f"{path}:{i + 1}: expected 'turns', 'prompt' or 'question'")
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"workload file {path} holds no usable prompts (FastChat 'turns', 'prompt' or 'question')")
    return out


def workload(name: str = "mixed", n: int = 8, path: str | None = None) -> list[Prompt]:
    """name: code | prose | chat | math | mixed, or a JSONL path via `path`."""
    if path:
        return load_jsonl(path, n)
    if name in BUILTIN:
        return BUILTIN[name](n)
    if name == "mixed":
        c, p = code_prompts(n), prose_prompts(n)
        return [x for pair in zip(c, p) for x in pair][:n]
    raise ValueError(f"unknown workload {name!r}; use {', '.join(BUILTIN)}, mixed or workload.prompts=PATH")


def encode(tokenizer, prompts: list[Prompt], max_len: int = 256) -> list[list[int]]:
    """Tokenize and keep the last `max_len` tokens of each prompt."""
    return [tokenizer.encode(p.text).ids[-max_len:] or [0] for p in prompts]
