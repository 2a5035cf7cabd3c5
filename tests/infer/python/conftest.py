"""Shared setup of retain_kv's tests: the package from the source tree, retain's binaries
(RETAIN_BIN_DIR, default build/bin), models and the greedy loops the tests compare."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "model", "infer", "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
# One thread: these models are tiny, and on a busy 2-core machine waking a second thread for each
# small op costs far more than the op (30x slower decoding steps measured here with 2 threads).
torch.set_num_threads(1)

BIN = os.environ.get("RETAIN_BIN_DIR", os.path.join(REPO, os.environ.get("BUILD_DIR", "build"), "bin"))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
RECALL = os.path.join(REPO, "models", "recall-qwen3")
POLICIES = {k: os.path.join(RECALL, "policies", f"{k}.safetensors") for k in ("trimkv", "dbtrimkv", "kvpop")}


def tool(name):
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} not found: build the project first (or set RETAIN_BIN_DIR)")
    return path


def run(args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r


def retain_generate(tmp_path, model_dir, gates, policy, budget, prompt, new, chunk=0, buffer=1):
    """retain-generate --json's result (greedy, no EOS stop)."""
    out = str(tmp_path / f"gen-{policy}-{budget}-{chunk}-{buffer}.json")
    run([tool("retain-generate"), "--model", model_dir, "--gates", gates, "--policy", policy, "--budget", str(budget),
         "--buffer", str(buffer), "--greedy", "--ignore-eos", "--max-new", str(new), "--prefill-chunk", str(chunk),
         "--prompt-ids", " ".join(map(str, prompt)), "--json", out])
    with open(out) as f:
        return json.load(f)


def load_model(model_dir, attn="sdpa"):
    """A stock Qwen3ForCausalLM in float32. transformers 4.57 does not read the `rope_parameters`
    key newer configs (and retain-make-tiny) write: the same RoPE goes in the legacy keys it reads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters", None)
    if rp and not c.get("rope_scaling"):
        c["rope_theta"] = rp.get("rope_theta", 10000.0)
        if rp.get("rope_type", "default") != "default":
            c["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return Qwen3ForCausalLM.from_pretrained(model_dir, config=Qwen3Config(**c), dtype=torch.float32,
                                            attn_implementation=attn).eval()


@pytest.fixture(scope="session")
def recall_model():
    return load_model(RECALL)


def greedy(model, cache, prompt, new, chunk=0):
    """Greedy tokens after feeding `prompt` in chunks of `chunk` (0: one forward), as retain-generate:
    the last generated token is not fed back. Positions are passed explicitly (a kvpress
    DynamicCache counts only the entries it holds)."""
    ids = torch.tensor([prompt])
    step = chunk or len(prompt)
    with torch.no_grad():
        for a in range(0, len(prompt), step):
            b = min(a + step, len(prompt))
            logits = model(ids[:, a:b], past_key_values=cache, cache_position=torch.arange(a, b)).logits
        out = []
        for i in range(new):
            out.append(int(logits[0, -1].argmax()))
            if i + 1 < new:
                p = len(prompt) + i
                logits = model(torch.tensor([[out[-1]]]), past_key_values=cache,
                               cache_position=torch.tensor([p])).logits
    return out


def hf_generate(model, cache, prompt, new, **kw):
    """model.generate, greedy, exactly `new` tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def decoded_tables(model, policy_path, budget, press, decode):
    """Prefill 90 tokens in chunks of 37, then `decode` one-token forwards, under RetainCache or
    (press) RetainPress on kvpress's DynamicCache; returns the table (positions, scores) after each
    forward, each forward's last logits, the kept positions and the Retention."""
    from transformers import DynamicCache

    from retain_kv import RetainCache, RetainPress

    ids = torch.tensor([[16 + (7 * i) % 200 for i in range(90 + decode)]])
    if press:
        p = RetainPress(policy_path, budget)
        ctx, cache, retention = p(model), DynamicCache(), p._retention
    else:
        cache = RetainCache(model, policy_path, budget)
        ctx, retention = torch.no_grad(), cache.retention
    tables, logits = [], []
    with ctx, torch.no_grad():
        for a, b in ((0, 37), (37, 74), (74, 90)) + tuple((t, t + 1) for t in range(90, 90 + decode)):
            logits.append(model(ids[:, a:b], past_key_values=cache, cache_position=torch.arange(a, b)).logits[0, -1])
            n = max(retention.books.width)
            tables.append((retention.books.pos[:, :n].copy(), retention.books.score[:, :n].copy()))
    return tables, torch.stack(logits), retention.kept_positions(), retention
