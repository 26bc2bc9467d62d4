#!/bin/bash
# The downstream effect benchmark at 2,048 pool examples, k = 5%, on one GPU: the run recorded in
# bench/results/fidelity_gpu2048 and bench/results/effect_gpu2048 (one H100, 8.5 min in all). Four steps, each the
# product's own stages through the benchmarks' ledgers (a re-run resumes; a step cut by BUDGET is re-made next time):
#   1. fidelity_v2: warm-up (WarmupModule) + the warmed target's TracIn scores of a 2,048-example stratified sample;
#   2. effect: base, random x 3 seeds, target, RDS+, the length sort (one fine-tune + held-out evaluation each);
#   3. fidelity_v2 again: the IProX rho = 0.5 proxy (IPSVD + alignment) and its scores;
#   4. effect again: the proxy's rows (the others are reused).
# Usage: MODEL=<gguf|hf dir> POOL=<jsonl> EVAL=<eval dir> RESULTS=<dir> BUDGET=<seconds> bash bench/effect_gpu.sh
set -u
cd "$(dirname "$0")/.."
M=${MODEL:-../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf}
P=${POOL:-../shared/data/pool/instructions.jsonl}
E=${EVAL:-../shared/data/eval}
F=${RESULTS:-bench/results}/fidelity_gpu2048
R=${RESULTS:-bench/results}/effect_gpu2048
END=$((SECONDS + ${BUDGET:-3600}))
V="ipsvd/exact/rel1e-3/global@0.5+align2:3e-4"
FA=(--model "$M" --pool "$P" --eval-dir "$E" --sample 2048 --no-unwarmed --in-process --batch-size 32 --out "$F")
EA=(--fidelity "$F" --model "$M" --pool "$P" --eval-dir "$E" --out "$R" --k 0.05 --in-process --eval-batch-size 64)
step() {
  local left=$((END - SECONDS))
  if [ "$left" -le 15 ]; then echo "skipped (budget spent): $*"; return 0; fi
  echo "== ${SECONDS}s: $* (${left}s left)"
  timeout "$left" python3 "$@"
}
step bench/fidelity_v2.py "${FA[@]}" --variants
step bench/effect.py "${EA[@]}" --selectors target rds length
step bench/fidelity_v2.py "${FA[@]}" --variants "$V"
step bench/effect.py "${EA[@]}" --selectors target rds length iprox@0.5
