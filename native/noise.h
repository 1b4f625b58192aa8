#pragma once

// The counter-based noise of Clover's candidate choice (docs/CONTRACTS.md): splitmix64 keys, and
// the Gumbel noise GGML_OP_GUMBEL_ARGMAX draws (ggml-impl.h's ggml_gumbel_noise, which ggml does not
// export), so that the host path draws what the device does.

#include <cmath>
#include <cstdint>

inline uint64_t clover_mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

inline double clover_gumbel_noise(uint64_t key, int64_t c) {
    const double u = ((double) (clover_mix64(key ^ ((uint64_t) c * 0x9E3779B97F4A7C15ull)) >> 40) + 0.5) * (1.0 / 16777216.0);
    return -std::log(-std::log(u));
}
