// SPDX-License-Identifier: Apache-2.0
module github.com/kvsieve/kvsieve/bindings/go/kvsieve

go 1.19
