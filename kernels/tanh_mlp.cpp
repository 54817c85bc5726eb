// A frozen policy's choice between two engine rounds on CPU, in one call: observation values -> one argmax per
// action dimension of its Linear (Tanh Linear)* actor, and optionally the values themselves read straight from the
// request's History.
//
// The actor computes in float32, as the TorchScript actor it was frozen from: each value is rounded to float32 and
// clipped to [0, 1] (observation_vector's last step, idempotent on a vector that already had it), clipped to the
// folded normalisation's [lo, hi], then x <- tanh(W x + b) per hidden layer and logits = W_out x + b_out over the
// padded output [D * width] (padding at -inf), argmax (first maximum, NaN wins, as numpy's) in each dimension's
// row of `width`. The weights are stored float32 (the folded first layer rounded once), each output summed over its
// inputs in order, tanh a rational approximation within 4e-7 of the exact one (Eigen's float tanh): the logits are
// within ~1e-5 of engine.runtime.frozen's float64 numpy twin, and the decisions the same wherever the two largest
// logits of a dimension are further apart than that (tested).
//
// `choose` also computes the values: engine.runtime.observation.observation_values (the reference twin, equal bit
// for bit: tested) over the History's attributes and its last RoundStats, the calibrated block from the isotonic
// knots the policy was frozen with (engine.spec.calibration.interp's arithmetic).
//
// Why one call, why float32, and why the raw CPython calling convention for the hot entry points (`act`, `choose`,
// `values`, METH_FASTCALL on a capsule) rather than pybind11's dispatcher: after a model forward every first call
// starts with cold caches, and measured in place (engine.bench policy, README) a pybind11 call that does nothing
// costs ~12 us there against ~6 us for a raw one; the observation values in Python ~30 us; the float64 actor with
// libm's tanh ~15 us, of which its 76 KB of weights and 128 tanh calls most. Plain C++ (no CPU-specific flags: the
// compiler vectorises the blocked sums and the tanh with SSE2, and with GCC on x86-64 the layers get an AVX2 clone
// chosen at load time; no FP contraction: the calibration's interpolation must round as Python's does, and the
// clone's logits equal SSE2's bit for bit; -fno-trapping-math lets the tanh's clamp vectorise, no FP exception
// flag is ever read). Session 2026-12-06 j: blocks of up to 64 outputs (the adds' latency hidden), the vectorised
// tanh and the AVX2 clone took the actor from ~1.45 to ~0.8 us hot (engine.bench policy's `native_choose`).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr const char* kCapsule = "expertspec.tanh_mlp.TanhMLP";
constexpr int kMaxIn = 256;  // observation values the stack buffers hold (OBS_DIM is 48)
constexpr int kMaxWidth = 1024;  // widest layer the stack buffers hold (a multiple of 16: the padded layers')

struct Layer {
  std::vector<float> wt;  // [in, stride]: the weight transposed, its outputs zero-padded to `stride` (a multiple of 16)
  std::vector<float> b;  // [stride], the padding 0
  int64_t out, in, stride;
};

// tanh in float32 within 4e-7 of the exact value (Eigen's generic_fast_tanh_float: a 13/6 odd/even rational
// function on [-7.905, 7.905], +-1 outside it; NaN stays NaN). No libm call, so a layer's loop vectorises.
inline float fast_tanh(float x) {
  constexpr float c = 7.90531110763549805f;
  x = x < -c ? -c : (x > c ? c : x);  // NaN compares false both times: stays NaN
  const float x2 = x * x;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return x * p / q;
}

// dst[j] = b[j] + sum_k wt[k, j] x[k] for j0 <= j < j0 + B, k in order, the B sums held in registers.
template <int B>
inline void dense_block(const Layer& L, const float* __restrict x, float* __restrict dst, int64_t j0) {
  float acc[B];
  for (int j = 0; j < B; ++j) acc[j] = 0.0f;
  for (int64_t k = 0; k < L.in; ++k) {
    const float* __restrict w = L.wt.data() + k * L.stride + j0;
    const float xk = x[k];
    for (int j = 0; j < B; ++j) acc[j] += w[j] * xk;
  }
  for (int j = 0; j < B; ++j) dst[j0 + j] = acc[j] + L.b[j0 + j];
}

// dst[j] for every j < stride, in blocks of up to 64 outputs: each output's sum is a chain of `in` dependent adds,
// so the more outputs a block keeps in flight, the less the adds' latency shows (an output layer of 36 logits is one
// block of 48, not 16 + 16 + 4 latency-bound ones).
inline void dense(const Layer& L, const float* __restrict x, float* __restrict dst) {
  int64_t j0 = 0;
  for (; L.stride - j0 >= 64; j0 += 64) dense_block<64>(L, x, dst, j0);
  switch (L.stride - j0) {
    case 48: dense_block<48>(L, x, dst, j0); break;
    case 32: dense_block<32>(L, x, dst, j0); break;
    case 16: dense_block<16>(L, x, dst, j0); break;
    default: break;
  }
}

// Where GCC builds function clones for x86-64 (chosen once at load time by the CPU, through glibc's ifunc), the
// actor's layers run with AVX2's 8-wide vectors on a CPU that has them, SSE2's 4-wide ones elsewhere: the same float32
// operations in the same order (no FP contraction), so the same logits bit for bit.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define EXPERTSPEC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EXPERTSPEC_CLONES
#endif

// The padded logits [layers.back().out] into z of the clipped input x [in] (x and y: buffers of kMaxWidth floats).
EXPERTSPEC_CLONES void forward(const std::vector<Layer>& layers, float* x, float* y, double* z) {
  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer& L = layers[l];
    dense(L, x, y);
    if (l + 1 == layers.size()) {
      for (int64_t i = 0; i < L.out; ++i) z[i] = static_cast<double>(y[i]);
    } else {
      for (int64_t i = 0; i < L.out; ++i) y[i] = fast_tanh(y[i]);
      std::swap(x, y);
    }
  }
}

inline double clip(double x, double lo, double hi) {  // numpy's minimum(maximum(x, lo), hi): NaN stays NaN
  if (x != x) return x;
  return x < lo ? lo : (x > hi ? hi : x);
}

// engine.spec.calibration.interp (np.interp for one float), same operations in the same order.
double interp(double x, const std::vector<double>& xp, const std::vector<double>& fp) {
  if (xp.size() == 1) return fp[0];
  if (x != x) return x;
  const int64_t j = static_cast<int64_t>(std::upper_bound(xp.begin(), xp.end(), x) - xp.begin()) - 1;  // bisect_right
  if (j < 0) return fp[0];
  if (j >= static_cast<int64_t>(xp.size()) - 1 || xp[j] == x) return fp[j];
  const double slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j]);
  double y = slope * (x - xp[j]) + fp[j];
  if (y != y) {
    y = slope * (x - xp[j + 1]) + fp[j + 1];
    if (y != y && fp[j] == fp[j + 1]) y = fp[j];
  }
  return y;
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
    if (in > kMaxIn) throw std::invalid_argument("TanhMLP: more than " + std::to_string(kMaxIn) + " inputs");
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t out = static_cast<int64_t>(biases[i].size());
      if (out == 0 || static_cast<int64_t>(weights[i].size()) != out * in)
        throw std::invalid_argument("TanhMLP: layer " + std::to_string(i) + " is not [" + std::to_string(out) +
                                    ", " + std::to_string(in) + "]");
      if (out > kMaxWidth)
        throw std::invalid_argument("TanhMLP: layer " + std::to_string(i) + " is wider than " +
                                    std::to_string(kMaxWidth));
      const int64_t stride = (out + 15) / 16 * 16;  // at most kMaxWidth, itself a multiple of 16
      std::vector<float> wt(stride * in, 0.0f), b(stride, 0.0f);
      for (int64_t j = 0; j < out; ++j) {
        b[j] = static_cast<float>(biases[i][j]);  // -inf padding stays -inf
        for (int64_t k = 0; k < in; ++k) wt[k * stride + j] = static_cast<float>(weights[i][j * in + k]);
      }
      layers_.push_back({std::move(wt), std::move(b), out, in, stride});
      in = out;
    }
    if (dims_ <= 0 || in % dims_ != 0)
      throw std::invalid_argument("TanhMLP: the output layer's rows are not dims * width");
    width_ = in / dims_;
  }

  // The observation layout `choose` writes (observation_values'): kmax draft depths, and the isotonic knots per
  // depth of the policy's calibration (none: the raw confidences fill the calibrated block).
  void set_observation(int64_t kmax, std::vector<std::vector<double>> knots_x,
                       std::vector<std::vector<double>> knots_y) {
    if (kmax <= 0 || 4 * kmax + 16 != static_cast<int64_t>(lo_.size()))
      throw std::invalid_argument("TanhMLP: " + std::to_string(lo_.size()) + " inputs is not the observation "
                                  "layout of kmax " + std::to_string(kmax) + " (4 kmax + 16 values)");
    if (knots_x.size() != knots_y.size()) throw std::invalid_argument("TanhMLP: knots_x and knots_y differ");
    for (size_t d = 0; d < knots_x.size(); ++d)
      if (knots_x[d].size() != knots_y[d].size())
        throw std::invalid_argument("TanhMLP: depth " + std::to_string(d + 1) + "'s knots differ in length");
    kmax_ = kmax;
    knots_x_ = std::move(knots_x);
    knots_y_ = std::move(knots_y);
  }

  int64_t inputs() const { return static_cast<int64_t>(lo_.size()); }
  int64_t kmax() const { return kmax_; }

  double calibrate(double c, int64_t depth) const {  // IsotonicCalibration.__call__
    const int64_t n = static_cast<int64_t>(knots_x_.size());
    const int64_t d = std::min(std::max(depth, int64_t{1}), n) - 1;
    const std::vector<double>& xs = knots_x_[d];
    return xs.empty() ? c : interp(c, xs, knots_y_[d]);
  }
  bool calibrated() const { return !knots_x_.empty(); }

  // Padded logits [D * width] of `values` [in] into `z` [kMaxWidth].
  void logits_into(const double* values, double* z) const {
    alignas(64) float buf[2][kMaxWidth > kMaxIn ? kMaxWidth : kMaxIn];
    const size_t n = lo_.size();
    float* x = buf[0];
    float* y = buf[1];
    for (size_t k = 0; k < n; ++k) {
      const double v = clip(static_cast<double>(static_cast<float>(values[k])), 0.0, 1.0);  // float32 vector
      x[k] = static_cast<float>(clip(v, lo_[k], hi_[k]));
    }
    forward(layers_, x, y, z);
  }

  int64_t num_logits() const { return dims_ * width_; }

  // The action table `choose_action` answers from: the real size of each action dimension (`nvec`, each at most
  // the padded width) and `make(indices) -> action`, called once per action the first time it is chosen (its result
  // kept here). Row-major over nvec: the flat index of (i_0, ..., i_{D-1}) is sum_d i_d * prod_{e > d} nvec_e.
  void set_actions(std::vector<int64_t> nvec, py::object make) {
    if (static_cast<int64_t>(nvec.size()) != dims_)
      throw std::invalid_argument("TanhMLP: nvec has " + std::to_string(nvec.size()) + " dimensions, the actor " +
                                  std::to_string(dims_));
    int64_t total = 1;
    for (int64_t n : nvec) {
      if (n <= 0 || n > width_)
        throw std::invalid_argument("TanhMLP: an action dimension of size " + std::to_string(n) +
                                    " (the padded width is " + std::to_string(width_) + ")");
      total *= n;
    }
    if (!PyCallable_Check(make.ptr())) throw std::invalid_argument("TanhMLP: set_actions needs a callable `make`");
    nvec_ = std::move(nvec);
    make_ = std::move(make);
    actions_.assign(total, py::object());
  }

  // The action of (index per dimension) from the table, built by `make` on its first use: a new reference, or
  // nullptr with a Python error set.
  PyObject* action(const int64_t* idx) {
    if (!make_) {
      PyErr_SetString(PyExc_RuntimeError, "TanhMLP: set_actions() was not called");
      return nullptr;
    }
    int64_t flat = 0;
    for (int64_t d = 0; d < dims_; ++d) {
      if (idx[d] >= nvec_[d]) {  // only a NaN logit in the padding can pick it
        PyErr_Format(PyExc_ValueError, "TanhMLP: action index %lld of dimension %lld is past its %lld actions "
                     "(NaN logits)", static_cast<long long>(idx[d]), static_cast<long long>(d),
                     static_cast<long long>(nvec_[d]));
        return nullptr;
      }
      flat = flat * nvec_[d] + idx[d];
    }
    py::object& slot = actions_[flat];
    if (!slot) {
      PyObject* t = index_tuple(idx);
      if (t == nullptr) return nullptr;
      PyObject* made = PyObject_CallOneArg(make_.ptr(), t);
      Py_DECREF(t);
      if (made == nullptr) return nullptr;
      slot = py::reinterpret_steal<py::object>(made);
    }
    return py::object(slot).release().ptr();
  }

  // The argmax of each action dimension's row of the padded logits of `values` into idx [dims].
  void argmax(const double* values, int64_t* idx) const {
    double z[kMaxWidth];
    logits_into(values, z);
    for (int64_t d = 0; d < dims_; ++d) {
      const double* r = z + d * width_;
      int64_t best = 0;
      for (int64_t i = 1; i < width_; ++i)
        if (r[best] == r[best] && (r[i] > r[best] || r[i] != r[i])) best = i;
      idx[d] = best;
    }
  }

  // (idx[0], ..., idx[dims - 1]) as a new tuple, or nullptr with a Python error set.
  PyObject* index_tuple(const int64_t* idx) const {
    PyObject* t = PyTuple_New(dims_);
    if (t == nullptr) return nullptr;
    for (int64_t d = 0; d < dims_; ++d) {
      PyObject* b = PyLong_FromLongLong(idx[d]);
      if (b == nullptr) {
        Py_DECREF(t);
        return nullptr;
      }
      PyTuple_SET_ITEM(t, d, b);
    }
    return t;
  }

  // (index per action dimension) as a new tuple, or nullptr with a Python error set.
  PyObject* act_tuple(const double* values) const {
    int64_t idx[kMaxWidth];
    argmax(values, idx);
    return index_tuple(idx);
  }

  // Plain decoding's action indices [dims], answered without the observation or the actor when the probe proposes
  // nothing (`unproposed`): a policy observing its drafter's own probe, which then has nothing to draft. Empty: off.
  void set_plain(std::vector<int64_t> idx) {
    if (!idx.empty() && static_cast<int64_t>(idx.size()) != dims_)
      throw std::invalid_argument("TanhMLP: set_plain needs one index per action dimension (" +
                                  std::to_string(dims_) + ") or none");
    for (int64_t i : idx)
      if (i < 0 || i >= width_) throw std::invalid_argument("TanhMLP: set_plain index out of range");
    plain_ = std::move(idx);
  }
  const int64_t* plain() const { return plain_.empty() ? nullptr : plain_.data(); }

 private:
  std::vector<double> lo_, hi_;
  std::vector<Layer> layers_;
  int64_t dims_, width_ = 0, kmax_ = 0;
  std::vector<std::vector<double>> knots_x_, knots_y_;
  std::vector<int64_t> plain_;  // set_plain: plain decoding's indices (empty: the actor always answers)
  std::vector<int64_t> nvec_;  // set_actions: the real size of each action dimension
  py::object make_;  // ... its action maker
  std::vector<py::object> actions_;  // ... and the actions made so far, row-major over nvec_ (empty: not yet)
};

// ---------------------------------------------------------------- raw CPython helpers (nullptr / false: error set)

PyObject* s_acc;  // interned attribute names
PyObject* s_last;
PyObject* s_committed_ema;
PyObject* s_utility_ema;
PyObject* s_rounds;
PyObject* s_draft_confidence;
PyObject* s_accepted;
PyObject* s_cost;
PyObject* s_cost_ar;
PyObject* s_round_seconds;
PyObject* s_verified_tokens;
PyObject* s_distinct_experts;
PyObject* s_new_pairs_per_node;
PyObject* s_overlap_prev;
PyObject* s_rank_imbalance_mean;
PyObject* s_cross_node_ratio;
PyObject* s_committed;
PyObject* s_built_depth;
PyObject* s_depth;

struct Ref {  // an owned reference, released on scope exit
  PyObject* p;
  explicit Ref(PyObject* q) : p(q) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// getattr(o, name, None) as a new reference (only a missing attribute becomes None).
PyObject* attr_or_none(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return v;
}

bool as_double(PyObject* o, double* out) {  // float(o)
  const double d = PyFloat_AsDouble(o);
  if (d == -1.0 && PyErr_Occurred()) return false;
  *out = d;
  return true;
}

bool attr_double(PyObject* o, PyObject* name, double* out) {  // float(o.name)
  Ref v(PyObject_GetAttr(o, name));
  return v.p != nullptr && as_double(v.p, out);
}

bool as_int(PyObject* o, long long* out) {  // int(o)
  Ref v(PyNumber_Long(o));
  if (v.p == nullptr) return false;
  *out = PyLong_AsLongLong(v.p);
  return !(*out == -1 && PyErr_Occurred());
}

bool attr_int(PyObject* o, PyObject* name, long long* out) {  // int(o.name)
  Ref v(PyObject_GetAttr(o, name));
  return v.p != nullptr && as_int(v.p, out);
}

// float(v or dflt) for v = getattr(o, name[, None]).
bool attr_or_default(PyObject* o, PyObject* name, bool optional, double dflt, double* out) {
  Ref v(optional ? attr_or_none(o, name) : PyObject_GetAttr(o, name));
  if (v.p == nullptr) return false;
  const int truth = v.p == Py_None ? 0 : PyObject_IsTrue(v.p);
  if (truth < 0) return false;
  if (!truth) {
    *out = dflt;
    return true;
  }
  return as_double(v.p, out);
}

// observation_values(h, position=..., ..., probe=probe) into v [4 kmax + 16]; false with a Python error set.
// `probe`: a sequence of this round's draft confidences per depth, or nullptr / None (not probed).
bool observation_values(const TanhMLP& a, PyObject* h, long long position, long long max_new_tokens,
                        long long batch_size, long long top_k, long long num_moe_layers, PyObject* probe,
                        double* v) {
  const int64_t K = a.kmax();
  if (K <= 0) {
    PyErr_SetString(PyExc_ValueError, "TanhMLP: set_observation() was not called");
    return false;
  }
  int64_t i = 0;
  {  // v = list(h.acc)
    Ref acc(PyObject_GetAttr(h, s_acc));
    if (acc.p == nullptr) return false;
    Ref seq(PySequence_Fast(acc.p, "History.acc is not a sequence"));
    if (seq.p == nullptr) return false;
    if (PySequence_Fast_GET_SIZE(seq.p) != K) {
      PyErr_Format(PyExc_ValueError, "History.acc has %zd depths, the observation %lld",
                   PySequence_Fast_GET_SIZE(seq.p), static_cast<long long>(K));
      return false;
    }
    PyObject** items = PySequence_Fast_ITEMS(seq.p);
    for (int64_t d = 0; d < K; ++d)
      if (!as_double(items[d], &v[i++])) return false;
  }
  double committed_ema, utility_ema;
  if (!attr_double(h, s_committed_ema, &committed_ema) || !attr_double(h, s_utility_ema, &utility_ema)) return false;
  Ref s(PyObject_GetAttr(h, s_last));
  if (s.p == nullptr) return false;
  long long depth = 0;
  if (s.p == Py_None) {
    v[i++] = 0.0;
    v[i++] = committed_ema / static_cast<double>(K + 1);
    for (int64_t d = 0; d < 2 * K; ++d) v[i++] = 0.0;
    const double tail[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.25, utility_ema / 4.0, 0.125};
    for (double t : tail) v[i++] = t;
  } else {
    Ref conf_obj(PyObject_GetAttr(s.p, s_draft_confidence));
    if (conf_obj.p == nullptr) return false;
    Ref conf(PySequence_Fast(conf_obj.p, "RoundStats.draft_confidence is not a sequence"));
    if (conf.p == nullptr) return false;
    const int64_t nc = std::min<int64_t>(PySequence_Fast_GET_SIZE(conf.p), K);
    double raw[kMaxIn];
    PyObject** items = PySequence_Fast_ITEMS(conf.p);
    for (int64_t d = 0; d < nc; ++d)
      if (!as_double(items[d], &raw[d])) return false;
    long long accepted;
    if (!attr_int(s.p, s_accepted, &accepted)) return false;
    v[i++] = static_cast<double>(accepted) / static_cast<double>(K);
    v[i++] = committed_ema / static_cast<double>(K + 1);
    for (int64_t d = 0; d < K; ++d) v[i++] = d < nc ? raw[d] : 0.0;
    for (int64_t d = 0; d < K; ++d) v[i++] = d < nc ? (a.calibrated() ? a.calibrate(raw[d], d + 1) : raw[d]) : 0.0;
    double cost, cost_ar;  // round_cost(s)
    {
      Ref c(attr_or_none(s.p, s_cost));
      if (c.p == nullptr) return false;
      if (c.p == Py_None) {
        if (!attr_double(s.p, s_round_seconds, &cost)) return false;
      } else if (!as_double(c.p, &cost)) {
        return false;
      }
    }
    if (!attr_or_default(s.p, s_cost_ar, true, 0.0, &cost_ar)) return false;
    long long n;
    if (!attr_int(s.p, s_verified_tokens, &n)) return false;
    n = std::max(n, 1LL);
    {  // sum(U) / (len(U) * n * top_k)
      Ref u_obj(PyObject_GetAttr(s.p, s_distinct_experts));
      if (u_obj.p == nullptr) return false;
      Ref u(PySequence_Fast(u_obj.p, "RoundStats.distinct_experts is not a sequence"));
      if (u.p == nullptr) return false;
      const Py_ssize_t L = PySequence_Fast_GET_SIZE(u.p);
      long long total = 0;
      PyObject** ue = PySequence_Fast_ITEMS(u.p);
      for (Py_ssize_t l = 0; l < L; ++l) {  // integers only (the Python twin's exact integer sum)
        Ref idx(PyNumber_Index(ue[l]));
        if (idx.p == nullptr) return false;
        const long long x = PyLong_AsLongLong(idx.p);
        if (x == -1 && PyErr_Occurred()) return false;
        total += x;
      }
      v[i++] = (L && top_k) ? static_cast<double>(total) / static_cast<double>(L * n * top_k) : 0.0;
    }
    double x;
    if (!attr_or_default(s.p, s_new_pairs_per_node, true, 0.0, &x)) return false;
    v[i++] = x / static_cast<double>(std::max(top_k * num_moe_layers, 1LL));
    if (!attr_or_default(s.p, s_overlap_prev, false, 0.0, &x)) return false;
    v[i++] = x;
    if (!attr_or_default(s.p, s_rank_imbalance_mean, false, 1.0, &x)) return false;
    v[i++] = x - 1.0;
    if (!attr_or_default(s.p, s_cross_node_ratio, false, 0.0, &x)) return false;
    v[i++] = x;
    double committed;
    if (!attr_double(s.p, s_committed, &committed)) return false;
    v[i++] = (cost > 0 && cost_ar > 0 ? committed * cost_ar / cost : 1.0) / 4.0;
    v[i++] = utility_ema / 4.0;
    v[i++] = (cost_ar > 0 ? cost / cost_ar : 1.0) / 8.0;
    Ref built(attr_or_none(s.p, s_built_depth));
    if (built.p == nullptr) return false;
    if (built.p == Py_None ? !attr_int(s.p, s_depth, &depth) : !as_int(built.p, &depth)) return false;
  }
  const double p = static_cast<double>(position) / static_cast<double>(std::max(max_new_tokens, 1LL));
  v[i++] = 1.0 < p ? 1.0 : p;
  v[i++] = std::log2(static_cast<double>(std::max(batch_size, 1LL))) / 8.0;
  v[i++] = static_cast<double>(depth) / static_cast<double>(K);
  long long rounds;
  if (!attr_int(h, s_rounds, &rounds)) return false;
  v[i++] = rounds == 0 ? 1.0 : 0.0;
  // confidence_now: the probe's first kmax depths, zero-padded; match_now: its values kmax, kmax + 1 when it has
  // more than kmax (engine.runtime.observation.probe_values), else zeros
  int64_t np_ = 0, n_all = 0;
  PyObject** items = nullptr;
  Ref seq(nullptr);
  if (probe != nullptr && probe != Py_None) {
    seq.p = PySequence_Fast(probe, "probe is not a sequence of floats");
    if (seq.p == nullptr) return false;
    n_all = PySequence_Fast_GET_SIZE(seq.p);
    np_ = std::min<int64_t>(n_all, K);
    items = PySequence_Fast_ITEMS(seq.p);
    for (int64_t d = 0; d < np_; ++d)
      if (!as_double(items[d], &v[i++])) return false;
  }
  for (int64_t d = np_; d < K; ++d) v[i++] = 0.0;
  if (n_all > K) {
    if (n_all < K + 2) {
      PyErr_SetString(PyExc_ValueError, "probe values: kmax confidences then (recency, in_output)");
      return false;
    }
    if (!as_double(items[K], &v[i++]) || !as_double(items[K + 1], &v[i++])) return false;
  } else {
    v[i++] = 0.0;
    v[i++] = 0.0;
  }
  return true;
}

TanhMLP* from_capsule(PyObject* cap) { return static_cast<TanhMLP*>(PyCapsule_GetPointer(cap, kCapsule)); }

bool sequence_values(const TanhMLP& a, PyObject* seq_obj, double* v) {  // a list / tuple / sequence of floats
  Ref seq(PySequence_Fast(seq_obj, "observation values must be a sequence of floats"));
  if (seq.p == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
  if (n != a.inputs()) {
    PyErr_Format(PyExc_ValueError, "TanhMLP: %zd observation values, expected %lld", n,
                 static_cast<long long>(a.inputs()));
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(seq.p);
  for (Py_ssize_t k = 0; k < n; ++k)
    if (!as_double(items[k], &v[k])) return false;
  return true;
}

bool history_args(PyObject* const* args, long long* ctx) {  // position, max_new_tokens, batch_size, top_k, layers
  for (int j = 0; j < 5; ++j) {
    ctx[j] = PyLong_AsLongLong(args[2 + j]);
    if (ctx[j] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// act(actor, values) -> (index per action dimension)
PyObject* raw_act(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "act(actor, values)");
    return nullptr;
  }
  const TanhMLP* a = from_capsule(args[0]);
  double v[kMaxIn];
  if (a == nullptr || !sequence_values(*a, args[1], v)) return nullptr;
  return a->act_tuple(v);
}

// Whether the probe (args[7] of a history call; absent or None: not probed) proposes nothing: its first kmax
// values (its confidences per depth; fewer when the depth was capped) all 0. 1 yes, 0 no, -1 with a Python error set.
int unproposed(const TanhMLP& a, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8 || args[7] == Py_None || a.kmax() <= 0) return 0;
  Ref seq(PySequence_Fast(args[7], "probe is not a sequence of floats"));
  if (seq.p == nullptr) return -1;
  const int64_t n = std::min<int64_t>(PySequence_Fast_GET_SIZE(seq.p), a.kmax());
  PyObject** items = PySequence_Fast_ITEMS(seq.p);
  for (int64_t d = 0; d < n; ++d) {
    double c;
    if (!as_double(items[d], &c)) return -1;
    if (c != 0.0) return 0;
  }
  return 1;
}

// The actor of a (actor, history, position, max_new_tokens, batch_size, top_k, num_moe_layers[, probe]) call named
// `name` and, with `plain` given, where it answers plain decoding without computing (set_plain and an unproposed
// probe) *plain = its indices; nullptr with a Python error set.
TanhMLP* history_actor(const char* name, PyObject* const* args, Py_ssize_t nargs, const int64_t** plain) {
  if (plain != nullptr) *plain = nullptr;
  if (nargs != 7 && nargs != 8) {
    PyErr_Format(PyExc_TypeError,
                 "%s(actor, history, position, max_new_tokens, batch_size, top_k, num_moe_layers[, probe])", name);
    return nullptr;
  }
  TanhMLP* a = from_capsule(args[0]);
  if (a == nullptr || plain == nullptr || a->plain() == nullptr) return a;
  const int skip = unproposed(*a, args, nargs);
  if (skip < 0) return nullptr;
  if (skip) *plain = a->plain();
  return a;
}

// The observation values [in] into v of a history call (`history_actor` checked its arguments and found `a`);
// false with a Python error set.
bool history_values(const TanhMLP& a, PyObject* const* args, Py_ssize_t nargs, double* v) {
  long long c[5];
  return history_args(args, c) &&
         observation_values(a, args[1], c[0], c[1], c[2], c[3], c[4], nargs == 8 ? args[7] : nullptr, v);
}

PyObject* float_list(const double* v, int64_t n) {  // [float(v[k]) for k < n]
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (int64_t k = 0; k < n; ++k) {
    PyObject* f = PyFloat_FromDouble(v[k]);
    if (f == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, k, f);
  }
  return out;
}

// logits(actor, values) -> padded logits [D * width]
PyObject* raw_logits(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "logits(actor, values)");
    return nullptr;
  }
  const TanhMLP* a = from_capsule(args[0]);
  double v[kMaxIn], z[kMaxWidth];
  if (a == nullptr || !sequence_values(*a, args[1], v)) return nullptr;
  a->logits_into(v, z);
  return float_list(z, a->num_logits());
}

// choose(actor, history, position, max_new_tokens, batch_size, top_k, num_moe_layers[, probe]) -> (index per dimension)
// (plain decoding's indices without computing where set_plain applies: `unproposed`)
PyObject* raw_choose(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const int64_t* plain;
  const TanhMLP* a = history_actor("choose", args, nargs, &plain);
  if (a == nullptr || plain != nullptr) return a == nullptr ? nullptr : a->index_tuple(plain);
  double v[kMaxIn];
  return history_values(*a, args, nargs, v) ? a->act_tuple(v) : nullptr;
}

// choose_action(actor, history, position, max_new_tokens, batch_size, top_k, num_moe_layers[, probe]) -> the action
// of the table (set_actions): what a session's round takes, in one call
PyObject* raw_choose_action(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const int64_t* plain;
  TanhMLP* a = history_actor("choose_action", args, nargs, &plain);
  if (a == nullptr || plain != nullptr) return a == nullptr ? nullptr : a->action(plain);
  double v[kMaxIn];
  if (!history_values(*a, args, nargs, v)) return nullptr;
  int64_t idx[kMaxWidth];
  a->argmax(v, idx);
  return a->action(idx);
}

// values(actor, history, position, ...[, probe]) -> [observation values] (the check of `choose`'s first half)
PyObject* raw_values(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const TanhMLP* a = history_actor("values", args, nargs, nullptr);
  double v[kMaxIn];
  return a != nullptr && history_values(*a, args, nargs, v) ? float_list(v, a->inputs()) : nullptr;
}

PyMethodDef kRawMethods[] = {
    {"act", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_act)), METH_FASTCALL,
     "act(actor capsule, values [in]) -> (index per action dimension)"},
    {"logits", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_logits)), METH_FASTCALL,
     "logits(actor capsule, values [in]) -> padded logits [D * width]"},
    {"choose", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_choose)), METH_FASTCALL,
     "choose(actor capsule, history, position, max_new_tokens, batch_size, top_k, num_moe_layers[, probe]) -> indices"},
    {"choose_action", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_choose_action)),
     METH_FASTCALL,
     "choose_action(actor capsule, history, position, ...[, probe]) -> the action of the table (set_actions)"},
    {"values", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_values)), METH_FASTCALL,
     "values(actor capsule, history, position, ...) -> observation values [in] (observation_values' twin)"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* intern(const char* s) {
  PyObject* p = PyUnicode_InternFromString(s);
  if (p == nullptr) throw py::error_already_set();
  return p;  // kept for the process's life
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  s_acc = intern("acc");
  s_last = intern("last");
  s_committed_ema = intern("committed_ema");
  s_utility_ema = intern("utility_ema");
  s_rounds = intern("rounds");
  s_draft_confidence = intern("draft_confidence");
  s_accepted = intern("accepted");
  s_cost = intern("cost");
  s_cost_ar = intern("cost_ar");
  s_round_seconds = intern("round_seconds");
  s_verified_tokens = intern("verified_tokens");
  s_distinct_experts = intern("distinct_experts");
  s_new_pairs_per_node = intern("new_pairs_per_node");
  s_overlap_prev = intern("overlap_prev");
  s_rank_imbalance_mean = intern("rank_imbalance_mean");
  s_cross_node_ratio = intern("cross_node_ratio");
  s_committed = intern("committed");
  s_built_depth = intern("built_depth");
  s_depth = intern("depth");
  py::class_<TanhMLP>(m, "TanhMLP")
      .def(py::init<std::vector<double>, std::vector<double>, std::vector<std::vector<double>>,
                    std::vector<std::vector<double>>, int64_t>(),
           py::arg("lo"), py::arg("hi"), py::arg("weights"), py::arg("biases"), py::arg("dims"))
      .def("set_observation", &TanhMLP::set_observation, py::arg("kmax"), py::arg("knots_x"), py::arg("knots_y"),
           "the observation layout `choose` computes: kmax depths, the calibration's isotonic knots per depth")
      .def("set_plain", &TanhMLP::set_plain, py::arg("indices"),
           "plain decoding's action indices `choose` / `choose_action` answer when the probe proposes nothing "
           "(its first kmax values all 0), without the observation or the actor; [] turns it off")
      .def("set_actions", &TanhMLP::set_actions, py::arg("nvec"), py::arg("make"),
           "the action table `choose_action` answers from: nvec, and make(indices) -> action (called once per action)")
      .def(
          "capsule", [](TanhMLP& self) { return py::reinterpret_steal<py::object>(PyCapsule_New(&self, kCapsule, nullptr)); },
          "a capsule of this actor for the raw entry points (the caller keeps the actor alive)");
  if (PyModule_AddFunctions(m.ptr(), kRawMethods) < 0) throw py::error_already_set();
}
