"""The bounded-KV semantics of DESIGN §8 on a stock Hugging Face Qwen3, shared by RetainCache and
RetainPress: forward hooks on every layer's self_attn (no model code is replaced).

Before a layer's attention (pre-hook): the gates read the layer's input-RMSNorm output h (the
`hidden_states` the layer hands self_attn) and give each new token its logβ; when the cache's
entries are not simply the whole causal prefix, the hook hands attention a mask of its own,
built from every entry's original position (what retain's kv_attention does by position).
After the attention (post-hook): KVPOP's mLSTM reads the new keys and values. A decoding step (one
token) defers both to after the last layer and scores every layer at once (scoring.GateStep;
kvpop_step.py: numpy for a float32 model on the CPU, else torch ops): what such a step pays is the
number of small calls, not their work. After the last layer's attention, the forward's entries of
every layer are booked with their positions and scores and the policy evicts — per (layer, KV head) for
trimkv and kvpop, over all layers and heads for dbtrimkv — for all layers at once (a layer's
cache is not read again in the forward):
the bookkeeping is one host-side table (books.py), and the key/value tensors get only the moves
that close their holes (O(evicted·d)) and a trim to the layer's largest head. A decoding step that
drops as many entries as it adds (buffer 1) chooses from a few candidates carried between steps
(step_choice.py) instead of passes over the whole table, and when every row drops one, writes
each row's new token straight into the dropped slot (_fast_step). K/V memory stays
bounded: B + buffer slots per head under per-head policies; under dbtrimkv every layer has the
widest layer's slots + buffer (cache.py: _Store).

Every head's entries sit in slots [0, count) of the layer's [1, K, N, d] tensors, and a forward's
new tokens above them (the rest of a head's slots, when heads differ in count under dbtrimkv,
are empty and masked)."""
import time

import numpy as np
import torch

from .books import Books
from .policy import as_policy
from .kvpop_step import KvpopStep, TorchKvpopStep
from .scoring import GateStep, KvpopState, gate_log_beta
from .select import global_drops, per_head_drops, trim_scores
from .step_choice import RankHeaps, TrimChoice

SUPPORTED_ATTENTION = ("sdpa", "eager")


class Retention:
    """A policy, its budget and one sequence's state on one model."""

    fast_steps = True  # False: a decoding step runs the general code (per layer, any T; for the tests)
    fast_choice = True  # False: a decoding step chooses by select.py over the whole table (for the tests)
    torch_kvpop_step = False  # True: KVPOP's decoding step in torch ops even on the CPU (as on a GPU; for the tests)

    def __init__(self, policy, budget=None, buffer=1, compression_ratio=None):
        self.policy = as_policy(policy)
        self.configure(budget, buffer, compression_ratio)
        self.model_id = None
        # Seconds in eviction (selection + compaction) and in scoring (gate MLP, KVPOP mLSTM), all
        # forwards and one-token (decoding) forwards only; CPU wall time (on a GPU: launch time).
        self.evict_s = self.score_s = self.decode_evict_s = self.decode_score_s = 0.0
        self.forwards = 0

    def configure(self, budget, buffer, compression_ratio):
        """Checks and sets the budget (entries per (layer, KV head)) or the compression ratio
        (the budget is then max(1, int((1 − ratio)·T)) of each sequence's first forward of T
        tokens, kvpress's rule), and the buffer. One-line ValueErrors."""
        src = self.policy.source
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"{src}: buffer must be an integer >= 1, got {buffer!r}")
        if (budget is None) == (compression_ratio is None):
            raise ValueError(f"{src}: give exactly one of budget (entries per layer and KV head) and compression_ratio")
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int):
                raise ValueError(f"{src}: budget must be an integer, got {budget!r}")
            self._check_budget(budget)
        elif not (isinstance(compression_ratio, (int, float)) and 0 <= compression_ratio < 1):
            raise ValueError(f"{src}: compression_ratio must be in [0, 1), got {compression_ratio!r}")
        self.budget_arg, self.buffer, self.ratio = budget, buffer, compression_ratio

    def _check_budget(self, budget):
        p = self.policy
        if budget < p.min_budget():
            why = (f" ({p.sinks} sinks + a window of {p.window} + 1 top-k entry, from the scorers)"
                   if p.kind == "kvpop" else "")
            raise ValueError(f"{p.source}: budget {budget} is below the minimum {p.min_budget()} of policy "
                             f"{p.kind}{why}")

    def bind(self, model):
        """Checks the model (one-line ValueError naming the policy file) and prepares for it."""
        if self.model_id == id(model):
            return
        config = model.config
        if getattr(config, "model_type", None) != "qwen3":
            raise ValueError(f"{self.policy.source}: retain policies are for Qwen3 models, this model is "
                             f"{getattr(config, 'model_type', type(model).__name__)!r}")
        self.policy.check_model(config)
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"{self.policy.source}: attention implementation {impl!r} cannot take the per-head masks "
                             f"bounded decoding needs; load the model with attn_implementation='sdpa' or 'eager'")
        self.device = next(model.parameters()).device
        self.policy.to(self.device)
        self.L, self.K = config.num_hidden_layers, config.num_key_value_heads
        self.groups = config.num_attention_heads // self.K
        self.heads = torch.arange(self.K, device=self.device)
        if self.policy.kind != "kvpop":  # a decoding step's gate MLP writes into these (scoring.GateStep)
            self.gates = GateStep(self.policy, self.device)
        self.model_id = id(model)
        self.reset()

    def reset(self):
        """Forget the sequence: the next forward starts a new one at position 0."""
        self.seen = 0
        self.evicted = False  # whether any entry has been dropped in this sequence
        self.books = Books(self.L, self.K, watch_nan=self.policy.kind == "dbtrimkv", track=self.policy.kind == "kvpop")
        self.bound = np.inf  # dbtrimkv: where the next global choice looks first (select.global_drops)
        self.pending = [None] * self.L  # per layer, this forward: the gates' logβ [K, T] / KVPOP's (u0, keys)
        self.kvpop = KvpopState(self.policy, self.device) if self.policy.kind == "kvpop" else None
        # kvpop with decay_every n > 1: per row (layer·K + head) the float32 log γ that an entry
        # with i mod n > q mod n gains back at eviction (policy.cpp kvpop_drops)
        self.decay_lg = (self.kvpop.log_gamma.reshape(-1, 1).float().cpu().numpy()
                         if self.kvpop is not None and self.policy.decay_every > 1 else None)
        # KVPOP's decoding step of all layers at once: numpy on the host, torch ops on a GPU (kvpop_step.py)
        self.kvpop_step = (None if self.kvpop is None else
                           KvpopStep(self.kvpop) if self.kvpop.host and not self.torch_kvpop_step else
                           TorchKvpopStep(self.kvpop))
        # A decoding step's choice from a few candidates carried between steps (step_choice.py); KVPOP's
        # rank keys must stay put for it (decay_every 1).
        S = self.L * self.K
        self.choice = (TrimChoice(S, per_row=self.policy.kind == "trimkv") if self.kvpop is None else
                       RankHeaps(S) if self.policy.decay_every == 1 else None)
        # Whether this forward is a decoding step scored for all layers at once after the last
        # (GateStep's gate MLP, KVPOP's mLSTM step); otherwise the general code.
        self.step = False

    # ---- hooks ---------------------------------------------------------------------------------
    def before_attention(self, module, kwargs, fresh):
        """Pre-hook body: returns new kwargs when the attention mask must change, else None.
        `fresh`: the cache holds nothing yet (a new sequence)."""
        l = module.layer_idx
        h = kwargs["hidden_states"]
        if h.shape[0] != 1:
            raise ValueError(f"{self.policy.source}: batch size {h.shape[0]}: bounded-KV decoding runs one sequence "
                             f"at a time (batch 1)")
        T = h.shape[1]
        if l == 0:
            if fresh and self.seen:
                self.reset()
            if self.seen == 0:  # a sequence starts: its budget (from compression_ratio: of its first forward)
                self.budget = self.budget_arg if self.budget_arg is not None else max(1, int(T * (1 - self.ratio)))
                self._check_budget(self.budget)
            self._check_positions(kwargs.get("position_ids"), T)
            self.T = T  # tokens of this forward (every layer's)
            # (Gates reading [k ‖ v] score after the attention from the cached entries, per layer.)
            # (GateStep computes in float32 from any dtype, as gate_log_beta; KvpopStep reads float32
            # only: a model of another dtype on the CPU decodes KVPOP with TorchKvpopStep, on the same state)
            if T == 1 and h.dtype != torch.float32 and type(self.kvpop_step) is KvpopStep:
                self.kvpop_step = TorchKvpopStep(self.kvpop)
            self.step = self.fast_steps and T == 1 and self.policy.gate_input != "kv"
        if self.policy.kind != "kvpop" and self.policy.gate_input != "kv":
            t0 = time.perf_counter()
            if self.step:
                self.gates.keep(l, h)
            else:
                self.pending[l] = gate_log_beta(self.policy, l, h[0]).t()
            self._spent("score", T, time.perf_counter() - t0)
        return self._mask(l, T, kwargs, h.dtype)

    def _check_positions(self, position_ids, T):
        if position_ids is None:
            return
        first = int(position_ids[0, 0])
        if first != self.seen or int(position_ids[0, -1]) != self.seen + T - 1:
            raise ValueError(f"{self.policy.source}: this forward feeds positions {first}…"
                             f"{int(position_ids[0, -1])} but the cache has seen {self.seen} tokens: bounded "
                             f"decoding takes one sequence, in order (use a new cache for a new sequence)")

    def _mask(self, l, T, kwargs, dtype):
        books = self.books
        if books.width[l] == 0 or (books.gapless[l] and (T == 1 or not self.evicted)):
            # Every cached entry is visible to every new token, and the chunk is causal among itself:
            # the mask transformers made (sized by layer 0's cache: right while no layer has evicted
            # anything), or none for one token.
            if T == 1 and kwargs.get("attention_mask") is not None:
                return {**kwargs, "attention_mask": None}
            return None
        # Built on the host from the entries' original positions (−1: an empty slot, never visible).
        pos = books.layer_pos(l)
        wide = np.float64 if dtype == torch.float64 else np.float32  # holds finfo(dtype).min exactly
        lowest = wide(torch.finfo(dtype).min)
        if T == 1:  # every held entry is older than the new token: only the empty slots are hidden
            mask = np.zeros((self.K, self.groups, 1, pos.shape[1] + 1), wide)
            mask[:, :, 0, :-1] = np.where(pos < 0, lowest, wide(0))[:, None, :]
            mask = mask.reshape(1, -1, 1, pos.shape[1] + 1)  # query head h·G + g reads KV head h
        else:
            qpos = np.arange(self.seen, self.seen + T)
            keypos = np.concatenate([pos, np.broadcast_to(qpos, (self.K, T))], 1)
            allowed = (keypos[:, None, :] <= qpos[None, :, None]) & (keypos >= 0)[:, None, :]
            mask = np.where(np.repeat(allowed, self.groups, 0)[None], 0, lowest)
        return {**kwargs, "attention_mask": torch.from_numpy(mask).to(self.device, dtype)}

    def after_attention(self, module, cache):
        """Post-hook body: checks the layer's entries and runs KVPOP's mLSTM on its new keys and
        values; after the last layer, books every layer's new entries and evicts (all layers at once:
        a layer's cache is not read again in this forward)."""
        l = module.layer_idx
        layer = cache.layers[l]
        T = self.T
        if layer.keys.shape[-2] != self.books.width[l] + T:
            raise ValueError(f"{self.policy.source}: layer {l} holds {layer.keys.shape[-2]} entries, expected "
                             f"{self.books.width[l] + T}: the cache was changed outside the policy (one sequence "
                             f"per cache)")
        if self.policy.gate_input == "kv":  # gates reading [k_1 … k_K ‖ v_1 … v_K] of the new tokens (after RoPE)
            t0 = time.perf_counter()
            k = layer.keys[0, :, -T:, :].transpose(0, 1).reshape(T, -1)
            v = layer.values[0, :, -T:, :].transpose(0, 1).reshape(T, -1)
            self.pending[l] = gate_log_beta(self.policy, l, torch.cat([k, v], 1)).t()
            self._spent("score", T, time.perf_counter() - t0)
        if self.kvpop is not None:
            t0 = time.perf_counter()
            if self.step:  # the new token's [k; v], for the step of all layers after the last
                if getattr(cache, "store", None) is None:  # (else read there, at once: _step_input)
                    self.kvpop_step.write(l, layer.keys[0, :, -1], layer.values[0, :, -1])
            else:
                k = layer.keys[0, :, -T:, :].transpose(0, 1)
                v = layer.values[0, :, -T:, :].transpose(0, 1)
                self.pending[l] = self.kvpop.feed(l, k, v)
            self._spent("score", T, time.perf_counter() - t0)
        if l == self.L - 1:
            self._end_forward(cache, T)

    def _end_forward(self, cache, T):
        seen = self.seen + T
        t0 = time.perf_counter()
        score = left = None  # the gates' logβ [L·K, T] of the new tokens; KVPOP: the token that left the window
        if self.kvpop is None and self.step:
            score = self.gates.run()
            t1 = time.perf_counter()
            self._spent("score", T, t1 - t0)  # scoring, not eviction
            t0 = t1
        elif self.kvpop is None:
            score = torch.cat(self.pending, 0).numpy(force=True)  # (force: detached, on the host)
        elif self.step:  # KVPOP's step of every layer: the new token sits above each row's entries
            self._step_input(cache, self.books.width[0])
            left = self.kvpop_step()
            t1 = time.perf_counter()
            self._spent("score", T, t1 - t0)
            t0 = t1
        booking = self._fast_step(cache, seen, score, left) if self.step and self.fast_choice else None
        if booking is not None:
            t0 += booking  # booking KVPOP's rank keys: scoring, not eviction
            self._spent("score", T, booking)
        else:
            self.books.append(self.seen, score, T)  # (KVPOP: protected, +inf until scored)
            if self.kvpop is not None:
                t1 = time.perf_counter()
                self._book_ranks(left)
                t0 += time.perf_counter() - t1  # scoring, not eviction
                self._spent("score", T, time.perf_counter() - t1)
            self._evict(cache, seen)
        self.pending = [None] * self.L
        self._spent("evict", T, time.perf_counter() - t0)
        self.seen = seen
        self.forwards += 1

    def _book_ranks(self, left):
        """KVPOP: the tokens that left the window in this forward (the same in every layer) get
        their rank keys in place of +inf (a decoding step: `left`, KvpopStep's result)."""
        if self.step:
            if left is not None:
                self.books.book_ranks(left[0], left[1][None, :], self.policy.sinks)
            return
        u0 = self.pending[0][0]
        if self.pending[0][1].shape[0]:
            ranks = torch.cat([keys for _, keys in self.pending], 1).numpy(force=True)  # [U, L·K]
            self.books.book_ranks(u0, ranks, self.policy.sinks)

    def _step_input(self, cache, slot):
        """A decoding step's new [k; v] into KvpopStep's input: from RetainCache's store in one read
        (the token sits in `slot` of every row: kvpop evicts per head, the widths are equal), else
        already there (the hooks wrote it layer by layer)."""
        store = getattr(cache, "store", None)
        if store is None:
            return
        if store.np is not None and type(self.kvpop_step) is KvpopStep:
            self.kvpop_step.read(store.slot_floats(slot))  # (a numpy view, the same object every step)
        else:
            self.kvpop_step.read(store.kv[:, :, :, slot].reshape(2, -1, store.kv.shape[-1]))

    def _fast_step(self, cache, seen, score, left):
        """A decoding step that drops as many entries as it adds (buffer 1, the cache full), chosen by
        step_choice.py, and written straight into the table without appending the new tokens: when
        every row drops one entry (always for trimkv and kvpop) each row's new token takes the
        dropped entry's slot, else they go where drop_decoding's layout puts them; their keys and
        values move there from the store's top slots. Returns the seconds spent booking KVPOP's
        rank keys, or None: this step needs the general code (which redoes anything done here)."""
        books, choice, S = self.books, self.choice, self.L * self.K
        if choice is None or self.buffer != 1 or books.fresh:
            return None
        t, spent, W = seen - 1, 0.0, max(books.width)
        table = lambda: (books.score[:, :W], books.pos[:, :W])  # noqa: E731  (views made only to refresh)
        if self.policy.kind == "dbtrimkv":
            if books.total != S * self.budget:
                return None
            tops = [w for w in books.width for _ in range(self.K)]  # where each row's new token is
            lam = score.reshape(-1).tolist()
            got = choice.global_step(table, seen + 1, t, lam, tops, S)
            if got is None:
                choice.invalidate()
                return None
            dr, ds, dst = got
            if dst is not None:  # one per row: each row's new token into its row's dropped slot
                rows = range(S)
                books.fill_step(t, dst, lam, tops)
                src = tops
            else:  # some row loses two or more: drop_decoding's layout, the new tokens never appended
                rows, dst, src = books.drop_step(t, lam, dr, ds, tops)
                choice.moved(dr, ds, rows, dst, src)
        else:
            top = W
            if top != self.budget or books.width.count(top) != self.L:
                return None
            if self.kvpop is None:
                lam = score.reshape(-1).tolist()
                dst = choice.per_row_step(table, seen + 1, t, lam, top)
            else:
                t1 = time.perf_counter()
                booked = self._book_step(left, t, top)
                spent = time.perf_counter() - t1
                dst = choice.step(table, booked) if booked is not False else None
                lam = None  # the new token is protected: +inf
            if dst is None:
                choice.invalidate()
                return None
            if self.kvpop is not None:
                choice.where[t] = dst
            books.fill_step(t, dst, lam, top)
            rows, src = range(S), [top] * S
        self.evicted = True
        store = getattr(cache, "store", None)
        if store is not None:  # RetainCache: row rows[i]'s key and value from slot src[i] to dst[i]
            store.moves(rows, dst, src)
            self._fit(cache, store, self.policy.kind != "dbtrimkv")
        else:
            self._move_layers(cache, (np.array(list(rows), np.int64), np.array(dst, np.int64), np.array(src, np.int64)))
        return spent

    def _book_step(self, left, t, top):
        """KVPOP in _fast_step: books the rank keys of the token u that left the window at its
        slots (remembered from its own step, else found); returns (u, keys, slots), None when no
        token is booked, False when the general code must book it."""
        if left is None:
            return None
        u, keys = left
        slots = self.choice.where.pop(u, None)
        if u < self.policy.sinks:
            return None
        if u >= t:  # (a window of 1: the new token itself)
            return False
        pos, score = self.books.pos, self.books.score
        if slots is None:  # (placed before the choice's last refill: searched; else it is still there,
            # since only decoding steps that drop other entries ran since, and the window protects u)
            slots = (pos[:, :top] == u).argmax(1).tolist()
            if any(pos[r, s] != u for r, s in enumerate(slots)):
                return False
        keys = keys.tolist()
        for r, (s, k) in enumerate(zip(slots, keys)):
            score[r, s] = k
        return u, keys, slots

    def _spent(self, what, T, seconds):
        if what == "score":
            self.score_s += seconds
            self.decode_score_s += seconds if T == 1 else 0.0
        else:
            self.evict_s += seconds
            self.decode_evict_s += seconds if T == 1 else 0.0

    # ---- eviction ------------------------------------------------------------------------------
    def _evict(self, cache, seen):
        books, S, B = self.books, self.L * self.K, self.budget
        moves = None
        if self.choice is not None:
            self.choice.invalidate()  # (the general code moves entries: _fast_step's choice starts afresh)
        if self.policy.kind == "dbtrimkv":
            if books.total >= S * (B + self.buffer):
                W = max(books.width)
                pos = books.pos[:, :W]
                dr, ds, self.bound = global_drops(self._scores(books.score[:, :W], pos, seen), pos,
                                                  books.total - S * B, self.bound, exact_only=books.nan)
                if books.fresh == 1 and dr.size == S and len(set(dr.tolist())) == S:  # one per row
                    by_row = np.empty(S, np.int64)
                    by_row[dr] = ds
                    moves = books.drop_and_fill(by_row)
                elif books.fresh == 1:
                    moves = books.drop_decoding(dr, ds)
                else:
                    moves = books.compact(dr, ds)
        else:
            n = books.width[0]  # every head of every layer holds n entries (per-head eviction keeps them equal)
            if n >= B + self.buffer:
                pos = books.pos[:, :n]
                ds = per_head_drops(self._scores(books.score[:, :n], pos, seen), pos, n - B)
                if ds.shape[1] == 1 and books.fresh == 1:  # a decoding step: the new token fills the hole
                    moves = books.drop_and_fill(ds[:, 0])
                else:
                    moves = books.compact(np.repeat(np.arange(S), ds.shape[1]), ds.reshape(-1))
        if moves is not None:
            self.evicted = True
        store = getattr(cache, "store", None)
        if store is not None:  # RetainCache: one tensor for every layer
            if moves is not None:
                store.move(*moves)
            self._fit(cache, store, self.T > 1 or moves is not None and self.policy.kind != "dbtrimkv")
        elif moves is not None:
            self._move_layers(cache, moves)

    def _fit(self, cache, store, tight):
        """RetainCache after the moves: the store's capacity (_Store.fit), each layer's view of its width."""
        store.fit(self.books.width, self.buffer, tight)
        for l, (layer, width) in enumerate(zip(cache.layers, self.books.width)):
            layer.keys, layer.values = store.view(l, width)

    def _scores(self, score, pos, seen):
        """What the policy ranks entries by, after `seen` tokens (lower is evicted first): KVPOP's
        rank key (booked +inf while protected; with decay_every n > 1, minus log γ where
        i mod n > q mod n, q = seen: ⌊(q − i)/n⌋ = ⌊q/n⌋ − ⌊i/n⌋ − [i mod n > q mod n]), TRIM-KV's
        (q − i)·logβ_i with q = seen + 1."""
        if self.policy.kind != "kvpop":
            return trim_scores(score, pos, seen + 1)
        if self.decay_lg is None:
            return score
        n = self.policy.decay_every
        return np.where((pos >= 0) & (pos % n > seen % n) & np.isfinite(score), score - self.decay_lg, score)

    def _move_layers(self, cache, moves):
        """The table's moves on each layer's own key/value tensors [1, K, n, d] (a kvpress cache),
        then the trim to the layer's new width."""
        rows, dst, src = moves
        if rows is None:
            rows = np.arange(self.L * self.K)
        src = np.broadcast_to(src, rows.shape)
        cut = np.searchsorted(rows, self.K * np.arange(self.L + 1)).tolist()
        for l, (layer, width) in enumerate(zip(cache.layers, self.books.width)):
            a, b = cut[l], cut[l + 1]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                if b > a:
                    if not t.is_contiguous():
                        t = t.contiguous()
                    n = t.shape[-2]
                    at = (rows[a:b] - l * self.K) * n
                    flat = t.view(-1, t.shape[-1])
                    flat.index_copy_(0, torch.from_numpy(at + dst[a:b]).to(self.device),
                                     flat.index_select(0, torch.from_numpy(at + src[a:b]).to(self.device)))
                setattr(layer, name, t[:, :, :width])

    # ---- results -------------------------------------------------------------------------------
    def kept_positions(self):
        """Per layer and KV head, the sorted original positions the cache holds."""
        return self.books.kept_positions()

    def entry_counts(self):
        """Per layer and KV head, the number of entries held."""
        return self.books.entry_counts()
