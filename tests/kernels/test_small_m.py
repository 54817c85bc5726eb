"""The CPU small-M kernel (kernels.small_m) against its reference twin F.linear, and the engine with it on / off."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import engine
import kernels
from engine.models.layout import input_major
from engine.paths import zoo_path
from kernels import small_m

pytestmark = pytest.mark.skipif(small_m.load() is None, reason=f"small-M kernel {small_m.status()}")


@contextlib.contextmanager
def kernel_off():
    """Every `small_m.linear` falls back to F.linear inside the block."""
    saved = dict(small_m._state)
    small_m._state.update(module=None, status="off (test)")
    try:
        yield
    finally:
        small_m._state.update(saved)


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 15, 16])
@pytest.mark.parametrize("N, K", [(16, 32), (17, 33), (1029, 256), (256, 512), (3, 5), (2065, 40), (1024, 24)])
def test_equals_f_linear_and_is_batch_invariant(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = input_major(torch.randn(N, K, generator=g))
    x, b = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    for bias in (None, b):
        assert small_m.supports(x, w, bias)
        y, ref = small_m.linear(x, w, bias), F.linear(x, w, bias)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        for m in range(M):  # a row's bits do not depend on the rows it shares the call with (nor on the sweep's
            # U: one or two rows of N <= 1280 sweep one weight row at a time, others 8 / 16 at a time; nor on
            # whether AVX2 sweeps 4+ rows of a 1 KB-multiple width through its padded scratch: N = 256, 1024)
            assert torch.equal(small_m.linear(x[[m, (m + 1) % M]], w, bias)[0], y[m])
            assert torch.equal(small_m.linear(x[[m]], w, bias)[0], y[m])


def test_falls_back_where_it_does_not_apply():
    w = torch.randn(64, 32)  # row-major [out, in]: not the kernel's layout
    x = torch.randn(2, 32)
    assert not small_m.supports(x, w)
    assert not small_m.supports(torch.randn(17, 32), input_major(w))  # more than 16 rows
    assert not small_m.supports(x.double(), input_major(w).double())
    wg = input_major(w).requires_grad_(True)
    assert not small_m.supports(x, wg)
    y = small_m.linear(x, wg)
    y.sum().backward()  # F.linear: autograd flows
    assert wg.grad is not None
    assert torch.equal(small_m.linear(x, w), F.linear(x, w))
    x3 = torch.randn(2, 3, 32)
    assert torch.equal(small_m.linear(x3, input_major(w)), F.linear(x3, input_major(w)))
    with kernel_off():
        assert not small_m.supports(x, input_major(w))


def test_cpu_fused_moe_uses_it_and_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    T, D, E, F_, r = 6, 64, 8, 48, 2
    hidden = torch.randn(T, D, generator=g)
    gu, down = input_major(torch.randn(E, 2 * F_, D, generator=g)), input_major(torch.randn(E, D, F_, generator=g))
    ids = torch.randint(0, E, (T, r), generator=g)
    wts = torch.rand(T, r, generator=g)
    ref = kernels.fused_moe_ref(hidden, gu, down, ids, wts)
    torch.testing.assert_close(kernels.fused_moe(hidden, gu, down, ids, wts), ref, rtol=1e-5, atol=1e-4)


def test_engine_logits_and_greedy_tokens_with_and_without_it(same_engine_output_on_and_off):
    """Same logits to 1e-5 and the same greedy tokens, target-only and speculative, kernel on and off (every matmul of
    these forwards has <= 16 rows, the kernel's range), and the same plain uncached logits."""
    target = engine.load_model(zoo_path("tiny-moe"))
    ids = torch.tensor([list(range(5, 40))])
    with torch.inference_mode():
        on = target.logits(ids)
        with kernel_off():
            off = target.logits(ids)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    same_engine_output_on_and_off(kernel_off)


def test_a_stale_build_lock_is_cleared(tmp_path):
    """A lock left by a killed build would make torch wait forever: one older than the threshold is removed."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    small_m._clear_stale_lock(tmp_path)
    assert lock.exists()  # fresh: a build may own it
    old = time.time() - 3600
    os.utime(lock, (old, old))
    small_m._clear_stale_lock(tmp_path)
    assert not lock.exists()
    small_m._clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_switched_off_by_the_environment(switched_off):
    code = (
        "from kernels import small_m; import torch; "
        "print(small_m.status(), small_m.supports(torch.ones(2, 4), torch.ones(4, 4).t()))"
    )
    assert switched_off("EXPERTSPEC_SMALL_M", code) == "off (EXPERTSPEC_SMALL_M=0) False"


@pytest.mark.parametrize("cap, flags, status", [
    ("AVX512", ["-mavx512f", "-mfma"], "on (AVX-512)"),
    ("AVX2", ["-mavx2", "-mfma"], "on (AVX2)"),
    ("DEFAULT", None, "off (CPU capability DEFAULT, needs AVX2 or AVX512)"),
])  # fmt: skip
def test_simd_extensions_build_for_the_cpus_vector_set(monkeypatch, cap, flags, status):
    """A simd extension is built with the flags of the widest vector set torch detects, or is off without one."""
    from torch.utils import cpp_extension

    from kernels.cpp_build import CppExtension

    seen = {}

    def fake_load(name, sources, extra_cflags, verbose):
        seen["cflags"] = extra_cflags
        return object()

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    ext = CppExtension("small_m", "EXPERTSPEC_TEST_UNSET", ("-O3",), simd=True)
    assert ext.status() == status
    if flags is None:
        assert ext.load() is None and "cflags" not in seen
    else:
        assert seen["cflags"][0] == "-O3" and seen["cflags"][-2:] == flags


@pytest.fixture
def packing_on(monkeypatch):
    """Packing on whatever the build (by default it is on with AVX-512 only: `small_m.packing_default`)."""
    monkeypatch.setitem(small_m._packs, "on", True)


@contextlib.contextmanager
def packing_off():
    """Every `linear(..., pack=True)` and `cpu_decode.moe_decode(..., pack=True)` sweeps the weights unpacked."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(small_m._packs, "on", False)  # what EXPERTSPEC_PACK=0 sets at import
        yield


@pytest.mark.parametrize("S", [16, 32])
def test_pack_layout(S):
    """P[..., s, k, j] = w[..., s S + j, k], zeros past N, for any strides and leading dims."""
    w = torch.randn(3, 37, 5)  # [E, N, K]
    for src in (w, input_major(w)):
        p = small_m.pack(src, S)
        assert p.shape == (3, -(-37 // S), 5, S) and p.is_contiguous()
        for s in range(p.shape[1]):
            for j in range(S):
                n = s * S + j
                assert torch.equal(p[:, s, :, j], w[:, n] if n < 37 else torch.zeros(3, 5))


@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 16, 17, 40, 64])
@pytest.mark.parametrize("N, K", [(2, 5), (16, 32), (17, 33), (33, 1), (100, 64), (1029, 256), (2065, 40)])
def test_packed_equals_the_sweep_bit_for_bit(M, N, K, packing_on):
    """The strip-packed weight gives the input-major sweep's bits (same FMA chain per output), batch-invariantly."""
    g = torch.Generator().manual_seed(7 * M + N + K)
    w = input_major(torch.randn(N, K, generator=g))
    x, b = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    for bias in (None, b):
        assert small_m.supports(x, w, bias, small_m.MAX_PACKED_ROWS)
        y = small_m.linear(x, w, bias, pack=True)
        assert small_m.packed(w) is not None
        if M <= small_m.MAX_ROWS:
            assert torch.equal(y, small_m.linear(x, w, bias))
        else:  # above 16 rows only the packed weight takes the kernel (blocks of 16 rows)
            assert torch.equal(y[:16], small_m.linear(x[:16], w, bias))
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * float(y.abs().max()))
        for m in range(M):
            assert torch.equal(small_m.linear(x[[m]], w, bias, pack=True)[0], y[m])


def test_packed_copy_follows_the_weight_and_its_cap(monkeypatch, packing_on):
    w = input_major(torch.randn(40, 24))
    x = torch.randn(3, 24)
    p = small_m.packed(w)
    assert p is not None and small_m.packed(w) is p  # cached on the weight
    with torch.no_grad():
        w.mul_(2.0)  # in place: the copy is rebuilt, never stale
    assert small_m.packed(w) is not p
    assert torch.equal(small_m.linear(x, w, pack=True), small_m.linear(x, w))
    with packing_off():
        assert small_m.packed(input_major(torch.randn(40, 24))) is None
    monkeypatch.setitem(small_m._packs, "cap", small_m._packs["bytes"])  # no room left for another copy
    fresh = input_major(torch.randn(40, 24))
    assert small_m.packed(fresh) is None
    monkeypatch.setitem(small_m._packs, "cap", 2**40)
    assert small_m.packed(fresh) is None  # refused for good while unchanged: its bits never switch mid-run
    assert torch.equal(small_m.linear(x, fresh, pack=True), small_m.linear(x, fresh))


def test_packing_is_on_by_default_with_avx512_only(monkeypatch):
    for env, want in (("1", True), ("0", False), (None, small_m.status() == "on (AVX-512)")):
        if env is None:
            monkeypatch.delenv("EXPERTSPEC_PACK", raising=False)
        else:
            monkeypatch.setenv("EXPERTSPEC_PACK", env)
        assert small_m.packing_default() is want


def test_packing_settings_are_checked(monkeypatch):
    monkeypatch.setenv("EXPERTSPEC_PACK", "yes")
    with pytest.raises(ValueError, match="EXPERTSPEC_PACK must be 1"):
        small_m.packing_default()
    monkeypatch.setitem(small_m._packs, "cap", None)
    monkeypatch.setenv("EXPERTSPEC_PACK_MAX_MB", "lots")
    with pytest.raises(ValueError, match="EXPERTSPEC_PACK_MAX_MB must be a number"):
        small_m._cap_bytes()
    monkeypatch.setenv("EXPERTSPEC_PACK_MAX_MB", "1.5")
    assert small_m._cap_bytes() == int(1.5 * 2**20)


def test_engine_logits_and_greedy_tokens_with_and_without_packing(same_engine_output_on_and_off, packing_on):
    same_engine_output_on_and_off(packing_off)


def test_a_row_major_weight_reads_its_packed_copy(packing_on):
    """pack=True takes any layout: a row-major weight (BLAS's otherwise) gets the input-major sweep's bits, for 1-64
    rows; without its packed copy it stays with F.linear."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 80, generator=g)  # [N, K] row-major: the sweep does not read it
    b = torch.randn(48, generator=g)
    assert not small_m.supports(torch.randn(2, 80), w, b)
    for M in (1, 5, 16, 40):
        x = torch.randn(M, 80, generator=g)
        y = small_m.linear(x, w, b, pack=True)
        assert torch.equal(y[:16], small_m.linear(x[:16], input_major(w), b))
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with packing_off():
        x = torch.randn(3, 80, generator=g)
        assert torch.equal(small_m.linear(x, w, b, pack=True), F.linear(x, w, b))
