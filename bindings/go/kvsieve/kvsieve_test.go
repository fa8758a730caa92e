// SPDX-License-Identifier: Apache-2.0

// The Go package against the installed library: decodes, prefills and appends checked against
// softmax attention computed here in float64 on random inputs, a batch checked against
// per-session decodes, save/load, forks, method listing, and errors with their status.
package kvsieve

import (
	"errors"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const hq, hkv, d = 4, 2, 16

func randVec(rng *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(rng.Float64()*2 - 1)
	}
	return out
}

func nans(n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(math.NaN())
	}
	return out
}

// reference is softmax attention in float64 of one query row [hq, d] against the first ctx keys
// of k, v ([T, hkv, d]), grouped query heads. It returns o [hq, d] and lse [hq].
func reference(q, k, v []float32, ctx int) ([]float64, []float64) {
	scale := 1 / math.Sqrt(d)
	o, lse := make([]float64, hq*d), make([]float64, hq)
	for h := 0; h < hq; h++ {
		kh := h / (hq / hkv)
		s := make([]float64, ctx)
		m := math.Inf(-1)
		for j := 0; j < ctx; j++ {
			dot := 0.0
			for c := 0; c < d; c++ {
				dot += float64(q[h*d+c]) * float64(k[(j*hkv+kh)*d+c])
			}
			s[j] = scale * dot
			m = math.Max(m, s[j])
		}
		z := 0.0
		for j := range s {
			s[j] = math.Exp(s[j] - m)
			z += s[j]
		}
		lse[h] = m + math.Log(z)
		for c := 0; c < d; c++ {
			acc := 0.0
			for j := 0; j < ctx; j++ {
				acc += s[j] * float64(v[(j*hkv+kh)*d+c])
			}
			o[h*d+c] = acc / z
		}
	}
	return o, lse
}

func maxDiff(t *testing.T, a []float32, b []float64) float64 {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("lengths %d and %d", len(a), len(b))
	}
	w := 0.0
	for i := range a {
		w = math.Max(w, math.Abs(float64(a[i])-b[i]))
		if math.IsNaN(float64(a[i])) {
			return math.Inf(1)
		}
	}
	return w
}

func to64(a []float32) []float64 {
	out := make([]float64, len(a))
	for i, x := range a {
		out[i] = float64(x)
	}
	return out
}

func fullParams(layers uint32) SessionParams {
	p := NewSessionParams(layers, hq, hkv, d)
	p.Method, p.KVDtype = "full", F32
	return p
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantStatus(t *testing.T, err error, want Status) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("expected a *kvsieve.Error with %s, got %v", want, err)
	}
	if e.Status != want {
		t.Fatalf("expected %s, got %v", want, e)
	}
	return e
}

func TestFullPrefillDecodeAppendMatchFloat64Reference(t *testing.T) {
	rng := rand.New(rand.NewSource(11))
	const n, m = 40, 3
	total := n + 1 + m
	q, k, v := randVec(rng, total*hq*d), randVec(rng, total*hkv*d), randVec(rng, total*hkv*d)
	qrow := func(i int) []float32 { return q[i*hq*d : (i+1)*hq*d] }

	s, err := NewSession(fullParams(1))
	must(t, err)
	defer s.Close()
	// two prefill chunks; o is causal attention of each prompt token over the prompt so far
	const split = 25
	oPre := nans(n * hq * d)
	must(t, s.Prefill(0, q[:split*hq*d], k[:split*hkv*d], v[:split*hkv*d], oPre[:split*hq*d]))
	must(t, s.Prefill(0, q[split*hq*d:n*hq*d], k[split*hkv*d:n*hkv*d], v[split*hkv*d:n*hkv*d], oPre[split*hq*d:]))
	worst := 0.0
	for i := 0; i < n; i++ {
		oRef, _ := reference(qrow(i), k, v, i+1)
		worst = math.Max(worst, maxDiff(t, oPre[i*hq*d:(i+1)*hq*d], oRef))
	}
	if !(worst < 1e-4) {
		t.Fatalf("prefill o vs float64 causal reference: %g", worst)
	}
	must(t, s.BuildIndex())

	o, lse := nans(hq*d), nans(hq)
	must(t, s.Decode(0, qrow(n), k[n*hkv*d:(n+1)*hkv*d], v[n*hkv*d:(n+1)*hkv*d], o, lse))
	oRef, lseRef := reference(qrow(n), k, v, n+1)
	if eo, el := maxDiff(t, o, oRef), maxDiff(t, lse, lseRef); !(eo < 1e-4 && el < 1e-4) {
		t.Fatalf("decode vs float64 reference: o %g, lse %g", eo, el)
	}
	big := false
	for _, x := range oRef {
		big = big || math.Abs(x) > 0.05
	}
	if !big {
		t.Fatal("reference output is all tiny: the test would not tell a kernel from zeros")
	}

	a := n + 1
	oApp := nans(m * hq * d)
	must(t, s.Append(0, q[a*hq*d:], k[a*hkv*d:], v[a*hkv*d:], oApp))
	worst = 0
	for i := 0; i < m; i++ {
		oRef, _ := reference(qrow(a+i), k, v, a+i+1)
		worst = math.Max(worst, maxDiff(t, oApp[i*hq*d:(i+1)*hq*d], oRef))
	}
	if !(worst < 1e-4) {
		t.Fatalf("append o vs float64 reference: %g", worst)
	}
	st, err := s.Stats()
	must(t, err)
	if st.Tokens != int64(total) || st.DecodeSteps != 1 {
		t.Fatalf("stats: %+v", st)
	}
}

// Two 2-layer quest sessions (a real selection: a quarter of the context) decode three tokens
// through a batch; forks taken before decode the same tokens one session at a time.
func TestBatchMatchesPerSessionDecodes(t *testing.T) {
	const layers, B = 2, 2
	rng := rand.New(rand.NewSource(42))
	p := NewSessionParams(layers, hq, hkv, d)
	p.Method, p.KVDtype, p.Budget = "quest", F32, 0.25
	var sessions, forks []*Session
	for b := 0; b < B; b++ {
		n := 48 + 16*b
		s, err := NewSession(p)
		must(t, err)
		defer s.Close()
		q, k, v := randVec(rng, n*hq*d), randVec(rng, n*hkv*d), randVec(rng, n*hkv*d)
		for l := uint32(0); l < layers; l++ {
			must(t, s.Prefill(l, q, k, v, nil))
		}
		must(t, s.BuildIndex())
		f, err := s.Fork()
		must(t, err)
		defer f.Close()
		sessions, forks = append(sessions, s), append(forks, f)
	}
	batch, err := NewBatch(sessions...)
	must(t, err)
	if batch.Len() != B {
		t.Fatalf("Len: %d", batch.Len())
	}
	wantStatus(t, sessions[0].Close(), StatusInvalidState) // still in the batch
	worst := 0.0
	for token := 0; token < 3; token++ {
		must(t, batch.Plan())
		for l := uint32(0); l < layers; l++ {
			q, k, v := randVec(rng, B*hq*d), randVec(rng, B*hkv*d), randVec(rng, B*hkv*d)
			o, lse := nans(B*hq*d), nans(B*hq)
			must(t, batch.Decode(l, q, k, v, o, lse))
			if l == 0 {
				wantStatus(t, batch.Decode(0, q, k, v, o, lse), StatusInvalidState)
			}
			for b := 0; b < B; b++ {
				ob, lb := nans(hq*d), nans(hq)
				must(t, forks[b].Decode(l, q[b*hq*d:(b+1)*hq*d], k[b*hkv*d:(b+1)*hkv*d], v[b*hkv*d:(b+1)*hkv*d], ob, lb))
				worst = math.Max(worst, maxDiff(t, o[b*hq*d:(b+1)*hq*d], to64(ob)))
				worst = math.Max(worst, maxDiff(t, lse[b*hq:(b+1)*hq], to64(lb)))
			}
		}
	}
	if !(worst < 1e-5) {
		t.Fatalf("batch vs per-session decodes: %g", worst)
	}
	must(t, batch.Close())
	must(t, batch.Close()) // idempotent
	st, err := sessions[0].Stats()
	must(t, err)
	if st.DecodeSteps != 3*layers {
		t.Fatalf("decode steps %d", st.DecodeSteps)
	}
}

// A batch of two full sessions, and DecodeBatch, against the float64 reference directly.
func TestBatchOfFullSessionsMatchesFloat64Reference(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	const n = 30
	var ks, vs [][]float32
	var sessions []*Session
	for b := 0; b < 2; b++ {
		s, err := NewSession(fullParams(1))
		must(t, err)
		defer s.Close()
		q, k, v := randVec(rng, n*hq*d), randVec(rng, n*hkv*d), randVec(rng, n*hkv*d)
		must(t, s.Prefill(0, q, k, v, nil))
		must(t, s.BuildIndex())
		sessions, ks, vs = append(sessions, s), append(ks, k), append(vs, v)
	}
	batch, err := NewBatch(sessions...)
	must(t, err)
	defer batch.Close()
	for token := 0; token < 2; token++ {
		q, kn, vn := randVec(rng, 2*hq*d), randVec(rng, 2*hkv*d), randVec(rng, 2*hkv*d)
		o := nans(2 * hq * d)
		if token == 0 {
			must(t, batch.Plan())
			must(t, batch.Decode(0, q, kn, vn, o, nil))
		} else {
			must(t, DecodeBatch(sessions, 0, q, kn, vn, o, nil))
		}
		for b := 0; b < 2; b++ {
			ks[b] = append(ks[b], kn[b*hkv*d:(b+1)*hkv*d]...)
			vs[b] = append(vs[b], vn[b*hkv*d:(b+1)*hkv*d]...)
			oRef, _ := reference(q[b*hq*d:(b+1)*hq*d], ks[b], vs[b], n+1+token)
			if e := maxDiff(t, o[b*hq*d:(b+1)*hq*d], oRef); !(e < 1e-4) {
				t.Fatalf("token %d, batch element %d vs float64 reference: %g", token, b, e)
			}
		}
	}
}

func TestSaveLoadForkRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewSource(1234))
	const n = 64
	p := NewSessionParams(2, hq, hkv, d)
	p.Method, p.KVDtype, p.Budget = "quest", F32, 0.3
	s, err := NewSession(p)
	must(t, err)
	defer s.Close()
	q, k, v := randVec(rng, n*hq*d), randVec(rng, n*hkv*d), randVec(rng, n*hkv*d)
	for l := uint32(0); l < 2; l++ {
		must(t, s.Prefill(l, q, k, v, nil))
	}
	must(t, s.BuildIndex())
	dir := t.TempDir()
	path := filepath.Join(dir, "s.kvt")
	must(t, s.Save(path, true))
	desc, err := TablesDescribe(path)
	must(t, err)
	if !strings.Contains(desc, `"quest"`) {
		t.Fatalf("describe: %s", desc)
	}
	l, err := LoadSession(path, LoadParams{})
	must(t, err)
	defer l.Close()
	if l.Shape() != s.Shape() {
		t.Fatalf("loaded shape %+v, saved %+v", l.Shape(), s.Shape())
	}
	f, err := s.Fork()
	must(t, err)
	defer f.Close()
	q1, k1, v1 := randVec(rng, hq*d), randVec(rng, hkv*d), randVec(rng, hkv*d)
	var outs [][]float32
	for _, x := range []*Session{s, l, f} {
		o := nans(hq * d)
		must(t, x.Decode(1, q1, k1, v1, o, nil))
		outs = append(outs, o)
	}
	for i := range outs[0] {
		if outs[0][i] != outs[1][i] || outs[0][i] != outs[2][i] {
			t.Fatalf("element %d: saved %g, loaded %g, fork %g", i, outs[0][i], outs[1][i], outs[2][i])
		}
	}
	sel, err := l.LastSelection(1, 0)
	must(t, err)
	if len(sel) == 0 || len(sel) > n {
		t.Fatalf("selection of %d keys", len(sel))
	}
	for i := 1; i < len(sel); i++ {
		if sel[i-1] >= sel[i] {
			t.Fatalf("selection not ascending: %v", sel)
		}
	}
	data, err := os.ReadFile(path)
	must(t, err)
	bad := filepath.Join(dir, "bad.kvt")
	must(t, os.WriteFile(bad, data[:len(data)/2], 0o644))
	_, err = LoadSession(bad, LoadParams{})
	var e *Error
	if !errors.As(err, &e) || (e.Status != StatusFormatTruncated && e.Status != StatusFormatInvalid && e.Status != StatusFormatChecksum) {
		t.Fatalf("truncated file: %v", err)
	}
	_, err = LoadSession(filepath.Join(dir, "missing.kvt"), LoadParams{})
	wantStatus(t, err, StatusIO)
}

func TestErrorsCarryStatusAndMessage(t *testing.T) {
	rng := rand.New(rand.NewSource(99))
	_, err := NewSession(NewSessionParams(1, 4, 2, 3))
	if e := wantStatus(t, err, StatusInvalidArgument); !strings.Contains(e.Message, "head_dim") {
		t.Fatalf("message does not name head_dim: %v", e)
	}
	bad := fullParams(1)
	bad.Method = "no-such-method"
	_, err = NewSession(bad)
	wantStatus(t, err, StatusInvalidArgument)

	s, err := NewSession(fullParams(1))
	must(t, err)
	defer s.Close()
	q, k, v, o := randVec(rng, hq*d), randVec(rng, hkv*d), randVec(rng, hkv*d), make([]float32, hq*d)
	wantStatus(t, s.Decode(0, q, k, v, o, nil), StatusInvalidState) // before prefill
	must(t, s.Prefill(0, randVec(rng, 8*hq*d), randVec(rng, 8*hkv*d), randVec(rng, 8*hkv*d), nil))
	must(t, s.BuildIndex())
	if e := wantStatus(t, s.Decode(5, q, k, v, o, nil), StatusInvalidArgument); !strings.Contains(e.Message, "layer") {
		t.Fatalf("message does not name the layer: %v", e)
	}
	wantStatus(t, s.Decode(0, q[:2*d], k, v, o, nil), StatusInvalidArgument) // 2 heads, not 4
	wantStatus(t, s.Decode(0, q[:d+1], k, v, o, nil), StatusInvalidArgument) // not whole rows
	wantStatus(t, s.Decode(0, q, k, v, nil, nil), StatusInvalidArgument)     // o missing
	must(t, s.Decode(0, q, k, v, o, nil))                                    // nothing changed before
	if n, err := s.LayerTokens(0); err != nil || n != 9 {
		t.Fatalf("layer tokens %d, %v", n, err)
	}
	other := NewSessionParams(1, 2, 2, d)
	other.Method, other.KVDtype = "full", F32
	s2, err := NewSession(other)
	must(t, err)
	defer s2.Close()
	_, err = NewBatch(s, s2)
	wantStatus(t, err, StatusInvalidArgument)
	_, err = NewBatch()
	wantStatus(t, err, StatusInvalidArgument)
	b, err := NewBatch(s)
	must(t, err)
	e := wantStatus(t, b.Decode(0, q, k, v, o, nil), StatusInvalidState) // before Plan
	if !strings.Contains(e.Error(), "kvs_batch_decode") {
		t.Fatalf("message: %v", e)
	}
	must(t, b.Close())
	wantStatus(t, b.Plan(), StatusInvalidArgument) // a closed batch
	// a closed session: the library's NULL-handle error
	must(t, s2.Close())
	must(t, s2.Close())
	wantStatus(t, s2.BuildIndex(), StatusInvalidArgument)
}

func TestMethodsAreListed(t *testing.T) {
	names := Methods()
	has := map[string]bool{}
	for _, m := range names {
		has[m] = true
		if _, ok := MethodDoc(m); !ok {
			t.Fatalf("%s has no doc", m)
		}
		if _, err := MethodParams(m); err != nil {
			t.Fatalf("%s: %v", m, err)
		}
	}
	if !has["full"] || !has["quest"] {
		t.Fatalf("methods: %v", names)
	}
	if r := MethodUnsupportedReason("quest", BackendCPU); r != "" {
		t.Fatalf("quest on the cpu: %s", r)
	}
	cpu := false
	for _, b := range MethodBackends("quest") {
		cpu = cpu || b == BackendCPU
	}
	if !cpu {
		t.Fatal("quest does not list the cpu backend")
	}
	if _, ok := MethodDoc("no-such-method"); ok {
		t.Fatal("an unknown method has a doc")
	}
	_, err := MethodParams("no-such-method")
	wantStatus(t, err, StatusInvalidArgument)
	if !strings.HasPrefix(Version(), "0.") {
		t.Fatalf("version %s", Version())
	}
	must(t, ABICheck())
}

// Sessions and batches left to the garbage collector are freed by their finalizers, the batch
// before its sessions.
func TestFinalizers(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	for i := 0; i < 20; i++ {
		s, err := NewSession(fullParams(1))
		must(t, err)
		must(t, s.Prefill(0, randVec(rng, 4*hq*d), randVec(rng, 4*hkv*d), randVec(rng, 4*hkv*d), nil))
		must(t, s.BuildIndex())
		_, err = NewBatch(s)
		must(t, err)
	}
	runtime.GC()
	runtime.GC()
}

// Truncate drops decoded tokens: the next step equals a session that never saw them (csattention,
// whose rollback replays its history); out of range is refused naming the argument; lse base 2.
func TestTruncateAndLseBase2(t *testing.T) {
	rng := rand.New(rand.NewSource(2121))
	const n = 64
	q, k, v := randVec(rng, (n+3)*hq*d), randVec(rng, (n+3)*hkv*d), randVec(rng, (n+3)*hkv*d)
	start := func(base LseBase) *Session {
		p := NewSessionParams(1, hq, hkv, d)
		p.Method, p.Budget, p.MaxRollback, p.LseBase = "csattention", 0.5, 4, base
		s, err := NewSession(p)
		must(t, err)
		must(t, s.Prefill(0, q[:n*hq*d], k[:n*hkv*d], v[:n*hkv*d], nil))
		must(t, s.BuildIndex())
		return s
	}
	step := func(s *Session, i int) ([]float32, []float32) {
		o, lse := nans(hq*d), nans(hq)
		must(t, s.Decode(0, q[i*hq*d:(i+1)*hq*d], k[i*hkv*d:(i+1)*hkv*d], v[i*hkv*d:(i+1)*hkv*d], o, lse))
		return o, lse
	}
	a := start(LseBaseE)
	defer a.Close()
	step(a, n)
	step(a, n+1)
	must(t, a.Truncate(n+1))
	if got, _ := a.LayerTokens(0); got != n+1 {
		t.Fatalf("tokens after truncate: %d", got)
	}
	if e := wantStatus(t, a.Truncate(n+5), StatusInvalidArgument); !strings.Contains(e.Message, "num_tokens") {
		t.Fatalf("message does not name num_tokens: %v", e)
	}
	oa, la := step(a, n+2)
	b := start(LseBase2)
	defer b.Close()
	step(b, n)
	ob, lb := step(b, n+2)
	for i := range oa {
		if oa[i] != ob[i] {
			t.Fatalf("o[%d]: %g after rollback, %g without the dropped token", i, oa[i], ob[i])
		}
	}
	for h := 0; h < hq; h++ {
		want := float64(la[h]) / math.Ln2
		if math.Abs(float64(lb[h])-want) > 1e-5*math.Max(1, math.Abs(want)) {
			t.Fatalf("lse base 2 [%d]: %g, want %g", h, lb[h], want)
		}
	}
}

// A session over the caller's paged cache (KVFromCaller, BindKV, the Bound calls) decodes as one
// storing the same tokens, to the bit; its tables load back into a caller session.
func TestCallerKVMatchesAnOwnedSession(t *testing.T) {
	rng := rand.New(rand.NewSource(77))
	const n, page = 300, 256 // the cpu backend's page size
	q, k, v := randVec(rng, (n+2)*hq*d), randVec(rng, (n+2)*hkv*d), randVec(rng, (n+2)*hkv*d)
	// The engine's pool: 3 pages of [2][Hkv][P][d] float32 in C memory; the sequence in pages 2, 0.
	pool, err := NewHostPagePool(3 * 2 * hkv * page * d * 4)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Free()
	f := pool.Float32s()
	table := []int32{2, 0}
	for tok := 0; tok < n+2; tok++ {
		pg := int(table[tok/page])
		for h := 0; h < hkv; h++ {
			for j := 0; j < d; j++ {
				f[((pg*2)*hkv+h)*page*d+(tok%page)*d+j] = k[(tok*hkv+h)*d+j]
				f[((pg*2+1)*hkv+h)*page*d+(tok%page)*d+j] = v[(tok*hkv+h)*d+j]
			}
		}
	}
	bind := func(s *Session, tokens int) {
		t.Helper()
		kv := PagedKV{Pages: pool.Addr(), NumPages: 3, PageSize: page, PageIndices: table, NumTokens: int64(tokens),
			PoolBytes: pool.Bytes()}
		if err := s.BindKV(0, kv); err != nil {
			t.Fatal(err)
		}
	}
	p := NewSessionParams(1, hq, hkv, d)
	p.Method, p.Budget, p.KVDtype, p.NumThreads = "quest", 0.3, F32, 1
	own, err := NewSession(p)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	p.KVFromCaller = true
	cal, err := NewSession(p)
	if err != nil {
		t.Fatal(err)
	}
	defer cal.Close()
	if err := own.Prefill(0, q[:n*hq*d], k[:n*hkv*d], v[:n*hkv*d], nil); err != nil {
		t.Fatal(err)
	}
	var e *Error
	if err := cal.PrefillBound(0, q[:n*hq*d], nil); !errors.As(err, &e) || e.Status != StatusInvalidState {
		t.Fatalf("prefill before any binding: %v", err)
	}
	bind(cal, n)
	if err := cal.PrefillBound(0, q[:n*hq*d], nil); err != nil {
		t.Fatal(err)
	}
	if err := own.BuildIndex(); err != nil {
		t.Fatal(err)
	}
	if err := cal.BuildIndex(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "quest.kvs")
	if err := own.Save(path, false); err != nil {
		t.Fatal(err)
	}
	ld, err := LoadSession(path, LoadParams{KVFromCaller: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ld.Close()
	if got, _ := ld.LayerTokens(0); got != 0 {
		t.Fatalf("a caller session loaded from tables holds %d tokens before its prefill", got)
	}
	bind(ld, n)
	if err := ld.PrefillBound(0, q[:n*hq*d], nil); err != nil {
		t.Fatal(err)
	}
	for tok := n; tok < n+2; tok++ {
		o1, o2, o3 := nans(hq*d), nans(hq*d), nans(hq*d)
		qt := q[tok*hq*d : (tok+1)*hq*d]
		if err := own.Decode(0, qt, k[tok*hkv*d:(tok+1)*hkv*d], v[tok*hkv*d:(tok+1)*hkv*d], o1, nil); err != nil {
			t.Fatal(err)
		}
		bind(cal, tok+1)
		bind(ld, tok+1)
		if err := cal.DecodeBound(0, qt, o2, nil); err != nil {
			t.Fatal(err)
		}
		if err := ld.DecodeBound(0, qt, o3, nil); err != nil {
			t.Fatal(err)
		}
		for i := range o1 {
			if o1[i] != o2[i] || o1[i] != o3[i] {
				t.Fatalf("token %d, element %d: owned %v, caller %v, loaded caller %v", tok, i, o1[i], o2[i], o3[i])
			}
		}
	}
	st, err := cal.Stats()
	if err != nil || st.KVBytes != 0 {
		t.Fatalf("the caller session holds KV: %v %v", st.KVBytes, err)
	}
	// The cpu backend reads HND pages only.
	kv := PagedKV{Pages: pool.Addr(), NumPages: 3, PageSize: page, PageIndices: table, NumTokens: n + 2,
		Layout: KVLayoutNHD}
	if err := cal.BindKV(0, kv); !errors.As(err, &e) || e.Status != StatusUnsupported ||
		!strings.Contains(e.Message, "kv->layout") {
		t.Fatalf("NHD on the cpu backend: %v", err)
	}
}
