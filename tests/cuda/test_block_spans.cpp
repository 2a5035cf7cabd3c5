// The per-block span tables of kernels/cuda/block_spans.h, on the CPU in every build (the
// device builds the same table with a CUB scan and the same lookup, block_spans.cu):
// - sound for any layout: every block pair that can share a document lies inside both spans;
// - tight for ordered layouts (ids growing along the sequence, padding anywhere, as retain's
//   packer writes them): every non-empty block inside a span does share a document range;
// - the binary searches equal linear searches, and empty blocks have empty spans.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/block_spans.h"

using namespace retain::cuda::spans;

namespace {

struct Range {
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  bool empty() const { return lo > hi; }
};

bool meet(const Range& a, const Range& b) { return !a.empty() && !b.empty() && a.lo <= b.hi && b.lo <= a.hi; }

enum class Layout { packed, long_padding, interleaved };

// Token document ids: packed documents with padding runs (some longer than a block, so whole
// blocks are padding between documents), or ids in random order.
std::vector<int32_t> make_docs(int64_t T, Layout layout, std::mt19937& rng) {
  std::vector<int32_t> doc;
  if (layout == Layout::interleaved) {
    std::uniform_int_distribution<int32_t> id(-1, 6);
    for (int64_t t = 0; t < T; ++t) doc.push_back(id(rng));
    return doc;
  }
  const int64_t max_len = layout == Layout::long_padding ? 300 : std::max<int64_t>(1, T / 6);
  std::uniform_int_distribution<int64_t> len(1, max_len);
  std::bernoulli_distribution pad(layout == Layout::long_padding ? 0.4 : 0.15);
  int32_t next = 0;
  while (static_cast<int64_t>(doc.size()) < T) {
    const int32_t value = pad(rng) ? -1 : next++;
    for (int64_t n = len(rng); n > 0 && static_cast<int64_t>(doc.size()) < T; --n) doc.push_back(value);
  }
  return doc;
}

std::vector<Range> block_ranges(const std::vector<int32_t>& doc, int64_t block) {
  const int64_t T = static_cast<int64_t>(doc.size());
  std::vector<Range> r(static_cast<size_t>((T + block - 1) / block));
  for (int64_t t = 0; t < T; ++t) {
    if (doc[static_cast<size_t>(t)] < 0) continue;
    Range& x = r[static_cast<size_t>(t / block)];
    x.lo = std::min(x.lo, doc[static_cast<size_t>(t)]);
    x.hi = std::max(x.hi, doc[static_cast<size_t>(t)]);
  }
  return r;
}

std::vector<BlockSpan> spans_of(const std::vector<Range>& r) {
  return host_block_spans(&r[0].lo, &r[0].hi, 2, static_cast<int32_t>(r.size()));
}

}  // namespace

TEST(BlockSpans, SoundForAnyLayoutAndTightForPackedOnes) {
  std::mt19937 rng(7);
  int64_t ordered_cases = 0;
  for (int64_t T : {1, 63, 64, 65, 200, 1000, 5000, 20000}) {
    for (int64_t block : {64, 128}) {
      for (Layout layout : {Layout::packed, Layout::long_padding, Layout::interleaved}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " block=" << block << " layout=" << static_cast<int>(layout));
        const std::vector<Range> r = block_ranges(make_docs(T, layout, rng), block);
        const std::vector<BlockSpan> s = spans_of(r);
        const int32_t nb = static_cast<int32_t>(r.size());
        ASSERT_EQ(static_cast<int32_t>(s.size()), nb);
        for (int32_t b = 0; b < nb; ++b) {
          const BlockSpan& x = s[static_cast<size_t>(b)];
          if (r[static_cast<size_t>(b)].empty()) {
            EXPECT_EQ(x.key_begin, b + 1) << "empty block " << b;
            EXPECT_EQ(x.query_end, b) << "empty block " << b;
            continue;
          }
          EXPECT_GE(x.key_begin, 0);
          EXPECT_LE(x.key_begin, b) << "a block meets itself";
          EXPECT_GT(x.query_end, b) << "a block meets itself";
          EXPECT_LE(x.query_end, nb);
        }
        for (int32_t q = 0; q < nb; ++q)
          for (int32_t k = 0; k <= q; ++k) {
            const bool m = meet(r[static_cast<size_t>(q)], r[static_cast<size_t>(k)]);
            const bool in_key_span = k >= s[static_cast<size_t>(q)].key_begin;
            const bool in_query_span = q < s[static_cast<size_t>(k)].query_end;
            if (m) {  // sound: never cut off a pair that can share a document
              EXPECT_TRUE(in_key_span) << "q=" << q << " k=" << k;
              EXPECT_TRUE(in_query_span) << "q=" << q << " k=" << k;
            }
            const bool both_nonempty = !r[static_cast<size_t>(q)].empty() && !r[static_cast<size_t>(k)].empty();
            if (layout != Layout::interleaved && both_nonempty) {  // tight: nothing wasted
              EXPECT_EQ(in_key_span, m) << "q=" << q << " k=" << k;
              EXPECT_EQ(in_query_span, m) << "q=" << q << " k=" << k;
              ++ordered_cases;
            }
          }
      }
    }
  }
  EXPECT_GT(ordered_cases, 10000) << "the tightness check must run on many pairs";
}

// The binary searches against the linear definitions on random nondecreasing tables.
TEST(BlockSpans, BinarySearchesEqualLinearSearches) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> step(0, 3), probe(-2, 60);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t nb = 1 + trial % 37;
    std::vector<int32_t> table(static_cast<size_t>(nb));
    int32_t x = step(rng) - 1;
    for (int32_t& v : table) v = x += step(rng);
    for (int32_t b = 0; b < nb; ++b) {
      const int32_t value = probe(rng);
      int32_t first = b + 1;
      for (int32_t i = b; i >= 0; --i)
        if (table[static_cast<size_t>(i)] >= value) first = i;
      EXPECT_EQ(first_reaching(table.data(), b, value), first);
      int32_t end = b;
      for (int32_t i = b; i < nb; ++i)
        if (table[static_cast<size_t>(i)] <= value) end = i + 1;
      EXPECT_EQ(end_reaching(table.data(), nb, b, value), end);
    }
  }
}

// What the table saves at 128K tokens with 16 packed documents: the span walks touch exactly
// the tiles of each document instead of every block below (or above) the diagonal.
TEST(BlockSpans, PackedWalkLengthAt128K) {
  const int64_t T = 131072, block = 64, docs = 16;
  std::vector<int32_t> doc(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) doc[static_cast<size_t>(t)] = static_cast<int32_t>(t / (T / docs));
  const std::vector<Range> r = block_ranges(doc, block);
  const std::vector<BlockSpan> s = spans_of(r);
  const int64_t nb = static_cast<int64_t>(r.size()), per_doc = nb / docs;
  int64_t walked = 0;
  for (int64_t q = 0; q < nb; ++q) walked += q + 1 - s[static_cast<size_t>(q)].key_begin;
  EXPECT_EQ(walked, docs * per_doc * (per_doc + 1) / 2) << "one triangle of tiles per document";
  EXPECT_LT(walked * 15, nb * (nb + 1) / 2) << "vs the walk from block 0: about 1/16 of it";
}
