"""The layout is the architecture: no import cycle among the project's modules, data flows one way
(conf -> engine (+ kernels) -> env -> ctrl), every module imports in a fresh interpreter, and no file is
over ~500 lines without a reason written at its top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "engine", "env", "ctrl")
ORDER = {"kernels": 0, "engine": 1, "env": 2, "ctrl": 3}
LONG_FILE_REASON = "Long file:"  # a module over MAX_LINES says why in its docstring with these words
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = f
    return mods


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                r = resolve(n)
                if r and r != m and not r.startswith(m + ".") and not m.startswith(r + "."):
                    graph[m].add(r)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_and_no_upward_import():
    graph = _graph(_modules())
    assert _cycles(graph) == []
    upward = sorted((a, b) for a, bs in graph.items() for b in bs if ORDER[b.split(".")[0]] > ORDER[a.split(".")[0]])
    assert upward == [], f"imports against kernels -> engine -> env -> ctrl: {upward}"


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_every_module_imports_in_a_fresh_interpreter():
    names = [m for m in _modules() if not m.endswith("__main__") and not m.startswith("kernels.bench")]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_long_file_without_a_reason(pkg):
    long = []
    for f in (ROOT / pkg).rglob("*.py"):
        lines = f.read_text().count("\n")
        head = "\n".join(f.read_text().splitlines()[:40])
        if lines > MAX_LINES and LONG_FILE_REASON not in head:
            long.append(f"{f.relative_to(ROOT)} ({lines} lines)")
    assert long == [], f"over {MAX_LINES} lines without '{LONG_FILE_REASON}' in the docstring: {long}"
