"""RetainCache: a transformers Cache that evicts as retain-generate does (DESIGN §8), for
`model.generate(ids, past_key_values=RetainCache(model, policy, budget))` on a stock
Qwen3ForCausalLM. One sequence per cache, batch 1.

Its layers are transformers' DynamicLayer (keys and values [1, K, N, d], appended by
concatenation) whose entries the policy trims after every forward; get_seq_length() is the
number of tokens seen, as for transformers' sliding-window layers, so that positions keep
counting past evicted tokens."""
from transformers.cache_utils import Cache, DynamicLayer

from .engine import Retention
from .hooks import add_hooks


class _RetainLayer(DynamicLayer):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

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
        super().__init__(layers=[_RetainLayer(self) for _ in range(model.config.num_hidden_layers)])
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
