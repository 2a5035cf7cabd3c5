"""A decoding step's choice made in Python from a few candidates carried from step to step, not by
numpy passes over the whole eviction table: inside a decoding step each numpy call costs several
µs, the first ones tens (the model's forward pushed their code and data out of the caches,
docs/inference.md), and a step
that drops one entry per row needs only the handful of entries that can be the lowest in the
next few steps. The choices are select.py's (lowest score first, ties toward the older entry,
then across rows toward the later row), the same bits: the tests compare both on every step.

TRIM-KV (`TrimChoice`: trimkv per row, dbtrimkv over all rows). The float32 score
(q − i)·logβ_i only falls as q grows (logβ ≤ 0; rounding to float32 is monotone). A refresh at q0
for a window of k steps takes τ, the k-th lowest score at q0 of each row (dbtrimkv: the
(k·m)-th lowest of all, m entries dropped a step), and keeps as candidates the entries whose score
at q0 + k − 1 is ≤ τ. While the window lasts (q ≤ q0 + k − 1, and at most k·m drops globally),
an entry that a step drops, or that ties with one, scores at most τ then (it is among the lowest
D + m of the refresh's entries, D the drops since, all of which score ≤ their order statistic at
q0), so it is a candidate or a token that arrived since — and a token that arrives scoring above τ
at q0 + k − 1, its lowest score in the window, is not even that: it is not tracked. The refresh
sorts the candidates once
for each score time of the window (one argsort of integer keys); a step takes the first not yet
dropped and compares the tokens that arrived since, scored as exact doubles: a float32 logβ times
an integer distance below 2^24 is exact in a double, and rounding that product to float32 is what
numpy's float32 product gives, so the order is the double's except where two values round to the
same float32 — there the positions decide, and only the values near the choice are rounded.

KVPOP (`RankHeaps`): a rank key never changes once booked. Per row, a heap of the lowest
(key, position) pairs below a bound θ (every booked entry not in the heap is ≥ θ); a step
pushes the token that left the window if it is below θ and pops the lowest. A heap that runs
empty is refilled from the table (one partition).

Anything the shortcut cannot vouch for — a NaN score, a +inf rank key, a distance past 2^24, a
table changed by a chunk or a compaction — makes the caller use select.py's choice instead."""
import heapq
import math
import struct

import numpy as np

from .select import EXACT_DIST, score_key

_F32 = struct.Struct("<f")


def _above(v):
    """A bound above every double that rounds to the float32 v (NaN for v = −inf: then compare all)."""
    return v + abs(v) * 2.0 ** -22 + 2.0 ** -148


def f32(x):
    """The double x rounded to float32 (to nearest, ties to even), as a Python float."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # (pack refuses a finite x that rounds past the float32 range)
        return math.copysign(math.inf, x)


class TrimChoice:
    """TRIM-KV's choice for decoding steps: per row (trimkv, one drop per row a step) or over all
    rows (dbtrimkv, m drops a step). A refresh keeps the candidates of the table (index i: slot
    cs[i], position cp[i], row cr[i]) and, per step of the window, their order by score at that
    step (float32 values, as trim_scores computes them); a step takes the first of them not yet
    dropped and compares the tokens that arrived since (`fresh`), whose scores it computes."""

    WINDOW = 16  # steps per refresh: more candidates to order, fewer refreshes

    def __init__(self, S, per_row):
        self.S, self.per_row = S, per_row
        self.order = None
        self.disabled = False  # a NaN was seen: only select.py's integer keys order it

    def invalidate(self):
        self.order = None

    def _refresh(self, table, q, m):
        """Candidates from the table (table() → score = logβ, pos [S, W] views) for score times
        q … q + k − 1; False when the table is too small for a window, or holds a NaN."""
        score, pos = table()
        S, W = score.shape
        k = self.WINDOW
        low = k if self.per_row else k * m
        row_bits = max(1, (S - 1).bit_length())  # a refresh's sort keys: 32 bits of score, the position, the row
        pos_bits = 32 - row_bits
        if q + k >= min(EXACT_DIST, 1 << pos_bits) or W <= k or low >= S * W:
            return False
        dist = np.subtract(q, pos, dtype=np.float32)  # (trim_scores' distances: exact, q + k < 2^24)
        s0 = score * dist
        if math.isnan(np.minimum.reduce(s0, None)):
            self.disabled = True  # (the minimum is NaN when any score is)
            return False
        if self.per_row:
            tau = np.partition(s0, k - 1, axis=1)[:, k - 1:k]
        else:
            tau = np.partition(s0.reshape(-1), low - 1)[low - 1]
        dist += np.float32(k - 1)  # (the scores at q + k − 1, as trim_scores computes them)
        rows, slots = np.nonzero((np.multiply(score, dist, out=dist) <= tau) & (pos >= 0))
        # A token arriving in the window is tracked only if its score at q + k − 1 (its lowest in the
        # window, as an exact double) can round to τ or below: no other is dropped before the refresh.
        self.limit = [x if x == x else math.inf for x in map(_above, tau.reshape(-1).tolist())]  # (τ = −inf: all)
        self.last = q + k - 1
        p, lb = pos[rows, slots], score[rows, slots]
        # Their order at each step of the window [k, C]: by score (float32 as trim_scores computes it,
        # −0.0 = +0.0) and position, within each row (per_row) or, across rows, then the later row:
        # one sort of integer keys (the row, the score's order-preserving bits, the position).
        bits = (lb * np.subtract((q + np.arange(k))[:, None], p, dtype=np.float32) + np.float32(0.0)).view(np.int32)
        key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64) + (1 << 31)).view(np.uint64)  # 32 bits
        u = np.uint64
        if self.per_row:  # row | score | position
            key = (rows.astype(u) << u(32 + pos_bits)) | (key << u(pos_bits)) | p.astype(u)
        else:  # score | position | later row first
            key = (key << u(32)) | (p.astype(u) << u(row_bits)) | (S - 1 - rows).astype(u)
        self.order = key.argsort(1).tolist()
        self.cp, self.cs, self.cr, self.cl = p.tolist(), slots.tolist(), rows.tolist(), lb.tolist()
        self.segments, a = [], 0  # per row: its candidates' span of each order
        for n in np.bincount(rows, minlength=S).tolist():
            self.segments.append((a, a + n))
            a += n
        self.dropped = set()
        self.fresh = [[] for _ in range(S)] if self.per_row else []  # [position, logβ, slot(, row)]
        # dbtrimkv: (row, slot) → a candidate's index or a fresh entry, for the moves
        self.at = {} if self.per_row else {(r, s): i for i, (r, s) in enumerate(zip(self.cr, self.cs))}
        self.q0, self.left = q, low
        return True

    def _ready(self, table, q, m, lam):
        """Whether the shortcut can choose this step (refreshing when the window is over)."""
        if self.disabled or any(x != x for x in lam):
            self.disabled = True
            return False
        if self.order is None or q - self.q0 >= self.WINDOW or self.left < m:
            return self._refresh(table, q, m)
        return True

    def per_row_step(self, table, q, t, lam, top):
        """trimkv: the slot each row drops at score time q, after row r's new token t (logβ lam[r],
        in slot `top`, not in the table: table() → its logβ, positions [S, top]) joins; None: use
        select.py.
        The state then holds the table as it is after the drop with t moved into that slot."""
        if not self._ready(table, q, 1, lam):
            return None
        j = q - self.q0
        order, dropped, cp, cs, cl = self.order[j], self.dropped, self.cp, self.cs, self.cl
        drops = []
        last = self.last
        for (a, b), fresh, lb, limit in zip(self.segments, self.fresh, lam, self.limit):
            for i in order[a:b]:  # the row's lowest candidate not dropped (there are k > j of them)
                if i not in dropped:
                    break
            else:  # (cannot happen; were it to, the caller's general choice, which forgets this state)
                return None
            p0, best = cp[i], None
            v = f32((q - p0) * cl[i])
            hi = _above(v)
            x = (q - t) * lb
            if x <= hi:
                fv = f32(x)
                if (fv, t) < (v, p0):
                    v, p0, best, hi = fv, t, True, _above(fv)
            for e in fresh:
                x = (q - e[0]) * e[1]
                if x <= hi or hi != hi:
                    fv = f32(x)
                    if (fv, e[0]) < (v, p0):
                        v, p0, best, hi = fv, e[0], e, _above(fv)
            if best is None:  # a candidate of the table
                dropped.add(i)
                s = cs[i]
            elif best is True:  # the new token itself
                drops.append(top)
                continue
            else:
                fresh.remove(best)
                s = best[2]
            if (last - t) * lb <= limit:
                fresh.append([t, lb, s])
            drops.append(s)
        self.left -= 1
        return drops

    def global_step(self, table, q, t, lam, tops, m):
        """dbtrimkv: (rows, slots) of the m entries dropped at score time q over all rows, after
        every row's new token t (logβ lam[r], in slot tops[r], not in the table: table() → its logβ
        and positions), and when each row drops one, the slot per row (the state then holds each
        new token in its row's dropped slot, as fill_step puts it; else None, and the caller
        reports the moves that follow: moved). None: use select.py."""
        if not self._ready(table, q, m, lam):
            return None
        last, limit = self.last, self.limit[0]
        for r, (lb, s) in enumerate(zip(lam, tops)):
            if (last - t) * lb <= limit:
                e = [t, lb, s, r]
                self.fresh.append(e)
                self.at[r, s] = e
        j = q - self.q0
        dropped, cp, cr, cl = self.dropped, self.cp, self.cr, self.cl
        low = []  # the m lowest candidates not dropped: (score, position, −row, index)
        for i in self.order[j]:
            if i not in dropped:
                low.append((f32((q - cp[i]) * cl[i]), cp[i], -cr[i], i))
                if len(low) == m:
                    break
        if len(low) < m:
            return None
        hi = _above(low[-1][0])
        more = [(f32(x), e[0], -e[3], e) for e in self.fresh for x in ((q - e[0]) * e[1],) if x <= hi or hi != hi]
        if more:
            low = sorted(low + more)[:m]
        self.left -= m
        rows, slots = [], []
        for *_, i in low:
            if isinstance(i, int):
                rows.append(cr[i])
                slots.append(self.cs[i])
            else:
                rows.append(i[3])
                slots.append(i[2])
        if m != self.S or len(set(rows)) < m:
            return rows, slots, None
        by_row = [0] * m  # one drop per row: each row's new token into its dropped slot
        for r, s in zip(rows, slots):
            by_row[r] = s
        self.moved(rows, slots, range(m), by_row, tops)
        return rows, slots, by_row

    def moved(self, dr, ds, rows, dst, src):
        """dbtrimkv: the table's changes after global_step's drops (dr, ds): the entries dropped,
        then the moves (row, src slot → dst slot) books.py made; rows None: every row, src one slot."""
        at = self.at
        for r, s in zip(dr, ds):
            e = at.pop((r, s))
            if isinstance(e, int):
                self.dropped.add(e)
            else:
                self.fresh.remove(e)
        rows = range(self.S) if rows is None else rows.tolist() if isinstance(rows, np.ndarray) else rows
        if isinstance(dst, np.ndarray):
            dst = dst.tolist()
        src = [src] * len(dst) if isinstance(src, (int, np.integer)) else src.tolist() if isinstance(src, np.ndarray) else src
        moving = [(r, d, at.pop((r, s))) for r, d, s in zip(rows, dst, src) if (r, s) in at]
        for r, d, e in moving:
            at[r, d] = e
            if isinstance(e, int):
                self.cs[e] = d
            else:
                e[2] = d


class RankHeaps:
    """KVPOP's choice for decoding steps (one drop per row): per row a heap of the lowest booked
    (rank key, position, slot) below the bound theta[r]. `where` remembers the slots each
    decoding step's token went to, for booking its key when it leaves the window."""

    SIZE = 32  # entries a refill keeps per row

    def __init__(self, S):
        self.S = S
        self.heaps = None
        self.where = {}
        self.disabled = False  # a NaN rank key: only select.py's integer keys order it

    def invalidate(self):
        self.heaps, self.where = None, {}

    def _refill(self, table):
        """Heaps from the table (table() → score = rank keys, +inf protected; pos [S, W] views)."""
        score, pos = table()
        S, W = score.shape
        M = self.SIZE
        if math.isnan(np.minimum.reduce(score, None)):  # (the minimum is NaN when any key is)
            self.disabled = True
            return False
        key = np.where(pos >= 0, score_key(score) | pos, np.iinfo(np.int64).max)
        slots = np.argpartition(key, M, axis=1)[:, :M + 1] if W > M + 1 else np.broadcast_to(np.arange(W), (S, W))
        sc = np.take_along_axis(score, slots, 1).tolist()
        ps = np.take_along_axis(pos, slots, 1).tolist()
        self.heaps, self.theta = [], []
        for srow, prow, slrow in zip(sc, ps, slots.tolist()):
            e = sorted((s, p, sl) for s, p, sl in zip(srow, prow, slrow) if p >= 0 and s < math.inf)
            self.heaps.append(e[:M])  # (a sorted list is a heap)
            self.theta.append(e[M][:2] if len(e) > M else (math.inf, math.inf))
        return all(self.heaps)

    def step(self, table, booked):
        """The slot each row drops, after `booked` = (u, keys, slots) — the token u that left the
        window, booked in the table with its keys at its slots — or None; table() → the rank keys
        and positions [S, W] without this step's (protected) token, read only to refill. None: use
        select.py."""
        if self.disabled:
            return None
        if booked is not None and any(k != k for k in booked[1]):
            self.disabled = True
            return None
        if self.heaps is None or not all(self.heaps):
            return list(map(self._pop, self.heaps)) if self._refill(table) else None
        if booked is None:
            return list(map(self._pop, self.heaps))
        u, keys, slots = booked
        drops = []
        for h, th, k, s in zip(self.heaps, self.theta, keys, slots):
            e = (k, u, s)
            drops.append(heapq.heappushpop(h, e)[2] if k < math.inf and e < th else heapq.heappop(h)[2])
        return drops

    @staticmethod
    def _pop(h):
        return heapq.heappop(h)[2]
