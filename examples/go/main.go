// SPDX-License-Identifier: Apache-2.0

// kvsieve from Go through cgo and pkg-config (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig): a prefill
// and a decode checked against a float64 reference, a batch of two sessions (plan per token, decode
// per layer) checked against per-session decodes, then an error turned into a Go error.
package main

/*
#cgo pkg-config: kvsieve
#include <stdlib.h>
#include <kvsieve/kvsieve.h>

// Tensors point into C memory (cgo forbids C keeping Go pointers inside C structs).
static kvs_tensor kvs_go_tensor(float* data, int ndim, int64_t* shape) {
  kvs_tensor t = {0};
  t.data = data;
  t.device.device_type = KVS_DEVICE_CPU;
  t.ndim = ndim;
  t.dtype.code = KVS_DTYPE_CODE_FLOAT;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

// The batch's session array lives in C memory too.
static kvs_error_t kvs_go_batch_create(kvs_session_t a, kvs_session_t b, kvs_batch_t* out) {
  kvs_session_t s[2];
  s[0] = a;
  s[1] = b;
  return kvs_batch_create(s, 2, out);
}
*/
import "C"

import (
	"fmt"
	"math"
	"math/rand"
	"os"
	"unsafe"
)

// KvsError carries the kvs_status code and the library's message.
type KvsError struct {
	Code    int
	Message string
}

func (e *KvsError) Error() string { return fmt.Sprintf("kvsieve error %d: %s", e.Code, e.Message) }

func check(e C.kvs_error_t) error {
	if e == nil {
		return nil
	}
	defer C.kvs_error_destroy(e)
	return &KvsError{int(C.kvs_error_code(e)), C.GoString(C.kvs_error_message(e))}
}

// cFloats allocates n floats in C memory, filled by f.
func cFloats(n int, f func(i int) float32) []float32 {
	p := (*C.float)(C.calloc(C.size_t(n), 4))
	s := unsafe.Slice((*float32)(unsafe.Pointer(p)), n)
	for i := range s {
		s[i] = f(i)
	}
	return s
}

func cShape(dims ...int64) *C.int64_t {
	p := (*C.int64_t)(C.calloc(C.size_t(len(dims)), 8))
	copy(unsafe.Slice((*int64)(unsafe.Pointer(p)), len(dims)), dims)
	return p
}

func tensor(data []float32, dims ...int64) C.kvs_tensor {
	return C.kvs_go_tensor((*C.float)(unsafe.Pointer(&data[0])), C.int(len(dims)), cShape(dims...))
}

func main() {
	const hq, hkv, d, n = 4, 2, 16, 64
	rng := rand.New(rand.NewSource(7))
	g := func(int) float32 { return float32(rng.NormFloat64()) }
	q, k, v := cFloats(n*hq*d, g), cFloats((n+1)*hkv*d, g), cFloats((n+1)*hkv*d, g)
	q1, o, lse := cFloats(hq*d, g), cFloats(hq*d, nil2), cFloats(hq, nil2)

	var p C.kvs_session_params
	C.kvs_session_params_init(&p)
	p.num_layers, p.num_q_heads, p.num_kv_heads, p.head_dim = 1, hq, hkv, d
	p.kv_dtype = C.KVS_SCALAR_F32
	method := C.CString("exact_topk")
	defer C.free(unsafe.Pointer(method))
	p.method = method
	p.budget = 1.0
	var s C.kvs_session_t
	if err := check(C.kvs_session_create(&p, &s)); err != nil {
		fail(err)
	}
	defer C.kvs_session_destroy(s)

	tq, tk, tv := tensor(q, n, hq, d), tensor(k, n, hkv, d), tensor(v, n, hkv, d)
	if err := check(C.kvs_session_prefill(s, 0, &tq, &tk, &tv, nil, nil)); err != nil {
		fail(err)
	}
	if err := check(C.kvs_session_build_index(s, nil)); err != nil {
		fail(err)
	}
	t1, tkn, tvn := tensor(q1, hq, d), tensor(k[n*hkv*d:], hkv, d), tensor(v[n*hkv*d:], hkv, d)
	to, tl := tensor(o, hq, d), tensor(lse, hq)
	if err := check(C.kvs_session_decode(s, 0, &t1, &tkn, &tvn, &to, &tl, nil)); err != nil {
		fail(err)
	}

	scale := 1 / math.Sqrt(d)
	worst := 0.0
	for h := 0; h < hq; h++ {
		kh := h / (hq / hkv)
		sc := make([]float64, n+1)
		m := math.Inf(-1)
		for j := 0; j <= n; j++ {
			dot := 0.0
			for c := 0; c < d; c++ {
				dot += float64(q1[h*d+c]) * float64(k[(j*hkv+kh)*d+c])
			}
			sc[j] = scale * dot
			m = math.Max(m, sc[j])
		}
		sum := 0.0
		for j := range sc {
			sum += math.Exp(sc[j] - m)
		}
		worst = math.Max(worst, math.Abs(m+math.Log(sum)-float64(lse[h])))
		for c := 0; c < d; c++ {
			acc := 0.0
			for j := range sc {
				acc += math.Exp(sc[j]-m) * float64(v[(j*hkv+kh)*d+c])
			}
			worst = math.Max(worst, math.Abs(acc/sum-float64(o[h*d+c])))
		}
	}
	fmt.Printf("go: kvsieve %s: decode max |error| vs float64 reference = %.2e\n", C.GoString(C.kvs_version()), worst)
	if !(worst < 1e-4) {
		fail(fmt.Errorf("decode does not match the reference"))
	}

	bw := batchExample(g)
	fmt.Printf("go: batch of 2 sessions, 3 tokens x 2 layers: max |batch - per-session decode| = %.2e\n", bw)
	if !(bw < 1e-5) {
		fail(fmt.Errorf("batch decode does not match per-session decode"))
	}

	err := check(C.kvs_session_decode(s, 9, &t1, &tkn, &tvn, &to, &tl, nil))
	if e, ok := err.(*KvsError); ok && e.Code == C.KVS_STATUS_INVALID_ARGUMENT {
		fmt.Printf("go: error handled: %v\n", e)
	} else {
		fail(fmt.Errorf("expected INVALID_ARGUMENT, got %v", err))
	}
}

// batchExample decodes three tokens for a batch of two 2-layer quest sessions with different
// prompts (plan once per token, decode per layer) and the same tokens through forks taken before,
// one session at a time; it returns the largest difference between the two.
func batchExample(g func(int) float32) float64 {
	const layers, B, hq, hkv, d, n = 2, 2, 4, 2, 16, 48
	method := C.CString("quest")
	defer C.free(unsafe.Pointer(method))
	if why := C.kvs_method_unsupported_reason(method, C.KVS_BACKEND_CPU); why != nil {
		fail(fmt.Errorf("quest on the CPU: %s", C.GoString(why)))
	}
	if why := C.kvs_method_unsupported_reason(method, C.KVS_BACKEND_HYBRID); why != nil {
		fmt.Printf("go: quest on hybrid: %s\n", C.GoString(why))
	}
	var p C.kvs_session_params
	C.kvs_session_params_init(&p)
	p.num_layers, p.num_q_heads, p.num_kv_heads, p.head_dim = layers, hq, hkv, d
	p.kv_dtype = C.KVS_SCALAR_F32
	p.method = method
	p.budget = 0.25
	var sessions, forks [B]C.kvs_session_t
	for b := 0; b < B; b++ {
		if err := check(C.kvs_session_create(&p, &sessions[b])); err != nil {
			fail(err)
		}
		defer C.kvs_session_destroy(sessions[b])
		q, k, v := cFloats(n*hq*d, g), cFloats(n*hkv*d, g), cFloats(n*hkv*d, g)
		tq, tk, tv := tensor(q, n, hq, d), tensor(k, n, hkv, d), tensor(v, n, hkv, d)
		for l := 0; l < layers; l++ {
			if err := check(C.kvs_session_prefill(sessions[b], C.uint32_t(l), &tq, &tk, &tv, nil, nil)); err != nil {
				fail(err)
			}
		}
		if err := check(C.kvs_session_build_index(sessions[b], nil)); err != nil {
			fail(err)
		}
		if err := check(C.kvs_session_fork(sessions[b], &forks[b])); err != nil {
			fail(err)
		}
		defer C.kvs_session_destroy(forks[b])
	}
	var batch C.kvs_batch_t
	if err := check(C.kvs_go_batch_create(sessions[0], sessions[1], &batch)); err != nil {
		fail(err)
	}
	defer C.kvs_batch_destroy(batch) // deferred last: runs before the sessions' destroys
	if C.kvs_batch_size(batch) != B {
		fail(fmt.Errorf("kvs_batch_size: expected %d", B))
	}
	worst := 0.0
	for token := 0; token < 3; token++ {
		if err := check(C.kvs_batch_plan(batch, nil)); err != nil {
			fail(err)
		}
		for l := 0; l < layers; l++ {
			q, k, v := cFloats(B*hq*d, g), cFloats(B*hkv*d, g), cFloats(B*hkv*d, g)
			o, lse := cFloats(B*hq*d, nil2), cFloats(B*hq, nil2)
			tq, tk, tv := tensor(q, B, hq, d), tensor(k, B, hkv, d), tensor(v, B, hkv, d)
			to, tl := tensor(o, B, hq, d), tensor(lse, B, hq)
			if err := check(C.kvs_batch_decode(batch, C.uint32_t(l), &tq, &tk, &tv, &to, &tl, nil)); err != nil {
				fail(err)
			}
			if l == 0 { // each layer at most once per plan
				err := check(C.kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, &tl, nil))
				if e, ok := err.(*KvsError); !ok || e.Code != C.KVS_STATUS_INVALID_STATE {
					fail(fmt.Errorf("expected INVALID_STATE for a layer decoded twice, got %v", err))
				}
			}
			for b := 0; b < B; b++ {
				so, sl := cFloats(hq*d, nil2), cFloats(hq, nil2)
				t1 := tensor(q[b*hq*d:], hq, d)
				tk1, tv1 := tensor(k[b*hkv*d:], hkv, d), tensor(v[b*hkv*d:], hkv, d)
				to1, tl1 := tensor(so, hq, d), tensor(sl, hq)
				if err := check(C.kvs_session_decode(forks[b], C.uint32_t(l), &t1, &tk1, &tv1, &to1, &tl1, nil)); err != nil {
					fail(err)
				}
				for i := range so {
					worst = math.Max(worst, math.Abs(float64(so[i]-o[b*hq*d+i])))
				}
				for h := range sl {
					worst = math.Max(worst, math.Abs(float64(sl[h]-lse[b*hq+h])))
				}
			}
		}
	}
	return worst
}

func nil2(int) float32 { return 0 }

func fail(err error) {
	fmt.Fprintln(os.Stderr, "go:", err)
	os.Exit(1)
}
