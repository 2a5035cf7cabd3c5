"""A careless or hostile caller gets one ValueError line naming the policy file and the problem,
before any generation starts."""
import os

import pytest
import torch
from conftest import FIXTURES, POLICIES, hf_generate, load_model
from transformers import DynamicCache

from retain_kv import RetainCache, RetainPress, load_policy


def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_policy_for_another_model():
    tiny = load_model(os.path.join(FIXTURES, "hf", "mha_f16_oldstyle"))  # 2 layers × 4 KV heads, hidden 64
    for kind, want in (("trimkv", "× hidden 128, the model has 2 layers × 4 KV heads × hidden 64"),
                       ("kvpop", "× head_dim 64, the model has 2 layers × 4 KV heads × head_dim 16")):
        with pytest.raises(ValueError) as e:
            RetainCache(tiny, POLICIES[kind], 32)
        one_line(e, POLICIES[kind], want)
        with pytest.raises(ValueError) as e:
            with RetainPress(POLICIES[kind], 32)(tiny):
                pass
        one_line(e, POLICIES[kind], want)


@pytest.mark.parametrize("budget,words", [(0, "below the minimum 1"), (-5, "below the minimum 1"),
                                          (2.5, "must be an integer"), (True, "must be an integer"),
                                          ("64", "must be an integer"), (None, "exactly one of budget")])
def test_bad_budgets(recall_model, budget, words):
    with pytest.raises(ValueError) as e:
        RetainCache(recall_model, POLICIES["trimkv"], budget)
    one_line(e, POLICIES["trimkv"], words)


def test_kvpop_minimum_and_buffer(recall_model):
    with pytest.raises(ValueError) as e:
        RetainCache(recall_model, POLICIES["kvpop"], 20)
    one_line(e, "budget 20 is below the minimum 21 of policy kvpop (4 sinks + a window of 16")
    RetainCache(recall_model, POLICIES["kvpop"], 21)
    for buffer in (0, -1, 1.5):
        with pytest.raises(ValueError) as e:
            RetainCache(recall_model, POLICIES["dbtrimkv"], 8, buffer=buffer)
        one_line(e, "buffer must be an integer >= 1")
    for ratio in (1.0, -0.1, "half"):
        with pytest.raises(ValueError) as e:
            RetainPress(POLICIES["trimkv"], compression_ratio=ratio)
        one_line(e, "compression_ratio must be in [0, 1)")
    with pytest.raises(ValueError) as e:
        RetainPress(POLICIES["trimkv"], 8, compression_ratio=0.5)
    one_line(e, "exactly one of budget")


def test_bad_path_and_model_kind(recall_model, tmp_path):
    with pytest.raises(ValueError) as e:
        RetainCache(recall_model, str(tmp_path / "nope.safetensors"), 8)
    one_line(e, "nope.safetensors: no such file")
    with pytest.raises(ValueError) as e:
        RetainPress(os.path.join(FIXTURES, "hf", "mha_f16_oldstyle", "config.json"), 8)
    one_line(e, "config.json: is not a policy")


def test_attention_without_masks(recall_model):
    recall_model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError) as e:
            RetainCache(recall_model, POLICIES["trimkv"], 8)
        one_line(e, "attention implementation 'flash_attention_2'", "attn_implementation='sdpa'")
    finally:
        recall_model.config._attn_implementation = "sdpa"


def test_batch_and_reuse(recall_model):
    cache = RetainCache(recall_model, POLICIES["trimkv"], 8)
    with pytest.raises(ValueError) as e, torch.no_grad():
        recall_model(torch.randint(16, 256, (2, 10)), past_key_values=cache)
    one_line(e, "batch size 2")
    cache = RetainCache(recall_model, POLICIES["trimkv"], 8)
    hf_generate(recall_model, cache, list(range(20, 60)), 3)
    with pytest.raises(ValueError) as e, torch.no_grad():  # a second sequence from position 0 in the same cache
        recall_model(torch.randint(16, 256, (1, 10)), past_key_values=cache, cache_position=torch.arange(10))
    one_line(e, "feeds positions 0…9 but the cache has seen 42 tokens", "one sequence")
    # a press starts afresh on every new (empty) cache
    press = RetainPress(POLICIES["trimkv"], 8)
    with press(recall_model):
        a = hf_generate(recall_model, DynamicCache(), list(range(20, 60)), 3)
        b = hf_generate(recall_model, DynamicCache(), list(range(20, 60)), 3)
    assert a == b
    assert load_policy(POLICIES["trimkv"]).kind == "trimkv"
