"""Which entries a policy evicts (DESIGN §8), as model/infer/policy.cpp chooses them: the lowest
score first, ties toward the older entry (then, across streams, the later stream). The order is
made exact by one int64 key per entry: the float32 score mapped to an order-preserving integer
in the high 32 bits, the position in the low 32."""
import torch


def order_key(score, pos):
    """int64 keys ordering entries by (score, position); score F32, pos int64, same shape."""
    bits = (score + 0.0).view(torch.int32)  # + 0.0: −0.0 and +0.0 compare equal, as in C++
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
    return (key.long() << 32) | pos


def per_head_drops(score, pos, m):
    """Slots [K, m] of the m entries to evict from each head (every head has the same count)."""
    return torch.topk(order_key(score, pos), m, dim=1, largest=False, sorted=False).indices


def global_drops(keys, streams, m):
    """Indices of the m entries to evict over several streams: keys int64 [E] from order_key,
    streams int64 [E]. Entries with equal keys (same score and position) in different streams
    lose the later stream first, as select_global in model/infer/policy.cpp."""
    if m <= 0:
        return keys.new_empty(0)
    chosen = torch.topk(keys, m, largest=False, sorted=False).indices
    edge = keys[chosen].max()
    below = (keys < edge).nonzero().flatten()
    tied = (keys == edge).nonzero().flatten()
    if below.numel() + tied.numel() == m:
        return torch.cat([below, tied])
    tied = tied[torch.argsort(streams[tied], descending=True, stable=True)]
    return torch.cat([below, tied[: m - below.numel()]])
