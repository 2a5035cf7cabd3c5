#!/usr/bin/env bash
# Issue 14: retain's training step beside the TRIM-KV authors' trainer (trimkv 0.1.5, which pins
# transformers 4.57.1; the device image has 5.x) on the same Qwen3 shapes and tokens. Their
# packages come as wheels (launch/gpu-wheels.sh, carried as .whl/) installed into a private
# folder only the reference's Python sees. Rows accumulate in $REFERENCE_DIR (default
# /tmp/retain-reference, kept across calls on a still-warm machine); a call that runs out of
# time exits 75 (the ledger's CUT) and the next goes on. The table and plot are written into a
# copy of docs/benchmarks.md under $WORK/reference, for committing from there.
# usage: reference.sh main|visible
set -uo pipefail
what=$1
wheels=${WHEELS:-.whl}
site=$WORK/site
keep=${REFERENCE_DIR:-${TMPDIR:-/tmp}/retain-reference}
compgen -G "$wheels/*.whl" >/dev/null ||
  { echo "reference.sh: no wheels in $wheels (run launch/gpu-wheels.sh here and carry .whl)"; exit 69; }
if [ ! -d "$site/transformers" ]; then
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "$wheels"/*.whl || exit 1
fi
py=$WORK/reference-python
printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' "$site" >"$py" && chmod +x "$py"
"$py" -c 'import transformers as t; assert t.__version__ == "4.57.1", t.__version__; print("transformers", t.__version__)' ||
  exit 1
mkdir -p "$keep" "$WORK/reference"
[ -f "$keep/benchmarks.md" ] || cp docs/benchmarks.md "$keep/benchmarks.md"
# compare_train's --time-budget: what the ledger gave this step, less 60 s to copy the results.
budget=$(( ${LEDGER_STEP_LIMIT:-600} - 60 ))
if [ "$what" = main ]; then
  python3 trainer/bench/compare_train.py --shapes 4B,1.7B,0.6B --device cuda --python "$py" --bin-dir "$BIN" \
    --out "$keep/compare" --keep-models "$keep/models" --time-budget $((budget > 1 ? budget : 1)) \
    --write-docs --docs-file "$keep/benchmarks.md"
  rc=$?
  out=$keep/compare
else
  # The loss check with a visible decay: both sides' gates with output projection 0 and bias 2
  # (logβ = logsigmoid(2) ≈ −0.127 for every token), so the first-step losses show the gated math.
  python3 trainer/bench/compare_train.py --shapes 0.6B --seq 8192 --device cuda --gate-init zero-output:2 \
    --python "$py" --bin-dir "$BIN" --out "$keep/compare-visible" --keep-models "$keep/models" \
    --time-budget $((budget > 1 ? budget : 1))
  rc=$?
  out=$keep/compare-visible
fi
cp -r "$out" "$keep/benchmarks.md" "$WORK/reference/" 2>/dev/null
[ -d "$keep/images" ] && cp -r "$keep/images" "$WORK/reference/"
[ -f "$out/compare.md" ] && cat "$out/compare.md"
exit $rc
