"""The pretraining mixture of retain's built-in recall model (models/recall-qwen3).

Token ids are those of retain's recall task (model/infer/recall_task.h), for a model whose
first special token is <|endoftext|> = 256 (so the task's content ids stop at hi = 256):

    PAIR = 1, ARROW = 2, QUERY = 3
    keys and values: uniform over [16, 16 + R), R = (hi - 16) // 2 = 120
    filler:          uniform over [16 + R, hi) = [136, 256)

Three kinds of document, each one training row (no packing):

* recall (most rows): `context` tokens of filler with `pairs` records "PAIR k1 k2 ARROW v1 v2"
  at random places, then `queries` distinct keys queried at the end, each "QUERY k1 k2 ARROW v1
  v2". retain-eval asks one query; the first query here has exactly its form.
* copy (induction): filler with a span of key/value ids that is repeated later.
* text (filler prediction): a fixed sparse bigram chain over the filler ids, predictable from the
  previous token alone.

Every row ends with <|endoftext|>. Everything comes from numpy's Generator(PCG64(seed)).
"""
import numpy as np

PAIR, ARROW, QUERY, FIRST_CONTENT, EOT = 1, 2, 3, 16, 256
HI = 256
R = (HI - FIRST_CONTENT) // 2
KV_LO, KV_HI = FIRST_CONTENT, FIRST_CONTENT + R
FILL_LO, FILL_HI = FIRST_CONTENT + R, HI


def recall_row(rng, context, pairs, queries, key_len=2, value_len=2):
    """Returns (ids, answer_mask): answer_mask is 1 on the queried values."""
    record = 2 + key_len + value_len
    assert pairs * record <= context
    keys = set()
    while len(keys) < pairs:
        keys.add(tuple(rng.integers(KV_LO, KV_HI, key_len)))
    keys = list(keys)
    rng.shuffle(keys)
    values = [tuple(rng.integers(KV_LO, KV_HI, value_len)) for _ in range(pairs)]
    filler = context - pairs * record
    cuts = np.sort(rng.integers(0, filler + 1, pairs))
    ids, written = [], 0
    for p in range(pairs + 1):
        until = cuts[p] if p < pairs else filler
        ids.extend(rng.integers(FILL_LO, FILL_HI, until - written).tolist())
        written = until
        if p == pairs:
            break
        ids += [PAIR, *keys[p], ARROW, *values[p]]
    mask = [0] * len(ids)
    for q in rng.permutation(pairs)[:queries]:
        ids += [QUERY, *keys[q], ARROW]
        mask += [0] * (2 + key_len)
        ids += list(values[q])
        mask += [1] * value_len
    ids.append(EOT)
    mask.append(0)
    return ids, mask


def copy_row(rng, length):
    span = int(rng.integers(4, 33))
    seg = rng.integers(KV_LO, KV_HI, span).tolist()
    gap = int(rng.integers(0, max(1, length - 2 * span - 1)))
    before = rng.integers(FILL_LO, FILL_HI, gap).tolist()
    ids = before + seg
    mid = int(rng.integers(0, max(1, length - len(ids) - span - 1)))
    ids += rng.integers(FILL_LO, FILL_HI, mid).tolist()
    mask = [0] * len(ids) + [0] + [1] * (span - 1)
    ids += seg
    tail = length - len(ids) - 1
    if tail > 0:
        ids += rng.integers(FILL_LO, FILL_HI, tail).tolist()
        mask += [0] * tail
    ids.append(EOT)
    mask.append(0)
    return ids, mask


class BigramText:
    """A fixed chain over the filler ids: each id has 4 successors with probabilities .55 .25 .15 .05."""

    def __init__(self, seed=12345):
        g = np.random.Generator(np.random.PCG64(seed))
        n = FILL_HI - FILL_LO
        self.next = np.stack([g.choice(n, 4, replace=False) for _ in range(n)]) + FILL_LO
        self.p = np.array([0.55, 0.25, 0.15, 0.05])

    def row(self, rng, length):
        ids = [int(rng.integers(FILL_LO, FILL_HI))]
        choice = rng.choice(4, length - 2, p=self.p)
        for c in choice:
            ids.append(int(self.next[ids[-1] - FILL_LO][c]))
        ids.append(EOT)
        return ids, [0] * len(ids)  # predictable, but no memory needed: not an answer
