"""The decoding step's scoring fast paths give what the general code gives: the gate MLP run after
the last layer into preallocated outputs (scoring.GateStep) is gate_log_beta bit for bit; KVPOP's
one-token numpy step of all layers (kvpop_step.py) gives the rank keys of a pure-Python copy of
kvpop_state.cpp (the C++ reference, loop for loop) and of the chunk closed form, bit for bit, and
the reference's state; a whole decoding run books the same scores either way, under RetainCache
(keys and values read from its store) and RetainPress (read layer by layer)."""
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import POLICIES, decoded_tables
from test_eviction_paths import random_books
from transformers import DynamicCache

from retain_kv import RetainCache, RetainPress
from retain_kv.books import Books
from retain_kv.engine import Retention
from retain_kv.kvpop_step import KvpopStep, TorchKvpopStep
from retain_kv.policy import Policy
from retain_kv.scoring import GateStep, KvpopState, gate_log_beta


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits(t):
    return np.ascontiguousarray(np.asarray(t, np.float32)).view(np.int32)


@pytest.mark.parametrize("kind", ["trimkv", "dbtrimkv"])
@pytest.mark.parametrize("D,G,K", [(64, 16, 2), (48, 20, 3), (40, 33, 1), (128, 512, 8)])
def test_gate_step_is_gate_log_beta(kind, D, G, K):
    """Bit for bit, for gate widths whose elementwise ops end in a vector tail or not."""
    g, L = torch.Generator().manual_seed(D + G + K), 3
    layer = lambda: {"linear1.weight": torch.randn(G, D, generator=g) * 0.3,  # noqa: E731
                     "linear1.bias": torch.randn(G, generator=g), "linear2.weight": torch.randn(K, G, generator=g),
                     "bias": torch.randn(K, generator=g) * 3}
    layers = [layer() for _ in range(L)]
    if kind == "dbtrimkv":
        for p in layers:
            p["linear2.weight"], p["linear2.bias"] = torch.randn(G, G, generator=g) * 0.3, torch.randn(G, generator=g)
            p["linear3.weight"] = torch.randn(K, G, generator=g)
    policy = Policy(kind=kind, source="random", layers=layers, kv_heads=K, hidden=D, gate_hidden=G)
    step = GateStep(policy, torch.device("cpu"))
    for trial in range(20):
        hs = [torch.randn(1, 1, D, generator=g) * 10 ** (trial % 4 - 1) for _ in range(L)]
        hs[0].requires_grad_(trial % 2 == 1)  # kvpress's pipeline runs with grad on
        for l, h in enumerate(hs):
            step.keep(l, h)
        got = step.run()
        want = torch.cat([gate_log_beta(policy, l, h[0]).t() for l, h in enumerate(hs)]).detach().numpy()
        assert got.shape == want.shape == (L * K, 1)
        assert np.array_equal(bits(got), bits(want))


def test_logsigmoid_is_elementwise_wherever_the_element_sits():
    """GateStep runs one logsigmoid for all layers' [L, 1, K]: each element must come out as in its
    own layer's [1, K] call. (silu does not in torch 2.15: the last length mod 16 elements of a
    call take a scalar path that differs in ~4 % of them — so GateStep keeps it per layer.)"""
    x = torch.randn(20000 * 3, generator=torch.Generator().manual_seed(3)) * 8
    assert torch.equal(F.logsigmoid(x), torch.cat([F.logsigmoid(c) for c in x.split(3)]))


# ---- KVPOP -------------------------------------------------------------------------------------

def kvpop_policy(seed, L, K, r, window):
    g = torch.Generator().manual_seed(seed)
    x = 4 * r
    shapes = {"q_proj.weight": (K, r, x), "k_proj.weight": (K, r, x), "v_proj.weight": (K, r, x),
              "igate.weight": (K, x), "fgate.weight": (K, x), "out.weight": (K, r)}
    layers = []
    for _ in range(L):
        p = {k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}
        p.update({"igate.bias": torch.randn(K, generator=g), "fgate.bias": torch.randn(K, generator=g) + 2,
                  "out.bias": torch.randn(K, generator=g), "decay": torch.randn(K, generator=g)})
        layers.append(p)
    return Policy(kind="kvpop", source="random", layers=layers, kv_heads=K, head_dim=2 * r, window=window, sinks=1,
                  topk=1)


def cpp_reference(policy, l, h, xs):
    """model/infer/kvpop_state.cpp's feed for one (layer, head), loop for loop in Python floats
    (IEEE doubles, libm's exp/tanh/log1p, as the C++), with kernels/cpu/kvpop_project.cpp's
    projections. Returns the rank keys by position and the final (C, n, m)."""
    p = {k: v[h].double().tolist() for k, v in policy.layers[l].items()}
    r, w, c = len(p["out.weight"]), policy.window, 15.0
    d = 2 * r
    dot = lambda a, x: sum((a[i] * x[i] for i in range(len(x))), 0.0)  # noqa: E731  (left to right)

    def hedgehog(z):
        hi, lo = max(z), min(z)
        pos, neg = [math.exp(v - hi) for v in z], [math.exp(lo - v) for v in z]
        sp, sn = sum(pos, 0.0), sum(neg, 0.0)
        return [f32(v / sp) for v in pos] + [f32(v / sn) for v in neg]

    log_sigmoid = lambda x: -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))  # noqa: E731
    C, n, m = [[0.0] * r for _ in range(d)], [0.0] * d, 0.0
    lg = math.log(0.999) + (math.log(0.999999) - math.log(0.999)) / (1.0 + math.exp(-p["decay"]))
    recent, keys = [], {}
    for t, x in enumerate(xs):
        q = hedgehog([dot(row, x) for row in p["q_proj.weight"]])
        k = hedgehog([dot(row, x) for row in p["k_proj.weight"]])
        v = [f32(dot(row, x)) for row in p["v_proj.weight"]]
        ig = f32(c * math.tanh((dot(p["igate.weight"], x) + p["igate.bias"]) / c))
        lf = f32(log_sigmoid(c * math.tanh((dot(p["fgate.weight"], x) + p["fgate.bias"]) / c)))
        m_new = max(lf + m, ig)
        a, b = math.exp(lf + m - m_new), math.exp(ig - m_new)
        for i in range(d):
            for j in range(r):
                C[i][j] = a * C[i][j] + b * k[i] * v[j]
            n[i] = a * n[i] + b * k[i]
        m = m_new
        recent = (recent + [q])[-w:]
        u = t - w + 1
        if u < 0:
            continue
        qu, inv = recent[0], 1.0 / math.sqrt(d)
        nq = sum((n[i] * qu[i] * inv for i in range(d)), 0.0)
        den = max(abs(nq), math.exp(-m)) + f32(1e-6)
        score = p["out.bias"]
        for j in range(r):
            hj = sum((C[i][j] * qu[i] * inv for i in range(d)), 0.0) / den
            score += p["out.weight"][j] * hj / (1.0 + math.exp(-hj))
        keys[u] = f32(score - u * lg)
    return keys, (C, n, m)


@pytest.mark.parametrize("Step", [KvpopStep, TorchKvpopStep])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_kvpop_step_is_the_cpp_recurrence(window, Step):
    """Every rank key, by the step (after a chunked prefill, or from the first token) and by the
    chunk form, is the C++ reference's float32 key; the step's state is the reference's."""
    L, K, r, T = 2, 2, 4, 40
    policy = kvpop_policy(window, L, K, r, window)
    g = torch.Generator().manual_seed(100 + window)
    k, v = torch.randn(L, T, K, 2 * r, generator=g) * 2, torch.randn(L, T, K, 2 * r, generator=g) * 2
    ref = {(l, h): cpp_reference(policy, l, h, torch.cat([k[l, :, h], v[l, :, h]], -1).double().tolist())
           for l in range(L) for h in range(K)}
    for prefill in (0, 5, 17):
        state = KvpopState(policy, torch.device("cpu"))
        step, got = Step(state), {}
        for l in range(L):
            if prefill:
                u0, keys = state.feed(l, k[l, :prefill], v[l, :prefill])
                for i, row in enumerate(keys.numpy()):
                    got.update({(l, h, u0 + i): row[h] for h in range(K)})
        for t in range(prefill, T):
            kv = torch.stack([k[:, t].reshape(L * K, -1), v[:, t].reshape(L * K, -1)])  # [2, S, d]
            step.read(kv if Step is TorchKvpopStep else kv.numpy())
            left = step()
            if left is not None:
                u, keys = left
                got.update({(l, h, u): keys[l * K + h] for l in range(L) for h in range(K)})
        want = {(l, h, u): key for (l, h), (keys, _) in ref.items() for u, key in keys.items()}
        assert sorted(got) == sorted(want)
        assert np.array_equal(bits([got[i] for i in sorted(want)]), bits([want[i] for i in sorted(want)]))
        if prefill == 0:  # the recurrence term for term (rtol: numpy's vector exp may differ from libm's)
            for (l, h), (_, (C, n, m)) in ref.items():
                np.testing.assert_allclose(state.Cn[l, h, :, :r].numpy(), np.array(C), rtol=1e-13, atol=0)
                np.testing.assert_allclose(state.Cn[l, h, :, r].numpy(), np.array(n), rtol=1e-13, atol=0)
                assert state.m[l, h].item() == pytest.approx(m, rel=1e-15)
    chunked = KvpopState(policy, torch.device("cpu"))  # the chunk form alone, in two forwards
    for l in range(L):
        keys = [chunked.feed(l, k[l, a:b], v[l, a:b]) for a, b in ((0, 23), (23, T))]
        rows = torch.cat([kk for _, kk in keys]).numpy()
        assert rows.shape[0] == T - window + 1
        want = np.array([[ref[l, h][0][u] for h in range(K)] for u in range(T - window + 1)], np.float32)
        assert np.array_equal(bits(rows), bits(want))


def test_book_one_is_book_ranks():
    """One token's ranks booked by its slots (a decoding step) as by the search of a range, and
    refused (the search takes over) when a row does not hold it."""
    rng = np.random.default_rng(9)
    for _ in range(200):
        b = random_books(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        held = b.pos[b.pos >= 0]
        u = int(rng.choice(held))
        ranks = rng.standard_normal((1, b.S)).astype(np.float32)
        fast, slow = Books(b.L, b.K), Books(b.L, b.K)
        for x in (fast, slow):
            x.__dict__.update({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.__dict__.items()})
        slow._book_one = lambda *_: False
        in_every_row = all(u in row for row in b.pos)
        assert fast._book_one(u, ranks[0]) == in_every_row
        fast.book_ranks(u, ranks, 0)
        slow.book_ranks(u, ranks, 0)
        assert np.array_equal(fast.pos, slow.pos) and np.array_equal(bits(fast.score), bits(slow.score))


def test_book_one_books_where_the_token_was_put(monkeypatch):
    """A decoding step's token is booked at the column or slots it was put in (append, drop_and_fill),
    without a search of the table; when it is no longer there (dropped, or moved by compact), the
    search books it as before, or nothing when a row lost it."""
    rng, real_starts, hits = np.random.default_rng(4), Books.starts, 0
    for _ in range(100):
        L, K, q = int(rng.integers(1, 4)), int(rng.integers(1, 4)), 0
        b = Books(L, K, track=True)
        b.append(q, None, int(rng.integers(2, 9)))
        b.compact(np.zeros(0, np.int64), np.zeros(0, np.int64))  # after a prefill chunk
        q = b.width[0]
        searched = []
        monkeypatch.setattr(Books, "starts", lambda self: searched.append(1) or real_starts(self))
        for step in range(30):
            b.append(q, None)
            if step % 4:  # each row drops a held entry (every 5th step, one row its fresh token), as the engine
                n = max(b.width)
                ds = np.array([rng.choice(np.flatnonzero(row >= 0)) for row in b.pos[:, :n]])
                if step % 5 == 0:
                    row = int(rng.integers(0, b.S))
                    ds[row] = int(np.flatnonzero(b.pos[row] == q)[0])
                monkeypatch.setattr(Books, "starts", real_starts)
                if b.fresh == 1:
                    b.drop_and_fill(ds)
                else:  # (forgets where tokens were put)
                    b.compact(np.arange(b.S), ds)
                monkeypatch.setattr(Books, "starts", lambda self: searched.append(1) or real_starts(self))
            u = int(rng.integers(max(0, q - 5), q + 1))
            ranks = rng.standard_normal(b.S)
            want = Books(L, K)
            want.__dict__.update({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.__dict__.items()})
            want.track, want.placed = False, {}
            held = all(u in row for row in b.pos)
            fast = u in b.placed and held
            want.book_ranks(u, ranks[None], 0)
            searched.clear()
            b.book_ranks(u, ranks[None], 0)
            assert np.array_equal(b.pos, want.pos) and np.array_equal(bits(b.score), bits(want.score))
            if fast:
                assert not searched  # found where it was put
                hits += 1
            q += 1
    assert hits > 300


def booked_run(model, policy, budget, press, monkeypatch, fast):
    """Prefill 90 tokens in chunks of 37, then 40 one-token forwards; the table after each."""
    monkeypatch.setattr(Retention, "fast_steps", fast)
    tables, _, kept, retention = decoded_tables(model, POLICIES[policy], budget, press, 40)
    assert retention.step == fast  # the last forward (one token) took the path asked for
    return tables, kept


@pytest.mark.parametrize("policy,budget,press", [("trimkv", 24, False), ("dbtrimkv", 30, False),
                                                 ("kvpop", 24, False), ("kvpop", 40, True), ("trimkv", 50, True)])
def test_decoding_books_the_general_scores(recall_model, monkeypatch, policy, budget, press):
    fast, fast_kept = booked_run(recall_model, policy, budget, press, monkeypatch, True)
    slow, slow_kept = booked_run(recall_model, policy, budget, press, monkeypatch, False)
    assert fast_kept == slow_kept
    for (pf, sf), (ps, ss) in zip(fast, slow):
        assert np.array_equal(pf, ps) and np.array_equal(bits(sf), bits(ss))
    if policy == "kvpop":  # the step did book ranks (not only +inf)
        assert np.isfinite(fast[-1][1][fast[-1][0] >= 90]).any()


@pytest.mark.parametrize("policy,budget", [("trimkv", 24), ("dbtrimkv", 30), ("kvpop", 24)])
def test_store_holds_what_the_press_holds(recall_model, policy, budget):
    """RetainCache's keys and values (one store, moved through its numpy view) equal RetainPress's
    (kvpress's own tensors, moved by torch index ops) in every held slot after every forward."""
    ids = torch.tensor([[16 + (11 * i) % 200 for i in range(110)]])
    cache, press = RetainCache(recall_model, POLICIES[policy], budget), RetainPress(POLICIES[policy], budget)
    plain = DynamicCache()
    with torch.no_grad():
        for a, b in ((0, 37), (37, 60)) + tuple((t, t + 1) for t in range(60, 110)):
            recall_model(ids[:, a:b], past_key_values=cache, cache_position=torch.arange(a, b))
            with press(recall_model):
                recall_model(ids[:, a:b], past_key_values=plain, cache_position=torch.arange(a, b))
            books = cache.retention.books
            assert np.array_equal(books.pos, press._retention.books.pos)
            for l in range(2):
                held = torch.from_numpy(books.layer_pos(l) >= 0)[None, :, :, None]
                for mine, theirs in ((cache.layers[l].keys, plain.layers[l].keys),
                                     (cache.layers[l].values, plain.layers[l].values)):
                    assert mine.shape == theirs.shape
                    assert torch.equal(torch.where(held, mine, 0), torch.where(held, theirs, 0))
