// The small-M sweep shared by small_m.cpp and cpu_decode.cpp (AVX-512F or AVX2 + FMA: kernels/simd.h):
//
//   sweep<M>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1):  y[m, n0:n1] = bias[n0:n1] (or 0) + sum_k x[m, k] wt[k, n0:n1]
//
// for M <= 16 token rows x [M, K] (row stride ldx) and an input-major weight wt [K, N] (row stride ldw): the weight
// rows are swept in memory order, U at a time, once for all M rows, and every output accumulates over k in order
// with one FMA each, so a row's result has the same bits whatever M and U are (batch-invariant). U weight vectors
// stay in registers while each row's accumulator is loaded, updated U times and stored: the accumulator traffic
// through the cache is 1/U of the FMAs. U (measured, cold weights of the benchmark shapes, README): 1 for one or two
// rows whose accumulators fit in 10 KB (M N <= 2560 floats) — each weight row then streams whole, in address order,
// 1.1-1.9x faster than U = 8 / 16 there —, else 16 (8 for one row: a wide LM head); with AVX2's 16 vector
// registers U = 8 for every M (16 weight vectors would spill).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace expertspec {

constexpr int64_t kLanes = simd::kLanes;
constexpr int kWideU = simd::kRegisters >= 32 ? 16 : 8;  // U for M >= 2 (beyond the row-streaming case)
constexpr int kOneRowU = 8;                               // U for one row
constexpr int64_t kMaxBlock = 16;  // rows per sweep

constexpr int64_t kRowStreamFloats = 2560;  // M N at most for U = 1 (M <= 2)

// Column n of the sweep (a whole vector, or the partial last one when P): y[:, n] += x[:, k:k+U] wt[k:k+U, n]
template <int M, int U, bool P>
inline void sweep_column(const float* __restrict x, int64_t ldx, const float* __restrict w0, int64_t ldw, int64_t k,
                         float* __restrict y, int64_t ldy, int64_t n, simd::vmask tail) {
  simd::vf wv[U];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u) wv[u] = simd::load_part<P>(tail, w0 + u * ldw + n);
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    simd::vf acc = simd::load_part<P>(tail, y + m * ldy + n);
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc = simd::fmadd(simd::set1(x[m * ldx + k + u]), wv[u], acc);
    simd::store_part<P>(tail, y + m * ldy + n, acc);
  }
}

template <int M, int U>
inline void sweep_u(const float* __restrict x, int64_t ldx, const float* __restrict wt, int64_t ldw, int64_t K,
                    const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t full = n0 + (n1 - n0) / kLanes * kLanes;  // [n0, full) whole vectors, [full, n1) one partial
  const simd::vmask tail = simd::first(n1 - full);
  for (int64_t n = n0; n < n1; n += kLanes) {  // start from the bias
    const simd::vmask mk = n < full ? simd::all() : tail;
    const simd::vf b = bias ? simd::load(mk, bias + n) : simd::zero();
    for (int m = 0; m < M; ++m) simd::store(mk, y + m * ldy + n, b);
  }
  int64_t k = 0;
  for (; k + U <= K; k += U) {  // the weight rows U at a time
    const float* w0 = wt + k * ldw;
    for (int64_t n = n0; n < full; n += kLanes) sweep_column<M, U, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
    if (full < n1) sweep_column<M, U, true>(x, ldx, w0, ldw, k, y, ldy, full, tail);
  }
  for (; k < K; ++k) {  // K's remainder, one row at a time
    const float* w0 = wt + k * ldw;
    for (int64_t n = n0; n < full; n += kLanes) sweep_column<M, 1, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
    if (full < n1) sweep_column<M, 1, true>(x, ldx, w0, ldw, k, y, ldy, full, tail);
  }
}

// AVX2 builds: accumulator rows whose stride is a multiple of 1 KB share a few L1 sets (4 KB aliasing) and evict
// each other from 4 rows on; they are swept in a scratch whose rows are a cache line apart, then copied out (Zen 3,
// [512, 2048] weight cold: 12 / 16 rows 1.1 -> 3.8-5.0 GB/s). AVX-512 builds keep sweeping in place (measured
// there without this; not re-measured with it).
constexpr bool kPadAliasedRows = simd::kRegisters < 32;

template <int M>
inline void sweep(const float* __restrict x, int64_t ldx, const float* __restrict wt, int64_t ldw, int64_t K,
                  const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t n0, int64_t n1) {
  if (M <= 2 && M * (n1 - n0) <= kRowStreamFloats) {
    sweep_u<M, 1>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1);
    return;
  }
  constexpr int U = M == 1 ? kOneRowU : kWideU;
  if (!(kPadAliasedRows && M >= 4 && ldy % 256 == 0)) {
    sweep_u<M, U>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1);
    return;
  }
  thread_local std::vector<float> scratch;
  const int64_t width = n1 - n0, lds = (width + 15) / 16 * 16 + 16;  // rows 64 B off the 1 KB grid
  if (static_cast<int64_t>(scratch.size()) < M * lds) scratch.resize(M * lds);
  sweep_u<M, U>(x, ldx, wt, ldw, K, bias ? bias + n0 : nullptr, scratch.data(), lds, 0, width);
  for (int m = 0; m < M; ++m) std::copy_n(scratch.data() + m * lds, width, y + m * ldy + n0);
}

using SweepFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t,
                         int64_t, int64_t);
constexpr SweepFn kSweeps[] = {sweep<1>,  sweep<2>,  sweep<3>,  sweep<4>,  sweep<5>,  sweep<6>,  sweep<7>,  sweep<8>,
                                sweep<9>,  sweep<10>, sweep<11>, sweep<12>, sweep<13>, sweep<14>, sweep<15>, sweep<16>};

}  // namespace expertspec
