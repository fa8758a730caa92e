// SPDX-License-Identifier: Apache-2.0
/* SWIG interface of the Python binding: kvsieve.capi, wrapped by the Pythonic facade in
 * kvsieve/__init__.py. Only the public C ABI is used (include/kvsieve/kvsieve.h).
 *
 * What lives here and not in Python:
 *  - tensor intake: any object with __dlpack__ (NumPy, PyTorch, CuPy, JAX; CPU, CUDA-host or CUDA)
 *    or the buffer protocol is described as a kvs_tensor without copying. The DLPack capsule is held
 *    for the call and dropped afterwards (never renamed to "used_dltensor"), so the producer's
 *    capsule destructor frees it. Wrong dtype -> TypeError, wrong rank/shape/device/layout ->
 *    ValueError, naming what was expected. Nothing is ever copied.
 *  - strings: every const char* argument refuses an embedded NUL (ValueError naming it); a
 *    __dlpack_device__ that is not a tuple of two ints is a TypeError naming the tensor.
 *  - error translation: a kvs_error_t becomes kvsieve.Error(code, message, backend_code).
 *  - the GIL is released around every call into the library that can take time (prefill,
 *    build_index, decode, append, decode_batch, batch plan and decode, save, load, fork, trace open,
 *    tables describe).
 */
%module(package="kvsieve", docstring="Low-level SWIG wrapper of the kvsieve C ABI; use the kvsieve package.") capi

%{
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>
#include <kvsieve/kvsieve.h>
#include <dlpack/dlpack.h>

/* The wrapper is C: name the opaque handle structs without the struct keyword. */
typedef struct kvs_session_s kvs_session_s;
typedef struct kvs_trace_s kvs_trace_s;
typedef struct kvs_batch_s kvs_batch_s;

/* ---- errors ------------------------------------------------------------------------------- */

/* Raises kvsieve.Error(code, message, backend_code) from an error object, which it frees.
 * Returns 1 if an error was raised. */
static int kvsb_raise(kvs_error_t e) {
  if (!e) return 0;
  /* kvsieve._errors.make picks the subclass (ValueError, FileNotFoundError, FormatError, ...). */
  PyObject* mod = PyImport_ImportModule("kvsieve._errors");
  PyObject* make = mod ? PyObject_GetAttrString(mod, "make") : NULL;
  Py_XDECREF(mod);
  if (!make) { kvs_error_destroy(e); return 1; }
  PyObject* inst = PyObject_CallFunction(make, "isL", (int)kvs_error_code(e), kvs_error_message(e),
                                         (long long)kvs_error_backend_code(e));
  kvs_error_destroy(e);
  if (inst) { PyErr_SetObject((PyObject*)Py_TYPE(inst), inst); Py_DECREF(inst); }
  Py_DECREF(make);
  return 1;
}

/* ---- tensors ------------------------------------------------------------------------------ */

#define KVSB_MAXDIM 8

typedef struct kvsb_arg {
  kvs_tensor t;
  int64_t shape[KVSB_MAXDIM];
  int64_t strides[KVSB_MAXDIM];
  PyObject* capsule; /* DLPack capsule held for the call */
  Py_buffer view;    /* buffer-protocol view held for the call */
  int has_view;
  int present;
} kvsb_arg;

static void kvsb_release(kvsb_arg* a) {
  if (a->has_view) { PyBuffer_Release(&a->view); a->has_view = 0; }
  Py_CLEAR(a->capsule);
}

static const char* kvsb_dtype_name(kvs_dtype d, char* buf, size_t n) {
  if (d.lanes == 1 && d.code == KVS_DTYPE_CODE_FLOAT && (d.bits == 16 || d.bits == 32 || d.bits == 64))
    snprintf(buf, n, "float%d", (int)d.bits);
  else if (d.lanes == 1 && d.code == KVS_DTYPE_CODE_BFLOAT && d.bits == 16) snprintf(buf, n, "bfloat16");
  else if (d.lanes == 1 && d.code == KVS_DTYPE_CODE_INT) snprintf(buf, n, "int%d", (int)d.bits);
  else if (d.lanes == 1 && d.code == KVS_DTYPE_CODE_UINT) snprintf(buf, n, "uint%d", (int)d.bits);
  else snprintf(buf, n, "dtype(code=%d, bits=%d, lanes=%d)", (int)d.code, (int)d.bits, (int)d.lanes);
  return buf;
}

/* Buffer-protocol format -> dtype. Only native-order (little-endian) floats are accepted. */
static int kvsb_format(const char* fmt, Py_ssize_t itemsize, kvs_dtype* out, const char* name) {
  const char* f = fmt ? fmt : "B";
  if (*f == '@' || *f == '=' || *f == '<') ++f;
  else if (*f == '>' || *f == '!') {
    PyErr_Format(PyExc_ValueError, "%s: expected native (little-endian) byte order, got format '%s'", name, fmt);
    return 0;
  }
  out->lanes = 1;
  if (f[0] && !f[1]) {
    switch (f[0]) {
      case 'f': out->code = KVS_DTYPE_CODE_FLOAT; out->bits = 32; return 1;
      case 'e': out->code = KVS_DTYPE_CODE_FLOAT; out->bits = 16; return 1;
      case 'd': out->code = KVS_DTYPE_CODE_FLOAT; out->bits = 64; return 1;
      case 'i': case 'l': case 'q': case 'h': case 'b':
        out->code = KVS_DTYPE_CODE_INT; out->bits = (uint8_t)(itemsize * 8); return 1;
      case 'I': case 'L': case 'Q': case 'H': case 'B':
        out->code = KVS_DTYPE_CODE_UINT; out->bits = (uint8_t)(itemsize * 8); return 1;
    }
  }
  PyErr_Format(PyExc_TypeError, "%s: expected float32, float16 or bfloat16 elements, got buffer format '%s'",
               name, fmt ? fmt : "B");
  return 0;
}

/* Expectations the facade passes down (None = only the generic checks):
 *   (shape tuple with -1 for "any", device_type, device_id, contiguous) */
typedef struct kvsb_expect {
  int64_t shape[KVSB_MAXDIM];
  int ndim;
  int device_type; /* 0: host (CPU or CUDA_HOST); KVS_DEVICE_CUDA: CUDA; -1: either (hybrid) */
  int device_id;
  int contiguous;
} kvsb_expect;

static int kvsb_is_contiguous(const kvs_tensor* t) {
  if (!t->strides) return 1;
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] != 1 && t->strides[i] != s) return 0;
    s *= t->shape[i];
  }
  return 1;
}

static void kvsb_shape_str(const int64_t* shape, int ndim, char* buf, size_t n) {
  size_t at = 0;
  at += (size_t)snprintf(buf + at, n - at, "[");
  for (int i = 0; i < ndim && at < n; ++i) {
    if (shape[i] < 0) at += (size_t)snprintf(buf + at, n - at, "%s*", i ? ", " : "");
    else at += (size_t)snprintf(buf + at, n - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
  }
  if (at < n) snprintf(buf + at, n - at, "]");
}

/* obj.__dlpack_device__() as DLPack defines it: a tuple (device_type, device_id) of two ints (an
 * IntEnum counts). Anything else is a TypeError naming the argument (PyArg_ParseTuple would raise
 * SystemError on a non-tuple). */
static int kvsb_dlpack_device(PyObject* obj, const char* name, int* type, int* id) {
  PyObject* dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!dev) return 0;
  int ok = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2 && PyLong_Check(PyTuple_GET_ITEM(dev, 0)) &&
           PyLong_Check(PyTuple_GET_ITEM(dev, 1));
  if (ok) {
    int of0 = 0, of1 = 0;
    long t = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(dev, 0), &of0);
    long i = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(dev, 1), &of1);
    if (PyErr_Occurred()) { Py_DECREF(dev); return 0; }
    if (of0 || of1 || t < INT_MIN || t > INT_MAX || i < INT_MIN || i > INT_MAX) {
      PyErr_Format(PyExc_ValueError, "%s: __dlpack_device__() of %s returned an out-of-range device %R", name,
                   Py_TYPE(obj)->tp_name, dev);
      Py_DECREF(dev);
      return 0;
    }
    *type = (int)t;
    *id = (int)i;
  } else {
    PyErr_Format(PyExc_TypeError,
                 "%s: __dlpack_device__() of %s must return a tuple (device_type, device_id) of two ints, got %R",
                 name, Py_TYPE(obj)->tp_name, dev);
  }
  Py_DECREF(dev);
  return ok;
}

/* torch.Tensor without DLPack. torch's __dlpack__ is Python code that costs about 20 us per tensor
 * (an H100 host, torch 2.11), five tensors per decode call; the metadata read here directly costs
 * about 1 us. Only where DLPack would give the same answer with nothing to order: an exact
 * torch.Tensor (not a subclass), strided, not requiring grad, float32/float16/bfloat16, on the CPU,
 * or on a CUDA device whose current torch stream is the consumer stream (DLPack's stream rule then
 * has nothing to do). Anything else returns 0 and takes the DLPack path, so errors and stream
 * ordering stay DLPack's; a pending negation or conjugation is refused (-1, error set). Needs torch
 * imported already (it is never imported from here). */
static struct {
  int state; /* 0: not tried (or torch not loaded yet), 1: ready, -1: unavailable */
  PyObject *tensor, *f32, *f16, *bf16, *strided, *raw_stream;
} kvsb_torch;

static int kvsb_torch_ready(void) {
  if (kvsb_torch.state) return kvsb_torch.state > 0;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch"); /* borrowed */
  if (!torch) return 0;
  kvsb_torch.tensor = PyObject_GetAttrString(torch, "Tensor");
  kvsb_torch.f32 = PyObject_GetAttrString(torch, "float32");
  kvsb_torch.f16 = PyObject_GetAttrString(torch, "float16");
  kvsb_torch.bf16 = PyObject_GetAttrString(torch, "bfloat16");
  kvsb_torch.strided = PyObject_GetAttrString(torch, "strided");
  PyObject* c = PyObject_GetAttrString(torch, "_C");
  kvsb_torch.raw_stream = c ? PyObject_GetAttrString(c, "_cuda_getCurrentRawStream") : NULL; /* CUDA builds */
  Py_XDECREF(c);
  PyErr_Clear();
  kvsb_torch.state = kvsb_torch.tensor && PyType_Check(kvsb_torch.tensor) && kvsb_torch.f32 && kvsb_torch.f16 &&
                             kvsb_torch.bf16 && kvsb_torch.strided ? 1 : -1;
  return kvsb_torch.state > 0;
}

/* obj.<name>, or obj.<name>() when call: a new reference, or NULL with no error set. */
static PyObject* kvsb_torch_get(PyObject* obj, const char* name, int call) {
  PyObject* v = call ? PyObject_CallMethod(obj, name, NULL) : PyObject_GetAttrString(obj, name);
  if (!v) PyErr_Clear();
  return v;
}

static int kvsb_torch_flag(PyObject* obj, const char* name, int call) { /* 1 true, 0 false, -1 unknown */
  PyObject* v = kvsb_torch_get(obj, name, call);
  if (!v) return -1;
  const int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  if (r < 0) PyErr_Clear();
  return r;
}

static int kvsb_torch_ints(PyObject* seq, int64_t* out, int max, int* n) {
  if (!seq || !PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) > max) return 0;
  *n = (int)PyTuple_GET_SIZE(seq);
  for (int i = 0; i < *n; ++i) {
    const long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    out[i] = (int64_t)x;
  }
  return 1;
}

static int kvsb_torch_fast(PyObject* obj, const char* name, unsigned long long stream, kvsb_arg* a) {
  if (!kvsb_torch_ready() || Py_TYPE(obj) != (PyTypeObject*)kvsb_torch.tensor) return 0;
  /* A lazy negation or conjugation: the memory holds the values before it, and torch's DLPack export
   * hands that memory over as it is. Refused (resolving it would be a silent copy). */
  if (kvsb_torch_flag(obj, "is_neg", 1) == 1 || kvsb_torch_flag(obj, "is_conj", 1) == 1) {
    PyErr_Format(PyExc_ValueError, "%s: expected a tensor without a pending negation or conjugation (its "
                 "memory holds the values before it); pass t.resolve_neg() / t.resolve_conj()", name);
    return -1;
  }
  if (kvsb_torch_flag(obj, "requires_grad", 0) != 0) return 0;
  PyObject* layout = kvsb_torch_get(obj, "layout", 0);
  Py_XDECREF(layout);
  if (layout != kvsb_torch.strided) return 0; /* identity only: the reference is not used */
  PyObject* dt = kvsb_torch_get(obj, "dtype", 0);
  Py_XDECREF(dt);
  kvs_dtype dtype;
  dtype.lanes = 1;
  if (dt == kvsb_torch.f32) dtype.code = KVS_DTYPE_CODE_FLOAT, dtype.bits = 32;
  else if (dt == kvsb_torch.f16) dtype.code = KVS_DTYPE_CODE_FLOAT, dtype.bits = 16;
  else if (dt == kvsb_torch.bf16) dtype.code = KVS_DTYPE_CODE_BFLOAT, dtype.bits = 16;
  else return 0;
  const int cuda = kvsb_torch_flag(obj, "is_cuda", 0);
  int dev_id = 0;
  if (cuda < 0) return 0;
  if (cuda) {
    if (!kvsb_torch.raw_stream) return 0;
    PyObject* gd = kvsb_torch_get(obj, "get_device", 1);
    if (!gd) return 0;
    dev_id = (int)PyLong_AsLong(gd);
    Py_DECREF(gd);
    if (dev_id < 0 || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    PyObject* cur = PyObject_CallFunction(kvsb_torch.raw_stream, "i", dev_id);
    if (!cur) { PyErr_Clear(); return 0; }
    const unsigned long long cs = PyLong_AsUnsignedLongLong(cur);
    Py_DECREF(cur);
    if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
    if (cs != stream) return 0; /* another stream: DLPack orders torch's pending work before ours */
  } else if (kvsb_torch_flag(obj, "is_cpu", 0) != 1) {
    return 0; /* neither CPU nor CUDA (e.g. meta, mps): DLPack says what it is */
  }
  PyObject* shape = kvsb_torch_get(obj, "shape", 0);
  PyObject* strides = kvsb_torch_get(obj, "stride", 1);
  int n = 0, ns = 0;
  const int ok = kvsb_torch_ints(shape, a->shape, KVSB_MAXDIM, &n) && kvsb_torch_ints(strides, a->strides, KVSB_MAXDIM, &ns) &&
                 n == ns;
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  if (!ok) return 0;
  PyObject* ptr = kvsb_torch_get(obj, "data_ptr", 1);
  if (!ptr) return 0;
  void* data = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
  a->t.data = data;
  a->t.device.device_type = cuda ? KVS_DEVICE_CUDA : KVS_DEVICE_CPU;
  a->t.device.device_id = cuda ? dev_id : 0;
  a->t.ndim = n;
  a->t.dtype = dtype;
  a->t.byte_offset = 0;
  a->t.shape = a->shape;
  a->t.strides = a->strides;
  return 1;
}

/* Describes obj as a kvs_tensor without copying.
 * kind: 0 = input (q/k/v; float32/16/bf16), 1 = output (same dtypes, writable), 2 = lse output (float32).
 * ndim: required rank. stream: passed to __dlpack__ for CUDA producers. */
static int kvsb_tensor(PyObject* obj, const char* name, int kind, int ndim, unsigned long long stream,
                       const kvsb_expect* ex, kvsb_arg* a) {
  char b1[96], b2[96];
  memset(a, 0, sizeof *a);
  if (obj == NULL || obj == Py_None) return 1;
  a->present = 1;
  int done = kvsb_torch_fast(obj, name, stream, a);
  if (done < 0) return 0;
  if (!done && PyObject_HasAttrString(obj, "__dlpack__") && PyObject_HasAttrString(obj, "__dlpack_device__")) {
    int dtype_dev = 0, dev_id = 0;
    if (!kvsb_dlpack_device(obj, name, &dtype_dev, &dev_id)) return 0;
    if (dtype_dev != kDLCPU && dtype_dev != kDLCUDA && dtype_dev != kDLCUDAHost) {
      PyErr_Format(PyExc_ValueError, "%s: expected a CPU, CUDA-host or CUDA tensor, got DLPack device type %d",
                   name, dtype_dev);
      return 0;
    }
    PyObject* cap;
    if (dtype_dev == kDLCUDA) {
      /* DLPack stream rule: the consumer names the stream it will use; the producer orders its
       * pending work before it. NULL (stream 0, the legacy default) is DLPack's 1. */
      PyObject* kw = Py_BuildValue("{s:K}", "stream", stream ? stream : 1ULL);
      PyObject* meth = PyObject_GetAttrString(obj, "__dlpack__");
      PyObject* args = PyTuple_New(0);
      cap = (kw && meth && args) ? PyObject_Call(meth, args, kw) : NULL;
      Py_XDECREF(kw); Py_XDECREF(meth); Py_XDECREF(args);
    } else {
      cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    }
    if (!cap) {
      /* NumPy refuses to export read-only arrays through DLPack; inputs may still come through the
       * buffer protocol (read-only), outputs may not. */
      if (kind == 0 && PyErr_ExceptionMatches(PyExc_BufferError) && PyObject_CheckBuffer(obj)) {
        PyErr_Clear();
      } else {
        if (kind != 0 && PyErr_ExceptionMatches(PyExc_BufferError)) {
          PyObject *et, *ev, *tb;
          PyErr_Fetch(&et, &ev, &tb);
          PyObject* s = ev ? PyObject_Str(ev) : NULL;
          PyErr_Format(PyExc_ValueError, "%s: expected a writable tensor (%s)", name,
                       s ? PyUnicode_AsUTF8(s) : "not exportable");
          Py_XDECREF(s); Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb);
        }
        return 0;
      }
    } else {
      DLManagedTensor* m = (DLManagedTensor*)PyCapsule_GetPointer(cap, "dltensor");
      if (!m) { Py_DECREF(cap); return 0; }
      a->capsule = cap;
      const DLTensor* d = &m->dl_tensor;
      if (d->ndim > KVSB_MAXDIM) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d dimensions, got %d", name, ndim, d->ndim);
        kvsb_release(a);
        return 0;
      }
      a->t.data = d->data;
      a->t.device.device_type = d->device.device_type;
      a->t.device.device_id = d->device.device_id;
      a->t.ndim = d->ndim;
      a->t.dtype.code = d->dtype.code;
      a->t.dtype.bits = d->dtype.bits;
      a->t.dtype.lanes = d->dtype.lanes;
      a->t.byte_offset = d->byte_offset;
      for (int i = 0; i < d->ndim; ++i) a->shape[i] = d->shape[i];
      a->t.shape = a->shape;
      if (d->strides) {
        for (int i = 0; i < d->ndim; ++i) a->strides[i] = d->strides[i];
        a->t.strides = a->strides;
      }
      done = 1;
    }
  }
  if (!done) {
    if (!PyObject_CheckBuffer(obj)) {
      PyErr_Format(PyExc_TypeError,
                   "%s: expected an array with __dlpack__ or the buffer protocol (NumPy, PyTorch, CuPy), got %s",
                   name, Py_TYPE(obj)->tp_name);
      return 0;
    }
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (kind != 0 ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) != 0) {
      if (kind != 0 && PyErr_ExceptionMatches(PyExc_BufferError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a writable buffer, got a read-only %s", name,
                     Py_TYPE(obj)->tp_name);
      }
      return 0;
    }
    a->has_view = 1;
    if (!kvsb_format(a->view.format, a->view.itemsize, &a->t.dtype, name)) { kvsb_release(a); return 0; }
    if (a->view.ndim > KVSB_MAXDIM) {
      PyErr_Format(PyExc_ValueError, "%s: expected %d dimensions, got %d", name, ndim, a->view.ndim);
      kvsb_release(a);
      return 0;
    }
    a->t.data = a->view.buf;
    a->t.device.device_type = KVS_DEVICE_CPU;
    a->t.ndim = a->view.ndim;
    for (int i = 0; i < a->view.ndim; ++i) {
      a->shape[i] = a->view.shape ? a->view.shape[i] : a->view.len / a->view.itemsize;
      Py_ssize_t st = a->view.strides ? a->view.strides[i] : a->view.itemsize;
      if (st % a->view.itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected strides that are whole elements, got %zd bytes in dimension %d",
                     name, st, i);
        kvsb_release(a);
        return 0;
      }
      a->strides[i] = st / a->view.itemsize;
    }
    a->t.shape = a->shape;
    a->t.strides = a->strides;
  }
  /* dtype: never converted, so a mismatch is an error, not a copy. */
  kvs_dtype dt = a->t.dtype;
  int is_f32 = dt.lanes == 1 && dt.code == KVS_DTYPE_CODE_FLOAT && dt.bits == 32;
  int ok = kind == 2 ? is_f32
                     : dt.lanes == 1 && ((dt.code == KVS_DTYPE_CODE_FLOAT && (dt.bits == 32 || dt.bits == 16)) ||
                                         (dt.code == KVS_DTYPE_CODE_BFLOAT && dt.bits == 16));
  if (!ok) {
    PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s (kvsieve never converts silently)", name,
                 kind == 2 ? "float32" : "float32, float16 or bfloat16", kvsb_dtype_name(dt, b1, sizeof b1));
    kvsb_release(a);
    return 0;
  }
  if (a->t.ndim != ndim) {
    PyErr_Format(PyExc_ValueError, "%s: expected %d dimensions, got %d", name, ndim, a->t.ndim);
    kvsb_release(a);
    return 0;
  }
  if (a->t.strides)
    for (int i = 0; i < a->t.ndim; ++i)
      if (a->t.strides[i] < 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected non-negative strides, got %lld in dimension %d", name,
                     (long long)a->t.strides[i], i);
        kvsb_release(a);
        return 0;
      }
  if (ex) {
    for (int i = 0; i < ex->ndim && i < ndim; ++i)
      if (ex->shape[i] >= 0 && ex->shape[i] != a->shape[i]) {
        kvsb_shape_str(ex->shape, ex->ndim, b1, sizeof b1);
        kvsb_shape_str(a->shape, a->t.ndim, b2, sizeof b2);
        PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", name, b1, b2);
        kvsb_release(a);
        return 0;
      }
    int devt = a->t.device.device_type;
    if (ex->device_type == KVS_DEVICE_CUDA) {
      if (devt != KVS_DEVICE_CUDA || a->t.device.device_id != ex->device_id) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a CUDA tensor on device %d (cuda backend), got %s memory%s (kvsieve never copies "
                     "between devices)", name, ex->device_id, devt == KVS_DEVICE_CUDA ? "CUDA" : "host",
                     devt == KVS_DEVICE_CUDA ? " on another device" : "");
        kvsb_release(a);
        return 0;
      }
    } else if (ex->device_type == 0 && devt == KVS_DEVICE_CUDA) { /* -1 (hybrid): the library checks */
      PyErr_Format(PyExc_ValueError,
                   "%s: expected host memory (CPU or CUDA-host) for the cpu backend, got a CUDA tensor; move it with "
                   ".cpu() (kvsieve never copies between devices)", name);
      kvsb_release(a);
      return 0;
    }
    if (ex->contiguous && !kvsb_is_contiguous(&a->t)) {
      PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous tensor (cuda backend), got strides", name);
      kvsb_release(a);
      return 0;
    }
  }
  return 1;
}

/* Parses the facade's expectation: None or (Hq, Hkv, d, device_type, device_id, contiguous). */
static int kvsb_dims(PyObject* spec, int* has, long long dims[3], int* devt, int* devid, int* contig) {
  *has = 0;
  if (!spec || spec == Py_None) return 1;
  if (!PyArg_ParseTuple(spec, "LLLiii", &dims[0], &dims[1], &dims[2], devt, devid, contig)) return 0;
  *has = 1;
  return 1;
}

static kvsb_expect* kvsb_mk(kvsb_expect* e, int has, int devt, int devid, int contig, int ndim, int64_t s0,
                            int64_t s1, int64_t s2) {
  if (!has) return NULL;
  e->ndim = ndim;
  e->shape[0] = s0; e->shape[1] = s1; e->shape[2] = s2;
  e->device_type = devt;
  e->device_id = devid;
  e->contiguous = contig;
  return e;
}

static const kvs_tensor* kvsb_t(const kvsb_arg* a) { return a->present ? &a->t : NULL; }

/* Shared body of prefill and append: q [n, Hq, d], k, v [n, Hkv, d], o optional [n, Hq, d]. */
typedef kvs_error_t (*kvsb_chunk_fn)(kvs_session_t, uint32_t, const kvs_tensor*, const kvs_tensor*,
                                     const kvs_tensor*, const kvs_tensor*, void*);
static PyObject* kvsb_chunk(kvsb_chunk_fn fn, kvs_session_t s, uint32_t layer, PyObject* q, PyObject* k,
                            PyObject* v, PyObject* o, unsigned long long stream, PyObject* spec) {
  int has = 0, devt = 0, devid = 0, contig = 0;
  long long d[3];
  if (!kvsb_dims(spec, &has, d, &devt, &devid, &contig)) return NULL;
  kvsb_arg aq, ak, av, ao;
  kvsb_expect e;
  memset(&ak, 0, sizeof ak); memset(&av, 0, sizeof av); memset(&ao, 0, sizeof ao);
  if (!kvsb_tensor(q, "q", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, -1, d[0], d[2]), &aq)) return NULL;
  int64_t n = aq.shape[0];
  if (!kvsb_tensor(k, "k", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[1], d[2]), &ak) ||
      !kvsb_tensor(v, "v", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[1], d[2]), &av) ||
      !kvsb_tensor(o, "out", 1, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[0], d[2]), &ao)) {
    kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao);
    return NULL;
  }
  kvs_error_t err;
  Py_BEGIN_ALLOW_THREADS
  err = fn(s, layer, kvsb_t(&aq), kvsb_t(&ak), kvsb_t(&av), kvsb_t(&ao), (void*)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao);
  if (kvsb_raise(err)) return NULL;
  Py_RETURN_NONE;
}

/* Log sink: a Python callable called with (level, line); the GIL is taken in the callback. */
static PyObject* kvsb_log_callable = NULL;
static void kvsb_log_trampoline(int32_t level, const char* line, void* user) {
  (void)user;
  PyGILState_STATE g = PyGILState_Ensure();
  if (kvsb_log_callable) {
    PyObject* r = PyObject_CallFunction(kvsb_log_callable, "is", (int)level, line);
    if (!r) PyErr_WriteUnraisable(kvsb_log_callable);
    Py_XDECREF(r);
  }
  PyGILState_Release(g);
}
%}

/* ---- plain parts of the C ABI, wrapped as they are -------------------------------------------- */

%include <stdint.i>

/* Every string argument crosses the C ABI NUL-terminated: an embedded NUL would cut it short
 * silently (a method "full\0junk" would become "full"), so it is a ValueError naming the argument.
 * Otherwise SWIG's own conversion (str -> UTF-8 copy, None -> NULL). */
%typemap(in, noblock=1, fragment="SWIG_AsCharPtrAndSize") const char* (int res, char* buf = 0, size_t size = 0, int alloc = 0) {
  res = SWIG_AsCharPtrAndSize($input, &buf, &size, &alloc);
  if (!SWIG_IsOK(res)) {
    %argument_fail(res, "$type", $symname, $argnum);
  }
  if (buf && size > 1 && memchr(buf, 0, size - 1)) {
    PyErr_SetString(PyExc_ValueError, "$symname(): $1_name: expected a string without NUL characters");
    SWIG_fail;
  }
  $1 = ($1_ltype)buf;
}
%typemap(freearg, noblock=1, match="in") const char* {
  if (alloc$argnum == SWIG_NEWOBJ) %delete_array(buf$argnum);
}

/* Helpers raise through kvsb_raise (or a TypeError/ValueError) and return NULL; every wrapper checks. */
%exception {
  $action
  if (PyErr_Occurred()) SWIG_fail;
}

%ignore kvs_error_code;
%ignore kvs_error_message;
%ignore kvs_error_backend_code;
%ignore kvs_error_destroy;
%ignore kvs_abi_check;
%ignore kvs_string_free;
%ignore kvs_set_log_callback;
%ignore kvs_method_param_count;
%ignore kvs_method_param;
%ignore kvs_param_info;
%ignore kvs_session_params;
%ignore kvs_session_params_init;
%ignore kvs_load_params;
%ignore kvs_load_params_init;
%ignore kvs_session_stats;
%ignore kvs_trace_info;
%ignore kvs_trace_info_init;
%ignore kvs_tensor;
%ignore kvs_device;
%ignore kvs_dtype;
%ignore kvs_log_fn;
%ignore kvs_session_create;
%ignore kvs_session_destroy;
%ignore kvs_session_prefill;
%ignore kvs_session_build_index;
%ignore kvs_session_decode;
%ignore kvs_session_append;
%ignore kvs_session_truncate;
%ignore kvs_session_decode_tokens;
%ignore kvs_paged_kv;
%ignore kvs_paged_kv_init;
%ignore kvs_session_bind_kv;
%ignore kvs_decode_batch;
%ignore kvs_batch_create;
%ignore kvs_batch_destroy;
%ignore kvs_batch_plan;
%ignore kvs_batch_decode;
%ignore kvs_batch_size;
%ignore kvs_session_save;
%ignore kvs_session_load;
%ignore kvs_session_fork;
%ignore kvs_session_to;
%ignore kvs_session_get_stats;
%ignore kvs_session_layer_tokens;
%ignore kvs_session_last_selection;
%ignore kvs_session_method_stat;
%ignore kvs_tables_describe;
%ignore kvs_trace_open;
%ignore kvs_trace_destroy;
%ignore kvs_trace_get_info;
%ignore kvs_trace_layer_index;
%ignore kvs_trace_tensor;
%ignore kvs_trace_write;
%ignore kvs_error_s;


/* SWIG only sees the declarations: the export attribute is for the compiler. */
#define KVSIEVE_SWIG_KVS_API
#define __attribute__(x)
%include <kvsieve/kvsieve.h>

/* ---- owned handles: SWIG proxies with a destructor, so Python frees them exactly once --------- */

%newobject session_create;
%newobject session_load;
%newobject kvs_session_s::fork;
%newobject kvs_session_s::to;
%newobject trace_open;
%newobject batch_create;

%nodefaultctor kvs_session_s;
%nodefaultctor kvs_trace_s;
%nodefaultctor kvs_batch_s;

struct kvs_session_s {};
struct kvs_trace_s {};
struct kvs_batch_s {};

%extend kvs_session_s {
  ~kvs_session_s() { kvs_session_destroy($self); }

  PyObject* prefill(uint32_t layer, PyObject* q, PyObject* k, PyObject* v, PyObject* o,
                    unsigned long long stream, PyObject* spec) {
    return kvsb_chunk(kvs_session_prefill, $self, layer, q, k, v, o, stream, spec);
  }
  PyObject* append(uint32_t layer, PyObject* q, PyObject* k, PyObject* v, PyObject* o,
                   unsigned long long stream, PyObject* spec) {
    return kvsb_chunk(kvs_session_append, $self, layer, q, k, v, o, stream, spec);
  }
  PyObject* build_index(unsigned long long stream) {
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_build_index($self, (void*)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  PyObject* decode(uint32_t layer, PyObject* q, PyObject* k_new, PyObject* v_new, PyObject* o, PyObject* lse,
                   unsigned long long stream, PyObject* spec) {
    int has = 0, devt = 0, devid = 0, contig = 0;
    long long d[3];
    if (!kvsb_dims(spec, &has, d, &devt, &devid, &contig)) return NULL;
    kvsb_arg aq, ak, av, ao, al;
    kvsb_expect e;
    memset(&aq, 0, sizeof aq); memset(&ak, 0, sizeof ak); memset(&av, 0, sizeof av);
    memset(&ao, 0, sizeof ao); memset(&al, 0, sizeof al);
    int ok = kvsb_tensor(q, "q", 0, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, d[0], d[2], 0), &aq) &&
             kvsb_tensor(k_new, "k_new", 0, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, d[1], d[2], 0), &ak) &&
             kvsb_tensor(v_new, "v_new", 0, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, d[1], d[2], 0), &av) &&
             kvsb_tensor(o, "out", 1, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, d[0], d[2], 0), &ao) &&
             kvsb_tensor(lse, "lse", 2, 1, stream, kvsb_mk(&e, has, devt, devid, contig, 1, d[0], 0, 0), &al);
    kvs_error_t err = NULL;
    if (ok) {
      Py_BEGIN_ALLOW_THREADS
      err = kvs_session_decode($self, layer, kvsb_t(&aq), kvsb_t(&ak), kvsb_t(&av), kvsb_t(&ao), kvsb_t(&al),
                               (void*)(uintptr_t)stream);
      Py_END_ALLOW_THREADS
    }
    kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao); kvsb_release(&al);
    if (!ok || kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  /* kvs_session_decode_tokens: q [n, Hq, d], k_new, v_new [n, Hkv, d] or None, o [n, Hq, d], lse [n, Hq]. */
  PyObject* decode_tokens(uint32_t layer, PyObject* q, PyObject* k_new, PyObject* v_new, PyObject* o, PyObject* lse,
                          unsigned long long stream, PyObject* spec) {
    int has = 0, devt = 0, devid = 0, contig = 0;
    long long d[3];
    if (!kvsb_dims(spec, &has, d, &devt, &devid, &contig)) return NULL;
    kvsb_arg aq, ak, av, ao, al;
    kvsb_expect e;
    memset(&aq, 0, sizeof aq); memset(&ak, 0, sizeof ak); memset(&av, 0, sizeof av);
    memset(&ao, 0, sizeof ao); memset(&al, 0, sizeof al);
    int ok = kvsb_tensor(q, "q", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, -1, d[0], d[2]), &aq);
    int64_t n = ok ? aq.shape[0] : 0;
    ok = ok && kvsb_tensor(k_new, "k_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[1], d[2]), &ak) &&
         kvsb_tensor(v_new, "v_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[1], d[2]), &av) &&
         kvsb_tensor(o, "out", 1, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, n, d[0], d[2]), &ao) &&
         kvsb_tensor(lse, "lse", 2, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, n, d[0], 0), &al);
    kvs_error_t err = NULL;
    if (ok) {
      Py_BEGIN_ALLOW_THREADS
      err = kvs_session_decode_tokens($self, layer, kvsb_t(&aq), kvsb_t(&ak), kvsb_t(&av), kvsb_t(&ao), kvsb_t(&al),
                                      (void*)(uintptr_t)stream);
      Py_END_ALLOW_THREADS
    }
    kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao); kvsb_release(&al);
    if (!ok || kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  /* kvs_session_bind_kv: the pool(s) and the page indices (int32, host) by address; Python checks them. */
  PyObject* bind_kv(uint32_t layer, unsigned long long pages, int64_t num_pages, int32_t page_size,
                    unsigned long long page_indices, int64_t num_page_indices, int64_t num_tokens,
                    unsigned long long stream, unsigned long long pool_bytes, int32_t layout,
                    unsigned long long v_pages, unsigned long long v_pool_bytes) {
    kvs_paged_kv kv;
    kvs_paged_kv_init(&kv);
    kv.layout = layout;
    kv.v_pages = (const void*)(uintptr_t)v_pages;
    kv.v_pool_bytes = v_pool_bytes;
    kv.pages = (const void*)(uintptr_t)pages;
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_indices = (const int32_t*)(uintptr_t)page_indices;
    kv.num_page_indices = num_page_indices;
    kv.num_tokens = num_tokens;
    kv.pool_bytes = pool_bytes;
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_bind_kv($self, layer, &kv, (void*)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  PyObject* truncate(int64_t num_tokens) {
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_truncate($self, num_tokens);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  PyObject* save(const char* path, uint32_t flags) {
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_save($self, path, flags);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  kvs_session_s* fork() {
    kvs_session_t out = NULL;
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_fork($self, &out);
    Py_END_ALLOW_THREADS
    kvsb_raise(err);
    return out;
  }
  kvs_session_s* to(int backend, int device_id) {
    kvs_session_t out = NULL;
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_to($self, backend, device_id, &out);
    Py_END_ALLOW_THREADS
    kvsb_raise(err);
    return out;
  }
  PyObject* stats() {
    kvs_session_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (kvsb_raise(kvs_session_get_stats($self, &st))) return NULL;
    return Py_BuildValue("{s:L,s:L,s:K,s:K,s:K,s:K,s:d,s:d,s:d}", "tokens", (long long)st.tokens,
                         "decode_steps", (long long)st.decode_steps, "kv_bytes", (unsigned long long)st.kv_bytes,
                         "kv_shared_bytes", (unsigned long long)st.kv_shared_bytes, "index_bytes",
                         (unsigned long long)st.index_bytes, "workspace_bytes",
                         (unsigned long long)st.workspace_bytes, "last_selected_keys", st.last_selected_keys,
                         "mean_selected_keys", st.mean_selected_keys, "last_selected_fraction",
                         st.last_selected_fraction);
  }
  PyObject* layer_tokens(uint32_t layer) {
    int64_t n = 0;
    if (kvsb_raise(kvs_session_layer_tokens($self, layer, &n))) return NULL;
    return PyLong_FromLongLong((long long)n);
  }
  /* Returns bytes holding int32 indices (the facade views them as a NumPy array). */
  PyObject* last_selection(uint32_t layer, uint32_t kv_head) {
    size_t count = 0;
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_last_selection($self, layer, kv_head, NULL, 0, &count);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    PyObject* b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * sizeof(int32_t)));
    if (!b) return NULL;
    size_t got = 0;
    int32_t* dst = (int32_t*)PyBytes_AS_STRING(b);
    Py_BEGIN_ALLOW_THREADS
    err = kvs_session_last_selection($self, layer, kv_head, dst, count, &got);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) { Py_DECREF(b); return NULL; }
    return b;
  }
  PyObject* method_stat(const char* name) {
    double v = 0;
    if (kvsb_raise(kvs_session_method_stat($self, name, &v))) return NULL;
    return PyFloat_FromDouble(v);
  }
}

%extend kvs_trace_s {
  ~kvs_trace_s() { kvs_trace_destroy($self); }
  PyObject* info() {
    kvs_trace_info in;
    kvs_trace_info_init(&in);
    if (kvsb_raise(kvs_trace_get_info($self, &in))) return NULL;
    return Py_BuildValue("{s:I,s:I,s:I,s:I,s:L,s:L,s:I,s:d,s:i,s:s}", "num_layers", in.num_layers,
                         "num_q_heads", in.num_q_heads, "num_kv_heads", in.num_kv_heads, "head_dim",
                         in.head_dim, "prefill_len", (long long)in.prefill_len, "total_len",
                         (long long)in.total_len, "num_present_layers", in.num_present_layers,
                         "softmax_scale", (double)in.softmax_scale, "dtype", (int)in.dtype, "source",
                         in.source ? in.source : "");
  }
  PyObject* layer_index(uint32_t i) {
    uint32_t l = 0;
    if (kvsb_raise(kvs_trace_layer_index($self, i, &l))) return NULL;
    return PyLong_FromUnsignedLong(l);
  }
  /* (address, shape, strides_in_elements, dtype_code, bits) of a view valid while the trace lives. */
  PyObject* tensor(uint32_t layer, const char* name) {
    kvs_tensor t;
    memset(&t, 0, sizeof t);
    if (kvsb_raise(kvs_trace_tensor($self, layer, name, &t))) return NULL;
    PyObject* shape = PyTuple_New(t.ndim);
    PyObject* strides = PyTuple_New(t.ndim);
    for (int i = 0; i < t.ndim; ++i) {
      PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong((long long)t.shape[i]));
      PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong((long long)t.strides[i]));
    }
    return Py_BuildValue("(KNNii)", (unsigned long long)(uintptr_t)((char*)t.data + t.byte_offset), shape,
                         strides, (int)t.dtype.code, (int)t.dtype.bits);
  }
}

/* A batch holds raw session pointers: the facade (kvsieve.Batch) keeps the session proxies
 * referenced for as long as the batch lives, so that collection cannot free a session first. */
%extend kvs_batch_s {
  ~kvs_batch_s() { kvs_batch_destroy($self); }
  size_t size() { return kvs_batch_size($self); }
  PyObject* plan(unsigned long long stream) {
    kvs_error_t err;
    Py_BEGIN_ALLOW_THREADS
    err = kvs_batch_plan($self, (void*)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    if (kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
  /* q [B, Hq, d], k_new, v_new [B, Hkv, d], o [B, Hq, d], lse [B, Hq] or None; B = size(). */
  PyObject* decode(uint32_t layer, PyObject* q, PyObject* k_new, PyObject* v_new, PyObject* o, PyObject* lse,
                   unsigned long long stream, PyObject* spec) {
    int64_t B = (int64_t)kvs_batch_size($self);
    int has = 0, devt = 0, devid = 0, contig = 0;
    long long d[3];
    kvsb_arg aq, ak, av, ao, al;
    kvsb_expect e;
    memset(&aq, 0, sizeof aq); memset(&ak, 0, sizeof ak); memset(&av, 0, sizeof av);
    memset(&ao, 0, sizeof ao); memset(&al, 0, sizeof al);
    int ok = kvsb_dims(spec, &has, d, &devt, &devid, &contig) &&
             kvsb_tensor(q, "q", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[0], d[2]), &aq) &&
             kvsb_tensor(k_new, "k_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[1], d[2]), &ak) &&
             kvsb_tensor(v_new, "v_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[1], d[2]), &av) &&
             kvsb_tensor(o, "out", 1, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[0], d[2]), &ao) &&
             kvsb_tensor(lse, "lse", 2, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, B, d[0], 0), &al);
    kvs_error_t err = NULL;
    if (ok) {
      Py_BEGIN_ALLOW_THREADS
      err = kvs_batch_decode($self, layer, kvsb_t(&aq), kvsb_t(&ak), kvsb_t(&av), kvsb_t(&ao), kvsb_t(&al),
                             (void*)(uintptr_t)stream);
      Py_END_ALLOW_THREADS
    }
    kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao); kvsb_release(&al);
    if (!ok || kvsb_raise(err)) return NULL;
    Py_RETURN_NONE;
  }
}

%inline %{
kvs_session_s* session_create(uint32_t num_layers, uint32_t num_q_heads, uint32_t num_kv_heads,
                              uint32_t head_dim, double softmax_scale, int32_t kv_dtype, int32_t backend,
                              int32_t device_id, uint32_t num_threads, int32_t gemm, const char* method,
                              const char* method_params, double budget, int64_t budget_tokens,
                              int32_t lse_base, int64_t max_rollback, int32_t kv_memory, int32_t kv_source) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = num_layers;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.softmax_scale = (float)softmax_scale;
  p.kv_dtype = kv_dtype;
  p.backend = backend;
  p.device_id = device_id;
  p.num_threads = num_threads;
  p.gemm = gemm;
  p.method = method;
  p.method_params = method_params;
  p.budget = budget;
  p.budget_tokens = budget_tokens;
  p.lse_base = lse_base;
  p.max_rollback = max_rollback;
  p.kv_memory = kv_memory;
  p.kv_source = kv_source;
  kvs_session_t s = NULL;
  kvs_error_t err;
  Py_BEGIN_ALLOW_THREADS
  err = kvs_session_create(&p, &s);
  Py_END_ALLOW_THREADS
  kvsb_raise(err);
  return s;
}

kvs_session_s* session_load(const char* path, int32_t backend, int32_t device_id, uint32_t num_threads,
                            int32_t gemm, uint32_t flags, int32_t kv_memory, int32_t kv_source) {
  kvs_load_params p;
  kvs_load_params_init(&p);
  p.kv_source = kv_source;
  p.flags = flags;
  p.kv_memory = kv_memory;
  p.backend = backend;
  p.device_id = device_id;
  p.num_threads = num_threads;
  p.gemm = gemm;
  kvs_session_t s = NULL;
  kvs_error_t err;
  Py_BEGIN_ALLOW_THREADS
  err = kvs_session_load(path, &p, &s);
  Py_END_ALLOW_THREADS
  kvsb_raise(err);
  return s;
}

kvs_trace_s* trace_open(const char* path) {
  kvs_trace_t t = NULL;
  kvs_error_t err;
  Py_BEGIN_ALLOW_THREADS
  err = kvs_trace_open(path, &t);
  Py_END_ALLOW_THREADS
  kvsb_raise(err);
  return t;
}

/* sessions: a sequence of session proxies. */
PyObject* decode_batch(PyObject* sessions, uint32_t layer, PyObject* q, PyObject* k_new, PyObject* v_new,
                       PyObject* o, PyObject* lse, unsigned long long stream, PyObject* spec) {
  PyObject* seq = PySequence_Fast(sessions, "sessions: expected a sequence of sessions");
  if (!seq) return NULL;
  Py_ssize_t B = PySequence_Fast_GET_SIZE(seq);
  kvs_session_t* hs = (kvs_session_t*)PyMem_Calloc(B ? (size_t)B : 1, sizeof(kvs_session_t));
  if (!hs) { Py_DECREF(seq); return PyErr_NoMemory(); }
  for (Py_ssize_t i = 0; i < B; ++i) {
    void* p = NULL;
    if (!SWIG_IsOK(SWIG_ConvertPtr(PySequence_Fast_GET_ITEM(seq, i), &p, SWIGTYPE_p_kvs_session_s, 0)) || !p) {
      PyErr_Format(PyExc_TypeError, "sessions[%zd]: expected an open session", i);
      PyMem_Free(hs); Py_DECREF(seq);
      return NULL;
    }
    hs[i] = (kvs_session_t)p;
  }
  int has = 0, devt = 0, devid = 0, contig = 0;
  long long d[3];
  kvsb_arg aq, ak, av, ao, al;
  kvsb_expect e;
  memset(&aq, 0, sizeof aq); memset(&ak, 0, sizeof ak); memset(&av, 0, sizeof av);
  memset(&ao, 0, sizeof ao); memset(&al, 0, sizeof al);
  int ok = kvsb_dims(spec, &has, d, &devt, &devid, &contig) &&
           kvsb_tensor(q, "q", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[0], d[2]), &aq) &&
           kvsb_tensor(k_new, "k_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[1], d[2]), &ak) &&
           kvsb_tensor(v_new, "v_new", 0, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[1], d[2]), &av) &&
           kvsb_tensor(o, "out", 1, 3, stream, kvsb_mk(&e, has, devt, devid, contig, 3, B, d[0], d[2]), &ao) &&
           kvsb_tensor(lse, "lse", 2, 2, stream, kvsb_mk(&e, has, devt, devid, contig, 2, B, d[0], 0), &al);
  kvs_error_t err = NULL;
  if (ok) {
    Py_BEGIN_ALLOW_THREADS
    err = kvs_decode_batch(hs, (size_t)B, layer, kvsb_t(&aq), kvsb_t(&ak), kvsb_t(&av), kvsb_t(&ao),
                           kvsb_t(&al), (void*)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
  }
  kvsb_release(&aq); kvsb_release(&ak); kvsb_release(&av); kvsb_release(&ao); kvsb_release(&al);
  PyMem_Free(hs);
  Py_DECREF(seq);
  if (!ok || kvsb_raise(err)) return NULL;
  Py_RETURN_NONE;
}

/* sessions: a sequence of session proxies (borrowed: the caller keeps them referenced). */
kvs_batch_s* batch_create(PyObject* sessions) {
  PyObject* seq = PySequence_Fast(sessions, "sessions: expected a sequence of sessions");
  if (!seq) return NULL;
  Py_ssize_t B = PySequence_Fast_GET_SIZE(seq);
  kvs_session_t* hs = (kvs_session_t*)PyMem_Calloc(B ? (size_t)B : 1, sizeof(kvs_session_t));
  if (!hs) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
  for (Py_ssize_t i = 0; i < B; ++i) {
    void* p = NULL;
    if (!SWIG_IsOK(SWIG_ConvertPtr(PySequence_Fast_GET_ITEM(seq, i), &p, SWIGTYPE_p_kvs_session_s, 0)) || !p) {
      PyErr_Format(PyExc_TypeError, "sessions[%zd]: expected an open session", i);
      PyMem_Free(hs); Py_DECREF(seq);
      return NULL;
    }
    hs[i] = (kvs_session_t)p;
  }
  kvs_batch_t b = NULL;
  kvs_error_t err = kvs_batch_create(hs, (size_t)B, &b);
  PyMem_Free(hs);
  Py_DECREF(seq);
  kvsb_raise(err);
  return b;
}

/* Describes a tensor as the binding sees it (for tests and debugging): (device_type, device_id,
 * dtype_code, bits, shape, strides or None, byte_offset, data address). Never copies. */
PyObject* describe_tensor(PyObject* obj, int output) {
  kvsb_arg a;
  int ndim = 0;
  /* accept any rank: find it first through a dry run at rank -1 is not possible; try 1..8 */
  for (ndim = 1; ndim <= KVSB_MAXDIM; ++ndim) {
    if (kvsb_tensor(obj, "tensor", output ? 1 : 0, ndim, 0, NULL, &a)) break;
    if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject* s = ev ? PyObject_Str(ev) : NULL;
    int rank_error = s && strstr(PyUnicode_AsUTF8(s), "dimensions") != NULL;
    Py_XDECREF(s);
    if (!rank_error) { PyErr_Restore(et, ev, tb); return NULL; }
    Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb);
  }
  if (ndim > KVSB_MAXDIM) { PyErr_SetString(PyExc_ValueError, "tensor: expected at most 8 dimensions"); return NULL; }
  PyObject* shape = PyTuple_New(a.t.ndim);
  PyObject* strides = a.t.strides ? PyTuple_New(a.t.ndim) : (Py_INCREF(Py_None), Py_None);
  for (int i = 0; i < a.t.ndim; ++i) {
    PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong((long long)a.t.shape[i]));
    if (a.t.strides) PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong((long long)a.t.strides[i]));
  }
  PyObject* r = Py_BuildValue("(iiiiNNKK)", (int)a.t.device.device_type, (int)a.t.device.device_id,
                              (int)a.t.dtype.code, (int)a.t.dtype.bits, shape, strides,
                              (unsigned long long)a.t.byte_offset, (unsigned long long)(uintptr_t)a.t.data);
  kvsb_release(&a);
  return r;
}

PyObject* method_params(const char* method) {
  size_t n = 0;
  if (kvsb_raise(kvs_method_param_count(method, &n))) return NULL;
  PyObject* list = PyList_New(0);
  for (size_t i = 0; i < n; ++i) {
    kvs_param_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (kvsb_raise(kvs_method_param(method, i, &info))) { Py_DECREF(list); return NULL; }
    PyObject* t = Py_BuildValue("(ssss)", info.name, info.type, info.default_value, info.doc);
    PyList_Append(list, t);
    Py_DECREF(t);
  }
  return list;
}

/* JSON text of a tables file; raises kvsieve.Error on corruption with the JSON in .details. */
PyObject* tables_describe(const char* path) {
  char* json = NULL;
  kvs_error_t err;
  Py_BEGIN_ALLOW_THREADS
  err = kvs_tables_describe(path, &json);
  Py_END_ALLOW_THREADS
  PyObject* text = json ? PyUnicode_FromString(json) : (Py_INCREF(Py_None), Py_None);
  kvs_string_free(json);
  if (err) {
    kvsb_raise(err);
    if (text != Py_None) {
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      PyErr_NormalizeException(&et, &ev, &tb);
      if (ev) PyObject_SetAttrString(ev, "details", text);
      PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(text);
    return NULL;
  }
  return text;
}

PyObject* abi_check(uint32_t v) {
  if (kvsb_raise(kvs_abi_check(v))) return NULL;
  Py_RETURN_NONE;
}

/* fn(level, line) or None to restore the default sink. */
PyObject* set_log_callback(PyObject* fn, int32_t min_level) {
  if (fn == Py_None) {
    kvs_set_log_callback(NULL, NULL, min_level);
    Py_CLEAR(kvsb_log_callable);
    Py_RETURN_NONE;
  }
  if (!PyCallable_Check(fn)) { PyErr_SetString(PyExc_TypeError, "fn: expected a callable or None"); return NULL; }
  Py_INCREF(fn);
  PyObject* old = kvsb_log_callable;
  kvsb_log_callable = fn;
  kvs_set_log_callback(kvsb_log_trampoline, NULL, min_level);
  Py_XDECREF(old);
  Py_RETURN_NONE;
}
%}

%pythoncode %{
ABI_VERSION_HEADER = KVS_ABI_VERSION
%}
