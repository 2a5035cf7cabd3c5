"""Greedy generation under RetainCache and RetainPress on a stock Qwen3ForCausalLM makes the same
tokens and keeps the same positions per layer and KV head as `retain-generate --json` (run here),
for trimkv, dbtrimkv and kvpop, at several budgets, with and without chunked prefill; and the same
as the TRIM-KV authors' TrimKVCache fixtures (tests/fixtures/generate)."""
import json
import os
import random

import pytest
import torch
from conftest import (FIXTURES, POLICIES, RECALL, greedy, hf_generate, load_model, retain_generate)
from transformers import DynamicCache

from retain_kv import RetainCache, RetainPress

FIXTURE_CASES = sorted(d for d in os.listdir(os.path.join(FIXTURES, "generate"))
                       if os.path.isfile(os.path.join(FIXTURES, "generate", d, "expected.json")))


@pytest.mark.parametrize("case", FIXTURE_CASES)
def test_trimkv_fixtures(case, tmp_path):
    """The committed TrimKVCache decodings (tiny models: MHA, GQA 2 and 4, YaRN, tied, buffer 1-3)."""
    d = os.path.join(FIXTURES, "generate", case)
    with open(os.path.join(d, "expected.json")) as f:
        e = json.load(f)
    model_dir = os.path.join(FIXTURES, "hf", e["model"])
    gates = os.path.join(d, "gates.safetensors")
    model = load_model(model_dir)
    n = len(e["generated_ids"])
    want = retain_generate(tmp_path, model_dir, gates, "trimkv", e["budget"], e["prompt_ids"], n, buffer=e["buffer"])
    assert want["generated_ids"] == e["generated_ids"] and want["kept_positions"] == e["kept_positions"]
    cache = RetainCache(model, gates, e["budget"], buffer=e["buffer"])
    assert hf_generate(model, cache, e["prompt_ids"], n) == e["generated_ids"]
    assert cache.kept_positions() == e["kept_positions"]
    assert cache.cache_sizes() == e["cache_sizes"] == want["cache_sizes"]
    press = RetainPress(gates, e["budget"], buffer=e["buffer"])
    with press(model):
        assert hf_generate(model, DynamicCache(), e["prompt_ids"], n) == e["generated_ids"]
    assert press.kept_positions() == e["kept_positions"]


def recall_prompt(seed, n=300):
    return [random.Random(seed).randrange(16, 256) for _ in range(n)]


# (policy, budget, prefill chunk): budgets from the kvpop minimum (4 sinks + window 16 + 1) to
# half the prompt; chunk 0 = the whole prompt in one forward (the reference's way).
CASES = [(p, b, c) for p in ("trimkv", "dbtrimkv", "kvpop") for b, c in ((24, 0), (24, 37), (150, 0), (150, 64))]


@pytest.mark.parametrize("policy,budget,chunk", CASES)
def test_recall_policies(recall_model, tmp_path, policy, budget, chunk):
    """models/recall-qwen3 with its committed policies: RetainCache and RetainPress vs retain-generate."""
    prompt, new = recall_prompt(budget + chunk), 12
    want = retain_generate(tmp_path, RECALL, POLICIES[policy], policy, budget, prompt, new, chunk)
    cache = RetainCache(recall_model, POLICIES[policy], budget)
    got = hf_generate(recall_model, cache, prompt, new) if chunk == 0 else greedy(recall_model, cache, prompt, new,
                                                                                  chunk)
    assert got == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]
    assert cache.cache_sizes() == want["cache_sizes"]
    press = RetainPress(POLICIES[policy], budget)
    with press(recall_model):
        got = (hf_generate(recall_model, DynamicCache(), prompt, new) if chunk == 0 else
               greedy(recall_model, DynamicCache(), prompt, new, chunk))
    assert got == want["generated_ids"]
    assert press.kept_positions() == want["kept_positions"]


def test_hf_prefill_chunking(recall_model, tmp_path):
    """transformers' own generate(prefill_chunk_size=C) chunks prompt[:-1] and feeds the last token
    alone: with P = k·C + 1 that is retain-generate --prefill-chunk C."""
    C, prompt = 40, recall_prompt(7, 4 * 40 + 1)
    want = retain_generate(tmp_path, RECALL, POLICIES["dbtrimkv"], "dbtrimkv", 30, prompt, 10, chunk=C)
    cache = RetainCache(recall_model, POLICIES["dbtrimkv"], 30)
    assert hf_generate(recall_model, cache, prompt, 10, prefill_chunk_size=C) == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]


def test_eager_attention(tmp_path):
    """The per-head masks work with eager attention too (dbtrimkv: heads differ in count)."""
    model = load_model(RECALL, attn="eager")
    prompt = recall_prompt(11, 200)
    want = retain_generate(tmp_path, RECALL, POLICIES["dbtrimkv"], "dbtrimkv", 40, prompt, 10, chunk=50)
    cache = RetainCache(model, POLICIES["dbtrimkv"], 40)
    assert greedy(model, cache, prompt, 10, chunk=50) == want["generated_ids"]
    assert cache.kept_positions() == want["kept_positions"]


@pytest.mark.parametrize("policy,buffer", [("trimkv", 1), ("kvpop", 3), ("dbtrimkv", 2)])
def test_memory_bounded(recall_model, policy, buffer):
    """Physical eviction: after every forward each layer's key/value tensors hold at most B + buffer − 1
    entries per head (dbtrimkv: B·L·K + its buffer in all, the tensor as wide as the largest head),
    and the one tensor they are views of has room for no more than the widest layer + buffer
    (+ 1/4; per-head policies: exactly B + buffer once evicting)."""
    B, L, K = 30, 2, 2
    cache = RetainCache(recall_model, POLICIES[policy], B, buffer=buffer)
    ids = torch.tensor([recall_prompt(3, 120)])
    with torch.no_grad():
        for t in range(ids.shape[1]):
            recall_model(ids[:, t:t + 1], past_key_values=cache)
            counts = cache.entry_counts()
            for l in range(L):
                assert cache.layers[l].keys.shape == cache.layers[l].values.shape
                assert cache.layers[l].keys.shape[-2] == max(counts[l])
            if policy == "dbtrimkv":
                assert sum(map(sum, counts)) <= (B + buffer - 1) * L * K
            else:
                assert max(map(max, counts)) <= B + buffer - 1
            room, need = cache.store.kv.shape[3], max(map(max, counts)) + buffer
            assert all(layer.keys.untyped_storage().data_ptr() == cache.store.kv.untyped_storage().data_ptr()
                       for layer in cache.layers)
            assert room <= need + need // 4
            if policy != "dbtrimkv" and t + 1 >= B + buffer:  # evicting since forward t
                assert room == B + buffer
    if policy != "dbtrimkv":
        assert cache.layers[0].keys.shape[-2] >= B  # it did fill up


def test_budget_above_prompt(recall_model):
    """A budget no sequence reaches evicts nothing: the same tokens as plain DynamicCache decoding."""
    prompt = recall_prompt(5, 60)
    cache = RetainCache(recall_model, POLICIES["kvpop"], 1000)
    assert hf_generate(recall_model, cache, prompt, 8) == hf_generate(recall_model, DynamicCache(), prompt, 8)
    assert cache.kept_positions() == [[list(range(67))] * 2] * 2
