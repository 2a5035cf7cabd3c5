"""step_choice.py's decoding-step choices are select.py's, step after step: trimkv per row and
dbtrimkv over all rows on tables whose scores tie (equal logβ, −0.0 and +0.0, −inf, and
distinct products that round to the same float32), KVPOP's heaps on static rank keys with
protected entries; and a model decoding with the shortcut keeps the tables the general code keeps."""
import copy

import numpy as np
import pytest
import torch
from conftest import POLICIES, decoded_tables

from retain_kv.books import Books
from retain_kv.cache import _Store
from retain_kv.engine import Retention
from retain_kv.kvpop_step import KvpopStep, TorchKvpopStep
from retain_kv.scoring import GateStep
from retain_kv.select import global_drops, per_head_drops, trim_scores
from retain_kv.step_choice import RankHeaps, TrimChoice, f32

Q0 = 3000  # score time of the first step


def tie_prone_log_beta(rng, shape, pos, q):
    """logβ ≤ 0 from few values, and values chosen so that (q − i)·logβ_i of different entries round
    to the same float32 at score time q (ties the positions must decide)."""
    lb = np.array([-0.0, 0.0, -0.5, -0.25, -np.inf, -1e-30, -2.0 ** -140], np.float32)[rng.integers(0, 7, shape)]
    lb = np.where((lb == -np.inf) & (rng.random(shape) < 0.8), np.float32(-0.5), lb)  # (−inf: the lowest, rarely)
    target = np.array([-100.0, -37.5, -1000.0], np.float32)[rng.integers(0, 3, shape)]
    near = (target / np.maximum(q - pos, 1)).astype(np.float32)
    lb = np.where(rng.random(shape) < 0.5, near, lb)
    free = rng.random(shape) < 0.3  # the rest: any logβ
    return np.where(free, -rng.exponential(0.3, shape).astype(np.float32), lb).astype(np.float32)


def new_log_beta(rng, S, t, q, steady):
    """The new tokens' logβ: tie-prone; or set to round alike a few steps later, when several new
    tokens meet (ties among the tokens that came after a refresh); or near 0 (never dropped, so that
    the table's candidates run down). steady: all near −0.1, as a trained gate's."""
    if steady:
        return (-0.1 * (1 + 0.01 * rng.standard_normal(S))).astype(np.float32)
    meet = np.array([-1e6, -3.75e5], np.float32)[rng.integers(0, 2, S)] / (q + rng.integers(0, 8, S) - t)
    kind = rng.integers(0, 3, S)
    lb = tie_prone_log_beta(rng, (S, 1), np.full((S, 1), t), q)[:, 0]
    return np.where(kind == 0, lb, np.where(kind == 1, meet, -1e-4 * rng.random(S))).astype(np.float32)


def rounding_ties(lb, pos, q):
    """How many pairs of a row's entries score the same float32 from different exact products."""
    n = 0
    for r in range(lb.shape[0]):
        exact = {}
        for b, p in zip(lb[r].tolist(), pos[r].tolist()):
            x = (q - p) * b
            if np.isfinite(x):
                exact.setdefault(f32(x), set()).add(x)
        n += sum(len(v) > 1 for v in exact.values())
    return n


def check_rows(lb, pos, new_log_betas):
    """Per row, step after step: TrimChoice.per_row_step's slot is per_head_drops' over the table
    with the new token in slot B (the general code's append); then the new token takes it."""
    S, B = lb.shape
    choice = TrimChoice(S, per_row=True)
    for step, new in enumerate(new_log_betas):
        q, t = Q0 + step, Q0 + step - 2  # (a decoding step: q = seen + 1, the new token at seen − 1)
        full_lb, full_pos = np.concatenate([lb, new[:, None]], 1), np.concatenate([pos, np.full((S, 1), t)], 1)
        want = per_head_drops(trim_scores(full_lb, full_pos, q), full_pos, 1)[:, 0].tolist()
        got = choice.per_row_step(lambda: (lb, pos), q, t, new.tolist(), B)
        assert got == want, f"step {step}"
        for r, s in enumerate(got):
            if s != B:
                lb[r, s], pos[r, s] = new[r], t


@pytest.mark.parametrize("steady", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_trimkv_rows_choose_as_per_head_drops(seed, steady):
    rng = np.random.default_rng(seed)
    S, B = int(rng.integers(1, 5)), int(rng.integers(TrimChoice.WINDOW + 1, TrimChoice.WINDOW + 30))
    pos = np.stack([rng.permutation(Q0 - 2)[:B] for _ in range(S)]).astype(np.int64)
    lb = (tie_prone_log_beta(rng, (S, B), pos, Q0) if not steady else
          (-0.1 * (1 + 0.01 * rng.standard_normal((S, B)))).astype(np.float32))
    ties = rounding_ties(lb, pos, Q0)
    check_rows(lb, pos, [new_log_beta(rng, S, Q0 + i - 2, Q0 + i, steady) for i in range(120)])
    assert ties > 0 or steady  # the tables did hold products that round alike


def meeting(S, B, V=-5000.0, at=5, steps=12):
    """A table whose first `at` drops are its own very low entries, while every new token is set
    to score V at step `at` (distinct products that round to V: their positions decide among them)."""
    pos = np.stack([np.arange(100, 100 + B)] * S).astype(np.int64)
    lb = np.full((S, B), -1e-4, np.float32)
    lb[:, :at] = -1e3
    new = [np.full(S, V / (at + 2 - i), np.float32) for i in range(at + 1)]
    new[0][1:] = -1e-6  # (the oldest new token meets in row 0 only: then rows compete for the drops)
    new += [np.full(S, -1e-6, np.float32)] * (steps - len(new))
    return lb, pos, new


def test_trimkv_new_tokens_that_round_alike_go_oldest_first():
    lb, pos, new = meeting(3, TrimChoice.WINDOW + 4)
    assert len({(5 + 2 - i) * float(n[0]) for i, n in enumerate(new[:6])}) > 1  # different products …
    assert len({f32((5 + 2 - i) * float(n[0])) for i, n in enumerate(new[:6])}) == 1  # … one float32
    check_rows(lb, pos, new)


def just_below_tau(S, per_row):
    """A table whose k = 16 lowest of each row (dbtrimkv: of all) go first, and new tokens that
    arrive early in the first window to score, at its last score time, just below the last of
    those left then, the refresh's τ entry (the k-th lowest per row at the refresh, or the (k·S)-th
    of all) — within 1 % of τ, so still below τ's bound —, the rest never low: they are dropped then,
    before the τ entry, so the choice must track them (step_choice tracks only the tokens that can
    reach τ in the window)."""
    k = TrimChoice.WINDOW
    B = k + 4
    pos = np.stack([np.arange(100, 100 + B)] * S).astype(np.int64)
    lb = np.full((S, B), -1e-6, np.float32)
    lb[:, :k] = (-np.linspace(2.0, 1.0, k, dtype=np.float32) / (Q0 - 100))[None, :]  # scores ≈ −2 … −1 at Q0
    lb[:, :k] *= np.float32(1 + 0.01 * np.arange(S))[:, None].astype(np.float32)
    last = Q0 + k - 1
    end = trim_scores(lb, pos, last)
    tau = end[:, k - 1] if per_row else np.full(S, end[0, k - 1])  # (row 0 scores highest)
    new = []
    for step in range(2 * k + 4):
        t = Q0 + step - 2
        lam = np.full(S, -1e-9, np.float32)
        if 2 <= step < 6:
            lam = (tau.astype(np.float64) * (1 + 2.0 ** -12) / (last - t)).astype(np.float32)
        new.append(lam)
    return lb, pos, new


def test_trimkv_tracks_the_tokens_that_reach_tau_in_the_window():
    lb, pos, new = just_below_tau(3, per_row=True)
    check_rows(lb, pos, new)


def test_dbtrimkv_tracks_the_tokens_that_reach_tau_in_the_window():
    lb, pos, new = just_below_tau(3, per_row=False)
    books = Books(1, 3)
    books.append(100, lb)
    books.compact(np.zeros(0, np.int64), np.zeros(0, np.int64))
    check_global(books, new)


def layout(rng, L, K, B, steady):
    """Books holding S·B entries in rows of different counts (dbtrimkv's layout after evictions)."""
    books, q = Books(L, K), 0
    while books.total < books.S * B + books.S * 3:
        T = int(rng.integers(5, 40))
        books.append(q, np.zeros((books.S, T), np.float32), T)
        q += T
    r, s = np.nonzero(books.pos[:, :max(books.width)] >= 0)
    pick = rng.choice(r.size, books.total - books.S * B, replace=False)
    books.compact(r[pick], s[pick])
    held = books.pos >= 0
    books.score[held] = (tie_prone_log_beta(rng, books.pos.shape, books.pos, Q0) if not steady else
                         (-0.1 * (1 + 0.01 * rng.standard_normal(books.pos.shape))).astype(np.float32))[held]
    return books


def check_global(books, new_log_betas):
    """Every step: the same (row, slot) pairs as global_drops over the table with the new tokens,
    then the table changed as the engine changes it (one per row: fill_step; else drop_step, the
    choice told of the moves), as the general code changes it (append, then drop_and_fill or
    drop_decoding: the same table and moves). Returns the steps that took drop_step."""
    S, K = books.S, books.K
    choice, general = TrimChoice(S, per_row=False), 0
    assert books.total == S * (books.total // S)
    for step, new in enumerate(new_log_betas):
        q, t = Q0 + step, Q0 + step - 2
        new = new[:, None]
        ref = copy.deepcopy(books)
        ref.append(t, new, 1)
        W = max(ref.width)
        dr, ds, _ = global_drops(trim_scores(ref.score[:, :W], ref.pos[:, :W], q), ref.pos[:, :W], S)
        tops = [w for w in books.width for _ in range(K)]
        W = max(books.width)
        got = choice.global_step(lambda: (books.score[:, :W], books.pos[:, :W]), q, t, new[:, 0].tolist(), tops, S)
        got_r, got_s, drops = got
        assert sorted(zip(got_r, got_s)) == sorted(zip(dr.tolist(), ds.tolist())), f"step {step}"
        assert (drops is not None) == (len(set(got_r)) == S)
        if drops is not None:
            assert sorted(zip(got_r, got_s)) == sorted(enumerate(drops))
            books.fill_step(t, drops, new[:, 0].tolist(), tops)
            ref.drop_and_fill(np.array(drops))
        else:
            general += 1
            rows, dst, src = books.drop_step(t, new[:, 0].tolist(), got_r, got_s, tops)
            choice.moved(got_r, got_s, rows, dst, src)
            moves = ref.drop_decoding(dr, ds)
            assert sorted(zip(rows, dst, src)) == sorted(zip(*(m.tolist() for m in moves)))
        n = max(books.width)  # (the capacities may differ: append doubles its arrays when full)
        assert books.width == ref.width and books.count == ref.count and books.total == ref.total
        assert np.array_equal(books.pos[:, :n], ref.pos[:, :n])
        assert np.array_equal(books.score[:, :n].view(np.int32), ref.score[:, :n].view(np.int32))
    return general


@pytest.mark.parametrize("steady", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_dbtrimkv_chooses_as_global_drops(seed, steady):
    rng = np.random.default_rng(100 + seed)
    L, K, B = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(TrimChoice.WINDOW + 1, 40))
    books = layout(rng, L, K, B, steady)
    general = check_global(books, [new_log_beta(rng, books.S, Q0 + i - 2, Q0 + i, steady) for i in range(120)])
    assert general > 0 or steady  # some steps dropped two entries of one row


def test_dbtrimkv_new_tokens_that_round_alike_go_oldest_then_later_row_first():
    lb, pos, new = meeting(3, TrimChoice.WINDOW + 4)
    books = Books(1, 3)
    books.append(100, lb)
    books.compact(np.zeros(0, np.int64), np.zeros(0, np.int64))  # (the layout after an eviction)
    check_global(books, new)


@pytest.mark.parametrize("seed", range(4))
def test_kvpop_heaps_choose_as_per_head_drops(seed):
    """Static rank keys (ties, −0.0/+0.0, −inf; +inf = protected), one token leaving the window a
    step: the heaps' drops are per_head_drops' on the whole table."""
    rng = np.random.default_rng(200 + seed)
    S, W, window = int(rng.integers(1, 5)), int(rng.integers(40, 90)), 5
    values = np.array([-0.0, 0.0, -1.5, -2.0, -np.inf, -0.25], np.float32)
    keys = lambda n: np.where(rng.random(n) < 0.5, values[rng.integers(0, 6, n)],  # noqa: E731
                              rng.standard_normal(n)).astype(np.float32)
    pos = np.stack([rng.permutation(W)] * S).astype(np.int64)  # every row booked every token
    score = np.where(pos < W - window, keys((S, W)), np.inf).astype(np.float32)
    heaps, t = RankHeaps(S), W
    heaps.SIZE = 6  # small heaps: refills happen
    for step in range(150):
        u = t - window  # leaves the window: booked at its slot in every row
        slots = [int(np.flatnonzero(pos[r] == u)[0]) for r in range(S)]
        k = keys(S)
        for r, s in enumerate(slots):
            score[r, s] = k[r]
        want = per_head_drops(score, pos, 1)[:, 0].tolist()
        assert heaps.step(lambda: (score, pos), (u, k.tolist(), slots)) == want, f"step {step}"
        for r, s in enumerate(want):  # the new token (protected) into the dropped slot
            pos[r, s], score[r, s] = t, np.inf
        t += 1


def tables(model, policy, budget, press, monkeypatch, fast):
    """Prefill 90 tokens in chunks of 37, then 60 one-token forwards; the table after each."""
    monkeypatch.setattr(Retention, "fast_choice", fast)
    return decoded_tables(model, POLICIES[policy], budget, press, 60)[:3]


@pytest.mark.parametrize("policy,budget,press", [("trimkv", 24, False), ("dbtrimkv", 30, False), ("kvpop", 24, False),
                                                 ("kvpop", 40, True), ("dbtrimkv", 20, True), ("trimkv", 50, True)])
def test_decoding_keeps_the_tables_of_the_general_choice(recall_model, monkeypatch, policy, budget, press):
    fast, fast_logits, fast_kept = tables(recall_model, policy, budget, press, monkeypatch, True)
    slow, slow_logits, slow_kept = tables(recall_model, policy, budget, press, monkeypatch, False)
    assert fast_kept == slow_kept and torch.equal(fast_logits, slow_logits)
    for (pf, sf), (ps, ss) in zip(fast, slow):
        assert np.array_equal(pf, ps) and np.array_equal(sf.view(np.int32), ss.view(np.int32))


def test_many_rows():
    """A model's worth of rows (the sort keys then give the row more bits, the position fewer)."""
    rng = np.random.default_rng(9)
    S, B = 300, TrimChoice.WINDOW + 5
    pos = np.stack([rng.permutation(Q0 - 2)[:B] for _ in range(S)]).astype(np.int64)
    check_rows(tie_prone_log_beta(rng, (S, B), pos, Q0), pos, [new_log_beta(rng, S, Q0 + i - 2, Q0 + i, False)
                                                              for i in range(25)])
    books = layout(rng, 10, 10, TrimChoice.WINDOW + 5, False)
    check_global(books, [new_log_beta(rng, books.S, Q0 + i - 2, Q0 + i, False) for i in range(25)])


@pytest.mark.parametrize("press", [False, True])
def test_kvpop_torch_step_decodes_as_the_numpy_step(recall_model, monkeypatch, press):
    """KVPOP's decoding step in torch ops (what a GPU runs; here on the CPU, RetainCache's store
    read without numpy) keeps the tables, logits and kept entries of the numpy step."""
    *numpy_step, r = decoded_tables(recall_model, POLICIES["kvpop"], 24, press, 60)
    assert type(r.kvpop_step) is KvpopStep
    monkeypatch.setattr(Retention, "torch_kvpop_step", True)
    monkeypatch.setattr(_Store, "host_moves", False)
    steps, call = [], TorchKvpopStep.__call__
    monkeypatch.setattr(TorchKvpopStep, "__call__", lambda self: steps.append(1) or call(self))
    *torch_step, r = decoded_tables(recall_model, POLICIES["kvpop"], 24, press, 60)
    assert type(r.kvpop_step) is TorchKvpopStep and len(steps) == 60  # (every decoding step ran it)
    (a, a_logits, a_kept), (b, b_logits, b_kept) = numpy_step, torch_step
    assert a_kept == b_kept and torch.equal(a_logits, b_logits)
    for (pa, sa), (pb, sb) in zip(a, b):
        assert np.array_equal(pa, pb) and np.array_equal(sa.view(np.int32), sb.view(np.int32))


@pytest.mark.parametrize("policy,budget,press,dtype", [
    ("kvpop", 24, False, torch.bfloat16), ("kvpop", 40, True, torch.bfloat16), ("trimkv", 24, False, torch.bfloat16),
    ("trimkv", 50, True, torch.bfloat16), ("dbtrimkv", 30, False, torch.bfloat16), ("dbtrimkv", 20, True, torch.bfloat16),
    ("kvpop", 24, False, torch.float64), ("dbtrimkv", 30, True, torch.float64)])
def test_a_model_of_another_dtype_decodes_by_the_steps_as_by_the_general_code(recall_model, monkeypatch, policy,
                                                                              budget, press, dtype):
    """A bfloat16 model (as on a GPU) or a float64 one decodes by the decoding steps — the gate MLP
    of all layers in float32, KVPOP's torch step (on the CPU too: the numpy step reads float32
    only), the choice carried between steps — with the tables, logits and kept entries of the
    general code (per layer, KvpopState.feed's chunk form, select.py every forward)."""
    model = copy.deepcopy(recall_model).to(dtype)
    steps, kvpop_call, gate_call = [], TorchKvpopStep.__call__, GateStep.run
    monkeypatch.setattr(TorchKvpopStep, "__call__", lambda self: steps.append(1) or kvpop_call(self))
    monkeypatch.setattr(GateStep, "run", lambda self: steps.append(1) or gate_call(self))
    a, a_logits, a_kept, _ = decoded_tables(model, POLICIES[policy], budget, press, 60)
    assert len(steps) == 60
    monkeypatch.setattr(Retention, "fast_steps", False)
    b, b_logits, b_kept, _ = decoded_tables(model, POLICIES[policy], budget, press, 60)
    assert len(steps) == 60 and a_kept == b_kept and torch.equal(a_logits, b_logits)
    for (pa, sa), (pb, sb) in zip(a, b):
        assert np.array_equal(pa, pb) and np.array_equal(sa.view(np.int32), sb.view(np.int32))
