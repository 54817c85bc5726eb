"""Kernel tests run the Triton kernels on CPU tensors in the Triton interpreter.

TRITON_INTERPRET=1 only takes effect if it is set before triton is first imported, so it is set here,
at conftest import, when triton is not loaded yet and there is no GPU (on a GPU machine the `gpu`
tests want compiled kernels). When triton was imported earlier in this process (a whole-suite run, or
a GPU machine), the interpreter tests skip themselves and `test_interpreter_fallback.py` reruns them
in a fresh subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels._launch import interpreter_active  # noqa: E402
from kernels.moe_align import _moe_align_kernel  # noqa: E402

INTERPRETER_REASON = (
    "triton was imported before TRITON_INTERPRET=1 could be set; "
    "tests/kernels/test_interpreter_fallback.py reruns this test in a subprocess"
)


@pytest.fixture
def switched_off():
    """run(switch, code) -> the stripped stdout of `python -c code` with the C++ extension's switch `switch` set to 0
    (kernels.cpp_build: the Python twin runs instead)."""
    import subprocess

    def run(switch: str, code: str) -> str:
        env = {**os.environ, switch: "0"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    return run


@pytest.fixture
def triton_cpu() -> None:
    """Skip unless Triton kernels can run on CPU tensors in this process."""
    if not interpreter_active(_moe_align_kernel):
        pytest.skip(INTERPRETER_REASON)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machines are small and shared
    yield
    torch.set_num_threads(threads)


def _same_engine_output_on_and_off(off) -> None:
    """The zoo target with a CPU extension on and inside the `off()` context: cached forwards of n = 1 / 4 / 16 tokens
    give the same logits to 1e-5, and greedy generation the same tokens, target-only and speculative, batched and one
    request at a time."""
    import engine
    from engine.cost.verify_curve import CachedChain
    from engine.paths import zoo_path
    from engine.workloads import code_prompts, encode

    target = engine.load_model(zoo_path("tiny-moe"))
    for n in (1, 4, 16):  # decode and verification forwards
        with CachedChain(target, 24, n, seed=n) as chain, torch.inference_mode():
            batch = chain.batch(n)
            on = target.forward_batch(batch, chain.kv).logits
            with off():
                ref = target.forward_batch(batch, chain.kv).logits
        torch.testing.assert_close(on, ref, rtol=1e-5, atol=1e-5)
    prompts = encode(target.tokenizer, code_prompts(2), 32)
    eng = engine.Engine(target, drafter="ngram")
    spec = engine.SpecConfig(depth=4, width=2)

    def tokens():
        batched = [[r.token_ids for r in eng.generate(prompts, 24, spec=s)] for s in (None, spec)]
        single = [[r.token_ids for p in prompts for r in eng.generate([p], 24, spec=s)] for s in (None, spec)]
        return batched + single

    on_tokens = tokens()
    with off():
        off_tokens = tokens()
    assert all(t == on_tokens[0] for t in on_tokens + off_tokens)


@pytest.fixture
def same_engine_output_on_and_off():
    """`_same_engine_output_on_and_off(off)`: the engine-level parity check of a CPU extension against its twin."""
    return _same_engine_output_on_and_off
