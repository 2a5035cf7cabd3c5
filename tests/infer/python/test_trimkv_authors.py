"""trimkv under RetainCache equals the TRIM-KV authors' own TrimKVCache (PyPI trimkv 0.1.5 under
HF generate, run here as tests/fixtures/generate/make_fixtures.py runs it) on models/recall-qwen3
with its committed trimkv policy: same tokens, same kept positions."""
import importlib.util
import os
import random

import pytest
from conftest import FIXTURES, POLICIES, RECALL, hf_generate
from safetensors.torch import load_file
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from retain_kv import RetainCache, load_policy


def reference():
    spec = importlib.util.spec_from_file_location(
        "retain_trimkv_reference", os.path.join(FIXTURES, "generate", "make_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget,buffer", [(24, 1), (90, 3)])
def test_trimkv_cache_of_the_authors(recall_model, budget, buffer):
    prompt = [random.Random(budget).randrange(16, 256) for _ in range(200)]
    cache = RetainCache(recall_model, POLICIES["trimkv"], budget, buffer=buffer)
    got = hf_generate(recall_model, cache, prompt, 12)
    # The reference swaps transformers' sdpa for a CPU workaround (make_fixtures.py): put it back after.
    saved = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        want_ids, _, want_kept, _ = reference().run_reference(RECALL, load_file(POLICIES["trimkv"]),
                                                              load_policy(POLICIES["trimkv"]).gate_hidden, budget,
                                                              buffer, prompt, 12)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = saved
    assert got == want_ids
    assert cache.kept_positions() == want_kept
