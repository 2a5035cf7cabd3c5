"""KVPOP scorer files with a non-default decay (retain-train --decay-min/--decay-max/--decay-every,
issue 38): load_policy reads the range and the step n, and RetainCache ranks by
score_i + ⌊(q − i)/n⌋·log γ exactly as retain-generate does (the same tokens and kept positions,
prefill in one forward and in chunks, then decoding); malformed keys are one ValueError naming
the file."""
import pytest
from conftest import POLICIES, RECALL, greedy, retain_generate
from safetensors.torch import load_file, save_file

from retain_kv import RetainCache, load_policy


def with_metadata(tmp_path, name, drop=(), **extra):
    """models/recall-qwen3's kvpop policy with the keys `drop` removed from its __metadata__ and
    `extra` added."""
    from safetensors import safe_open

    src = POLICIES["kvpop"]
    with safe_open(src, "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k not in drop}
    meta.update({k: str(v) for k, v in extra.items()})
    out = str(tmp_path / name)
    save_file(load_file(src), out, metadata=meta)
    return out


@pytest.mark.parametrize("every,chunk", [(1, 0), (4, 0), (3, 37)])
def test_decay_matches_retain_generate(recall_model, tmp_path, every, chunk):
    # A range strong enough to change what is kept at this length (checked below).
    strong = with_metadata(tmp_path, "strong.safetensors", decay_min=0.9, decay_max=0.99, decay_every=every)
    p = load_policy(strong)
    assert (p.decay_min, p.decay_max, p.decay_every) == (0.9, 0.99, every)
    prompt = [(i * 37 + 11) % 240 + 16 for i in range(200)]
    budget, new = 40, 8
    want = retain_generate(tmp_path, RECALL, strong, "kvpop", budget, prompt, new, chunk)
    (tmp_path / "default").mkdir()
    default = retain_generate(tmp_path / "default", RECALL, POLICIES["kvpop"], "kvpop", budget, prompt, new, chunk)
    assert want["kept_positions"] != default["kept_positions"], "the decay does not change decisions here"
    if every > 1:  # and n changes them against n = 1 with the same range
        one = with_metadata(tmp_path, "one.safetensors", decay_min=0.9, decay_max=0.99)
        (tmp_path / "one").mkdir()
        assert retain_generate(tmp_path / "one", RECALL, one, "kvpop", budget, prompt, new, chunk)["kept_positions"] \
            != want["kept_positions"], "decay_every does not change decisions here"
    cache = RetainCache(recall_model, strong, budget)
    assert greedy(recall_model, cache, prompt, new, chunk) == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]


def test_bad_decay_keys_are_refused(tmp_path):
    for extra, what in (({"decay_every": "x"}, "decay_every = 'x' is not an integer"),
                        ({"decay_every": 0}, "decay_every must be at least 1, got 0"),
                        ({"decay_min": "y"}, "decay_min = 'y' is not a number"),
                        ({"decay_min": 0.99, "decay_max": 0.9}, "must satisfy 0 < decay_min ≤ decay_max ≤ 1")):
        with pytest.raises(ValueError, match=r"bad\.safetensors: .*" + what.replace("(", r"\(")) as e:
            load_policy(with_metadata(tmp_path, "bad.safetensors", **extra))
        assert "\n" not in str(e.value)
    # Without the keys: n = 1 and the KVPOP paper's range, retain-train's defaults.
    p = load_policy(with_metadata(tmp_path, "one.safetensors", drop=("decay_every", "decay_min", "decay_max")))
    assert (p.decay_every, p.decay_min, p.decay_max) == (1, 0.999, 0.999999)
