// Seeded permutations that are the same on every platform and standard library: std::shuffle
// and std::uniform_int_distribution are implementation-defined, so the packer (document order)
// and the loader (epoch order) use this SplitMix64 + Fisher-Yates instead.
#pragma once
#include <cstdint>
#include <numeric>
#include <vector>

namespace retain::data {

// SplitMix64 (Steele, Lea, Flood 2014): a full-period 64-bit generator, good enough to shuffle.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias (rejection of the short last interval).
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return x % bound;
  }

 private:
  uint64_t state_;
};

// Mixes a seed with a stream number (e.g. an epoch) into an independent seed.
inline uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  SplitMix64 g(seed ^ (stream * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull));
  return g.next();
}

// A uniformly random permutation of 0..n-1, a pure function of (n, seed).
inline std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  SplitMix64 g(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(g.below(static_cast<uint64_t>(i) + 1));
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

}  // namespace retain::data
