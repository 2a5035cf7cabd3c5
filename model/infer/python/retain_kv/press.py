"""RetainPress: the same policies as a kvpress press (kvpress >= 0.5.5), on kvpress's own
DynamicCache: `with press(model): model.generate(...)`, KVPressTextGenerationPipeline, and
kvpress's evaluation (evaluate.py) through retain_kv.kvpress_registry.

It is a PrefillDecodingPress — kvpress's kind of press that acts while prefilling and while
decoding — so that the pipeline keeps it on for the question and the answer too: the cache stays
bounded throughout and the decisions are retain-generate's, with the prompt = context + question
fed in two forwards (retain-generate --prefill-chunk len(context)). kvpress accepts one question
per context for such presses.

Eviction is physical: the layer's key/value tensors are trimmed after every forward. Heads that
differ in count (dbtrimkv) share the layer's [1, K, N, d] tensors, N the largest count; the
slots a smaller head does not use are masked, the same as in RetainCache. kvpress's own masking
(AdaKV's fake keys) is not used."""
from contextlib import contextmanager
from typing import Optional

from kvpress.presses.prefill_decoding_press import PrefillDecodingPress

from .engine import Retention
from .hooks import add_hooks


class RetainPress(PrefillDecodingPress):
    """RetainPress(policy, budget, buffer=1) or RetainPress(policy, compression_ratio=r): budget B
    entries per (layer, KV head), or per sequence max(1, int((1 − r)·context length)). `policy`:
    a Policy or a path load_policy reads. (PrefillDecodingPress is a dataclass whose own fields
    would come first; this press takes its arguments in its own order.)"""

    def __init__(self, policy, budget: Optional[int] = None, buffer: int = 1,
                 compression_ratio: Optional[float] = None):
        super().__init__(prefilling_press=None, decoding_press=None)
        self._retention = Retention(policy, budget, buffer, compression_ratio)
        self.policy = self._retention.policy
        self.budget, self.buffer, self.compression_ratio = budget, buffer, compression_ratio

    def __repr__(self):
        size = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        return f"RetainPress({self.policy.kind} {self.policy.source!r}, {size}, buffer={self.buffer})"

    def post_init_from_model(self, model):
        # evaluate.py sets compression_ratio after construction: take the fields as they are now.
        self._retention.configure(self.budget, self.buffer, self.compression_ratio)
        self._retention.bind(model)

    def _before(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or type(cache).__name__ == "RetainCache":
            return None
        fresh = cache.get_seq_length(0) == 0 if module.layer_idx == 0 else False
        new = self._retention.before_attention(module, kwargs, fresh)
        return (args, new) if new is not None else None

    def forward_hook(self, module, input, kwargs, output):
        cache = kwargs.get("past_key_values")
        if cache is not None and type(cache).__name__ != "RetainCache":
            self._retention.after_attention(module, cache)
        return output

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("RetainPress evicts in its hooks, entry by entry, not through compress()")

    @contextmanager
    def __call__(self, model):
        self.post_init_from_model(model)
        handles = add_hooks(model, self._before, self.forward_hook)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def kept_positions(self):
        """Per layer and KV head, the sorted original positions the cache holds (last sequence)."""
        return self._retention.kept_positions()

    def entry_counts(self):
        return self._retention.entry_counts()
