#!/usr/bin/env python3
"""The TRIM-KV authors' training step (package `trimkv` 0.1.5), timed on the batches that
`retain-bench train --dump-batch FILE` wrote, for comparison with retain (a benchmark, not a test).

Per (T, gate) — trimkv = the package's `rg` gate, dbtrimkv = `rg10` (gates tied over layers):
fresh gates (G = --gate-hidden; --gate-init, below), every other parameter frozen; one step is
  teacher    logits of the frozen model under no_grad (vanilla_forward=True, plain attention)
  student    the gated forward (model.train(), FlexAttention with the retention score_mod,
             gradient checkpointing, logit_block_size 8192) with labels and base_logits
  backward   loss.backward()
  optimizer  torch.optim.AdamW over the gate parameters (lr 2e-4, weight decay 1e-6)
The authors' settings: bf16 model on a GPU, float32 on the CPU; retention_weight 1.
The loss is retain's (KL/2 + NTP/2 + capacity at memory M, local capacity): the package's
base_loss "fwkl,ntp" averages its two losses, its NTP is given the same loss positions as its
KL (t whose t+1 is in t's document), and the package's Triton capacity sum is replaced by an
equal torch computation on the CPU. On the CPU, where FlexAttention has no backward (its device
check refuses gradients and its compiled form fails in Inductor), the package's compiled
flex_attention is replaced by PyTorch's eager one with the device check lifted: the same
score_mod and block mask through PyTorch's dense math, with autograd — slow, so CPU rows check the
loss, not the speed. Reported per row: median step ms and per phase over --iters
steps after --warmup, tokens/s, peak memory (torch.cuda.max_memory_allocated, or ru_maxrss on
the CPU), the first step's loss. An out-of-memory or any other failure is a row {"error": "..."}.

--gate-init random (default): the package's reset_parameters() at bias init 18 (weights
N(0, 0.02) from torch's RNG, seeded by --seed), so logβ ≈ −1.5e-8. zero-output:B: the same, then
the gate's output projection set to zero (RetentionGate.linear2.weight for trimkv,
RetentionGate10.linear3.weight for dbtrimkv, shared over the layers) and its bias to B: logβ =
logsigmoid(B) for every token, head and layer whatever the other weights are — what
`retain-bench train --gate-init zero-output:B` does, so the first-step losses of both must agree
although their random weights differ. The JSON's gate_init says which.

Every row, whether it succeeds or fails, releases what it allocated before the next one starts:
the model, the optimizer, the teacher logits (at 128K with a 151936-token vocabulary ~40 GB of
bf16) and the student's output go out of scope with the row (a failed row's traceback is dropped
too), then torch._dynamo.reset() (the graphs traced for FlexAttention hold the row's weights and
activations as constants), gc.collect() until it finds nothing, and torch.cuda.empty_cache().
On CUDA each row records "allocated_after_gb" (torch.cuda.memory_allocated() after that
cleanup), which should be ~0.
Test hook: BENCH_REFERENCE_FAIL_PHASE=PHASE (setup, teacher_forward, student_forward, backward,
optimizer) raises torch.OutOfMemoryError at the end of that phase of row BENCH_REFERENCE_FAIL_ROW
(0-based over (T, gate) in order, default 0), after its tensors exist;
BENCH_REFERENCE_REPORT_ALIVE=1 adds "alive_tensor_mb" to every row (the MB of torch tensors still
reachable after its cleanup) and "alive_tensor_mb_before_rows" to the JSON
(tests/live/bench_reference_check.py uses both hooks).

trimkv 0.1.5 pins transformers 4.57.1, so it needs its own Python environment, e.g.
    python3 -m venv ~/.cache/retain/venvs/trimkv
    ~/.cache/retain/venvs/trimkv/bin/pip install torch "transformers==4.57.1" accelerate einops \
        safetensors matplotlib
    ~/.cache/retain/venvs/trimkv/bin/pip install --no-deps trimkv==0.1.5
(flash_attn, which the package imports at load time, is replaced by a stand-in module; nothing on
the training path calls it). The live checks and compare_train.py find that Python through
$RETAIN_TRIMKV_PYTHON, default ~/.cache/retain/venvs/trimkv/bin/python. Then:
    build/bin/retain-bench train --model DIR --seq 128,256 --dump-batch /tmp/batch.json ...
    ~/.cache/retain/venvs/trimkv/bin/python trainer/bench/bench_reference.py --model DIR \
        --batch /tmp/batch.json --gate trimkv,dbtrimkv --json /tmp/reference.json
"""
import argparse
import datetime
import gc
import importlib.machinery
import json
import math
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import types


def stub_flash_attn():
    """trimkv imports flash_attn at module load; nothing on the training path calls it."""
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        if name in sys.modules:
            continue
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__version__ = "0.0.0"

        def missing(*a, **k):
            raise RuntimeError("flash_attn is not installed (stand-in module)")

        m.flash_attn_varlen_func = missing
        m.flash_attn_with_kvcache = missing
        m.flash_attn_func = missing
        sys.modules[name] = m


def retention_sum_torch(x, doc_mask=None, pad_id=-1, row_block=128, col_block=None):
    """The package's retention_sum_packed_triton in torch: out[..., i] =
    sum_{j <= i, doc[j] == doc[i]} exp((i - j) * x[..., j]), x (B, H, S)."""
    import torch

    B, H, S = x.shape
    if doc_mask is None:
        doc_mask = torch.zeros(B, S, dtype=torch.long, device=x.device)
    idx = torch.arange(S, device=x.device)
    out = []
    block = 256
    for r0 in range(0, S, block):
        rows = idx[r0:r0 + block]
        dist = (rows[:, None] - idx[None, :]).to(x.dtype)  # (R, S)
        keep = (dist >= 0)[None] & (doc_mask[:, r0:r0 + block, None] == doc_mask[:, None, :])  # (B, R, S)
        w = torch.exp(x.float()[:, :, None, :] * dist.float().clamp(min=0)[None, None])  # (B, H, R, S)
        out.append((w * keep[:, None].float()).sum(-1))
    return torch.cat(out, dim=-1)


def eager_flex_on_cpu():
    """FlexAttention eagerly on the CPU, with gradients: PyTorch's dense math path for the same
    score_mod and block mask. Its device check refuses CPU gradients (the compiled kernels have
    none); the eager path computes them through autograd (checked against plain attention by
    tests/live/train_reference_check.py)."""
    import torch.nn.attention.flex_attention as fa
    from trimkv.attn import flex_attn

    fa._validate_device = lambda *args, **kwargs: None
    flex_attn.flex_attention_compiled = fa.flex_attention


GATE_INIT_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_gate_init(text):
    """--gate-init: None for "random", B for "zero-output:B" (a finite decimal number); ValueError
    otherwise. compare_train.py uses it too."""
    if text == "random":
        return None
    prefix = "zero-output:"
    if text.startswith(prefix) and GATE_INIT_NUMBER.fullmatch(text[len(prefix):]):
        b = float(text[len(prefix):])
        if math.isfinite(b):
            return b
    raise ValueError(f"--gate-init: {text!r} is not random or zero-output:B (B a finite number, e.g. zero-output:2)")


def gate_init_name(bias):
    """The canonical --gate-init of parse_gate_init's result: "random" or "zero-output:B" with B
    as retain-bench writes it (shortest round trip, no trailing ".0")."""
    if bias is None:
        return "random"
    r = repr(float(bias))
    return "zero-output:" + (r[:-2] if r.endswith(".0") else r)


def init_gates(model, mq, zero_output_bias):
    """Fresh gates (the checkpoint has none): reset_parameters() at the config's bias init; for
    zero-output:B also the output projection (rg: linear2.weight, rg10: linear3.weight) to zero
    and the bias to B. Returns the number of gate modules."""
    n = 0
    for m in model.modules():
        if isinstance(m, (mq.RetentionGate, mq.RetentionGate10)):
            m.reset_parameters()
            if zero_output_bias is not None:
                out = m.linear2 if isinstance(m, mq.RetentionGate) else m.linear3
                out.weight.data.zero_()
                m.bias.data.fill_(zero_output_bias)
            n += 1
    if not n:
        raise RuntimeError("the model has no retention gate modules")
    return n


def peak_gb(device):
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def one_line(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


PHASES = ("setup", "teacher_forward", "student_forward", "backward", "optimizer")


def fail_hook(row_index):
    """The test hook: the phase of this row that BENCH_REFERENCE_FAIL_PHASE names, else None."""
    phase = os.environ.get("BENCH_REFERENCE_FAIL_PHASE")
    if not phase:
        return None
    if phase not in PHASES:
        sys.exit(f"bench_reference.py: BENCH_REFERENCE_FAIL_PHASE={phase!r} is not one of {', '.join(PHASES)}")
    return phase if row_index == int(os.environ.get("BENCH_REFERENCE_FAIL_ROW", "0")) else None


def alive_tensor_mb():
    """MB of the distinct tensor storages the garbage collector can still reach (the test hook's
    view of a leak: after a row's cleanup nothing of that row should remain)."""
    import warnings

    import torch

    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or type(obj).__name__ == "FakeTensor" or obj.is_meta:
                    continue
                st = obj.untyped_storage()
                key = (st.data_ptr(), obj.device.type)
                if key not in seen:
                    seen.add(key)
                    total += st.nbytes()
            except Exception:  # noqa: BLE001 - tensor subclasses, storages without data
                continue
    return total / 1e6


def run_row(a, mq, TrimKVQwen3Config, b, g, kind, device, dtype, state, fail_phase):
    """One (T, gate) row: its result dict. Everything it allocates is local to this call, so a
    return or an exception drops it (main then runs gc.collect() and empty_cache())."""
    import torch

    T = int(b["seq"])
    row = {"seq": T, "gate": g}

    def done(phase):  # the end of a phase: the test hook's failure point
        if fail_phase == phase:
            raise torch.OutOfMemoryError(f"test hook BENCH_REFERENCE_FAIL_PHASE={phase}")

    state["phase"] = "setup"
    torch.manual_seed(a.seed)
    cfg = TrimKVQwen3Config.from_pretrained(a.model)
    cfg.retention_gate = kind
    cfg.retention_gate_intermediate_size = a.gate_hidden
    cfg.retention_gate_bias_init = 18.0 if a.zero_output_bias is None else a.zero_output_bias
    cfg.retention_weight = 1.0
    cfg.memory_size = a.memory
    cfg.global_capacity = False  # retain's default capacity (local, per layer and KV head)
    cfg.logit_block_size = 8192
    cfg.base_loss = "fwkl,ntp"
    cfg.rg_dropout = 0.0
    cfg.attn_impl = "rg_attn_flex"
    cfg.use_cache = False
    cfg._attn_implementation = "flex_attention"
    model = mq.TrimKVQwen3ForCausalLM.from_pretrained(a.model, config=cfg, load_trimkv_weights=False,
                                                      dtype=dtype).to(device)
    model.config._attn_implementation = "flex_attention"
    init_gates(model, mq, a.zero_output_bias)  # the gates are missing from the checkpoint: fresh
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_("retention_gate" in name)
        if p.requires_grad:
            params.append(p)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    # retain's loss positions: t whose t+1 is in t's document; both losses read them unshifted.
    # The closure holds lm_head, not the model (no model -> closure -> model cycle).
    lm_head = model.lm_head

    def ntp_same_positions(hidden_states, labels=None, **kw):
        logits = lm_head(hidden_states).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                                                 ignore_index=-100)

    model.compute_ntp_loss = ntp_same_positions
    opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-6)

    ids = torch.tensor(b["ids"], dtype=torch.long, device=device)[None]
    doc = torch.tensor(b["doc"], dtype=torch.long, device=device)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[1:] = doc[1:] != doc[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(T, device=device), 0), 0).values
    pos = (torch.arange(T, device=device) - first)[None]
    labels = torch.full_like(ids, -100)
    same = doc[1:] == doc[:-1]
    labels[0, :-1] = torch.where(same, ids[0, 1:], torch.full_like(ids[0, 1:], -100))
    done("setup")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = {k: [] for k in ("step", "teacher", "student", "backward", "optimizer")}
    for it in range(a.warmup + a.iters):
        if it == a.warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        print(f"bench_reference: T={T} {g}: {'warm-up' if it < a.warmup else 'step'} "
              f"{it + 1 if it < a.warmup else it - a.warmup + 1}/{a.warmup if it < a.warmup else a.iters}",
              file=sys.stderr, flush=True)
        sync()
        state["phase"] = "teacher forward"
        t0 = time.perf_counter()
        with torch.no_grad():
            base_logits = model(input_ids=ids, position_ids=pos, vanilla_forward=True).logits
        sync()
        done("teacher_forward")
        t1 = time.perf_counter()
        state["phase"] = "student forward"
        out = model(input_ids=ids, position_ids=pos, labels=labels, base_logits=base_logits)
        sync()
        done("student_forward")
        t2 = time.perf_counter()
        state["phase"] = "backward"
        out.loss.backward()
        sync()
        done("backward")
        t3 = time.perf_counter()
        state["phase"] = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        done("optimizer")
        t4 = time.perf_counter()
        if it == 0:
            row["first_loss"] = float(out.loss)
            row["first_base_loss"] = float(out.base_loss) if out.base_loss is not None else None
            row["first_cap"] = float(out.retention_loss) if out.retention_loss is not None else None
        out = base_logits = None  # the next iteration's teacher must not overlap these
        if it < a.warmup:
            continue
        for k, v in (("step", t4 - t0), ("teacher", t1 - t0), ("student", t2 - t1),
                     ("backward", t3 - t2), ("optimizer", t4 - t3)):
            times[k].append(v * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    row["step_ms"] = med["step"]
    row["phase_ms"] = {k: med[k] for k in ("teacher", "student", "backward", "optimizer")}
    row["tokens_per_s"] = T / (med["step"] * 1e-3)
    row["peak_gb"] = peak_gb(device)
    return row


def release(device):
    """After a row: drop torch.compile's caches (the graphs traced for FlexAttention keep the row's
    layer weights and activations as constants; the next row's fresh model recompiles anyway),
    collect the cycles (model hooks, autograd graphs of a failed step) and give the CUDA cache
    back."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    for _ in range(4):  # a pass's finalizers free more (the traced graphs need two)
        if not gc.collect():
            break
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model directory (the one retain-bench train used)")
    ap.add_argument("--batch", required=True, help="the JSON that retain-bench train --dump-batch wrote")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when visible, else cpu")
    ap.add_argument("--gate", default="trimkv,dbtrimkv")
    ap.add_argument("--gate-hidden", type=int, default=512)
    ap.add_argument("--memory", type=float, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gate-init", default="random",
                    help="random (bias 18, weights N(0, 0.02)) or zero-output:B (output weights 0, bias B)")
    ap.add_argument("--json", help="write the results as JSON to FILE")
    a = ap.parse_args()
    try:
        a.zero_output_bias = parse_gate_init(a.gate_init)
    except ValueError as e:
        ap.error(str(e))
    a.gate_init = gate_init_name(a.zero_output_bias)

    stub_flash_attn()
    import torch
    import transformers
    import trimkv
    from trimkv.models.qwen3 import modeling_trimkv_qwen3 as mq
    from trimkv.models.qwen3.configuration_trimkv_qwen3 import TrimKVQwen3Config

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        mq.retention_sum_packed_triton = retention_sum_torch
        eager_flex_on_cpu()
    with open(a.batch) as f:
        batches = json.load(f)["batches"]
    kinds = {"trimkv": "rg", "dbtrimkv": "rg10"}
    gates = a.gate.split(",")
    for g in gates:
        if g not in kinds:
            sys.exit(f"bench_reference.py: --gate: '{g}' is not trimkv or dbtrimkv")

    device_line = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"reference (trimkv {getattr(trimkv, '__version__', '0.1.5')}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}) on {device_line}, {a.model}, G {a.gate_hidden} M {a.memory:g}, "
          f"median of {a.iters} after {a.warmup} warm-up", flush=True)
    if a.zero_output_bias is None:
        print("gates: --gate-init random (bias 18, weights N(0, 0.02))", flush=True)
    else:
        b = a.zero_output_bias
        ls = min(b, 0.0) - math.log1p(math.exp(-abs(b)))  # logsigmoid(B)
        print(f"gates: --gate-init {a.gate_init} (output weights 0, bias {a.zero_output_bias:g}: logβ = {ls:.6g} "
              f"for every token)", flush=True)
    header = f"{'seq':>7} {'gate':<8} {'step ms':>10} {'teacher':>9} {'student':>9} {'backward':>9} {'optim':>9} " \
             f"{'tokens/s':>10} {'peak GB':>8} {'loss@1':>10}"
    print(header, flush=True)
    rows = []
    report_alive = bool(os.environ.get("BENCH_REFERENCE_REPORT_ALIVE"))
    alive_before = alive_tensor_mb() if report_alive else None
    index = 0
    for b in batches:
        T = int(b["seq"])
        for g in gates:
            state = {"phase": "setup"}
            try:
                row = run_row(a, mq, TrimKVQwen3Config, b, g, kinds[g], device, dtype, state, fail_hook(index))
                print(f"{T:>7} {g:<8} {row['step_ms']:>10.2f} {row['phase_ms']['teacher']:>9.2f} "
                      f"{row['phase_ms']['student']:>9.2f} {row['phase_ms']['backward']:>9.2f} "
                      f"{row['phase_ms']['optimizer']:>9.2f} {row['tokens_per_s']:>10.1f} "
                      f"{row['peak_gb']:>8.3f} {row['first_loss']:>10.5f}", flush=True)
            except Exception as e:  # OOM, ...: the honest result
                if os.environ.get("BENCH_REFERENCE_TRACEBACK"):
                    import traceback
                    traceback.print_exc()
                oom = "out of memory, " if isinstance(e, torch.OutOfMemoryError) else ""
                row = {"seq": T, "gate": g, "error": f"{oom}{state['phase']}: {one_line(e)}"}
                print(f"{T:>7} {g:<8} error: {row['error']}", flush=True)
                e.__traceback__ = None  # its frames hold the row's tensors
                del e
            finally:
                release(device)
            if device == "cuda":
                row["allocated_after_gb"] = torch.cuda.memory_allocated() / 1e9
            if report_alive:
                row["alive_tensor_mb"] = alive_tensor_mb()
            rows.append(row)
            index += 1

    if a.json:
        result = {"tool": "bench_reference.py (trimkv)", "device": device_line, "model": a.model,
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "versions": {"trimkv": "0.1.5", "torch": torch.__version__,
                               "transformers": transformers.__version__},
                  "dtype": str(dtype).replace("torch.", ""), "gate_hidden": a.gate_hidden, "memory": a.memory,
                  "gate_init": a.gate_init, "iters": a.iters, "warmup": a.warmup, "rows": rows}
        if report_alive:
            result["alive_tensor_mb_before_rows"] = alive_before
        folder = os.path.dirname(os.path.abspath(a.json))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bench_reference.")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, a.json)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
