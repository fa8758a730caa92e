// SPDX-License-Identifier: Apache-2.0
module kvsieve.example/go

go 1.19

require github.com/kvsieve/kvsieve/bindings/go/kvsieve v0.0.0

// the package of this repository (not fetched: GOPROXY=off works)
replace github.com/kvsieve/kvsieve/bindings/go/kvsieve => ../../bindings/go/kvsieve
