"""retain_kv: retain's trained KV-cache retention policies (trimkv, dbtrimkv, kvpop) on a stock
Hugging Face Qwen3ForCausalLM — `load_policy`, the transformers cache `RetainCache` and the
kvpress press `RetainPress` (with the `kvpress` extra). Decisions identical to retain-generate
(DESIGN §8). See docs/inference.md."""
from .cache import RetainCache, uninstall as remove_hooks
from .policy import Policy, load_policy

__all__ = ["Policy", "RetainCache", "RetainPress", "load_policy", "remove_hooks"]
__version__ = "0.1.0"


def __getattr__(name):
    # kvpress is an optional extra: import the press only when asked for.
    if name == "RetainPress":
        from .press import RetainPress

        return RetainPress
    raise AttributeError(f"module 'retain_kv' has no attribute {name!r}")
