// Shared AMX helpers for the CPU kernels: asking Linux for the tile state, and the ldtilecfg operand.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedserve {

// Linux hands AMX tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); asked once per process. False where the kernel or the hypervisor refuses.
inline bool amx_tiles_usable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// The 64-byte operand of ldtilecfg (palette 1).
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};

// Loads a configuration where all eight tiles are 16 rows x 64 bytes (16 x 32 bf16 or 16 x 16 float32).
inline void configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace pagedserve
#endif
