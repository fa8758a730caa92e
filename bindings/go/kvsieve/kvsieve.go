// SPDX-License-Identifier: Apache-2.0

// Package kvsieve is the Go API of kvsieve, sparse-attention decoding over a KV cache, through
// cgo over the C ABI (include/kvsieve/kvsieve.h) of an installed library found by pkg-config
// (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig).
//
//   - Session: one sequence's KV cache and method index. NewSession (parameters as
//     kvs_session_params, defaults from kvs_session_params_init) or LoadSession; Prefill,
//     BuildIndex, Decode, Append, Save, Fork; Close frees it (a finalizer frees a forgotten one).
//   - Batch: sessions decoded together (Plan once per token, Decode per layer). It keeps its
//     sessions reachable; a session in an open batch refuses Close.
//   - Errors are *Error values carrying the kvs_status (Status), the library's message and the
//     backend code; use errors.As.
//
// Tensors are CPU []float32 in C order: q [n, Hq, d], k and v [n, Hkv, d] for Prefill and Append,
// [Hq, d] and [Hkv, d] for a decode step, lse [Hq]; batches put a leading [B] in front. The leading
// dimension comes from the slice length; a length that is not a whole number of rows is refused
// here (StatusInvalidArgument), every other check is the library's own, with its message. The
// slices are passed to C for the duration of the call only (no copies; C keeps nothing).
//
// A Session or Batch is not safe for concurrent use when one of the calls changes it (Prefill,
// BuildIndex, Decode, Append, Plan, Close); Save, Fork, Stats and the other getters may run
// concurrently with each other.
package kvsieve

/*
#cgo pkg-config: kvsieve
#include <stdlib.h>
#include <string.h>
#include <kvsieve/kvsieve.h>

enum { KVSGO_PREFILL, KVSGO_APPEND, KVSGO_DECODE, KVSGO_BATCH_DECODE, KVSGO_DECODE_BATCH };

// The tensor descriptions are built here, on the C stack, around Go memory passed as arguments:
// cgo forbids Go memory that holds Go pointers (a kvs_tensor's data) from being passed to C.
// shapes: 5 x 3 dims of q, k, v, o, lse; ndims: their ranks. o and lse may be NULL (absent).
// kv_given 0: NULL k and v (a session over the caller's cache counts the next bound tokens).
static kvs_error_t kvsgo_step(int op, kvs_session_t s, kvs_batch_t b, kvs_session_t* many, size_t count,
                              uint32_t layer, const int64_t* shapes, const int32_t* ndims, int o_given,
                              int lse_given, int kv_given, float* q, float* k, float* v, float* o, float* lse) {
  int64_t sh[5][3];
  kvs_tensor t[5];
  float* data[5] = {q, k, v, o, lse};
  memcpy(sh, shapes, sizeof sh);
  for (int i = 0; i < 5; ++i) {
    memset(&t[i], 0, sizeof t[i]);
    t[i].data = data[i];
    t[i].device.device_type = KVS_DEVICE_CPU;
    t[i].ndim = ndims[i];
    t[i].dtype.code = KVS_DTYPE_CODE_FLOAT;
    t[i].dtype.bits = 32;
    t[i].dtype.lanes = 1;
    t[i].shape = sh[i];
  }
  const kvs_tensor* to = o_given ? &t[3] : NULL;
  const kvs_tensor* tl = lse_given ? &t[4] : NULL;
  const kvs_tensor* tk = kv_given ? &t[1] : NULL;
  const kvs_tensor* tv = kv_given ? &t[2] : NULL;
  switch (op) {
    case KVSGO_PREFILL: return kvs_session_prefill(s, layer, &t[0], tk, tv, to, NULL);
    case KVSGO_APPEND: return kvs_session_append(s, layer, &t[0], tk, tv, to, NULL);
    case KVSGO_DECODE: return kvs_session_decode(s, layer, &t[0], tk, tv, to, tl, NULL);
    case KVSGO_BATCH_DECODE: return kvs_batch_decode(b, layer, &t[0], tk, tv, to, tl, NULL);
    default: return kvs_decode_batch(many, count, layer, &t[0], tk, tv, to, tl, NULL);
  }
}

// kvs_session_bind_kv with the struct built here: page_indices is Go memory passed as an argument
// (a C struct must not hold a Go pointer); the pools are addresses of memory Go does not manage.
static kvs_error_t kvsgo_bind(kvs_session_t s, uint32_t layer, uintptr_t pages, int64_t num_pages, int32_t page_size,
                              const int32_t* ids, int64_t n, int64_t num_tokens, uint64_t pool_bytes,
                              int32_t layout, uintptr_t v_pages, uint64_t v_pool_bytes, uintptr_t stream) {
  kvs_paged_kv kv;
  kvs_paged_kv_init(&kv);
  kv.pages = (const void*)pages;
  kv.num_pages = num_pages;
  kv.page_size = page_size;
  kv.page_indices = ids;
  kv.num_page_indices = n;
  kv.num_tokens = num_tokens;
  kv.pool_bytes = pool_bytes;
  kv.layout = layout;
  kv.v_pages = (const void*)v_pages;
  kv.v_pool_bytes = v_pool_bytes;
  return kvs_session_bind_kv(s, layer, &kv, (void*)stream);
}
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"runtime"
	"unsafe"
)

// Status is a kvs_status code.
type Status int32

const (
	StatusOK              Status = C.KVS_STATUS_OK
	StatusInvalidArgument Status = C.KVS_STATUS_INVALID_ARGUMENT
	StatusOutOfMemory     Status = C.KVS_STATUS_OUT_OF_MEMORY
	StatusUnsupported     Status = C.KVS_STATUS_UNSUPPORTED
	StatusInvalidState    Status = C.KVS_STATUS_INVALID_STATE
	StatusIO              Status = C.KVS_STATUS_IO
	StatusFormatMagic     Status = C.KVS_STATUS_FORMAT_MAGIC
	StatusFormatVersion   Status = C.KVS_STATUS_FORMAT_VERSION
	StatusFormatTruncated Status = C.KVS_STATUS_FORMAT_TRUNCATED
	StatusFormatChecksum  Status = C.KVS_STATUS_FORMAT_CHECKSUM
	StatusFormatInvalid   Status = C.KVS_STATUS_FORMAT_INVALID
	StatusBackend         Status = C.KVS_STATUS_BACKEND
	StatusABIMismatch     Status = C.KVS_STATUS_ABI_MISMATCH
	StatusInternal        Status = C.KVS_STATUS_INTERNAL
)

var statusNames = map[Status]string{
	StatusOK: "OK", StatusInvalidArgument: "INVALID_ARGUMENT", StatusOutOfMemory: "OUT_OF_MEMORY",
	StatusUnsupported: "UNSUPPORTED", StatusInvalidState: "INVALID_STATE", StatusIO: "IO",
	StatusFormatMagic: "FORMAT_MAGIC", StatusFormatVersion: "FORMAT_VERSION",
	StatusFormatTruncated: "FORMAT_TRUNCATED", StatusFormatChecksum: "FORMAT_CHECKSUM",
	StatusFormatInvalid: "FORMAT_INVALID", StatusBackend: "BACKEND", StatusABIMismatch: "ABI_MISMATCH",
	StatusInternal: "INTERNAL",
}

func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("STATUS_%d", int32(s))
}

// Error is an error of the library (or of this package's own argument checks, with
// StatusInvalidArgument and BackendCode 0).
type Error struct {
	Status      Status
	Message     string // names the function, the argument and what was expected
	BackendCode int64  // cudaError_t, dnnl_status_t or errno; 0 if none
}

func (e *Error) Error() string {
	return fmt.Sprintf("kvsieve: %s (status %s = %d)", e.Message, e.Status, int32(e.Status))
}

// check turns a kvs_error_t into a Go error and frees it.
func check(e C.kvs_error_t) error {
	if e == nil {
		return nil
	}
	defer C.kvs_error_destroy(e)
	return &Error{Status(C.kvs_error_code(e)), C.GoString(C.kvs_error_message(e)), int64(C.kvs_error_backend_code(e))}
}

func invalid(format string, args ...interface{}) error {
	return &Error{Status: StatusInvalidArgument, Message: fmt.Sprintf(format, args...)}
}

// Version is "MAJOR.MINOR.PATCH" of the loaded library.
func Version() string { return C.GoString(C.kvs_version()) }

// ABICheck fails with StatusABIMismatch when the loaded library has another ABI than the header
// this package was compiled against. NewSession and LoadSession call it.
func ABICheck() error { return check(C.kvs_abi_check(C.KVS_ABI_VERSION)) }

// Backend is a kvs_backend.
type Backend int32

const (
	BackendCPU    Backend = C.KVS_BACKEND_CPU
	BackendCUDA   Backend = C.KVS_BACKEND_CUDA
	BackendHybrid Backend = C.KVS_BACKEND_HYBRID
)

// ScalarType is a kvs_scalar_type (the stored K/V type).
type ScalarType int32

const (
	F32  ScalarType = C.KVS_SCALAR_F32
	F16  ScalarType = C.KVS_SCALAR_F16
	BF16 ScalarType = C.KVS_SCALAR_BF16
)

// Gemm is a kvs_gemm_provider.
type Gemm int32

const (
	GemmAuto     Gemm = C.KVS_GEMM_AUTO
	GemmOneDNN   Gemm = C.KVS_GEMM_ONEDNN
	GemmOpenBLAS Gemm = C.KVS_GEMM_OPENBLAS
)

// Methods lists the registered methods, in registry order.
func Methods() []string {
	n := int(C.kvs_method_count())
	out := make([]string, 0, n)
	for i := 0; i < n; i++ {
		if p := C.kvs_method_name(C.size_t(i)); p != nil {
			out = append(out, C.GoString(p))
		}
	}
	return out
}

// MethodDoc is the one-line description of a method; ok is false for an unknown one.
func MethodDoc(method string) (doc string, ok bool) {
	m := C.CString(method)
	defer C.free(unsafe.Pointer(m))
	p := C.kvs_method_doc(m)
	if p == nil {
		return "", false
	}
	return C.GoString(p), true
}

// MethodBackends lists the backends a method supports (none if unknown).
func MethodBackends(method string) []Backend {
	m := C.CString(method)
	defer C.free(unsafe.Pointer(m))
	mask := uint32(C.kvs_method_backends(m))
	var out []Backend
	for _, b := range []Backend{BackendCPU, BackendCUDA, BackendHybrid} {
		if mask&(1<<uint(b)) != 0 {
			out = append(out, b)
		}
	}
	return out
}

// MethodUnsupportedReason says why method cannot run on backend in this build; "" when it can (or
// the method is unknown: see MethodDoc).
func MethodUnsupportedReason(method string, backend Backend) string {
	m := C.CString(method)
	defer C.free(unsafe.Pointer(m))
	if p := C.kvs_method_unsupported_reason(m, C.int32_t(backend)); p != nil {
		return C.GoString(p)
	}
	return ""
}

// ParamInfo describes a method parameter (pass it as name=value in SessionParams.MethodParams).
type ParamInfo struct {
	Name, Type, Default, Doc string // Type: "int", "float", "bool", "string", or "enum:a|b|c"
}

// MethodParams lists a method's parameters; it fails on an unknown method.
func MethodParams(method string) ([]ParamInfo, error) {
	m := C.CString(method)
	defer C.free(unsafe.Pointer(m))
	var n C.size_t
	if err := check(C.kvs_method_param_count(m, &n)); err != nil {
		return nil, err
	}
	out := make([]ParamInfo, 0, int(n))
	for i := C.size_t(0); i < n; i++ {
		var p C.kvs_param_info
		p.struct_size = C.uint32_t(unsafe.Sizeof(p))
		if err := check(C.kvs_method_param(m, i, &p)); err != nil {
			return nil, err
		}
		out = append(out, ParamInfo{C.GoString(p.name), C.GoString(p._type), C.GoString(p.default_value), C.GoString(p.doc)})
	}
	return out, nil
}

// TablesDescribe verifies a tables file (written by Session.Save) and describes it as JSON. A
// corrupt file gives the error (the library's description of it is dropped).
func TablesDescribe(path string) (string, error) {
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	var out *C.char
	e := C.kvs_tables_describe(p, &out)
	// the one call that fills its output on error too: free both
	text := ""
	if out != nil {
		text = C.GoString(out)
		C.kvs_string_free(out)
	}
	if err := check(e); err != nil {
		return "", err
	}
	return text, nil
}

// Shape is the shape of a session's attention.
type Shape struct {
	NumLayers  uint32 `json:"num_layers"`
	NumQHeads  uint32 `json:"num_q_heads"`
	NumKVHeads uint32 `json:"num_kv_heads"`
	HeadDim    uint32 `json:"head_dim"`
}

// SessionParams mirrors kvs_session_params. NewSessionParams fills the defaults of
// kvs_session_params_init (bf16 KV, the cpu backend, method "full", ...).
type SessionParams struct {
	Shape
	SoftmaxScale float32 // 0 = 1/sqrt(head_dim)
	KVDtype      ScalarType
	Backend      Backend
	DeviceID     int32  // CUDA device for the cuda/hybrid backends
	NumThreads   uint32 // 0 = all hardware threads
	Gemm         Gemm
	Method       string  // registry name; "" = NULL = "full"
	MethodParams string  // "key=value,key=value"; "" = defaults
	Budget       float64 // fraction of the context in (0, 1]; 0 = unset
	BudgetTokens int64   // absolute number of exact keys; 0 = unset; wins over Budget
	LseBase      LseBase // the base of the lse Decode writes; LseBaseE (natural log) by default
	// MaxRollback: tokens Truncate must be able to drop on methods whose index keeps history
	// (csattention, ctkvr, lfps, hgca, retroinfer); 0 = none. Costs up to two copies of the index and
	// the queries of 2 * MaxRollback tokens (docs/api.md, "Rollback").
	MaxRollback int64
	// KVMemory is where the KV cache lives, a kvs_device_type (3 = KVS_DEVICE_CUDA_HOST: the cuda
	// backend keeps it in pinned host memory that its kernels read over the bus); 0 = the backend's own.
	KVMemory int32
	// KVFromCaller: the session attends the caller's paged KV cache (kv_source = KVS_KV_CALLER),
	// bound per layer with BindKV; prefill, append and decode with the Bound calls.
	KVFromCaller bool
}

// LseBase is kvs_lse_base: the base of the log-sum-exp a decode step writes.
type LseBase int32

const (
	LseBaseE LseBase = C.KVS_LSE_BASE_E // natural log
	LseBase2 LseBase = C.KVS_LSE_BASE_2 // log2 = ln / ln 2 (FlashInfer's merge_state); not on the cuda backend yet
)

// NewSessionParams gives the library's defaults for a shape.
func NewSessionParams(numLayers, numQHeads, numKVHeads, headDim uint32) SessionParams {
	var p C.kvs_session_params
	C.kvs_session_params_init(&p)
	sp := SessionParams{
		Shape:        Shape{numLayers, numQHeads, numKVHeads, headDim},
		SoftmaxScale: float32(p.softmax_scale),
		KVDtype:      ScalarType(p.kv_dtype),
		Backend:      Backend(p.backend),
		DeviceID:     int32(p.device_id),
		NumThreads:   uint32(p.num_threads),
		Gemm:         Gemm(p.gemm),
		Budget:       float64(p.budget),
		BudgetTokens: int64(p.budget_tokens),
		LseBase:      LseBase(p.lse_base),
		MaxRollback:  int64(p.max_rollback),
		KVMemory:     int32(p.kv_memory),
	}
	if p.method != nil {
		sp.Method = C.GoString(p.method)
	}
	if p.method_params != nil {
		sp.MethodParams = C.GoString(p.method_params)
	}
	return sp
}

// LoadParams mirrors kvs_load_params. The KV pages are always copied out of the file (the C API's
// mapped mode, whose file must not change while the session lives, is not offered here).
type LoadParams struct {
	Backend    Backend // 0 = as saved
	DeviceID   int32
	NumThreads uint32 // 0 = all hardware threads
	Gemm       Gemm
	KVMemory   int32 // as SessionParams.KVMemory; 0 = the backend's own memory
	// KVFromCaller: the tables only, for a session over the caller's cache (bind each layer with
	// BindKV, then PrefillBound it again to the saved length; the loaded index is kept).
	KVFromCaller bool
}

// Stats mirrors kvs_session_stats.
type Stats struct {
	Tokens, DecodeSteps                                      int64
	KVBytes, KVSharedBytes, IndexBytes, WorkspaceBytes       uint64
	LastSelectedKeys, MeanSelectedKeys, LastSelectedFraction float64
}

// Session owns a kvs_session_t.
type Session struct {
	raw     C.kvs_session_t
	shape   Shape
	batches int // open batches holding this session
}

func newSession(raw C.kvs_session_t, shape Shape) *Session {
	s := &Session{raw: raw, shape: shape}
	runtime.SetFinalizer(s, func(s *Session) { C.kvs_session_destroy(s.raw) })
	return s
}

// NewSession creates a session (kvs_session_create).
func NewSession(p SessionParams) (*Session, error) {
	if err := ABICheck(); err != nil {
		return nil, err
	}
	var c C.kvs_session_params
	C.kvs_session_params_init(&c)
	c.num_layers, c.num_q_heads = C.uint32_t(p.NumLayers), C.uint32_t(p.NumQHeads)
	c.num_kv_heads, c.head_dim = C.uint32_t(p.NumKVHeads), C.uint32_t(p.HeadDim)
	c.softmax_scale = C.float(p.SoftmaxScale)
	c.kv_dtype, c.backend, c.device_id = C.int32_t(p.KVDtype), C.int32_t(p.Backend), C.int32_t(p.DeviceID)
	c.num_threads, c.gemm = C.uint32_t(p.NumThreads), C.int32_t(p.Gemm)
	c.budget, c.budget_tokens = C.double(p.Budget), C.int64_t(p.BudgetTokens)
	c.lse_base, c.max_rollback = C.int32_t(p.LseBase), C.int64_t(p.MaxRollback)
	c.kv_memory = C.int32_t(p.KVMemory)
	if p.KVFromCaller {
		c.kv_source = C.KVS_KV_CALLER
	}
	// The strings live in C memory (a C struct must not hold Go pointers); the library copies them.
	if p.Method != "" {
		c.method = C.CString(p.Method)
		defer C.free(unsafe.Pointer(c.method))
	}
	if p.MethodParams != "" {
		c.method_params = C.CString(p.MethodParams)
		defer C.free(unsafe.Pointer(c.method_params))
	}
	var raw C.kvs_session_t
	if err := check(C.kvs_session_create(&c, &raw)); err != nil {
		return nil, err
	}
	return newSession(raw, p.Shape), nil
}

// LoadSession loads a session saved by Session.Save (kvs_session_load). Every checksum and header
// value is verified; the KV pages and the index are copied. A file without KV gives a session
// whose layers must be prefilled again with the same lengths before decoding.
func LoadSession(path string, p LoadParams) (*Session, error) {
	if err := ABICheck(); err != nil {
		return nil, err
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var c C.kvs_load_params
	C.kvs_load_params_init(&c)
	c.backend, c.device_id = C.int32_t(p.Backend), C.int32_t(p.DeviceID)
	c.num_threads, c.gemm = C.uint32_t(p.NumThreads), C.int32_t(p.Gemm)
	c.kv_memory = C.int32_t(p.KVMemory)
	if p.KVFromCaller {
		c.kv_source = C.KVS_KV_CALLER
	}
	var raw C.kvs_session_t
	if err := check(C.kvs_session_load(cp, &c, &raw)); err != nil {
		return nil, err
	}
	s := newSession(raw, Shape{})
	// The C ABI has no shape getter: the shape comes from the file's header, just verified by the
	// load.
	desc, err := TablesDescribe(path)
	if err == nil {
		var d struct {
			Header struct {
				Shape *Shape `json:"shape"`
			} `json:"header"`
		}
		if err = json.Unmarshal([]byte(desc), &d); err == nil && d.Header.Shape == nil {
			err = &Error{Status: StatusFormatInvalid, Message: path + ": no \"shape\" in the tables header"}
		}
		if err == nil {
			s.shape = *d.Header.Shape
		}
	}
	if err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// Shape is the session's attention shape.
func (s *Session) Shape() Shape { return s.shape }

// Close frees the session (kvs_session_destroy); forks of it stay valid. Closing twice is a no-op;
// a session in an open Batch refuses (StatusInvalidState): close the batch first. Calls on a closed
// session fail with the library's error for a NULL handle.
func (s *Session) Close() error {
	if s.batches > 0 {
		return &Error{Status: StatusInvalidState, Message: "Session.Close: the session is in an open Batch: close the batch first"}
	}
	if s.raw != nil {
		C.kvs_session_destroy(s.raw)
		s.raw = nil
		runtime.SetFinalizer(s, nil)
	}
	return nil
}

// dims is [len/prod(inner), inner...]; the slice must hold a whole number of rows.
func dims(name string, n int, layout string, inner ...uint32) ([3]int64, int32, error) {
	var sh [3]int64
	row := 1
	for i, x := range inner {
		row *= int(x)
		sh[i+1] = int64(x)
	}
	if row == 0 || n%row != 0 {
		return sh, 0, invalid("%s: expected %s float32 values (a multiple of %d), got a slice of %d", name, layout, row, n)
	}
	sh[0] = int64(n / row)
	return sh, int32(len(inner) + 1), nil
}

func ptr(s []float32) *C.float {
	if len(s) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&s[0]))
}

type stepArgs struct {
	q, k, v, o, lse []float32
	bound           bool // no k, v: a session over the caller's cache counts the next bound tokens
	// inner dims and layouts of each
	inner  [5][]uint32
	layout [5]string
}

// step describes the five tensors and makes the call.
func step(op C.int, s C.kvs_session_t, b C.kvs_batch_t, many []C.kvs_session_t, layer uint32, a stepArgs) error {
	var shapes [5][3]int64
	var ndims [5]int32
	names := [5]string{"q", "k", "v", "o", "lse"}
	if op == C.KVSGO_DECODE || op == C.KVSGO_BATCH_DECODE || op == C.KVSGO_DECODE_BATCH {
		names[1], names[2] = "k_new", "v_new"
	}
	data := [5][]float32{a.q, a.k, a.v, a.o, a.lse}
	kvGiven := C.int(1)
	if a.bound {
		kvGiven = 0
	}
	for i := range data {
		if ((i == 3 || i == 4) && data[i] == nil) || ((i == 1 || i == 2) && a.bound) {
			continue
		}
		var err error
		if shapes[i], ndims[i], err = dims(names[i], len(data[i]), a.layout[i], a.inner[i]...); err != nil {
			return err
		}
	}
	var manyp *C.kvs_session_t
	if len(many) > 0 {
		manyp = &many[0]
	}
	oGiven, lseGiven := C.int(0), C.int(0)
	if a.o != nil {
		oGiven = 1
	}
	if a.lse != nil {
		lseGiven = 1
	}
	return check(C.kvsgo_step(op, s, b, manyp, C.size_t(len(many)), C.uint32_t(layer),
		(*C.int64_t)(unsafe.Pointer(&shapes[0][0])), (*C.int32_t)(unsafe.Pointer(&ndims[0])), oGiven, lseGiven,
		kvGiven, ptr(a.q), ptr(a.k), ptr(a.v), ptr(a.o), ptr(a.lse)))
}

func (s *Session) chunk(op C.int, layer uint32, q, k, v, o []float32, bound bool) error {
	hq, hkv, d := s.shape.NumQHeads, s.shape.NumKVHeads, s.shape.HeadDim
	err := step(op, s.raw, nil, nil, layer, stepArgs{q: q, k: k, v: v, o: o, bound: bound,
		inner:  [5][]uint32{{hq, d}, {hkv, d}, {hkv, d}, {hq, d}, nil},
		layout: [5]string{"[n, Hq, d]", "[n, Hkv, d]", "[n, Hkv, d]", "[n, Hq, d]", ""}})
	runtime.KeepAlive(s)
	return err
}

// Prefill appends a chunk of one layer's prompt (kvs_session_prefill): q [n, Hq, d], k and v
// [n, Hkv, d]. o (nil to skip) [n, Hq, d] receives causal attention of the chunk over the prompt
// so far.
func (s *Session) Prefill(layer uint32, q, k, v, o []float32) error {
	return s.chunk(C.KVSGO_PREFILL, layer, q, k, v, o, false)
}

// Append adds several tokens of one layer after the index is built (kvs_session_append), shapes
// as Prefill; o (nil to skip) receives exact causal attention over the whole context.
func (s *Session) Append(layer uint32, q, k, v, o []float32) error {
	return s.chunk(C.KVSGO_APPEND, layer, q, k, v, o, false)
}

// BuildIndex builds the method's index over every prefilled layer (kvs_session_build_index).
func (s *Session) BuildIndex() error {
	err := check(C.kvs_session_build_index(s.raw, nil))
	runtime.KeepAlive(s)
	return err
}

// Decode is one decode step of one layer (kvs_session_decode): appends kNew, vNew [Hkv, d],
// attends with q [Hq, d], writes o [Hq, d] and, when lse is not nil, lse [Hq] (natural log).
func (s *Session) Decode(layer uint32, q, kNew, vNew, o, lse []float32) error {
	return s.decode(layer, q, kNew, vNew, o, lse, false)
}

// decode is Decode, or DecodeBound (bound: no kNew, vNew; the caller's cache holds the token).
func (s *Session) decode(layer uint32, q, kNew, vNew, o, lse []float32, bound bool) error {
	d := s.shape.HeadDim
	err := step(C.KVSGO_DECODE, s.raw, nil, nil, layer, stepArgs{q: q, k: kNew, v: vNew, o: o, lse: lse, bound: bound,
		inner:  [5][]uint32{{d}, {d}, {d}, {d}, {}},
		layout: [5]string{"[Hq, d]", "[Hkv, d]", "[Hkv, d]", "[Hq, d]", "[Hq]"}})
	runtime.KeepAlive(s)
	return err
}

// KVLayout is kvs_kv_layout: how a page of a caller's KV cache orders its tokens and heads.
type KVLayout int32

const (
	KVLayoutHND KVLayout = C.KVS_KV_LAYOUT_HND // [Hkv][page_size][d] per page (the default)
	KVLayoutNHD KVLayout = C.KVS_KV_LAYOUT_NHD // [page_size][Hkv][d] per page (cuda backend)
)

// PagedKV mirrors kvs_paged_kv (docs/api.md, "kvs_session_bind_kv"): one layer's KV cache as an
// inference engine keeps it. Pages and VPages are addresses of memory Go does not manage (cgo
// forbids C from keeping Go pointers): a HostPagePool's Addr, or GPU memory of the session's device.
type PagedKV struct {
	Pages       uintptr // the pool (the K pool when VPages is set)
	NumPages    int64
	PageSize    int32   // 256 on the cpu backend; a power of two in 16..1024 on the cuda backend
	PageIndices []int32 // the sequence's pages in token order (copied by the library)
	NumTokens   int64   // tokens of the sequence the cache holds in this layer now
	PoolBytes   uint64  // bytes the pool spans (0: not checked)
	Layout      KVLayout
	VPages      uintptr // 0: K and V in one pool; else the V pool (cuda backend)
	VPoolBytes  uint64
	Stream      uintptr // a cudaStream_t (cuda backend); 0 = the default stream
}

// HostPagePool is host memory for a caller's KV pages that the library may keep pointing to: C
// memory, zeroed, 16-byte aligned, freed by Free (never by the garbage collector). Free it only
// once no session is bound to it any more.
type HostPagePool struct {
	p     unsafe.Pointer
	bytes int
}

// NewHostPagePool allocates bytes of zeroed C memory.
func NewHostPagePool(bytes int) (*HostPagePool, error) {
	if bytes <= 0 {
		return nil, invalid("bytes: expected > 0, got %d", bytes)
	}
	p := C.calloc(C.size_t(bytes), 1)
	if p == nil {
		return nil, &Error{Status: StatusOutOfMemory, Message: fmt.Sprintf("NewHostPagePool: %d bytes", bytes)}
	}
	return &HostPagePool{p: p, bytes: bytes}, nil
}

// Addr is the pool's address (PagedKV.Pages); Bytes its size (PagedKV.PoolBytes).
func (h *HostPagePool) Addr() uintptr { return uintptr(h.p) }
func (h *HostPagePool) Bytes() uint64 { return uint64(h.bytes) }

// Float32s is the pool as float32 values (f32 KV), for the engine to write tokens into.
func (h *HostPagePool) Float32s() []float32 {
	return unsafe.Slice((*float32)(h.p), h.bytes/4)
}

// Uint16s is the pool as 16-bit values (bf16 or f16 KV bits).
func (h *HostPagePool) Uint16s() []uint16 {
	return unsafe.Slice((*uint16)(h.p), h.bytes/2)
}

// Free releases the memory; idempotent.
func (h *HostPagePool) Free() {
	if h.p != nil {
		C.free(h.p)
		h.p = nil
	}
}

// BindKV declares where layer's K/V are now (kvs_session_bind_kv), for sessions created with
// SessionParams.KVFromCaller: kvsieve keeps no copy and reads them in place. Bind again whenever
// the engine's page table grows or changes; PrefillBound, AppendBound and DecodeBound then count the
// next bound tokens as theirs. The pools must stay allocated, and the K/V of the tokens the session
// counts unchanged, until the layer is bound anew or the session (and its forks) is closed.
func (s *Session) BindKV(layer uint32, kv PagedKV) error {
	var ids *C.int32_t
	if len(kv.PageIndices) > 0 {
		ids = (*C.int32_t)(unsafe.Pointer(&kv.PageIndices[0]))
	}
	err := check(C.kvsgo_bind(s.raw, C.uint32_t(layer), C.uintptr_t(kv.Pages), C.int64_t(kv.NumPages),
		C.int32_t(kv.PageSize), ids, C.int64_t(len(kv.PageIndices)), C.int64_t(kv.NumTokens),
		C.uint64_t(kv.PoolBytes), C.int32_t(kv.Layout), C.uintptr_t(kv.VPages), C.uint64_t(kv.VPoolBytes),
		C.uintptr_t(kv.Stream)))
	runtime.KeepAlive(s)
	return err
}

// PrefillBound is Prefill for a session over the caller's cache: q [n, Hq, d], the chunk's K/V
// being the next n bound tokens.
func (s *Session) PrefillBound(layer uint32, q, o []float32) error {
	return s.chunk(C.KVSGO_PREFILL, layer, q, nil, nil, o, true)
}

// AppendBound is Append for a session over the caller's cache (the next n bound tokens).
func (s *Session) AppendBound(layer uint32, q, o []float32) error {
	return s.chunk(C.KVSGO_APPEND, layer, q, nil, nil, o, true)
}

// DecodeBound is Decode for a session over the caller's cache: the step's token is the bound
// token at LayerTokens(layer).
func (s *Session) DecodeBound(layer uint32, q, o, lse []float32) error {
	return s.decode(layer, q, nil, nil, o, lse, true)
}

// Save writes the session (parameters, method tables and, with includeKV, the KV cache)
// atomically to path (kvs_session_save).
func (s *Session) Save(path string, includeKV bool) error {
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	flags := C.uint32_t(C.KVS_SAVE_TABLES)
	if includeKV {
		flags = C.KVS_SAVE_INCLUDE_KV
	}
	err := check(C.kvs_session_save(s.raw, p, flags))
	runtime.KeepAlive(s)
	return err
}

// Fork gives a new session sharing this one's KV prefix, copy-on-write (kvs_session_fork).
func (s *Session) Fork() (*Session, error) {
	var raw C.kvs_session_t
	err := check(C.kvs_session_fork(s.raw, &raw))
	runtime.KeepAlive(s)
	if err != nil {
		return nil, err
	}
	return newSession(raw, s.shape), nil
}

// Stats is kvs_session_get_stats.
func (s *Session) Stats() (Stats, error) {
	var c C.kvs_session_stats
	c.struct_size = C.uint32_t(unsafe.Sizeof(c))
	err := check(C.kvs_session_get_stats(s.raw, &c))
	runtime.KeepAlive(s)
	if err != nil {
		return Stats{}, err
	}
	return Stats{int64(c.tokens), int64(c.decode_steps), uint64(c.kv_bytes), uint64(c.kv_shared_bytes),
		uint64(c.index_bytes), uint64(c.workspace_bytes), float64(c.last_selected_keys),
		float64(c.mean_selected_keys), float64(c.last_selected_fraction)}, nil
}

// Truncate is the rollback (kvs_session_truncate): it keeps the first numTokens tokens of every
// layer and drops the rest, KV and index alike, so decoding continues as if they had never been
// appended. The error names the allowed range (it depends on the method and MaxRollback).
func (s *Session) Truncate(numTokens int64) error {
	err := check(C.kvs_session_truncate(s.raw, C.int64_t(numTokens)))
	runtime.KeepAlive(s)
	return err
}

// LayerTokens is the number of tokens in a layer.
func (s *Session) LayerTokens(layer uint32) (int64, error) {
	var n C.int64_t
	err := check(C.kvs_session_layer_tokens(s.raw, C.uint32_t(layer), &n))
	runtime.KeepAlive(s)
	return int64(n), err
}

// LastSelection lists the keys the last decode step of layer attended for kvHead, ascending.
func (s *Session) LastSelection(layer, kvHead uint32) ([]int32, error) {
	defer runtime.KeepAlive(s)
	var count C.size_t
	if err := check(C.kvs_session_last_selection(s.raw, C.uint32_t(layer), C.uint32_t(kvHead), nil, 0, &count)); err != nil {
		return nil, err
	}
	out := make([]int32, int(count))
	if count == 0 {
		return out, nil
	}
	var got C.size_t
	if err := check(C.kvs_session_last_selection(s.raw, C.uint32_t(layer), C.uint32_t(kvHead),
		(*C.int32_t)(unsafe.Pointer(&out[0])), count, &got)); err != nil {
		return nil, err
	}
	if int(got) < len(out) {
		out = out[:int(got)]
	}
	return out, nil
}

// MethodStat is a statistic by name (kvs_session_method_stat).
func (s *Session) MethodStat(name string) (float64, error) {
	n := C.CString(name)
	defer C.free(unsafe.Pointer(n))
	var v C.double
	err := check(C.kvs_session_method_stat(s.raw, n, &v))
	runtime.KeepAlive(s)
	return float64(v), err
}

func batchArgs(sh Shape, q, kNew, vNew, o, lse []float32) stepArgs {
	hq, hkv, d := sh.NumQHeads, sh.NumKVHeads, sh.HeadDim
	return stepArgs{q: q, k: kNew, v: vNew, o: o, lse: lse,
		inner:  [5][]uint32{{hq, d}, {hkv, d}, {hkv, d}, {hq, d}, {hq}},
		layout: [5]string{"[B, Hq, d]", "[B, Hkv, d]", "[B, Hkv, d]", "[B, Hq, d]", "[B, Hq]"}}
}

// DecodeBatch is one layer's decode step for several sessions of the same shape, method and
// backend (kvs_decode_batch): q [B, Hq, d], kNew, vNew [B, Hkv, d], o [B, Hq, d], lse [B, Hq] or
// nil. All or nothing. For many tokens, a Batch plans once per token instead.
func DecodeBatch(sessions []*Session, layer uint32, q, kNew, vNew, o, lse []float32) error {
	if len(sessions) == 0 {
		return invalid("DecodeBatch: sessions: expected 1 or more, got 0")
	}
	handles := make([]C.kvs_session_t, len(sessions))
	for i, s := range sessions {
		handles[i] = s.raw
	}
	err := step(C.KVSGO_DECODE_BATCH, nil, nil, handles, layer, batchArgs(sessions[0].shape, q, kNew, vNew, o, lse))
	runtime.KeepAlive(sessions)
	return err
}

// Batch owns a kvs_batch_t: sessions decoded together, in a fixed order (the B dimension of the
// step tensors). It keeps its sessions reachable; they may be used on their own between tokens.
type Batch struct {
	raw      C.kvs_batch_t
	sessions []*Session
}

// NewBatch creates a batch of 1..65536 distinct sessions of the same shape, KV dtype, softmax
// scale, method, backend and device (kvs_batch_create).
func NewBatch(sessions ...*Session) (*Batch, error) {
	handles := make([]C.kvs_session_t, len(sessions)+1) // +1: a valid array even for none
	for i, s := range sessions {
		handles[i] = s.raw
	}
	var raw C.kvs_batch_t
	if err := check(C.kvs_batch_create(&handles[0], C.size_t(len(sessions)), &raw)); err != nil {
		return nil, err
	}
	b := &Batch{raw: raw, sessions: append([]*Session(nil), sessions...)}
	for _, s := range b.sessions {
		s.batches++
	}
	runtime.SetFinalizer(b, func(b *Batch) { C.kvs_batch_destroy(b.raw) })
	return b, nil
}

// Len is the number of sessions (kvs_batch_size).
func (b *Batch) Len() int {
	n := int(C.kvs_batch_size(b.raw))
	runtime.KeepAlive(b)
	return n
}

// Sessions are the batch's sessions, in order.
func (b *Batch) Sessions() []*Session { return append([]*Session(nil), b.sessions...) }

// Plan prepares the next token (kvs_batch_plan): once per token, before its Decode calls.
func (b *Batch) Plan() error {
	err := check(C.kvs_batch_plan(b.raw, nil))
	runtime.KeepAlive(b)
	return err
}

// Decode is one layer's step for the planned token (kvs_batch_decode), each layer at most once per
// plan: q [B, Hq, d], kNew, vNew [B, Hkv, d], o [B, Hq, d], lse [B, Hq] or nil.
func (b *Batch) Decode(layer uint32, q, kNew, vNew, o, lse []float32) error {
	sh := Shape{1, 1, 1, 1} // a closed batch: the library names the NULL handle
	if len(b.sessions) > 0 {
		sh = b.sessions[0].shape
	}
	err := step(C.KVSGO_BATCH_DECODE, nil, b.raw, nil, layer, batchArgs(sh, q, kNew, vNew, o, lse))
	runtime.KeepAlive(b)
	return err
}

// Close frees the batch (not its sessions); closing twice is a no-op.
func (b *Batch) Close() error {
	if b.raw != nil {
		C.kvs_batch_destroy(b.raw)
		b.raw = nil
		runtime.SetFinalizer(b, nil)
		for _, s := range b.sessions {
			s.batches--
		}
		b.sessions = nil
	}
	return nil
}
