// Small-M fp32 linear for CPU decode and verification: y[M, N] = x[M, K] @ wt[K, N] (+ bias), M <= 16.
//
// wt is the weight stored input-major ([in, out] rows contiguous: engine.models.layout). Its rows are swept in
// memory order (kernels/sweep.h), once for all <= 16 rows, so the weight streams close to the read bandwidth;
// y[m, n] starts at bias[n] (or 0) and accumulates x[m, k] * wt[k, n] over k in order with one FMA each, so a
// row's result has the same bits whatever M is (batch-invariant). AVX-512F or AVX2 + FMA (kernels/simd.h).
#include <torch/extension.h>

#include "decode_ops.h"

namespace {

using expertspec::kMaxBlock;
using expertspec::kStrip;

// the optional bias [N] (fp32, contiguous) of both entry points, or nullptr
const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
              "bias [N] fp32 contiguous");
  return bias->data_ptr<float>();
}

}  // namespace

torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& wt, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && x.size(1) == wt.size(0), "x [M, K] and wt [K, N] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && wt.stride(1) == 1, "x and wt rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxBlock, "1 <= M <= 16 rows");
  const float* b = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  expertspec::decode::linear_rows(x.data_ptr<float>(), M, K, x.stride(0), nullptr, wt.data_ptr<float>(), wt.stride(0),
                                  N, b, y.data_ptr<float>());
  return y;
}

// The same product from the strip-packed weight P [ceil(N / S), K, S] (sweep.h, kernels/small_m.pack): same bits,
// for up to 64 rows (blocks of 16: a row's bits never depend on M).
constexpr int64_t kMaxPackedRows = 64;
torch::Tensor small_m_linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                    const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && x.size(1) == packed.size(1), "x [M, K] and packed [S', K, S]");
  TORCH_CHECK(packed.size(2) == kStrip && packed.size(0) == (N + kStrip - 1) / kStrip && packed.is_contiguous(),
              "packed [ceil(N / S), K, S] contiguous, S = ", kStrip);
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxPackedRows, "1 <= M <= 64 rows");
  const float* b = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  expertspec::decode::linear_rows(x.data_ptr<float>(), M, K, x.stride(0), packed.data_ptr<float>(), nullptr, 0, N,
                                  b, y.data_ptr<float>());
  return y;
}

int64_t strip_width() { return kStrip; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear, "y[M, N] = x[M, K] @ wt[K, N] (+ bias), 1 <= M <= 16, fp32");
  m.def("small_m_linear_packed", &small_m_linear_packed, "the same from the packed weight [ceil(N/S), K, S], M <= 64");
  m.def("strip_width", &strip_width, "S, the columns of one strip of a packed weight");
}
