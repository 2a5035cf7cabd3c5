"""Forward hooks on every layer's self_attn of a stock Qwen3 model (the only change made to it)."""


def attention_modules(model):
    """The self_attn module of every decoder layer, in layer order."""
    inner = model.model if hasattr(model, "model") else model
    inner = inner.language_model if hasattr(inner, "language_model") else inner
    return [layer.self_attn for layer in inner.layers]


def add_hooks(model, before, after):
    """Registers before(module, args, kwargs) as a forward pre-hook and after(module, args,
    kwargs, output) as a forward hook on every self_attn; returns the handles."""
    handles = []
    for attn in attention_modules(model):
        handles.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(attn.register_forward_hook(after, with_kwargs=True))
    return handles
