"""Compile every kernel for an H100 (sm_90) without a GPU: catches type and lowering errors that the
interpreter tolerates. Runs in a subprocess because the interpreter must be off for compilation."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.fused_moe import (
    MoeBlockConfig, _fused_moe_down_kernel, _fused_moe_gate_up_kernel, _moe_combine_kernel, _tuned_configs,
)
from kernels.moe_align import _moe_align_kernel

TARGET = GPUTarget("cuda", 90, 32)
I32 = "i32"
SMEM_SM90 = 227 * 1024  # opt-in shared memory per block on H100/H200


def compile_(fn, sig, consts, num_warps=4, num_stages=3):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                       options={"num_warps": num_warps, "num_stages": num_stages})
    assert k.asm.get("cubin"), fn.__name__
    assert k.metadata.shared <= SMEM_SM90, (fn.__name__, consts, num_stages, k.metadata.shared)
    return k


tuned = {MoeBlockConfig(**{k: c[k] for k in MoeBlockConfig.__dataclass_fields__}) for c in _tuned_configs()}
done = 0
for dt, prec in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
    # every tuned config in bf16 (the production dtype); the default in every dtype
    for cfg in {MoeBlockConfig()} | (tuned if dt == "bf16" else set()):
        tiles = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
        tiles.update(DOT_PRECISION=prec, UPCAST=False)
        # plain SiLU (the bias pointer a placeholder fp32 buffer, as the launcher passes) and gpt_oss's variant
        for bias, clamp in ((False, False), (True, True)):
            bias_ptr = "*" + dt if bias else "*fp32"
            gate_up = dict(hidden_ptr="*" + dt, w_gate_up_ptr="*" + dt, inter_ptr="*fp32", sorted_ids_ptr="*i32",
                           block_expert_ptr="*i32", bias_ptr=bias_ptr, num_assign=I32, top_r=I32, D=I32, F=I32,
                           stride_ht=I32, stride_we=I32, stride_wn=I32, stride_wk=I32, stride_it=I32,
                           stride_be=I32, alpha="fp32", limit="fp32")
            compile_(_fused_moe_gate_up_kernel, gate_up, {**tiles, "HAS_BIAS": bias, "CLAMP": clamp},
                     cfg.num_warps, cfg.num_stages)
            down = dict(inter_ptr="*fp32", w_down_ptr="*" + dt, topk_weights_ptr="*fp32", partial_ptr="*fp32",
                        sorted_ids_ptr="*i32", block_expert_ptr="*i32", bias_ptr=bias_ptr, num_assign=I32, D=I32,
                        F=I32, stride_it=I32, stride_we=I32, stride_wn=I32, stride_wk=I32, stride_pt=I32,
                        stride_be=I32)
            compile_(_fused_moe_down_kernel, down, {**tiles, "HAS_BIAS": bias}, cfg.num_warps, cfg.num_stages)
            done += 2
    combine = dict(partial_ptr="*fp32", expert_ids_ptr="*i64", out_ptr="*" + dt, top_r=I32, D=I32,
                   stride_pt=I32, stride_ot=I32)
    compile_(_moe_combine_kernel, combine, dict(BLOCK_D=1024))
    done += 1
for e_pad, ids in ((8, "*i64"), (256, "*i32")):
    align = dict(expert_ids_ptr=ids, sorted_ids_ptr="*i32", block_expert_ptr="*i32", counts_ptr="*i32",
                 offsets_ptr="*i32", num_padded_ptr="*i32", num_invalid_ptr="*i32", num_assign=I32,
                 num_experts=I32, total_len=I32)
    chunk = max(16, min(128, 8192 // e_pad))  # as in moe_align()
    compile_(_moe_align_kernel, align, dict(BLOCK_M=16, E_PAD=e_pad, CHUNK=chunk, FILL=1024))
    done += 1
print("compiled", done)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA backend")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled" in proc.stdout
