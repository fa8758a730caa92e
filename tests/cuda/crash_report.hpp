// SPDX-License-Identifier: Apache-2.0
// For the GPU test programs, whose output is piped into logs: stdout line-buffered (so a crash does
// not swallow the lines before it) and, on SIGSEGV/SIGBUS/SIGFPE/SIGABRT, the stack printed to
// stderr (frames in libkvsieve are "libkvsieve.so.0(+0xOFFSET)": resolve them with
// `addr2line -f -C -e <the unstripped library> 0xOFFSET`) before the signal's default action.
#pragma once
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>

namespace {

extern "C" void kvs_test_crash_handler(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  static const char msg[] = "\n*** fatal signal; stack:\n";
  (void)!write(2, msg, sizeof msg - 1);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

inline void install_crash_report() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) std::signal(sig, kvs_test_crash_handler);
}

}  // namespace
