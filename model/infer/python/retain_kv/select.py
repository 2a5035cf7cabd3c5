"""Which entries a policy evicts (DESIGN §8), as model/infer/policy.cpp chooses them: the lowest
score first, ties toward the older entry, then (across streams) toward the later stream.

numpy on the host: a numpy call costs ~1 µs where a small torch call costs 5–10 µs on a CPU, and
float32 products and integer comparisons are the same bits in both. The exact order is one int64
key per entry (the float32 score mapped to an order-preserving integer in the high 32 bits, the
position — and across streams the reversed stream index — in the low 32); as building it takes
seven passes, the common case first picks by the float scores alone and checks that no tie at the
edge of the choice could change it, falling back to the keys when one could."""
import heapq
import math

import numpy as np

EXACT_DIST = 1 << 24  # below it a float32 holds every integer: q − i rounds the same computed either way


def trim_scores(log_beta, pos, q):
    """TRIM-KV's (q − i)·logβ_i in float32, as TrimKVCache computes it (and the C++): the
    distance rounded to float32, then multiplied in float32. Empty slots (position −1, score
    +inf) come out +inf."""
    if q < EXACT_DIST:
        return log_beta * np.subtract(q, pos, dtype=np.float32)
    return log_beta * (q - pos).astype(np.float32)


def score_key(score):
    """int64 keys ordered as the float32 scores, in the high 32 bits (−0.0 = +0.0, as in C++)."""
    bits = (score + np.float32(0.0)).view(np.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64) << 32


def per_head_drops(score, pos, m):
    """Slots [S, m] of the m lowest (score, position) of every row (rows hold the same count)."""
    if m == 1:
        slot = np.argmin(score, 1)
        low = score.min(1, keepdims=True)
        # One entry per row at its row's lowest score: no tie, the choice whatever the positions.
        # (A NaN makes its row's min NaN: the keys order NaNs.)
        if np.count_nonzero(score == low) == score.shape[0] and not math.isnan(low.sum()):
            return slot[:, None]
    return np.argpartition(score_key(score) | pos, m - 1, axis=1)[:, :m]


def global_drops(score, pos, m, bound=np.inf, exact_only=False):
    """(rows, slots) of the m lowest (score, position, later row first) over all rows, and a bound
    for the next decoding step's call. Empty slots score +inf. Any `bound` gives the same choice:
    when at least m entries score ≤ bound, the m lowest are among them and only they are ordered
    (a handful, not every entry); otherwise the bound is the 2m-th lowest score, from a partition
    of all. The bound returned is the 2m-th lowest score: the m of those not evicted still score
    ≤ it one token later (TRIM-KV scores only fall as q grows), so a decoding step usually orders
    ~2m entries and partitions none. `exact_only`: NaN scores were booked, whose order only the
    integer keys have."""
    if not exact_only:
        for b in (bound, None):
            if b is None or b == np.inf:  # a bound that holds: the 2m-th lowest score of all (O(n))
                k = min(2 * m, score.size) - 1
                b = np.partition(score.reshape(-1), k)[k]
            rows, slots = np.divmod(np.flatnonzero(score <= b), score.shape[1])  # (2-D nonzero: 4× slower)
            if rows.size >= m:
                s = score[rows, slots]
                order = np.lexsort((-rows, pos[rows, slots], s))
                nxt = s[order[2 * m - 1]] if rows.size >= 2 * m else np.inf
                return rows[order[:m]], slots[order[:m]], nxt
    S, W = score.shape
    bits = max(1, int(S - 1).bit_length())
    if int(pos.max()) < 1 << (32 - bits):  # position and reversed row share the low 32 bits
        key = score_key(score) | (pos << bits) | (S - 1 - np.arange(S))[:, None]
        key[pos < 0] = np.iinfo(np.int64).max
        r, s = np.divmod(np.argpartition(key.reshape(-1), m - 1)[:m], W)
        return r, s, np.inf
    r, s = np.nonzero(pos >= 0)
    order = np.lexsort((-r, pos[r, s], score_key(score[r, s])))[:m]
    return r[order], s[order], np.inf


class RankHeaps:
    """KVPOP's per-head choice in a decoding step without a pass over the table. A booked rank key
    never changes, and a decoding step moves no entry but the new token (Books.drop_and_fill), so
    each row's lowest booked entries can wait in a heap of (score_key(rank) | position, slot): the
    order per_head_drops sorts by. Each heap holds at most CAP of its row's booked entries, the
    lowest when built, and `cut`, the highest of those: an entry booked later joins only below it,
    so the heap's lowest is the row's lowest booked entry until the heap runs dry (then: rebuilt
    from the table, O(n), about once every CAP steps). Protected entries (+inf, not yet ranked)
    are not booked; when a row's lowest is not below them (a +inf or +NaN rank) the answer is None
    and per_head_drops decides. Anything that moves other entries makes the heaps stale: the
    engine drops them."""

    CAP = 64
    INF = int(score_key(np.float32(np.inf)))  # the key of +inf at position 0

    def __init__(self, score, pos):
        key = score_key(score) | pos
        key[(pos < 0) | (score == np.inf)] = np.iinfo(np.int64).max  # empty or protected: not booked
        c = min(self.CAP, key.shape[1])
        slots = np.argpartition(key, c - 1, axis=1)[:, :c]
        low = np.take_along_axis(key, slots, 1)
        self.heaps, self.cut = [], []
        for k, s in zip(low.tolist(), slots.tolist()):
            h = [(a, b) for a, b in zip(k, s) if a != np.iinfo(np.int64).max]
            heapq.heapify(h)
            self.heaps.append(h)
            # A full heap may have left booked entries out, all above its highest: none may join above it.
            self.cut.append(max(k) if len(h) == c else np.iinfo(np.int64).max)

    def push(self, u, ranks, slots):
        """Books token u's ranks F32 [S] at slots [S] (one per row)."""
        for h, cut, b, s in zip(self.heaps, self.cut, (ranks + np.float32(0.0)).view(np.int32).tolist(),
                                slots.tolist()):
            key = (b ^ ((b >> 31) & 0x7FFFFFFF)) << 32 | u  # score_key | position, in Python ints
            if key < cut:
                heapq.heappush(h, (key, s))

    def pop(self):
        """Each row's lowest (rank, position)'s slot [S], removed from the heaps; None (nothing
        removed) when a heap is empty or its lowest is not below the protected entries."""
        if not all(h and h[0][0] < self.INF for h in self.heaps):
            return None
        return np.array([heapq.heappop(h)[1] for h in self.heaps], np.int64)
