"""Which entries a policy evicts (DESIGN §8), as model/infer/policy.cpp chooses them: the lowest
score first, ties toward the older entry, then (across streams) toward the later stream.

numpy on the host: a numpy call costs ~1 µs where a small torch call costs 5–10 µs on a CPU, and
float32 products and integer comparisons are the same bits in both. The exact order is one int64
key per entry (the float32 score mapped to an order-preserving integer in the high 32 bits, the
position — and across streams the reversed stream index — in the low 32); as building it takes
seven passes, the common case first picks by the float scores alone and checks that no tie at the
edge of the choice could change it, falling back to the keys when one could."""
import math

import numpy as np

EXACT_DIST = 1 << 24  # below it a float32 holds every integer: q − i rounds the same computed either way
FEW = 64  # global_drops orders at most this many candidates in Python (each numpy call costs µs in a step)


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
    if m == 1:  # (the methods and the ufunc's reduce, not np.argmin/np.min's Python wrappers; the
        # handful of minima summed in Python: in a decoding step each numpy call costs µs)
        slot = score.argmin(1)
        low = np.minimum.reduce(score, 1, keepdims=True)
        # One entry per row at its row's lowest score: no tie, the choice whatever the positions.
        # (A NaN makes its row's min NaN: the keys order NaNs.)
        if np.count_nonzero(score == low) == score.shape[0] and not math.isnan(sum(low.ravel().tolist())):
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
            at = np.flatnonzero(score <= b)  # (2-D nonzero: 4× slower)
            if m <= at.size <= FEW:  # a handful (a decoding step): ordered in Python, not ~8 numpy calls
                W = score.shape[1]
                keys = sorted((float(score[r, c]), int(pos[r, c]), -r, r, c) for r, c in
                              (divmod(i, W) for i in at.tolist()))  # (stable: flat order, as lexsort's)
                nxt = np.float32(keys[2 * m - 1][0]) if len(keys) >= 2 * m else np.inf
                return (np.array([k[3] for k in keys[:m]], np.int64), np.array([k[4] for k in keys[:m]], np.int64),
                        nxt)
            rows, slots = np.divmod(at, score.shape[1])
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
