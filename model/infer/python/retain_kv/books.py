"""The entries of every (layer, KV head) stream of one sequence, all layers in one table — row
r = l·K + h — on the host: positions (int64) and scores (float32: logβ for the gates, the KVPOP
rank key, +inf while protected). A slot that holds no entry has position −1 and score +inf, so
that no choice needs a mask.

Slots are the slots of the layer's key/value tensors [1, K, width_l, d]. After an eviction each
row holds slots [0, count_r) and base_l, the layer's width, is the largest count of its rows.
Each forward appends its tokens at the top of every row of the layer, where a DynamicLayer
concatenates them: until the next eviction row r holds [0, count_r) and the `fresh` slots
[base_l, width_l). An eviction removes entries and closes the holes: every empty slot below a
row's new count is filled, in slot order, by the row's survivors at or above the new count, in
slot order — so the key/value tensors get O(evicted) moves, never a shift of the rest.

One table rather than one per layer: a decoding step books, chooses and moves for all layers in
a fixed number of numpy calls (~1–4 µs each here), where a small torch call costs 5–10 µs."""
import math

import numpy as np


class Books:
    def __init__(self, L, K, watch_nan=False, track=False):
        self.L, self.K, self.S = L, K, L * K
        self.watch_nan = watch_nan  # the global choice's float pick cannot see NaN: note any booked
        # KVPOP (track): where each decoding step's token was put — a column of the table, or its
        # flat index per row — for booking its rank when it leaves the window (_book_one) without
        # searching the table; forgotten by any other move or a new capacity.
        self.track, self.placed, self.last = track, {}, None
        self.pos = np.full((self.S, 0), -1, np.int64)
        self.score = np.zeros((self.S, 0), np.float32)
        self.rows = np.arange(self.S)
        self.tops = {}  # (widths, capacity) → each row's first free slot as a flat index [S, 1]
        self._starts = (None, None)  # (capacity, each row's slot 0 as a flat index): starts()
        self.nan = False          # a NaN score was booked: only the exact integer keys order it
        self.base = [0] * L       # per layer: its width after the last eviction
        self.fresh = 0            # tokens appended since then, in slots [base_l, base_l + fresh)
        self.width = [0] * L      # per layer: base_l + fresh, the slots per head of its tensors
        self.gapless = [True] * L  # per layer: every row's count is base_l (no empty slot below it)
        self.count = [0] * self.S  # per row: entries in slots [0, count) (the fresh ones not counted)
        self.total = 0            # entries held, all rows

    def layer_pos(self, l):
        """Positions [K, width_l] of layer l's slots (−1: no entry)."""
        return self.pos[l * self.K:(l + 1) * self.K, :self.width[l]]

    def append(self, q0, score, T=1):
        """Books the T = score.shape[1] tokens at positions q0… with `score` [S, T] at the top of every
        row; score None: T protected tokens (+inf, which every free slot already holds)."""
        T = score.shape[1] if score is not None else T
        self._room(max(self.width) + T)
        self.last = q0 if T == 1 and self.track else None
        if self.width.count(self.width[0]) == self.L:
            w = self.width[0]
            self.pos[:, w:w + T] = q0 if T == 1 else np.arange(q0, q0 + T)
            if self.last is not None:
                self.placed[q0] = w
            if score is not None:
                self.score[:, w:w + T] = score
        else:  # at each row's own top, by flat index (2-D fancy indexing costs several times more)
            key = (tuple(self.width), self.pos.shape[1])
            if key not in self.tops:  # (dbtrimkv's widths change on most decoding steps)
                self.tops = {key: (self.starts() + np.repeat(self.width, self.K))[:, None]}
            at = self.tops[key] if T == 1 else self.tops[key] + np.arange(T)
            self.pos.reshape(-1)[at] = q0 if T == 1 else np.arange(q0, q0 + T)
            if self.last is not None:
                self.placed[q0] = at[:, 0]
            if score is not None:
                self.score.reshape(-1)[at] = score
        self.fresh += T
        self.width = [w + T for w in self.width]
        self.total += self.S * T
        if score is not None:
            self._watch(score)

    def _room(self, top):
        """At least `top` slots per row: double, so that appends are in place."""
        if top > self.pos.shape[1]:
            pad = max(top, 2 * self.pos.shape[1]) - self.pos.shape[1]
            self.pos = np.concatenate([self.pos, np.full((self.S, pad), -1, np.int64)], 1)
            self.score = np.concatenate([self.score, np.full((self.S, pad), np.inf, np.float32)], 1)
            self.placed = {}

    def book_ranks(self, u0, ranks, sinks):
        """KVPOP: the tokens u0 … u0 + U − 1 left the window; `ranks` [U, S] are their rank keys
        (the sinks stay protected)."""
        lo, hi = max(u0, sinks), u0 + ranks.shape[0]
        if hi - lo == 1 and self._book_one(lo, ranks[0]):
            return
        if lo < hi:
            pos = self.pos[:, :max(self.width)]
            r, s = np.divmod(np.flatnonzero((pos >= lo) & (pos < hi)), pos.shape[1])
            self.score[r, s] = ranks[pos[r, s] - u0, r]
            self._watch(ranks)

    def _book_one(self, u, ranks):
        """book_ranks for one token (a decoding step): at the slots where it was put, if it is still
        there (a column: basic slices), else its slot per row by one comparison of the positions,
        not a search of the whole range; False (nothing booked) unless every row holds it."""
        at = self.placed.pop(u, None)
        if isinstance(at, int):
            if (self.pos[:, at] == u).all():
                self.score[:, at] = ranks
                self._watch(ranks)
                return True
        elif at is not None and (self.pos.reshape(-1)[at] == u).all():
            self.score.reshape(-1)[at] = ranks
            self._watch(ranks)
            return True
        at = self.starts() + (self.pos[:, :max(self.width)] == u).argmax(1)
        if not (self.pos.reshape(-1)[at] == u).all():
            return False
        self.score.reshape(-1)[at] = ranks
        self._watch(ranks)
        return True

    def _watch(self, scores):
        if self.watch_nan and not self.nan:  # (inf − inf would say NaN too: harmless)
            # Python's sum of the list: in a decoding step, cheaper than the first numpy reduction
            self.nan = math.isnan(sum(scores.ravel().tolist()) if scores.size <= 1024 else scores.sum())

    def drop_and_fill(self, ds):
        """compact() for a decoding step that drops one entry of every row (ds [S]): each row's
        fresh token, in its top slot, takes the dropped slot (dropping the fresh token itself moves
        it onto itself); counts and empty slots stay. Returns the moves (rows, destination slots,
        source slots); rows None: every row in order, all from one slot."""
        uniform = self.base.count(self.base[0]) == self.L
        top = self.base[0] if uniform else np.repeat(self.base, self.K)
        if uniform:  # the top slots are one column: basic slices, half the calls of _move
            at = self.starts() + ds
            self.pos.reshape(-1)[at], self.score.reshape(-1)[at] = self.pos[:, top], self.score[:, top]
            self.pos[:, top], self.score[:, top] = -1, np.inf
        else:
            start = self.starts()
            at = start + ds
            self._move(at, start + top, start + top)
        if self.last is not None:  # the fresh token (if dropped, at holds no entry: _book_one searches)
            self.placed[self.last] = at
        self.fresh, self.width, self.total = 0, list(self.base), self.total - self.S
        return (None if uniform else self.rows), ds, top

    def fill_step(self, t, slots, scores, top):
        """A decoding step that drops one entry of every row, written straight in (no append):
        row r's new token t takes slots[r] with score scores[r] (None: +inf, protected) — or is
        itself the entry dropped when slots[r] is `top` (or top[r]: per row), the slot it would have
        been appended to. Leaves the table as append + drop_and_fill do, in a few scalar writes (a
        handful of rows: each numpy call costs more than these)."""
        pos, score = self.pos, self.score
        tops = [top] * len(slots) if isinstance(top, int) else top
        for r, (s, tr) in enumerate(zip(slots, tops)):
            if s != tr:
                pos[r, s] = t
                score[r, s] = scores[r] if scores is not None else math.inf
        if self.placed:
            self.placed = {}
        self.last = None

    def starts(self):
        """Each row's slot 0 as a flat index [S] (cached while the capacity stays)."""
        if self._starts[0] != self.pos.shape[1]:
            self._starts = self.pos.shape[1], self.rows * self.pos.shape[1]
        return self._starts[1]

    def _move(self, dst, src, vacated):
        """Table moves by flat index (2-D fancy indexing costs several times more): the entries at
        `src` to `dst`, then the slots `vacated` emptied (a dropped fresh token is its own `dst`,
        `src` and `vacated`: emptied; otherwise no destination is vacated)."""
        pos, score = self.pos.reshape(-1), self.score.reshape(-1)
        pos[dst], score[dst] = pos[src], score[src]
        pos[vacated], score[vacated] = -1, np.inf

    def compact(self, dr, ds):
        """Removes the entries at rows `dr`, slots `ds` and closes the holes (see the module doc).
        Returns the moves (rows, destination slots, source slots) for the tensors as they are."""
        self.placed = {}
        n = max(self.width)
        pos, score = self.pos[:, :n], self.score[:, :n]
        keep = pos >= 0
        keep[dr, ds] = False
        new = keep.sum(1)
        inside = np.arange(n) < new[:, None]
        hr, hs = np.divmod(np.flatnonzero(inside > keep), n)  # empty or dropped slots below the new count
        mr, ms = np.divmod(np.flatnonzero(keep > inside), n)  # survivors at or above it: as many, row by row
        pos[hr, hs] = pos[mr, ms]
        score[hr, hs] = score[mr, ms]
        outside = ~inside
        pos[outside], score[outside] = -1, np.inf
        per_layer = new.reshape(self.L, self.K)
        widths = per_layer.max(1)
        self.gapless = (per_layer == widths[:, None]).all(1).tolist()
        self.base, self.fresh, self.total = widths.tolist(), 0, int(new.sum())
        self.width, self.count = list(self.base), new.tolist()
        return hr, hs, ms

    def _plan_decoding(self, dr, ds):
        """drop_decoding's layout, in Python over the rows that lost an entry or have an empty slot
        below the top (each row's fresh token counts as its slot count[r], wherever it sits):
        updates the counts, widths and layers' gaps, and returns the moves (rows, dst, src) and the
        slots emptied (clear_r, clear_s) as lists."""
        self.placed = {}
        K = self.K
        count = self.count = [c + 1 for c in self.count]  # a row that loses nothing keeps its fresh token
        lost = {}
        for r, s in zip(dr, ds):
            lost.setdefault(r, []).append(s)
        rows, dst, src, clear_r, clear_s = [], [], [], [], []
        for r in sorted(set(lost).union(*(range(l * K, (l + 1) * K) for l in range(self.L) if not self.gapless[l]))):
            c, top = count[r] - 1, self.base[r // K]
            gone = sorted(c if s == top else s for s in lost.get(r, ()))  # the fresh token counts as slot c
            new = c + 1 - len(gone)
            if not gone:
                if top > c:  # the fresh token into the first empty slot
                    rows.append(r), dst.append(c), src.append(top), clear_r.append(r), clear_s.append(top)
            else:
                movers = [s for s in range(new, c + 1) if s not in gone]
                for h, s in zip((s for s in gone if s < new), movers):
                    rows.append(r), dst.append(h), src.append(top if s == c else s)
                vacated = [top if s == c else s for s in range(new, c + 1)]
                clear_r.extend([r] * len(vacated)), clear_s.extend(vacated)
            count[r] = new
        self.base = [max(count[l * K:(l + 1) * K]) for l in range(self.L)]
        self.gapless = [min(count[l * K:(l + 1) * K]) == self.base[l] for l in range(self.L)]
        self.fresh, self.width, self.total = 0, list(self.base), self.total - len(dr)
        return rows, dst, src, clear_r, clear_s

    def drop_decoding(self, dr, ds):
        """compact() for a decoding step (one fresh token per row, in its layer's top slot), in
        Python over the rows that lost an entry or have an empty slot below the top: the same
        moves and layout without compact()'s passes over the whole table. Returns the moves."""
        rows, dst, src, clear_r, clear_s = self._plan_decoding(dr.tolist(), ds.tolist())
        cap = self.pos.shape[1]  # flat indices in Python: a handful, where each numpy call costs µs
        self._move(np.array([r * cap + s for r, s in zip(rows, dst)], np.int64),
                   np.array([r * cap + s for r, s in zip(rows, src)], np.int64),
                   np.array([r * cap + s for r, s in zip(clear_r, clear_s)], np.int64))
        return np.array(rows, np.int64), np.array(dst, np.int64), np.array(src, np.int64)

    def drop_step(self, t, scores, dr, ds, tops):
        """drop_decoding for a decoding step whose new tokens were never appended: row r's token t
        (score scores[r]) counts as sitting in slot tops[r] (its layer's width), and goes where
        drop_decoding would move it, in a few scalar writes (lists in, lists out; a handful of rows).
        Returns the moves (rows, dst, src) for the keys and values, whose new tokens are in tops."""
        self._room(max(tops) + 1)  # (a token that stays in its top slot is written there)
        before, lost = self.count, set(dr)
        self.total += self.S  # (what append counts)
        rows, dst, src, clear_r, clear_s = self._plan_decoding(dr, ds)
        pos, score = self.pos, self.score
        for r, d, s in zip(rows, dst, src):
            if s == tops[r]:
                pos[r, d], score[r, d] = t, scores[r]
            else:
                pos[r, d], score[r, d] = pos[r, s], score[r, s]
        for r, s in zip(clear_r, clear_s):
            if s != tops[r]:  # (a top slot was never written)
                pos[r, s], score[r, s] = -1, math.inf
        for r, (c, top) in enumerate(zip(before, tops)):
            if c == top and r not in lost:  # the token stays in the top slot
                pos[r, top], score[r, top] = t, scores[r]
        self.last = None
        return rows, dst, src

    def kept_positions(self):
        """Per layer and head, the sorted positions held."""
        return [[sorted(int(p) for p in row if p >= 0) for row in self.layer_pos(l)] for l in range(self.L)]

    def entry_counts(self):
        return [(self.layer_pos(l) >= 0).sum(1).tolist() for l in range(self.L)]
