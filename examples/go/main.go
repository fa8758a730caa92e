// SPDX-License-Identifier: Apache-2.0

// kvsieve from Go through the kvsieve package (bindings/go/kvsieve: cgo + pkg-config,
// PKG_CONFIG_PATH=<prefix>/lib/pkgconfig): a prefill and a decode checked against a float64
// reference, a batch of two sessions (plan per token, decode per layer) checked against
// per-session decodes of forks, then an error as a *kvsieve.Error.
package main

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"os"

	"github.com/kvsieve/kvsieve/bindings/go/kvsieve"
)

const hq, hkv, d = 4, 2, 16

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "go:", err)
		os.Exit(1)
	}
}

func run() error {
	rng := rand.New(rand.NewSource(7))
	vec := func(n int) []float32 {
		out := make([]float32, n)
		for i := range out {
			out[i] = float32(rng.NormFloat64())
		}
		return out
	}

	// one layer, method "full": the decode is dense attention over the prompt and the new token
	const n = 64
	p := kvsieve.NewSessionParams(1, hq, hkv, d)
	p.Method, p.KVDtype = "full", kvsieve.F32
	s, err := kvsieve.NewSession(p)
	if err != nil {
		return err
	}
	defer s.Close()
	q, k, v := vec(n*hq*d), vec((n+1)*hkv*d), vec((n+1)*hkv*d)
	if err := s.Prefill(0, q, k[:n*hkv*d], v[:n*hkv*d], nil); err != nil {
		return err
	}
	if err := s.BuildIndex(); err != nil {
		return err
	}
	q1, o, lse := vec(hq*d), make([]float32, hq*d), make([]float32, hq)
	if err := s.Decode(0, q1, k[n*hkv*d:], v[n*hkv*d:], o, lse); err != nil {
		return err
	}
	scale := 1 / math.Sqrt(d)
	worst := 0.0
	for h := 0; h < hq; h++ {
		kh := h / (hq / hkv)
		sc := make([]float64, n+1)
		m := math.Inf(-1)
		for j := range sc {
			for c := 0; c < d; c++ {
				sc[j] += scale * float64(q1[h*d+c]) * float64(k[(j*hkv+kh)*d+c])
			}
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
	fmt.Printf("go: kvsieve %s: decode max |error| vs float64 reference = %.2e\n", kvsieve.Version(), worst)
	if !(worst < 1e-4) {
		return fmt.Errorf("decode does not match the reference")
	}

	bw, err := batchExample(vec)
	if err != nil {
		return err
	}
	fmt.Printf("go: batch of 2 sessions, 3 tokens x 2 layers: max |batch - per-session decode| = %.2e\n", bw)
	if !(bw < 1e-5) {
		return fmt.Errorf("batch decode does not match per-session decode")
	}

	// errors come back as *kvsieve.Error with the library's status and message
	err = s.Decode(9, q1, k[n*hkv*d:], v[n*hkv*d:], o, lse)
	var e *kvsieve.Error
	if !errors.As(err, &e) || e.Status != kvsieve.StatusInvalidArgument {
		return fmt.Errorf("expected INVALID_ARGUMENT, got %v", err)
	}
	fmt.Printf("go: error handled: %v\n", e)
	return nil
}

// batchExample decodes three tokens for a batch of two 2-layer quest sessions with different
// prompts and the same tokens through forks taken before, one session at a time; it returns the
// largest difference between the two.
func batchExample(vec func(int) []float32) (float64, error) {
	const layers, B = 2, 2
	if why := kvsieve.MethodUnsupportedReason("quest", kvsieve.BackendHybrid); why != "" {
		fmt.Printf("go: quest on hybrid: %s\n", why)
	}
	p := kvsieve.NewSessionParams(layers, hq, hkv, d)
	p.Method, p.KVDtype, p.Budget = "quest", kvsieve.F32, 0.25
	var sessions, forks []*kvsieve.Session
	for b := 0; b < B; b++ {
		n := 48 + 16*b
		s, err := kvsieve.NewSession(p)
		if err != nil {
			return 0, err
		}
		defer s.Close()
		q, k, v := vec(n*hq*d), vec(n*hkv*d), vec(n*hkv*d)
		for l := uint32(0); l < layers; l++ {
			if err := s.Prefill(l, q, k, v, nil); err != nil {
				return 0, err
			}
		}
		if err := s.BuildIndex(); err != nil {
			return 0, err
		}
		f, err := s.Fork()
		if err != nil {
			return 0, err
		}
		defer f.Close()
		sessions, forks = append(sessions, s), append(forks, f)
	}
	batch, err := kvsieve.NewBatch(sessions...)
	if err != nil {
		return 0, err
	}
	defer batch.Close() // deferred last: runs before the sessions' Close
	worst := 0.0
	for token := 0; token < 3; token++ {
		if err := batch.Plan(); err != nil {
			return 0, err
		}
		for l := uint32(0); l < layers; l++ {
			q, k, v, o := vec(B*hq*d), vec(B*hkv*d), vec(B*hkv*d), make([]float32, B*hq*d)
			if err := batch.Decode(l, q, k, v, o, nil); err != nil {
				return 0, err
			}
			for b := 0; b < B; b++ {
				ob := make([]float32, hq*d)
				if err := forks[b].Decode(l, q[b*hq*d:(b+1)*hq*d], k[b*hkv*d:(b+1)*hkv*d], v[b*hkv*d:(b+1)*hkv*d], ob, nil); err != nil {
					return 0, err
				}
				for i := range ob {
					worst = math.Max(worst, math.Abs(float64(ob[i]-o[b*hq*d+i])))
				}
			}
		}
	}
	return worst, nil
}
