// A frozen policy's Linear (Tanh Linear)* actor on CPU: observation values -> one argmax per action dimension.
//
// What engine.runtime.frozen's numpy twin computes, in one call and float64: each value is rounded to float32 and
// clipped to [0, 1] (observation_vector's last step, idempotent on a vector that already had it), clipped to the
// folded normalisation's [lo, hi], then x <- tanh(W x + b) per hidden layer and logits = W_out x + b_out over the
// padded output [D * width] (padding at -inf), argmax (first maximum, NaN wins, as numpy's) in each dimension's
// row of `width`. Plain C++ (no CPU-specific flags): between two engine rounds the numpy twin's dozen calls cost
// ~80 us with cold caches, this one call a few.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

struct Layer {
  std::vector<double> wt;  // [in, out]: the weight transposed, so a layer is `in` independent axpy sweeps
  std::vector<double> b;  // [out]
  int64_t out, in;
};

inline double clip(double x, double lo, double hi) {  // numpy's minimum(maximum(x, lo), hi): NaN stays NaN
  if (x != x) return x;
  return x < lo ? lo : (x > hi ? hi : x);
}

class TanhMLP {
 public:
  TanhMLP(std::vector<double> lo, std::vector<double> hi, std::vector<std::vector<double>> weights,
          std::vector<std::vector<double>> biases, int64_t dims)
      : lo_(std::move(lo)), hi_(std::move(hi)), dims_(dims) {
    if (weights.empty() || weights.size() != biases.size())
      throw std::invalid_argument("TanhMLP: needs one bias per weight matrix and at least the output layer");
    int64_t in = static_cast<int64_t>(lo_.size());
    if (in == 0 || hi_.size() != lo_.size()) throw std::invalid_argument("TanhMLP: lo and hi differ in length");
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t out = static_cast<int64_t>(biases[i].size());
      if (out == 0 || static_cast<int64_t>(weights[i].size()) != out * in)
        throw std::invalid_argument("TanhMLP: layer " + std::to_string(i) + " is not [" + std::to_string(out) +
                                    ", " + std::to_string(in) + "]");
      std::vector<double> wt(out * in);
      for (int64_t j = 0; j < out; ++j)
        for (int64_t k = 0; k < in; ++k) wt[k * out + j] = weights[i][j * in + k];
      layers_.push_back({std::move(wt), std::move(biases[i]), out, in});
      in = out;
    }
    if (dims_ <= 0 || in % dims_ != 0)
      throw std::invalid_argument("TanhMLP: the output layer's rows are not dims * width");
    width_ = in / dims_;
  }

  // Padded logits [D * width] of `values` [in].
  std::vector<double> logits(const std::vector<double>& values) const {
    const size_t n = lo_.size();
    if (values.size() != n)
      throw std::invalid_argument("TanhMLP: " + std::to_string(values.size()) + " observation values, expected " +
                                  std::to_string(n));
    std::vector<double> x(n), y;
    for (size_t k = 0; k < n; ++k) {
      const double v = clip(static_cast<double>(static_cast<float>(values[k])), 0.0, 1.0);  // float32 vector
      x[k] = clip(v, lo_[k], hi_[k]);
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      y.assign(L.out, 0.0);  // y[j] = sum_k w[j, k] x[k] over k in order (a dot product's order), vectorised over j
      for (int64_t k = 0; k < L.in; ++k) {
        const double* w = L.wt.data() + k * L.out;
        const double xk = x[k];
        for (int64_t j = 0; j < L.out; ++j) y[j] += w[j] * xk;
      }
      const bool last = l + 1 == layers_.size();
      for (int64_t j = 0; j < L.out; ++j) y[j] = last ? y[j] + L.b[j] : std::tanh(y[j] + L.b[j]);
      x.swap(y);
    }
    return x;
  }

  // Action indices, one per dimension.
  py::tuple act(const std::vector<double>& values) const {
    const std::vector<double> z = logits(values);
    py::tuple idx(dims_);
    for (int64_t d = 0; d < dims_; ++d) {
      const double* r = z.data() + d * width_;
      int64_t best = 0;
      for (int64_t i = 1; i < width_; ++i)
        if (r[best] == r[best] && (r[i] > r[best] || r[i] != r[i])) best = i;
      idx[d] = py::int_(best);
    }
    return idx;
  }

 private:
  std::vector<double> lo_, hi_;
  std::vector<Layer> layers_;
  int64_t dims_, width_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<TanhMLP>(m, "TanhMLP")
      .def(py::init<std::vector<double>, std::vector<double>, std::vector<std::vector<double>>,
                    std::vector<std::vector<double>>, int64_t>(),
           py::arg("lo"), py::arg("hi"), py::arg("weights"), py::arg("biases"), py::arg("dims"))
      .def("logits", &TanhMLP::logits, "padded logits [D * width] of the observation values")
      .def("act", &TanhMLP::act, "observation values [in] -> (index per action dimension)");
}
