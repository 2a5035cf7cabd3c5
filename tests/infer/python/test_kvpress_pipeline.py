"""RetainPress in kvpress's KVPressTextGenerationPipeline: the recall accuracy of
`retain-eval --task recall` (its samples dumped with --dump-task) is reproduced sample by sample,
for trimkv, dbtrimkv and kvpop at two budgets; and the evaluation-registry entries."""
import json
import os
import sys

import pytest
import torch
from conftest import POLICIES, RECALL, run, tool
from transformers import PreTrainedTokenizerFast, pipeline

from retain_kv import RetainPress
from retain_kv.kvpress_eval import main, retain_presses

CONTEXT, BUDGETS = 512, (24, 40)


class IdsAsText:
    """The recall task's token ids are bytes that are not UTF-8 text: answers are compared as ids,
    so the pipeline's final decode writes the ids. Everything else is the tokenizer's."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def recall_eval(tmp_path_factory):
    d = tmp_path_factory.mktemp("recall")
    gates = [a for k, p in POLICIES.items() for a in ("--gates", f"{k}={p}")]
    run([tool("retain-eval"), "--model", RECALL, *gates, "--task", "recall", "--context", str(CONTEXT), "--pairs", "8",
         "--samples", "16", "--seed", "4242", "--policy", "trimkv,dbtrimkv,kvpop", "--budget",
         ",".join(map(str, BUDGETS)), "--prefill-chunk", str(CONTEXT), "--dump-task", str(d / "tasks.jsonl"),
         "--out", str(d / "metrics.json")])
    with open(d / "tasks.jsonl") as f:
        tasks = [json.loads(line) for line in f]
    with open(d / "metrics.json") as f:
        results = {(r["policy"], r["budget"]): r for r in json.load(f)["results"]}
    return tasks, results


@pytest.mark.parametrize("policy", ["trimkv", "dbtrimkv", "kvpop"])
def test_recall_accuracy_through_pipeline(recall_model, recall_eval, policy):
    tasks, results = recall_eval
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(RECALL, "tokenizer.json"))
    pipe = pipeline("kv-press-text-generation", model=recall_model, tokenizer=tok)
    pipe.tokenizer = IdsAsText(tok)
    for budget in BUDGETS:
        correct = 0
        for t in tasks:
            ids, answer = t["input_ids"][:-2], t["input_ids"][-2:]
            assert t["target_mask"][-2:] == [1, 1] and len(ids) == CONTEXT + 4
            # The pipeline's own steps after tokenizing: the context prefilled under the press, then
            # the question (QUERY k1 k2 ARROW) and greedy answer tokens, the press still evicting.
            out = pipe._forward({"context_ids": torch.tensor([ids[:CONTEXT]]),
                                 "questions_ids": [torch.tensor([ids[CONTEXT:]])]},
                                max_new_tokens=2, press=RetainPress(POLICIES[policy], budget))
            correct += out[0] == " ".join(map(str, answer))
        assert correct / len(tasks) == pytest.approx(results[(policy, budget)]["accuracy"], abs=1e-12), budget


def test_pipeline_with_text(recall_model):
    """The public pipeline call on text, with a compression ratio as evaluate.py sets it."""
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(RECALL, "tokenizer.json"), bos_token="<|endoftext|>")
    pipe = pipeline("kv-press-text-generation", model=recall_model, tokenizer=tok)
    press = retain_presses({"dbtrimkv": POLICIES["dbtrimkv"]})["retain_dbtrimkv"]
    press.compression_ratio = 0.75
    context = "the quick brown fox jumps over the lazy dog " * 8
    out = pipe(context, question="what jumps?", press=press, max_new_tokens=4)
    assert isinstance(out["answer"], str)
    n = len(tok.encode("<|endoftext|>" + context))
    counts = press.entry_counts()
    assert sum(map(sum, counts)) <= max(1, int(n * 0.25)) * 2 * 2  # B·L·K after the last eviction
    assert "retain_dbtrimkv" in retain_presses({"dbtrimkv": POLICIES["dbtrimkv"]})


def test_evaluation_wrapper(tmp_path, monkeypatch):
    """python -m retain_kv.kvpress_eval adds retain_<name> to PRESS_REGISTRY before evaluate.py's CLI
    runs (here a stand-in evaluation/ folder that reports what it got)."""
    (tmp_path / "evaluate_registry.py").write_text("PRESS_REGISTRY = {'knorm': None}\n")
    (tmp_path / "evaluate.py").write_text(
        "import json\nfrom evaluate_registry import PRESS_REGISTRY\n"
        "class CliEntryPoint:\n"
        "    def __call__(self, press_name, compression_ratio):\n"
        "        press = PRESS_REGISTRY[press_name]\n"
        "        press.compression_ratio = compression_ratio\n"
        "        json.dump({'names': sorted(PRESS_REGISTRY), 'press': repr(press)}, open('out.json', 'w'))\n")
    monkeypatch.chdir(tmp_path)  # main() changes into the evaluation folder and imports from it
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        main([str(tmp_path), "--policy", f"kv={POLICIES['kvpop']}", "--", "--press_name", "retain_kv",
              "--compression_ratio", "0.5"])
    finally:
        for name in ("evaluate", "evaluate_registry"):
            sys.modules.pop(name, None)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["names"] == ["knorm", "retain_kv"]
    assert got["press"].startswith("RetainPress(kvpop") and "compression_ratio=0.5" in got["press"]
