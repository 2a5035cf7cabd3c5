"""KVPOP scorer files with a non-default decay (retain-train --decay-min/--decay-max/--decay-every,
issue 38): load_policy reads the range and ranks with it exactly as retain-generate does (the
same tokens and kept positions); a decay that steps every n > 1 tokens is refused with one
ValueError naming the file (retain_kv ranks with n = 1 only), as are malformed keys."""
import pytest
from conftest import POLICIES, RECALL, greedy, retain_generate
from safetensors.torch import load_file, save_file

from retain_kv import RetainCache, load_policy


def with_metadata(tmp_path, name, **extra):
    """models/recall-qwen3's kvpop policy with `extra` added to its __metadata__."""
    from safetensors import safe_open

    src = POLICIES["kvpop"]
    with safe_open(src, "pt") as f:
        meta = dict(f.metadata() or {})
    meta.update({k: str(v) for k, v in extra.items()})
    out = str(tmp_path / name)
    save_file(load_file(src), out, metadata=meta)
    return out


def test_decay_range_matches_retain_generate(recall_model, tmp_path):
    # A range strong enough to change what is kept at this length (checked below).
    strong = with_metadata(tmp_path, "strong.safetensors", decay_min=0.9, decay_max=0.99)
    p = load_policy(strong)
    assert (p.decay_min, p.decay_max) == (0.9, 0.99)
    prompt = [(i * 37 + 11) % 240 + 16 for i in range(200)]
    budget, new = 40, 8
    want = retain_generate(tmp_path, RECALL, strong, "kvpop", budget, prompt, new)
    (tmp_path / "default").mkdir()
    default = retain_generate(tmp_path / "default", RECALL, POLICIES["kvpop"], "kvpop", budget, prompt, new)
    assert want["kept_positions"] != default["kept_positions"], "the range does not change decisions here"
    cache = RetainCache(recall_model, strong, budget)
    assert greedy(recall_model, cache, prompt, new) == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]


def test_decay_every_and_bad_keys_are_refused(tmp_path):
    path = with_metadata(tmp_path, "every.safetensors", decay_every=4)
    with pytest.raises(ValueError, match=r"every\.safetensors: kvpop scorers with decay_every 4") as e:
        load_policy(path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="decay_every = 'x' is not an integer"):
        load_policy(with_metadata(tmp_path, "x.safetensors", decay_every="x"))
    with pytest.raises(ValueError, match="decay_min = 'y' is not a number"):
        load_policy(with_metadata(tmp_path, "y.safetensors", decay_min="y"))
    with pytest.raises(ValueError, match="must satisfy 0 < decay_min ≤ decay_max ≤ 1"):
        load_policy(with_metadata(tmp_path, "z.safetensors", decay_min=0.99, decay_max=0.9))
    assert load_policy(with_metadata(tmp_path, "one.safetensors", decay_every=1)).decay_min == 0.999
