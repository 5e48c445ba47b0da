// SPDX-License-Identifier: Apache-2.0
// A hint to the core that the calling thread is polling, for the library's spin waits.
#pragma once

namespace stellatrain::detail {

// x86 PAUSE (or the Arm YIELD hint): frees resources for the other hyper-thread and saves power
// while a wait spins.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace stellatrain::detail
