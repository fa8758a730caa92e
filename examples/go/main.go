// kvsieve from Go through cgo and pkg-config (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig): a prefill
// and a decode checked against a float64 reference, then an error turned into a Go error.
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

	err := check(C.kvs_session_decode(s, 9, &t1, &tkn, &tvn, &to, &tl, nil))
	if e, ok := err.(*KvsError); ok && e.Code == C.KVS_STATUS_INVALID_ARGUMENT {
		fmt.Printf("go: error handled: %v\n", e)
	} else {
		fail(fmt.Errorf("expected INVALID_ARGUMENT, got %v", err))
	}
}

func nil2(int) float32 { return 0 }

func fail(err error) {
	fmt.Fprintln(os.Stderr, "go:", err)
	os.Exit(1)
}
