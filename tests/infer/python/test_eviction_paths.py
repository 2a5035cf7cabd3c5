"""The fast paths of retain_kv's eviction make the choices and the layout of the general ones:
a decoding step's drop_decoding/drop_and_fill leave the table and the key/value slots exactly as
compact() does; the float-score choices (argmin, a bound carried between steps) pick what a
brute-force sort by (score, position, later row first) picks, ties and ±0.0 included; and gates
that tie everywhere decode as retain-generate does."""
import copy
import random
import struct

import numpy as np
import pytest
import torch
from conftest import POLICIES, RECALL, greedy, hf_generate, retain_generate
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import retain_kv.cache
import retain_kv.select
from retain_kv import RetainCache
from retain_kv.books import Books
from retain_kv.select import global_drops, per_head_drops, trim_scores


def random_books(rng, L, K):
    """Books after a few chunks and random evictions (rows of different counts, empty slots),
    then one fresh decoding token per row."""
    b, q = Books(L, K), 0
    for _ in range(rng.integers(1, 6)):
        T = int(rng.integers(1, 8))
        b.append(q, -rng.random((b.S, T)).astype(np.float32))
        q += T
        r, s = np.nonzero(b.pos[:, :max(b.width)] >= 0)
        pick = rng.choice(r.size, int(rng.integers(0, max(1, r.size - b.S))), replace=False)
        b.compact(r[pick], s[pick])
    b.append(q, -rng.random((b.S, 1)).astype(np.float32))
    return b


def slots_after(books, moves):
    """Positions each layer's key/value slots hold after `moves` (the table's positions stand in
    for the keys), where the table says an entry is."""
    kv = books.pos.copy()
    rows, dst, src = moves
    rows = np.arange(books.S) if rows is None else rows
    kv[rows, dst] = kv[rows, np.broadcast_to(src, rows.shape)]
    return kv


def same_state(a, b, kv_a, kv_b):
    n = max(a.width)
    assert (a.base, a.width, a.fresh, a.gapless, a.count, a.total) == (b.base, b.width, b.fresh, b.gapless, b.count,
                                                                      b.total)
    assert np.array_equal(a.pos, b.pos) and np.array_equal(a.score, b.score)  # every slot, held or not
    held = a.pos[:, :n] >= 0
    assert np.array_equal(np.where(held, kv_a[:, :n], -1), np.where(held, kv_b[:, :n], -1))
    assert np.array_equal(np.where(held, kv_a[:, :n], -1), a.pos[:, :n])  # the tensors hold what the table says


@pytest.mark.parametrize("seed", range(4))
def test_decoding_evictions_equal_compact(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        b = random_books(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        r, s = np.nonzero(b.pos[:, :max(b.width)] >= 0)
        pick = rng.choice(r.size, int(rng.integers(1, min(r.size, 3 * b.S))), replace=False)
        ref, fast = copy.deepcopy(b), copy.deepcopy(b)
        kv_ref = slots_after(b, ref.compact(r[pick], s[pick]))
        kv_fast = slots_after(b, fast.drop_decoding(r[pick], s[pick]))
        same_state(ref, fast, kv_ref, kv_fast)
        one = np.array([rng.choice(np.flatnonzero(b.pos[row] >= 0)) for row in range(b.S)])  # one drop per row
        ref, fast = copy.deepcopy(b), copy.deepcopy(b)
        kv_ref, kv_fast = slots_after(b, ref.compact(np.arange(b.S), one)), slots_after(b, fast.drop_and_fill(one))
        same_state(ref, fast, kv_ref, kv_fast)


def ordered(x):
    """float32 → int in the order policy.cpp compares scores (−0.0 = +0.0), from the bits."""
    bits = struct.unpack("<i", struct.pack("<f", float(x) + 0.0))[0]
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def brute_force(score, pos, m):
    entries = [(ordered(score[r, s]), int(pos[r, s]), -r, r, s) for r, s in zip(*np.nonzero(pos >= 0))]
    return sorted((r, s) for *_, r, s in sorted(entries)[:m])


def tie_prone(rng, S, W):
    """Scores from few values (ties within and across rows, ±0.0, −inf), positions shared across
    rows (as every head books every token), some empty slots (position −1, score +inf)."""
    values = np.array([-0.0, 0.0, -1.5, -2.0, -np.inf, -0.25], np.float32)
    score = values[rng.integers(0, values.size, (S, W))]
    pos = np.stack([rng.permutation(W) for _ in range(S)]).astype(np.int64)
    empty = rng.random((S, W)) < 0.2
    empty[:, 0] = False
    pos[empty], score[empty] = -1, np.inf
    return score, pos


@pytest.mark.parametrize("few", [64, 0])  # the candidates ordered in Python, or by numpy's lexsort
@pytest.mark.parametrize("seed", range(4))
def test_choices_equal_a_full_sort(seed, few, monkeypatch):
    monkeypatch.setattr(retain_kv.select, "FEW", few)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        S, W = int(rng.integers(1, 6)), int(rng.integers(2, 12))
        score, pos = tie_prone(rng, S, W)
        m = int(rng.integers(1, max(2, (pos >= 0).sum())))
        for bound in (np.inf, -2.0, -0.25, 0.0, float(rng.choice(score[pos >= 0]))):
            for exact_only in (False, True):
                r, s, _ = global_drops(score, pos, m, bound, exact_only)
                assert sorted(zip(r.tolist(), s.tolist())) == brute_force(score, pos, m)
        full = np.stack([rng.permutation(W) for _ in range(S)]).astype(np.int64)  # per-head rows: every slot held
        nan = rng.random((S, W)) < 0.1  # NaNs of both signs: only the keys order them, as policy.cpp's
        score = np.where(nan, np.where(rng.random((S, W)) < 0.5, np.float32(np.nan), -np.float32(np.nan)), score)
        r, s, _ = global_drops(score, full, m, exact_only=True)
        assert sorted(zip(r.tolist(), s.tolist())) == brute_force(score, full, m)
        for k in (1, int(rng.integers(1, W))):
            got = np.sort(per_head_drops(score, full, k), 1)
            want = [sorted(s for _, s in brute_force(score[r:r + 1], full[r:r + 1], k)) for r in range(S)]
            assert got.tolist() == want


@pytest.mark.parametrize("q", [300, (1 << 24) - 1, (1 << 24) + 12345, 1 << 30])
def test_trim_scores_are_torchs(q):
    """The numpy (q − i)·logβ_i is bit for bit torch's float32 × int64 product (TrimKVCache's), at
    distances a float32 holds exactly and beyond."""
    rng = np.random.default_rng(q)
    log_beta = np.concatenate([-rng.random(5000) * 10 ** rng.uniform(-8, 1, 5000), [-0.0, 0.0, -np.inf]])
    log_beta = log_beta.astype(np.float32)
    pos = rng.integers(0, q, log_beta.size)
    want = (torch.from_numpy(log_beta) * (q - torch.from_numpy(pos))).numpy()
    assert np.array_equal(trim_scores(log_beta, pos, q).view(np.int32), want.view(np.int32))


def test_bound_from_one_step_serves_the_next():
    """The bound a decoding step returns still has m entries at or below it one token later (the
    scores fall), so the next step orders only those."""
    rng = np.random.default_rng(7)
    log_beta = -rng.random((4, 50)).astype(np.float32)
    pos = np.stack([np.arange(50)] * 4)
    r, s, bound = global_drops(trim_scores(log_beta, pos, 60), pos, 4)
    pos[r, s], log_beta[r, s] = -1, np.inf
    assert np.count_nonzero(trim_scores(log_beta, pos, 61) <= bound) >= 4


@pytest.mark.parametrize("policy,bias", [("trimkv", 2.0), ("trimkv", 120.0), ("dbtrimkv", 2.0), ("dbtrimkv", 120.0)])
def test_tied_gates_as_retain_generate(recall_model, tmp_path, policy, bias):
    """Gates that ignore their input: logβ the same for every token and head (bias 120: −0.0, every
    score ties), so each choice rests on the tie-breaks, against retain-generate's."""
    tensors = load_file(POLICIES[policy])
    for name, t in tensors.items():
        if name.endswith("linear2.weight" if policy == "trimkv" else "linear3.weight"):
            tensors[name] = torch.zeros_like(t)
        elif name.endswith(".bias") and "linear" not in name:
            tensors[name] = torch.full_like(t, bias)
    gates = str(tmp_path / f"{policy}.safetensors")
    with safe_open(POLICIES[policy], "pt") as f:
        save_file(tensors, gates, metadata=f.metadata())
    prompt = [random.Random(3).randrange(16, 256) for _ in range(90)]
    for chunk in (0, 37):
        want = retain_generate(tmp_path, RECALL, gates, policy, 24, prompt, 16, chunk)
        cache = RetainCache(recall_model, gates, 24)
        got = (hf_generate(recall_model, cache, prompt, 16) if chunk == 0 else
               greedy(recall_model, cache, prompt, 16, chunk))
        assert got == want["generated_ids"]
        assert cache.kept_positions() == want["kept_positions"]


@pytest.mark.parametrize("policy", ["trimkv", "dbtrimkv"])
def test_device_moves(recall_model, tmp_path, monkeypatch, policy):
    """The key/value moves a GPU makes (torch index ops, not the CPU's numpy view), run here."""
    monkeypatch.setattr(retain_kv.cache._Store, "host_moves", False)
    prompt = [random.Random(5).randrange(16, 256) for _ in range(120)]
    want = retain_generate(tmp_path, RECALL, POLICIES[policy], policy, 24, prompt, 16, 37)
    cache = RetainCache(recall_model, POLICIES[policy], 24)
    assert greedy(recall_model, cache, prompt, 16, 37) == want["generated_ids"]
    assert cache.store.np is None and cache.kept_positions() == want["kept_positions"]
