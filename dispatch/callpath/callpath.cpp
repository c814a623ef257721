// anymla's compiled call path: a repeated call of a known signature, run without Python.
//
// The Python path of a call (validate, select, plan, launch) is made once per call signature and then costs
// the host tens of microseconds a call in Python: the signature's key, the outputs' allocations, the glue of
// the plan and Triton's launcher. What the Triton tier does for a signature is fixed: the buffers it
// allocates (shapes, strides, dtypes), the ATen ops it runs (an MLA layer step's GEMMs), the kernels it
// launches with which grid, and each kernel parameter, which is a constant of the signature or the address of
// one of the call's tensors (an argument, or a tensor an earlier step made) plus a fixed offset.
// `anymla.callpath` watches one Python-path call and hands that description here as ordered steps
// (`register`); later calls of the same key (`call`) run the steps: allocate, call the ops through ATen's
// dispatcher, write the call's addresses into the kept parameter buffers and launch with cuLaunchKernel.
// A backend with its own form of a signature's calls (the FlashMLA peer) gives a callable instead.
//
// A key holds every argument's kind and value as the Python path's decision key does (tensors: dtype,
// device, sizes, strides and whether the address is 16-byte aligned, which Triton specializes on; ints,
// bools and floats by value), so a hit is a call the Python path has validated and planned. The scheduling
// metadata object is not part of the key: a call's object must be unused or bound to the entry's
// configuration (what FlashMLASchedMeta.bind checks), else the call takes the Python path, which raises.
// Kernels whose tensor-memory descriptors encode an input's address (the cache) keep one set of steps a
// cache address ("variants"): a model's layers each pass their own cache with one signature.

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);

// Where a tensor of a call comes from: one of its arguments, a tensor an earlier step made (an allocation or
// an op's result, numbered in the order they were made), or a tensor the entry holds (a layer's weight).
enum class Source : uint8_t { Input = 0, Value = 1, Constant = 2 };

struct Patch {
  uint32_t param;  // the parameter it writes
  Source source;   // Input or Value
  uint32_t index;
  int64_t offset;  // bytes past that tensor's address
};

struct Ref {  // a tensor: its source itself, or a view of the source's storage
  Source source;
  uint32_t index;
  bool whole;
  std::vector<int64_t> sizes, strides;
  int64_t offset;  // storage offset, in elements
};

struct Launch {
  uint64_t function = 0;  // CUfunction
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;
  unsigned shared = 0;
  std::unique_ptr<uint8_t[]> storage;  // every parameter's bytes, 64-byte aligned where a descriptor needs it
  std::vector<void*> params;           // cuLaunchKernel's array: one pointer a parameter, into storage
  std::vector<uint32_t> sizes;         // bytes a parameter
  std::vector<Patch> patches;
};

struct Allocation {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  bool poisoned;  // filled with NaN in poison mode (the buffers anymla.buffers allocates)
};

// A Python object an entry holds (a reference of its own, released with the entry).
struct PyRef {
  PyObject* p = nullptr;
  PyRef() = default;
  explicit PyRef(PyObject* o) : p(o) { Py_XINCREF(p); }
  PyRef(const PyRef& o) : p(o.p) { Py_XINCREF(p); }
  PyRef(PyRef&& o) noexcept : p(o.p) { o.p = nullptr; }
  PyRef& operator=(PyRef o) {
    std::swap(p, o.p);
    return *this;
  }
  ~PyRef() { Py_XDECREF(p); }
};

struct OpArg {
  bool tensor;
  Ref ref;
  c10::IValue value;  // a constant argument of an op
  PyRef object;       // a constant argument of a call
};

enum class Kind : uint8_t { Allocate = 0, Launch = 1, Op = 2, Call = 3 };

struct Step {
  Kind kind;
  Allocation allocation;
  Launch launch;
  std::optional<c10::OperatorHandle> op;  // an ATen op run through the dispatcher (its result is a Value)
  PyRef callable;                         // a Python function a call step calls (its results are Values)
  uint32_t results = 1;                   // Values the step makes
  std::vector<OpArg> args;
};

struct Entry {
  at::Device device{at::kCPU};
  std::vector<at::Tensor> constants;
  std::vector<Ref> outputs;
  long desc_input = -1;                                      // argument whose address descriptors encode
  std::unordered_map<uint64_t, std::vector<Step>> variants;  // that address (0: none) -> the steps
  PyObject* config = nullptr;                                // the metadata's configuration (owned)
  PyObject* keep = nullptr;                                  // what the launches need alive (owned)
  PyObject* callable = nullptr;  // a backend's own form of the calls (owned): run instead of steps
  long long owner = 0;           // who made it (a layer's number; 0: none), for forget()

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    Py_XDECREF(config);
    Py_XDECREF(keep);
    Py_XDECREF(callable);
  }
};

constexpr size_t kTableLimit = 4096;
// Never destroyed: entries hold Python objects, which must not be released after the interpreter is gone.
auto& g_table = *new std::unordered_map<std::string, std::unique_ptr<Entry>>();
PyObject* g_get_device = nullptr;     // torch.cuda.current_device's raw form: () -> int
PyObject* g_get_stream = nullptr;     // (device) -> the current stream's handle
PyObject* g_test_launcher = nullptr;  // stands for the driver in tests (CPU)
PyObject* g_str_initialized = nullptr;
PyObject* g_str_config = nullptr;
LaunchKernel g_launch = nullptr;
uint64_t g_hits = 0;  // calls an entry ran

template <typename T>
void put(std::string& key, T value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The key of `args` (after the op's tag); false when an argument is of a kind no entry is made for.
bool build_key(long op, PyObject* const* args, Py_ssize_t n, std::string& key) {
  put(key, op);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = args[i];
    if (a == Py_None) {
      key.push_back('N');
    } else if (THPVariable_Check(a)) {
      const at::Tensor& t = THPVariable_Unpack(a);
      key.push_back('T');
      put(key, static_cast<int8_t>(t.scalar_type()));
      put(key, static_cast<int8_t>(t.device().type()));
      put(key, static_cast<int8_t>(t.device().index()));
      put(key, static_cast<int8_t>(t.dim()));
      for (int64_t s : t.sizes()) put(key, s);
      for (int64_t s : t.strides()) put(key, s);
      put(key, static_cast<int8_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0));
    } else if (PyBool_Check(a)) {
      key.push_back(a == Py_True ? 'Y' : 'F');
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow) return false;
      key.push_back('I');
      put(key, v);
    } else if (PyFloat_CheckExact(a)) {
      key.push_back('D');
      put(key, PyFloat_AS_DOUBLE(a));
    } else {
      return false;
    }
  }
  return true;
}

uint64_t address(PyObject* a) {
  return reinterpret_cast<uint64_t>(THPVariable_Unpack(a).data_ptr());
}

// Whether a call's scheduling metadata can go with `e` (binding an unused object to e's configuration, as
// FlashMLASchedMeta.bind does on first use).
int metadata_fits(PyObject* sched, const Entry& e) {
  if (sched == Py_None) return 1;
  if (e.config == nullptr) return 0;
  PyObject* used = PyObject_GetAttr(sched, g_str_initialized);
  if (used == nullptr) return -1;
  int is_used = PyObject_IsTrue(used);
  Py_DECREF(used);
  if (is_used < 0) return -1;
  if (!is_used) {
    if (PyObject_SetAttr(sched, g_str_config, e.config) < 0) return -1;
    return PyObject_SetAttr(sched, g_str_initialized, Py_True) < 0 ? -1 : 1;
  }
  PyObject* config = PyObject_GetAttr(sched, g_str_config);
  if (config == nullptr) return -1;
  // Identity is the usual answer (the object was bound to this entry's decision's configuration); a metadata
  // object bound by another decision of an equal configuration compares equal.
  int same = config == e.config ? 1 : PyObject_RichCompareBool(config, e.config, Py_EQ);
  Py_DECREF(config);
  return same;
}

bool launch_one(Launch& l, void* stream) {
  if (g_test_launcher != nullptr) {
    PyObject* params = PyList_New(static_cast<Py_ssize_t>(l.params.size()));
    if (params == nullptr) return false;
    for (size_t i = 0; i < l.params.size(); ++i) {
      PyList_SET_ITEM(params, i, PyBytes_FromStringAndSize(static_cast<const char*>(l.params[i]), l.sizes[i]));
    }
    PyObject* r = PyObject_CallFunction(g_test_launcher, "K(III)IIKN", static_cast<unsigned long long>(l.function),
                                        l.grid[0], l.grid[1], l.grid[2], l.block, l.shared,
                                        static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)), params);
    Py_XDECREF(r);
    return r != nullptr;
  }
  if (g_launch == nullptr) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib != nullptr) g_launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    if (g_launch == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "anymla callpath: the CUDA driver (libcuda.so.1) is not loaded");
      return false;
    }
  }
  int rc = g_launch(reinterpret_cast<void*>(l.function), l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared,
                    stream, l.params.data(), nullptr);
  if (rc != 0) {
    PyErr_Format(PyExc_RuntimeError, "anymla callpath: cuLaunchKernel failed with CUresult %d", rc);
    return false;
  }
  return true;
}

// A call step: its function called with its arguments (tensors resolved), each tensor of the tuple it returns
// made a Value. False with a Python error set when the call raised or returned something else.
template <typename Resolve>
bool call_step(const Step& step, const Resolve& resolve, std::vector<at::Tensor>& values) {
  std::vector<PyObject*> argv;
  argv.reserve(step.args.size());
  for (const OpArg& a : step.args) {
    PyObject* o = a.tensor ? THPVariable_Wrap(resolve(a.ref)) : (Py_INCREF(a.object.p), a.object.p);
    if (o == nullptr) break;
    argv.push_back(o);
  }
  PyObject* r = argv.size() == step.args.size()
                    ? PyObject_Vectorcall(step.callable.p, argv.data(), argv.size(), nullptr)
                    : nullptr;
  for (PyObject* o : argv) Py_DECREF(o);
  if (r == nullptr) return false;
  bool ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == static_cast<Py_ssize_t>(step.results);
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(r); ++i) {
    ok = THPVariable_Check(PyTuple_GET_ITEM(r, i));
    if (ok) values.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(r, i)));
  }
  Py_DECREF(r);
  if (!ok) PyErr_SetString(PyExc_TypeError, "a call step's function returned other than its tuple of tensors");
  return ok;
}

// call(op, poison, sched, *args) -> the outputs' tuple, or None when no entry fits (the Python path then runs).
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n < 3) {
    PyErr_SetString(PyExc_TypeError, "call(op, poison, sched, *args)");
    return nullptr;
  }
  long op = PyLong_AsLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t first = 3;
  std::string key;
  key.reserve(320);
  if (!build_key(op, args + first, n - first, key)) Py_RETURN_NONE;
  auto found = g_table.find(key);
  if (found == g_table.end()) Py_RETURN_NONE;
  Entry& e = *found->second;
  uint64_t variant = e.desc_input < 0 ? 0 : address(args[first + e.desc_input]);
  auto launches = e.variants.find(variant);
  if (launches == e.variants.end()) Py_RETURN_NONE;
  void* stream = nullptr;
  if (e.device.is_cuda()) {
    PyObject* dev = PyObject_CallNoArgs(g_get_device);
    if (dev == nullptr) return nullptr;
    long index = PyLong_AsLong(dev);
    if (index != e.device.index()) {
      Py_DECREF(dev);
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;  // launched from another current device: the Python path handles it
    }
    if (e.callable != nullptr) {  // a callable finds its own stream
      Py_DECREF(dev);
    } else {
      PyObject* s = PyObject_CallOneArg(g_get_stream, dev);
      Py_DECREF(dev);
      if (s == nullptr) return nullptr;
      stream = reinterpret_cast<void*>(PyLong_AsUnsignedLongLong(s));
      Py_DECREF(s);
      if (PyErr_Occurred()) return nullptr;
    }
  }
  int fits = metadata_fits(args[2], e);
  if (fits < 0) return nullptr;
  if (fits == 0) Py_RETURN_NONE;
  if (e.callable != nullptr) {  // callable(sched, *the public call's arguments): args without the scope
    std::vector<PyObject*> call_args(args + first, args + n);
    call_args[0] = args[2];
    ++g_hits;
    return PyObject_Vectorcall(e.callable, call_args.data(), call_args.size(), nullptr);
  }
  int poison = PyObject_IsTrue(args[1]);
  if (poison < 0) return nullptr;
  std::vector<at::Tensor> values;
  auto source = [&](Source kind, uint32_t index) -> const at::Tensor& {
    return kind == Source::Input ? THPVariable_Unpack(args[first + index])
                                 : kind == Source::Value ? values[index] : e.constants[index];
  };
  auto resolve = [&](const Ref& r) -> at::Tensor {
    const at::Tensor& base = source(r.source, r.index);
    return r.whole ? base : base.as_strided(r.sizes, r.strides, r.offset);
  };
  try {
    for (Step& step : launches->second) {
      if (step.kind == Kind::Allocate) {
        const Allocation& a = step.allocation;
        values.push_back(at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(e.device)));
        if (poison && a.poisoned) values.back().fill_(NAN);  // as anymla.buffers.empty does in poison mode
      } else if (step.kind == Kind::Op) {
        torch::jit::Stack stack;
        stack.reserve(step.args.size());
        for (const OpArg& a : step.args) {
          if (a.tensor) {
            stack.emplace_back(resolve(a.ref));
          } else {
            stack.push_back(a.value);
          }
        }
        step.op->callBoxed(&stack);
        values.push_back(stack.at(0).toTensor());
      } else if (step.kind == Kind::Call) {
        if (!call_step(step, resolve, values)) return nullptr;
      } else {
        Launch& l = step.launch;
        for (const Patch& p : l.patches) {
          uint64_t value = reinterpret_cast<uint64_t>(source(p.source, p.index).data_ptr()) +
                           static_cast<uint64_t>(p.offset);
          std::memcpy(l.params[p.param], &value, sizeof(value));
        }
        if (!launch_one(l, stream)) return nullptr;
      }
    }
  } catch (const std::exception& ex) {
    PyErr_SetString(PyExc_RuntimeError, ex.what());
    return nullptr;
  }
  ++g_hits;
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(e.outputs.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < e.outputs.size(); ++i) {
    PyTuple_SET_ITEM(out, i, THPVariable_Wrap(resolve(e.outputs[i])));
  }
  return out;
}

bool int64s(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
  }
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

// One launch from (function, (gx, gy, gz), block, shared, [parameter bytes], [(param, source, index, offset)]).
bool parse_launch(PyObject* spec, Launch& l) {
  unsigned long long function;
  PyObject *params, *patches;
  if (!PyArg_ParseTuple(spec, "K(III)IIOO", &function, &l.grid[0], &l.grid[1], &l.grid[2], &l.block, &l.shared,
                        &params, &patches)) {
    return false;
  }
  l.function = function;
  Py_ssize_t n = PySequence_Size(params);
  if (n < 0) return false;
  std::vector<size_t> offsets(n);
  size_t total = 0;
  l.sizes.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* b = PySequence_GetItem(params, i);
    if (b == nullptr || !PyBytes_Check(b)) {
      Py_XDECREF(b);
      PyErr_SetString(PyExc_TypeError, "a parameter's value must be bytes");
      return false;
    }
    l.sizes[i] = static_cast<uint32_t>(PyBytes_GET_SIZE(b));
    size_t align = l.sizes[i] >= 64 ? 64 : 8;
    total = (total + align - 1) / align * align;
    offsets[i] = total;
    total += l.sizes[i];
    Py_DECREF(b);
  }
  l.storage.reset(new uint8_t[total + 64]);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(l.storage.get()) + 63) / 64 * 64);
  l.params.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* b = PySequence_GetItem(params, i);
    std::memcpy(base + offsets[i], PyBytes_AS_STRING(b), l.sizes[i]);
    Py_DECREF(b);
    l.params[i] = base + offsets[i];
  }
  PyObject* fast = PySequence_Fast(patches, "patches: expected a sequence");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    unsigned param, source, index;
    long long offset;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "IIIL", &param, &source, &index, &offset)) {
      Py_DECREF(fast);
      return false;
    }
    if (param >= l.params.size() || l.sizes[param] != 8 || source > 1) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "a patch must name an 8-byte parameter and an input or a value");
      return false;
    }
    l.patches.push_back({param, static_cast<Source>(source), index, offset});
  }
  Py_DECREF(fast);
  return true;
}

// A tensor reference from (source, index, sizes or None for the source itself, strides, storage offset).
bool parse_ref(PyObject* spec, Ref& r) {
  unsigned source;
  PyObject *sizes, *strides;
  long long offset;
  if (!PyArg_ParseTuple(spec, "IIOOL", &source, &r.index, &sizes, &strides, &offset)) return false;
  if (source > 2) {
    PyErr_SetString(PyExc_ValueError, "a tensor's source must be 0 (input), 1 (value) or 2 (constant)");
    return false;
  }
  r.source = static_cast<Source>(source);
  r.whole = sizes == Py_None;
  r.offset = offset;
  return r.whole || (int64s(sizes, r.sizes) && int64s(strides, r.strides));
}

// A constant op argument: None, a bool, an int or a float.
bool parse_value(PyObject* v, c10::IValue& out) {
  if (v == Py_None) {
    out = c10::IValue();
  } else if (PyBool_Check(v)) {
    out = c10::IValue(v == Py_True);
  } else if (PyLong_Check(v)) {
    out = c10::IValue(static_cast<int64_t>(PyLong_AsLongLong(v)));
  } else if (PyFloat_Check(v)) {
    out = c10::IValue(PyFloat_AS_DOUBLE(v));
  } else {
    PyErr_SetString(PyExc_TypeError, "an op's constant argument must be None, a bool, an int or a float");
    return false;
  }
  return !PyErr_Occurred();
}

// One step from ("alloc", sizes, strides, dtype, poisoned), ("launch", launch), ("op", name, overload, [("t", ref)
// or ("v", value)], the arguments in the schema's order) or ("call", function, [("t", ref) or ("o", object)],
// the number of tensors it returns).
bool parse_step(PyObject* spec, Step& step) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
    PyErr_SetString(PyExc_TypeError, "a step must be a tuple starting with its kind");
    return false;
  }
  std::string kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(spec, 0));
  if (kind == "alloc") {
    PyObject *name, *sizes, *strides, *dtype;
    int poisoned;
    step.kind = Kind::Allocate;
    if (!PyArg_ParseTuple(spec, "OOOO!p", &name, &sizes, &strides, &THPDtypeType, &dtype, &poisoned) ||
        !int64s(sizes, step.allocation.sizes) || !int64s(strides, step.allocation.strides)) {
      return false;
    }
    step.allocation.poisoned = poisoned != 0;
    step.allocation.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    return true;
  }
  if (kind == "launch") {
    step.kind = Kind::Launch;
    return parse_launch(PyTuple_GET_ITEM(spec, 1), step.launch);
  }
  const char *name, *overload;
  PyObject *kind_name, *op_args, *function;
  if (kind == "call") {
    step.kind = Kind::Call;
    if (!PyArg_ParseTuple(spec, "OOOI", &kind_name, &function, &op_args, &step.results)) return false;
    if (!PyCallable_Check(function)) {
      PyErr_SetString(PyExc_TypeError, "a call step's function must be callable");
      return false;
    }
    step.callable = PyRef(function);
  } else if (kind != "op" || !PyArg_ParseTuple(spec, "OssO", &kind_name, &name, &overload, &op_args)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a step's kind must be alloc, launch, op or call");
    return false;
  } else {
    step.kind = Kind::Op;
    try {
      step.op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
    } catch (const std::exception& ex) {
      PyErr_SetString(PyExc_ValueError, ex.what());
      return false;
    }
  }
  PyObject* fast = PySequence_Fast(op_args, "an op's arguments: expected a sequence");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* tag;
    PyObject* what;
    OpArg a;
    bool ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "sO", &tag, &what);
    if (ok && (a.tensor = tag[0] == 't')) {
      ok = parse_ref(what, a.ref);
    } else if (ok && step.kind == Kind::Call) {
      a.object = PyRef(what);
    } else if (ok) {
      ok = parse_value(what, a.value);
    }
    if (!ok) {
      Py_DECREF(fast);
      return false;
    }
    step.args.push_back(std::move(a));
  }
  Py_DECREF(fast);
  return true;
}

// Whether every reference of `steps` and `outputs` names an argument, an earlier value or a constant.
bool references_resolve(const std::vector<Step>& steps, const std::vector<Ref>& outputs, size_t n_args,
                        size_t n_constants) {
  size_t values = 0;
  auto fits = [&](Source s, uint32_t i) {
    return s == Source::Input ? i < n_args : s == Source::Value ? i < values : i < n_constants;
  };
  for (const Step& step : steps) {
    for (const Patch& p : step.launch.patches) {
      if (!fits(p.source, p.index)) return false;
    }
    for (const OpArg& a : step.args) {
      if (a.tensor && !fits(a.ref.source, a.ref.index)) return false;
    }
    values += step.kind == Kind::Launch ? 0 : step.results;
  }
  for (const Ref& r : outputs) {
    if (!fits(r.source, r.index)) return false;
  }
  return true;
}

// register(op, args, device, constants, steps, outputs, desc_input, variant, config, keep[, callable]): make
// (or extend with a new descriptor variant) the entry of `args`' key. constants: tensors the steps use;
// steps: see parse_step; outputs: tensor references (parse_ref); variant: the address of args[desc_input]
// (0 when desc_input is -1); callable: instead of steps, a function of (sched, *the call's arguments after
// the scope) returning the outputs; owner: a number forget() drops the entry by.
PyObject* register_entry(PyObject*, PyObject* args) {
  long op, desc_input;
  unsigned long long variant;
  long long owner = 0;
  PyObject *call_args, *device, *constants, *steps, *outputs, *config, *keep, *callable = Py_None;
  if (!PyArg_ParseTuple(args, "lO!OOOOlKOO|OL", &op, &PyTuple_Type, &call_args, &device, &constants, &steps,
                        &outputs, &desc_input, &variant, &config, &keep, &callable, &owner)) {
    return nullptr;
  }
  std::string key;
  if (!build_key(op, &PyTuple_GET_ITEM(call_args, 0), PyTuple_GET_SIZE(call_args), key)) {
    PyErr_SetString(PyExc_TypeError, "register: an argument of a kind calls are not keyed on");
    return nullptr;
  }
  const char* type;
  int index;
  if (!PyArg_ParseTuple(device, "si", &type, &index)) return nullptr;
  auto entry = std::make_unique<Entry>();
  try {
    entry->device = at::Device(std::string(type) + (std::strcmp(type, "cpu") ? ":" + std::to_string(index) : ""));
  } catch (const std::exception& ex) {
    PyErr_SetString(PyExc_ValueError, ex.what());
    return nullptr;
  }
  entry->desc_input = desc_input;
  entry->owner = owner;
  PyObject* fast = PySequence_Fast(constants, "constants: expected a sequence of tensors");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* t = PySequence_Fast_GET_ITEM(fast, i);
    if (!THPVariable_Check(t)) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_TypeError, "a constant must be a tensor");
      return nullptr;
    }
    entry->constants.push_back(THPVariable_Unpack(t));
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(outputs, "outputs: expected a sequence");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    entry->outputs.emplace_back();
    if (!parse_ref(PySequence_Fast_GET_ITEM(fast, i), entry->outputs.back())) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);
  std::vector<Step> parsed;
  fast = PySequence_Fast(steps, "steps: expected a sequence");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    parsed.emplace_back();
    if (!parse_step(PySequence_Fast_GET_ITEM(fast, i), parsed.back())) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);
  if (!references_resolve(parsed, entry->outputs, PyTuple_GET_SIZE(call_args), entry->constants.size())) {
    PyErr_SetString(PyExc_ValueError, "a step or output names no argument, earlier value or constant");
    return nullptr;
  }
  auto found = g_table.find(key);
  if (found != g_table.end() && found->second->desc_input == desc_input && desc_input >= 0) {
    found->second->variants[variant] = std::move(parsed);  // a new cache address of a known signature
    Py_RETURN_NONE;
  }
  if (g_table.size() >= kTableLimit) g_table.clear();
  entry->variants[variant] = std::move(parsed);
  if (config != Py_None) {
    Py_INCREF(config);
    entry->config = config;
  }
  Py_INCREF(keep);
  entry->keep = keep;
  if (callable != Py_None) {
    Py_INCREF(callable);
    entry->callable = callable;
  }
  g_table[key] = std::move(entry);
  Py_RETURN_NONE;
}

// has(op, args) -> whether an entry (and, for descriptor kernels, the variant of args' cache) exists.
PyObject* has(PyObject*, PyObject* args) {
  long op;
  PyObject* call_args;
  if (!PyArg_ParseTuple(args, "lO!", &op, &PyTuple_Type, &call_args)) return nullptr;
  std::string key;
  if (!build_key(op, &PyTuple_GET_ITEM(call_args, 0), PyTuple_GET_SIZE(call_args), key)) Py_RETURN_FALSE;
  auto found = g_table.find(key);
  if (found == g_table.end()) Py_RETURN_FALSE;
  const Entry& e = *found->second;
  uint64_t variant = e.desc_input < 0 ? 0 : address(PyTuple_GET_ITEM(call_args, e.desc_input));
  return PyBool_FromLong(e.variants.count(variant));
}

// forget(owner): drop the entries `owner` made (a layer that is gone: its weights are released).
PyObject* forget(PyObject*, PyObject* arg) {
  long long owner = PyLong_AsLongLong(arg);
  if (owner == -1 && PyErr_Occurred()) return nullptr;
  for (auto it = g_table.begin(); it != g_table.end();) {
    it = it->second->owner == owner ? g_table.erase(it) : std::next(it);
  }
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  g_table.clear();
  Py_RETURN_NONE;
}

PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(g_table.size()); }

PyObject* hits(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(g_hits); }

// configure(get_device, get_stream, test_launcher): the current device's and stream's readers, and (tests on
// the CPU only) a callable that stands for cuLaunchKernel, or None.
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *get_device, *get_stream, *test_launcher;
  if (!PyArg_ParseTuple(args, "OOO", &get_device, &get_stream, &test_launcher)) return nullptr;
  Py_INCREF(get_device);
  Py_INCREF(get_stream);
  Py_XSETREF(g_get_device, get_device);
  Py_XSETREF(g_get_stream, get_stream);
  if (test_launcher == Py_None) {
    Py_CLEAR(g_test_launcher);
  } else {
    Py_INCREF(test_launcher);
    Py_XSETREF(g_test_launcher, test_launcher);
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
     "call(op, poison, sched, *args): the outputs, or None when no entry fits"},
    {"register", register_entry, METH_VARARGS, "register(op, args, device, constants, steps, outputs, desc_input, "
                                               "variant, config, keep[, callable, owner])"},
    {"has", has, METH_VARARGS, "has(op, args): whether a call of args would find an entry"},
    {"clear", clear, METH_NOARGS, "forget every entry"},
    {"forget", forget, METH_O, "forget(owner): drop the entries owner made"},
    {"size", size, METH_NOARGS, "how many entries there are"},
    {"hits", hits, METH_NOARGS, "how many calls entries have run"},
    {"configure", configure, METH_VARARGS, "configure(get_device, get_stream, test_launcher)"},
    {nullptr, nullptr, 0, nullptr},
};

#define ANYMLA_STR2(x) #x
#define ANYMLA_STR(x) ANYMLA_STR2(x)
PyModuleDef module = {PyModuleDef_HEAD_INIT, ANYMLA_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

}  // namespace

#define ANYMLA_INIT2(name) PyInit_##name
#define ANYMLA_INIT(name) ANYMLA_INIT2(name)

PyMODINIT_FUNC ANYMLA_INIT(TORCH_EXTENSION_NAME)() {
  g_str_initialized = PyUnicode_InternFromString("have_initialized");
  g_str_config = PyUnicode_InternFromString("config");
  return PyModule_Create(&module);
}
