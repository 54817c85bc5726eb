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
// 1.1-1.9x faster than U = 8 / 16 there —, else 8 (one row: a wide LM head; more rows: see kWideU, kWideC).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace expertspec {

constexpr int64_t kLanes = simd::kLanes;
// U and C (adjacent columns per pass) for M >= 2 beyond the row-streaming case: AVX-512 8 x 2 (16 weight vectors
// live, each broadcast of x feeding two FMAs: 1.0-1.2x the 16 x 1 sweep per matrix, forward 1.00-1.035x at n >= 8,
// README), AVX2 8 x 1 (16 registers)
constexpr int kWideU = 8;
constexpr int kWideC = simd::kRegisters >= 32 ? 2 : 1;
constexpr int kOneRowU = 8;  // U for one row
constexpr int64_t kMaxBlock = 16;  // rows per sweep

constexpr int64_t kRowStreamFloats = 2560;  // M N at most for U = 1 (M <= 2)

// C adjacent columns from n (C whole vectors, or one partial last vector when P): y[:, n...] += x[:, k:k+U]
// wt[k:k+U, n...]. The C U weight vectors stay in registers while each row's C accumulators are loaded, updated U
// times and stored; each x[m, k + u] is broadcast once for the C columns.
template <int M, int U, int C, bool P>
inline void sweep_column(const float* __restrict x, int64_t ldx, const float* __restrict w0, int64_t ldw, int64_t k,
                         float* __restrict y, int64_t ldy, int64_t n, simd::vmask tail) {
  simd::vf wv[C][U];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) wv[c][u] = simd::load_part<P>(tail, w0 + u * ldw + n + c * kLanes);
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    simd::vf acc[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] = simd::load_part<P>(tail, y + m * ldy + n + c * kLanes);
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const simd::vf b = simd::set1(x[m * ldx + k + u]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[c] = simd::fmadd(b, wv[c][u], acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) simd::store_part<P>(tail, y + m * ldy + n + c * kLanes, acc[c]);
  }
}

// U weight rows from k over columns [n0, n1): C whole columns at a time, then single ones, then the partial last
template <int M, int U, int C>
inline void sweep_rows_k(const float* __restrict x, int64_t ldx, const float* __restrict w0, int64_t ldw, int64_t k,
                         float* __restrict y, int64_t ldy, int64_t n0, int64_t full, int64_t n1, simd::vmask tail) {
  int64_t n = n0;
  if constexpr (C > 1) {
    for (; n + C * kLanes <= full; n += C * kLanes) sweep_column<M, U, C, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
  }
  for (; n < full; n += kLanes) sweep_column<M, U, 1, false>(x, ldx, w0, ldw, k, y, ldy, n, tail);
  if (full < n1) sweep_column<M, U, 1, true>(x, ldx, w0, ldw, k, y, ldy, full, tail);
}

template <int M, int U, int C = 1>
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
  for (; k + U <= K; k += U) sweep_rows_k<M, U, C>(x, ldx, wt + k * ldw, ldw, k, y, ldy, n0, full, n1, tail);
  for (; k < K; ++k) sweep_rows_k<M, 1, 1>(x, ldx, wt + k * ldw, ldw, k, y, ldy, n0, full, n1, tail);  // K's rest
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
  constexpr int C = M == 1 ? 1 : kWideC;
  if (!(kPadAliasedRows && M >= 4 && ldy % 256 == 0)) {
    sweep_u<M, U, C>(x, ldx, wt, ldw, K, bias, y, ldy, n0, n1);
    return;
  }
  thread_local std::vector<float> scratch;
  const int64_t width = n1 - n0, lds = (width + 15) / 16 * 16 + 16;  // rows 64 B off the 1 KB grid
  if (static_cast<int64_t>(scratch.size()) < M * lds) scratch.resize(M * lds);
  sweep_u<M, U, C>(x, ldx, wt, ldw, K, bias ? bias + n0 : nullptr, scratch.data(), lds, 0, width);
  for (int m = 0; m < M; ++m) std::copy_n(scratch.data() + m * lds, width, y + m * ldy + n0);
}

using SweepFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t,
                         int64_t, int64_t);
constexpr SweepFn kSweeps[] = {sweep<1>,  sweep<2>,  sweep<3>,  sweep<4>,  sweep<5>,  sweep<6>,  sweep<7>,  sweep<8>,
                                sweep<9>,  sweep<10>, sweep<11>, sweep<12>, sweep<13>, sweep<14>, sweep<15>, sweep<16>};

}  // namespace expertspec
