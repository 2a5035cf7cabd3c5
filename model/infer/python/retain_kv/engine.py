"""The bounded-KV semantics of DESIGN §8 on a stock Hugging Face Qwen3, shared by RetainCache and
RetainPress: forward hooks on every layer's self_attn (no model code is replaced).

Before a layer's attention (pre-hook): the gates read the layer's input-RMSNorm output h (the
`hidden_states` the layer hands self_attn) and give each new token its logβ; when the cache's
entries are not simply the whole causal prefix, the hook hands attention a mask of its own,
built from every entry's original position (what retain's kv_attention does by position).
After the attention (post-hook): the new entries are booked with their positions and scores,
KVPOP's mLSTM reads their keys and values, and the policy evicts — per (layer, KV head) for
trimkv and kvpop, once over all layers after the last one for dbtrimkv. Eviction fills the holes
with the head's last entries (O(evicted·d), no shift of the rest) and trims the layer's tensors
to its largest head: K/V memory stays bounded by (B + buffer) entries per head.

Every head's entries sit in slots [0, count) of the layer's [1, K, N, d] tensors (the rest of a
head's slots, when heads differ in count under dbtrimkv, are masked); `pos`/`score` [K, N] go
with them."""
import time

import torch

from .policy import as_policy
from .scoring import KvpopLayerState, gate_log_beta
from .select import global_drops, order_key, per_head_drops

SUPPORTED_ATTENTION = ("sdpa", "eager")


class _Book:
    """One layer's entry bookkeeping: positions, scores (logβ or the KVPOP rank key; NaN until
    scored) and, when heads differ in count, which slots hold an entry."""

    def __init__(self, K, device):
        self.pos = torch.empty(K, 0, dtype=torch.long, device=device)
        self.score = torch.empty(K, 0, dtype=torch.float32, device=device)
        self.valid = None  # None: every slot of every head holds an entry

    @property
    def slots(self):
        return self.pos.shape[1]

    def counts(self):
        if self.valid is not None:
            return self.valid.sum(1)
        return torch.full((self.pos.shape[0],), self.slots, dtype=torch.long, device=self.pos.device)

    def append(self, qpos, score):
        K = self.pos.shape[0]
        self.pos = torch.cat([self.pos, qpos.expand(K, -1)], 1)
        self.score = torch.cat([self.score, score], 1)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(K, qpos.numel())], 1)

    def kept_positions(self):
        pos = self.pos.tolist()
        valid = self.valid.tolist() if self.valid is not None else None
        return [sorted(p for j, p in enumerate(row) if valid is None or valid[h][j]) for h, row in enumerate(pos)]


class Retention:
    """A policy, its budget and one sequence's state on one model."""

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
        self.model_id = id(model)
        self.reset()

    def reset(self):
        """Forget the sequence: the next forward starts a new one at position 0."""
        self.seen = 0
        self.evicted = False  # whether any layer has dropped an entry in this sequence
        self.books = [_Book(self.K, self.device) for _ in range(self.L)]
        self.pending = [None] * self.L
        self.kvpop = ([KvpopLayerState(self.policy.layers[l], self.policy.window, self.device) for l in range(self.L)]
                      if self.policy.kind == "kvpop" else None)

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
        t0 = time.perf_counter()
        qpos = torch.arange(self.seen, self.seen + T, device=self.device)
        if self.policy.kind == "kvpop":
            score = torch.full((self.K, T), float("nan"), device=self.device)
        else:
            score = gate_log_beta(self.policy, l, h[0]).t()
        self.pending[l] = (qpos, score)
        self._spent("score", T, time.perf_counter() - t0)
        return self._mask(self.books[l], qpos, kwargs, h.dtype)

    def _check_positions(self, position_ids, T):
        if position_ids is None:
            return
        first = int(position_ids[0, 0])
        if first != self.seen or int(position_ids[0, -1]) != self.seen + T - 1:
            raise ValueError(f"{self.policy.source}: this forward feeds positions {first}…"
                             f"{int(position_ids[0, -1])} but the cache has seen {self.seen} tokens: bounded "
                             f"decoding takes one sequence, in order (use a new cache for a new sequence)")

    def _mask(self, book, qpos, kwargs, dtype):
        T = qpos.numel()
        if book.slots == 0 or (book.valid is None and (T == 1 or not self.evicted)):
            # Every cached entry is visible to every new token, and the chunk is causal among itself:
            # the mask transformers made (sized by layer 0's cache: right while no layer has evicted
            # anything), or none for one token.
            if T == 1 and kwargs.get("attention_mask") is not None:
                return {**kwargs, "attention_mask": None}
            return None
        K = self.K
        keypos = torch.cat([book.pos, qpos.expand(K, -1)], 1)
        allowed = keypos[:, None, :] <= qpos[None, :, None]
        if book.valid is not None:
            valid = torch.cat([book.valid, book.valid.new_ones(K, T)], 1)
            allowed &= valid[:, None, :]
        allowed = allowed.repeat_interleave(self.groups, 0)[None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return {**kwargs, "attention_mask": mask.masked_fill_(~allowed, torch.finfo(dtype).min)}

    def after_attention(self, module, cache):
        """Post-hook body: books the layer's new entries, scores them, evicts."""
        l = module.layer_idx
        layer = cache.layers[l]
        qpos, score = self.pending[l]
        self.pending[l] = None
        T = qpos.numel()
        book = self.books[l]
        if layer.keys.shape[-2] != book.slots + T:
            raise ValueError(f"{self.policy.source}: layer {l} holds {layer.keys.shape[-2]} entries, expected "
                             f"{book.slots + T}: the cache was changed outside the policy (one sequence per cache)")
        book.append(qpos, score)
        seen = self.seen + T
        if self.kvpop is not None:
            t0 = time.perf_counter()
            k = layer.keys[0, :, -T:, :].transpose(0, 1)
            v = layer.values[0, :, -T:, :].transpose(0, 1)
            u0, keys = self.kvpop[l].feed(k, v)
            if keys.shape[0]:
                inside = (book.pos >= u0) & (book.pos < u0 + keys.shape[0])
                rank = keys.t().gather(1, (book.pos - u0).clamp(0, keys.shape[0] - 1))
                book.score = torch.where(inside, rank, book.score)
            self._spent("score", T, time.perf_counter() - t0)
        t0 = time.perf_counter()
        if self.policy.kind == "dbtrimkv":
            if l == self.L - 1:
                self._evict_global(cache, seen)
        else:
            self._evict_layer(layer, book, seen)
        self._spent("evict", T, time.perf_counter() - t0)
        if l == self.L - 1:
            self.seen = seen
            self.forwards += 1

    def _spent(self, what, T, seconds):
        setattr(self, f"{what}_s", getattr(self, f"{what}_s") + seconds)
        if T == 1:
            setattr(self, f"decode_{what}_s", getattr(self, f"decode_{what}_s") + seconds)

    # ---- eviction ------------------------------------------------------------------------------
    def _scores(self, book, seen):
        """What the policy ranks a layer's entries by, after `seen` tokens (lower is evicted first)."""
        if self.policy.kind == "kvpop":
            p = self.policy
            protected = (book.pos < p.sinks) | (book.pos > seen - p.window)
            return torch.where(protected, torch.full_like(book.score, float("inf")), book.score)
        # TRIM-KV: (q − i)·logβ_i with q = seen + 1, in float32 as TrimKVCache computes it (float32 ×
        # int64 is float32: the distance is rounded to float, as the C++ does).
        return book.score * (seen + 1 - book.pos)

    def _evict_layer(self, layer, book, seen):
        n = book.slots  # every head holds n entries (per-head policies keep the counts equal)
        if n < self.budget + self.buffer:
            return
        if n == self.budget + 1:  # a decoding step with buffer 1: one entry per head, in a few ops
            self._drop_one(layer, book, self._scores(book, seen))
            return
        drops = per_head_drops(self._scores(book, seen), book.pos, n - self.budget)
        dropped = torch.zeros_like(book.pos, dtype=torch.bool).scatter_(1, drops, True)
        self._compact(layer, book, ~dropped)

    def _drop_one(self, layer, book, score):
        """Evicts each head's worst entry (the oldest of equal scores) and moves the head's last
        entry into its slot: O(K·d), no selection key, no sync."""
        worst = torch.amin(score, 1, keepdim=True)
        slot = torch.where(score == worst, book.pos, torch.iinfo(torch.long).max).argmin(1)
        heads, last = self.heads, book.slots - 1
        layer.keys[0, heads, slot] = layer.keys[0, :, last]
        layer.values[0, heads, slot] = layer.values[0, :, last]
        book.pos[heads, slot] = book.pos[:, last]
        book.score[heads, slot] = book.score[:, last]
        layer.keys, layer.values = layer.keys[:, :, :last], layer.values[:, :, :last]
        book.pos, book.score = book.pos[:, :last], book.score[:, :last]
        self.evicted = True

    def _evict_global(self, cache, seen):
        counts = [b.counts() for b in self.books]
        total = int(sum(c.sum() for c in counts))
        streams = self.L * self.K
        if total < streams * (self.budget + self.buffer):
            return
        keys, stream, where = [], [], []
        for l, b in enumerate(self.books):
            valid = b.valid if b.valid is not None else torch.ones_like(b.pos, dtype=torch.bool)
            heads, slots = valid.nonzero(as_tuple=True)
            keys.append(order_key(self._scores(b, seen), b.pos)[heads, slots])
            stream.append(l * self.K + heads)
            where.append(torch.stack([torch.full_like(heads, l), heads, slots], 1))
        drop = global_drops(torch.cat(keys), torch.cat(stream), total - streams * self.budget)
        where = torch.cat(where)[drop]
        for l, b in enumerate(self.books):
            mine = where[where[:, 0] == l]
            keep = b.valid.clone() if b.valid is not None else torch.ones_like(b.pos, dtype=torch.bool)
            keep[mine[:, 1], mine[:, 2]] = False
            self._compact(cache.layers[l], b, keep)

    def _compact(self, layer, book, keep):
        """Keeps the entries `keep` [K, N]: each head's survivors move into slots [0, count) —
        the survivors beyond a head's count fill its holes — and the layer is trimmed to the
        largest count."""
        count = keep.sum(1)
        self.evicted = True
        slot = torch.arange(book.slots, device=self.device)
        inside = slot[None, :] < count[:, None]
        hk, hs = (~keep & inside).nonzero(as_tuple=True)   # holes, head by head in slot order
        mk, ms = (keep & ~inside).nonzero(as_tuple=True)   # movers, as many per head as holes
        keys, values = layer.keys, layer.values
        if hk.numel():
            keys[0, hk, hs] = keys[0, mk, ms]
            values[0, hk, hs] = values[0, mk, ms]
            book.pos[hk, hs] = book.pos[mk, ms]
            book.score[hk, hs] = book.score[mk, ms]
        n = int(count.max())
        layer.keys, layer.values = keys[:, :, :n], values[:, :, :n]
        book.pos, book.score = book.pos[:, :n], book.score[:, :n]
        book.valid = None if bool((count == n).all()) else inside[:, :n]

    # ---- results -------------------------------------------------------------------------------
    def kept_positions(self):
        """Per layer and KV head, the sorted original positions the cache holds."""
        return [b.kept_positions() for b in self.books]

    def entry_counts(self):
        """Per layer and KV head, the number of entries held."""
        return [b.counts().tolist() for b in self.books]
