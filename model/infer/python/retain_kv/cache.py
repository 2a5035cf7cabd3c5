"""RetainCache: a transformers Cache that evicts as retain-generate does (DESIGN §8), for
`model.generate(ids, past_key_values=RetainCache(model, policy, budget))` on a stock
Qwen3ForCausalLM. One sequence per cache, batch 1.

Every layer's keys and values live in one tensor [2, L, K, capacity, d] (_Store): a forward
writes its tokens in place (transformers' DynamicLayer concatenates, copying the whole layer on
every step) and an eviction's moves are one index_copy_ for all layers, keys and values. A
layer's `keys`/`values` are views [1, K, width, d] of it: exactly the slots in use.
get_seq_length() is the number of tokens seen, as for transformers' sliding-window layers, so
that positions keep counting past evicted tokens."""
import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from .engine import Retention
from .hooks import add_hooks


class _Store:
    """All layers' keys and values, kv [2, L, K, capacity, d]; layer l's head h is row r = l·K + h
    of the eviction table (books.py). Capacity: exactly what a prefill chunk needs, 1/64 more
    when one token needs more (tokens fed one by one: geometric growth; dbtrimkv's widest head
    creeping up, rarely: once in 256 steps of docs/inference.md's benchmark), cut back to the
    widest layer + buffer after a chunk or a per-head eviction, or when over 1/4 spare:
    per-head policies hold exactly B + buffer slots per head once evicting. Every layer has the
    widest layer's slots (dbtrimkv's layers may differ in width)."""

    host_moves = True  # False: torch's index ops even on the CPU (as on a GPU; for the tests)

    def __init__(self, L):
        self.L, self.kv = L, None

    def update(self, l, width, keys, values):
        """Writes a forward's keys/values [1, K, T, d] of layer l at slots [width, width + T)."""
        T = keys.shape[-2]
        if self.kv is None or width + T > self.kv.shape[3]:
            self.resize(width + T + ((width + T) // 64 if T == 1 and self.kv is not None else 0), keys)
        k, v = self.layers[l]
        k[:, width:width + T] = keys[0]
        v[:, width:width + T] = values[0]
        return self.view(l, width + T)

    def resize(self, capacity, like):
        """A new tensor of `capacity` slots per head (like: a layer's keys, for K, d, dtype, device)."""
        kv = like.new_empty((2, self.L, like.shape[-3], capacity, like.shape[-1]))
        if self.kv is not None:
            keep = min(capacity, self.kv.shape[3])
            kv[:, :, :, :keep] = self.kv[:, :, :, :keep]
        self.kv, self.flat = kv, kv.view(-1, kv.shape[-1])
        # On the CPU, moves go through a numpy view of the same memory (a numpy call costs a
        # fraction of a torch one); as integers of the element's width: moves only copy bits.
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[kv.element_size()]
        host = kv.device.type == "cpu" and self.host_moves
        self.np = kv.view(bits).numpy().reshape(2, -1, capacity, kv.shape[-1]) if host else None
        self.layers = [(kv[0, l], kv[1, l]) for l in range(self.L)]
        self.views = [{} for _ in range(self.L)]  # per layer: width → (keys, values) views
        self._slot = (None, None)  # slot_floats' last view
        self.rows = np.arange(self.L * kv.shape[2])
        rows = self.rows * capacity
        self.offsets = np.stack([rows, rows + rows.size * capacity])  # [2, S] flat row of slot 0: keys, values

    def fit(self, widths, buffer, tight):
        """After a forward: back to the widths + buffer — the most the next forwards reach before
        an eviction — when `tight` (after a chunk, or a per-head eviction: widths then stay put),
        or when over 1/4 spare."""
        need = max(widths) + buffer
        cap = self.kv.shape[3] if self.kv is not None else 0
        if cap > need + need // 4 or tight and cap > need:
            self.resize(need, self.kv[0, 0])

    def view(self, l, width):
        """Layer l's keys and values [1, K, width, d] (views; a decoding step reuses two widths)."""
        v = self.views[l].get(width)
        if v is None:
            v = self.views[l][width] = (self.kv[0:1, l, :, :width], self.kv[1:2, l, :, :width])
        return v

    def slot_floats(self, slot):
        """Every row's key and value in `slot`, as floats [2, L·K, d] (a view; the same object
        while the capacity stays, as a decoding step reads the same slot each time)."""
        if self._slot[0] != slot:
            self._slot = slot, self.np[:, :, slot].view(np.float32)
        return self._slot[1]

    def moves(self, rows, dst, src):
        """move() for a decoding step's few moves (lists: row r, slot src → slot dst, none of them
        a source of another; nothing where they are equal). On the CPU basic slices, one move at a
        time: inside a decoding step a handful of them cost half of one gather."""
        if self.np is None or len(rows) > 16:
            return self.move(np.array(rows, np.int64), np.array(dst, np.int64), np.array(src, np.int64))
        a = self.np
        for r, d, s in zip(rows, dst, src):
            if d != s:
                a[:, r, d] = a[:, r, s]

    def move(self, rows, dst, src):
        """Moves entries within their rows (row r: slot src → slot dst), keys and values alike;
        rows None: every row, in order."""
        if self.np is not None:
            if rows is None and isinstance(src, int):  # from one slot: a basic slice, not a gather
                self.np[:, self.rows, dst] = self.np[:, :, src]
            else:
                rows = self.rows if rows is None else rows
                self.np[:, rows, dst] = self.np[:, rows, src]
            return
        rows = self.rows if rows is None else rows
        at = self.offsets[:, rows]  # index_select copies the sources before index_copy_ writes
        to = torch.from_numpy((at + dst).reshape(-1)).to(self.kv.device)
        frm = torch.from_numpy((at + src).reshape(-1)).to(self.kv.device)
        self.flat.index_copy_(0, to, self.flat.index_select(0, frm))


class _RetainLayer(DynamicLayer):
    def __init__(self, owner, layer_idx):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def update(self, key_states, value_states, cache_kwargs=None):
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        width = self.owner.retention.books.width[self.layer_idx]
        self.keys, self.values = self.owner.store.update(self.layer_idx, width, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        return self.owner.retention.seen

    def get_mask_sizes(self, cache_position):
        # The held entries come before the new tokens; the offset makes transformers' causal mask
        # right when every head holds the same entries (the hooks replace it when they do not).
        held = self.keys.shape[-2] if self.is_initialized else 0
        return held + cache_position.shape[0], self.owner.retention.seen - held

    def crop(self, max_length):
        raise NotImplementedError("RetainCache cannot be cropped: evicted tokens are gone")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("RetainCache holds one sequence: no beam search")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("RetainCache holds one sequence (batch 1)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("RetainCache holds one sequence (batch 1)")


def _dispatch_before(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, RetainCache):
        return cache._before(module, args, kwargs)
    return None


def _dispatch_after(module, args, kwargs, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, RetainCache):
        cache.retention.after_attention(module, cache)
    return output


def install(model):
    """Adds the dispatching hooks to `model` once: they act only for a RetainCache passed to a forward."""
    if not getattr(model, "_retain_kv_hooks", None):
        model._retain_kv_hooks = add_hooks(model, _dispatch_before, _dispatch_after)


def uninstall(model):
    """Removes the hooks install() added."""
    for handle in getattr(model, "_retain_kv_hooks", None) or []:
        handle.remove()
    model._retain_kv_hooks = None


class RetainCache(Cache):
    """RetainCache(model, policy, budget, buffer=1): `policy` is a Policy or a path load_policy reads;
    budget = B entries per (layer, KV head) (dbtrimkv: B·L·K in all). Checks everything (policy
    against the model, budget, attention implementation) here, before any generation."""

    def __init__(self, model, policy, budget, buffer=1):
        self.retention = Retention(policy, budget=budget, buffer=buffer)
        self.retention.bind(model)
        L = model.config.num_hidden_layers
        self.store = _Store(L)
        super().__init__(layers=[_RetainLayer(self, l) for l in range(L)])
        install(model)

    @property
    def policy(self):
        return self.retention.policy

    def _before(self, module, args, kwargs):
        new = self.retention.before_attention(module, kwargs, fresh=self.retention.seen == 0)
        return (args, new) if new is not None else None

    def kept_positions(self):
        """Per layer and KV head, the sorted original positions of the entries held (retain-generate --json)."""
        return self.retention.kept_positions()

    def cache_sizes(self):
        """Entries per layer, summed over KV heads (retain-generate --json's cache_sizes)."""
        return [sum(c) for c in self.retention.entry_counts()]

    def entry_counts(self):
        """Entries per layer and KV head."""
        return self.retention.entry_counts()

    def crop(self, max_length):
        raise NotImplementedError("RetainCache cannot be cropped: evicted tokens are gone")
