// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness of `method_params` parsing: the input (up to its first NUL) is passed as
// kvs_session_params.method_params to kvs_session_create for every registered method that runs on
// the CPU, on a small shape. Parsing and validating the text is what is fuzzed; a session that is
// created is destroyed again.
//
// KVS_FUZZ_DEEP=1 also prefills a 64-token prompt, builds the index and decodes one step of every
// session that was created, so the accepted values are used as well (about 3x fewer inputs per
// second). Off by default and in CI: any valid but slow parameter set (work bounded, but large)
// is reported by libFuzzer as a timeout, which needs a person to judge.
// Seeds: one "name=default" line per parameter of every method (tests/fuzz/make_corpus.sh, from
// `kvsieve methods --json`) and the hand-written files in tests/fuzz/seeds/method_params/.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.hpp"

namespace {

std::vector<std::string> g_methods;
bool g_deep = false;

constexpr uint32_t kLayers = 1, kQHeads = 4, kKvHeads = 2, kHeadDim = 32;
constexpr int64_t kPrompt = 64;

void use(kvs_session_t s) {
  kvs_fuzz::Tensor q({kPrompt, kQHeads, kHeadDim}, 1), k({kPrompt, kKvHeads, kHeadDim}, 2),
      v({kPrompt, kKvHeads, kHeadDim}, 3);
  kvs_error_t err = kvs_session_prefill(s, 0, &q.t, &k.t, &v.t, nullptr, nullptr);
  if (!err) err = kvs_session_build_index(s, nullptr);
  if (!err) {
    kvs_fuzz::Tensor qs({kQHeads, kHeadDim}, 4), ks({kKvHeads, kHeadDim}, 5), vs({kKvHeads, kHeadDim}, 6),
        o({kQHeads, kHeadDim}, 0), lse({kQHeads}, 0);
    err = kvs_session_decode(s, 0, &qs.t, &ks.t, &vs.t, &o.t, &lse.t, nullptr);
  }
  kvs_fuzz::expect_not_internal(err, "prefill/build_index/decode");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvs_set_log_callback(nullptr, nullptr, KVS_LOG_OFF);
  for (size_t i = 0; i < kvs_method_count(); ++i) {
    const char* name = kvs_method_name(i);
    if (kvs_method_backends(name) & (1u << KVS_BACKEND_CPU)) g_methods.emplace_back(name);
  }
  const char* deep = std::getenv("KVS_FUZZ_DEEP");
  g_deep = deep && std::strcmp(deep, "1") == 0;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A C string: the text up to the first NUL (what a C caller can pass at all).
  const std::string text(reinterpret_cast<const char*>(data), strnlen(reinterpret_cast<const char*>(data), size));
  for (const std::string& m : g_methods) {
    kvs_session_params p;
    kvs_session_params_init(&p);
    p.num_layers = kLayers;
    p.num_q_heads = kQHeads;
    p.num_kv_heads = kKvHeads;
    p.head_dim = kHeadDim;
    p.kv_dtype = KVS_SCALAR_F32;
    p.num_threads = 1;
    p.method = m.c_str();
    p.method_params = text.c_str();
    p.budget = 0.25;
    kvs_session_t s = nullptr;
    kvs_error_t err = kvs_session_create(&p, &s);
    if (err) {
      if (s) std::abort();  // outputs are untouched on error
      // A rejected string must be rejected as a bad argument, never as an internal failure.
      if (kvs_error_code(err) != KVS_STATUS_INVALID_ARGUMENT) {
        std::fprintf(stderr, "%s: method_params \"%s\": expected INVALID_ARGUMENT, got %d: %s\n", m.c_str(),
                     text.c_str(), kvs_error_code(err), kvs_error_message(err));
        std::abort();
      }
      kvs_error_destroy(err);
      continue;
    }
    if (g_deep) use(s);
    kvs_session_destroy(s);
  }
  return 0;
}
