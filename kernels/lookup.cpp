// Prompt lookup on CPU in one call: the suffix match of engine.drafting.suffix.suffix_match, the match's source of
// engine.drafting.suffix.match_source, and the probe of engine.drafting.ngram.NGramDrafter.probe (the match, this
// round's draft confidence per depth and the match's source).
//
// Both are reference twins of the Python code (same continuations, n-gram length, followers in the same order, and
// the same float32-rounded confidences bit for bit: tests/kernels/test_lookup.py). Why in C++: a lookup round is a
// fraction of a millisecond on a CPU, and a learned policy that observes `confidence_now` pays the probe before
// every round, also in the rounds it then drafts nothing (README, issue 10): in Python the probe took ~26 us in
// place after a forward, most of it interpreter work on cold caches. Plain CPython (METH_FASTCALL), no pybind11 and
// no torch headers: it builds in about a second.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Ref {  // owns one reference
  PyObject* p;
  explicit Ref(PyObject* q) : p(q) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

struct Found {  // one chosen continuation: tokens[start : start + len]
  long long first;
  Py_ssize_t start, len;
};

struct Match {
  std::vector<Found> best;  // in the order their first tokens were met (Python's dict order)
  std::vector<long long> follower;  // tokens that followed the matched n-gram, in the order they were met
  std::vector<long long> count;  // how often each did
  int ngram = 0;
  Py_ssize_t recent_end = -1;  // the end of the most recent earlier occurrence of the matched n-gram (-1: none)
};

bool read_tokens(PyObject* obj, std::vector<long long>* out) {
  Ref seq(PySequence_Fast(obj, "tokens must be a sequence of ints"));
  if (seq.p == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
  PyObject** items = PySequence_Fast_ITEMS(seq.p);
  out->resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(items[i]);
    if (v == -1 && PyErr_Occurred()) return false;
    (*out)[i] = v;
  }
  return true;
}

// suffix_match's search: the longest suffix (n = max_ngram .. min_ngram) that occurred earlier, its continuations
// (at most `cap` tokens, per first token the longest, most recent on ties, at most `width` first tokens) and its
// followers. Earlier occurrences are those of the last token, latest first.
void search(const std::vector<long long>& t, long long width, long long max_ngram, long long min_ngram,
            long long cap, Match* m) {
  const Py_ssize_t T = static_cast<Py_ssize_t>(t.size());
  const long long last = t[T - 1];
  std::vector<Py_ssize_t> ends;
  for (Py_ssize_t e = T - 2; e >= 0; --e)
    if (t[e] == last) ends.push_back(e);
  for (long long n = std::min<long long>(max_ngram, T - 1); n >= min_ngram; --n) {
    m->best.clear();
    m->follower.clear();
    m->count.clear();
    m->recent_end = -1;
    for (Py_ssize_t e : ends) {
      const Py_ssize_t start = e - n + 1;
      if (start < 0) continue;
      bool same = true;
      for (Py_ssize_t j = 0; j < n - 1 && same; ++j) same = t[start + j] == t[T - n + j];  // t[e] == last already
      if (!same) continue;
      if (m->recent_end < 0) m->recent_end = e;  // ends are latest first
      const Py_ssize_t from = start + n;
      const Py_ssize_t len = std::min<Py_ssize_t>(static_cast<Py_ssize_t>(cap), T - from);
      const long long first = t[from];
      const auto f = std::find(m->follower.begin(), m->follower.end(), first);
      if (f == m->follower.end()) {
        m->follower.push_back(first);
        m->count.push_back(1);
      } else {
        ++m->count[f - m->follower.begin()];
      }
      auto b = std::find_if(m->best.begin(), m->best.end(), [first](const Found& x) { return x.first == first; });
      if (b != m->best.end()) {
        if (len > b->len) *b = Found{first, from, len};
      } else if (static_cast<long long>(m->best.size()) != width) {  // Python's `len(best) == width: continue`
        m->best.push_back(Found{first, from, len});
      }
    }
    if (!m->best.empty()) {
      m->ngram = static_cast<int>(n);
      return;
    }
  }
  m->best.clear();
  m->follower.clear();
  m->count.clear();
  m->ngram = 0;
  m->recent_end = -1;
}

// match_source's (recency, in_output) of a search's match: 1 - min(log2(d + 1), 8) / 8 for the d tokens between the
// end of its most recent earlier occurrence and the end of `tokens`, and whether its continuation starts past the
// first `prompt_len` tokens; (0, 0) without a match. Python's arithmetic (its math.log2 is libm's log2).
void source(const Match& m, Py_ssize_t T, long long prompt_len, double* recency, double* in_output) {
  if (m.ngram == 0 || m.recent_end < 0) {
    *recency = *in_output = 0.0;
    return;
  }
  const double d = static_cast<double>(T - 1 - m.recent_end);
  *recency = 1.0 - std::min(std::log2(d + 1.0), 8.0) / 8.0;
  *in_output = m.recent_end + 1 >= prompt_len ? 1.0 : 0.0;
}

// (continuations cut to `depth`, ngram, followers {token: count}) as Python objects
PyObject* as_python(const std::vector<long long>& t, const Match& m, long long depth) {
  Ref conts(PyList_New(static_cast<Py_ssize_t>(m.best.size())));
  Ref followers(PyDict_New());
  if (conts.p == nullptr || followers.p == nullptr) return nullptr;
  for (size_t i = 0; i < m.best.size(); ++i) {
    const Found& f = m.best[i];
    const Py_ssize_t len = std::min<Py_ssize_t>(f.len, static_cast<Py_ssize_t>(depth));
    PyObject* c = PyList_New(len);
    if (c == nullptr) return nullptr;
    PyList_SET_ITEM(conts.p, i, c);
    for (Py_ssize_t j = 0; j < len; ++j) {
      PyObject* v = PyLong_FromLongLong(t[f.start + j]);
      if (v == nullptr) return nullptr;
      PyList_SET_ITEM(c, j, v);
    }
  }
  for (size_t i = 0; i < m.follower.size(); ++i) {
    Ref k(PyLong_FromLongLong(m.follower[i]));
    Ref v(PyLong_FromLongLong(m.count[i]));
    if (k.p == nullptr || v.p == nullptr || PyDict_SetItem(followers.p, k.p, v.p) < 0) return nullptr;
  }
  return Py_BuildValue("(OiO)", conts.p, m.ngram, followers.p);
}

bool int_args(const char* name, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, long long* out) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
    return false;
  }
  for (Py_ssize_t j = 1; j < want; ++j) {
    out[j - 1] = PyLong_AsLongLong(args[j]);
    if (out[j - 1] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// match(tokens, depth, width, max_ngram, min_ngram, cap) -> (continuations, ngram, followers)
PyObject* raw_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[5];  // depth, width, max_ngram, min_ngram, cap
  std::vector<long long> t;
  if (!int_args("match", args, nargs, 6, a) || !read_tokens(args[0], &t)) return nullptr;
  Match m;
  if (a[0] > 0 && t.size() >= 2) search(t, a[1], a[2], a[3], a[4], &m);
  return as_python(t, m, a[0]);
}

// source(tokens, prompt_len, max_ngram, min_ngram) -> (recency, in_output): engine.drafting.suffix.match_source
PyObject* raw_source(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[3];  // prompt_len, max_ngram, min_ngram
  std::vector<long long> t;
  if (!int_args("source", args, nargs, 4, a) || !read_tokens(args[0], &t)) return nullptr;
  Match m;
  if (t.size() >= 2) search(t, 1, a[1], a[2], 1, &m);
  double rec, out;
  source(m, static_cast<Py_ssize_t>(t.size()), a[0], &rec, &out);
  return Py_BuildValue("(dd)", rec, out);
}

// probe(tokens, depth, width, max_ngram, min_ngram, cap, node_budget, prompt_len) -> (confidence per depth,
// continuations, ngram, followers, recency, in_output): NGramDrafter.probe's confidence — per depth the best
// conditional score of the nodes the node budget keeps, each continuation's first tokens in order — rounded to
// float32, and the match's source (`source`; (0, 0) when depth <= 0, as no match is searched then).
PyObject* raw_probe(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[7];  // depth, width, max_ngram, min_ngram, cap, node_budget, prompt_len
  std::vector<long long> t;
  if (!int_args("probe", args, nargs, 8, a) || !read_tokens(args[0], &t)) return nullptr;
  Match m;
  if (a[0] > 0 && t.size() >= 2) search(t, a[1], a[2], a[3], a[4], &m);
  long long total = 0;
  for (long long c : m.count) total += c;
  std::vector<double> best;
  long long left = a[5];
  for (const Found& f : m.best) {
    const long long len = std::min<long long>(f.len, a[0]);
    const long long k = std::min(len, left);
    if (k <= 0) break;
    left -= k;
    const long long cnt = m.count[std::find(m.follower.begin(), m.follower.end(), f.first) - m.follower.begin()];
    for (long long d = 0; d < k; ++d) {
      const double c = d == 0 ? static_cast<double>(m.ngram) / static_cast<double>(a[2]) * static_cast<double>(cnt) /
                                    static_cast<double>(total)
                              : static_cast<double>(std::min<long long>(a[2], m.ngram + d)) / static_cast<double>(a[2]);
      if (d < static_cast<long long>(best.size())) {
        if (c > best[d]) best[d] = c;
      } else {
        best.push_back(c);
      }
    }
  }
  Ref conf(PyList_New(static_cast<Py_ssize_t>(best.size())));
  if (conf.p == nullptr) return nullptr;
  for (size_t d = 0; d < best.size(); ++d) {
    PyObject* v = PyFloat_FromDouble(static_cast<double>(static_cast<float>(best[d])));
    if (v == nullptr) return nullptr;
    PyList_SET_ITEM(conf.p, d, v);
  }
  Ref rest(as_python(t, m, a[0]));
  if (rest.p == nullptr) return nullptr;
  double rec, out;
  source(m, static_cast<Py_ssize_t>(t.size()), a[6], &rec, &out);
  return Py_BuildValue("(OOOOdd)", conf.p, PyTuple_GET_ITEM(rest.p, 0), PyTuple_GET_ITEM(rest.p, 1),
                       PyTuple_GET_ITEM(rest.p, 2), rec, out);
}

PyMethodDef kMethods[] = {
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_match)), METH_FASTCALL,
     "match(tokens, depth, width, max_ngram, min_ngram, cap) -> (continuations, ngram, followers)"},
    {"probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_probe)), METH_FASTCALL,
     "probe(tokens, depth, width, max_ngram, min_ngram, cap, node_budget, prompt_len) -> (confidence, continuations, "
     "ngram, followers, recency, in_output)"},
    {"source", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(raw_source)), METH_FASTCALL,
     "source(tokens, prompt_len, max_ngram, min_ngram) -> (recency, in_output)"},
    {nullptr, nullptr, 0, nullptr}};

#define EXPERTSPEC_STR_(x) #x
#define EXPERTSPEC_STR(x) EXPERTSPEC_STR_(x)
#define EXPERTSPEC_CAT_(a, b) a##b
#define EXPERTSPEC_CAT(a, b) EXPERTSPEC_CAT_(a, b)

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, EXPERTSPEC_STR(TORCH_EXTENSION_NAME), "prompt lookup in C++", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC EXPERTSPEC_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
