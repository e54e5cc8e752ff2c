#!/usr/bin/env bash
# The whole GPU measurement in one call, on a CUDA machine with torch + triton (the lent H200 has no
# vLLM and no internet; gguf/papermill/ipykernel travel as wheels in .whl/). From the repo root:
#   bash scripts/gpu_run.sh [PART ...]      # parts: tests bench tp notebooks (default: all, in that order);
#                                           # kgluon ktests kbench kceiling kanatomy ksweep kphases kmerge kptx kpower
#                                           # ktma kwave ktail ktopk klogits kprefill:
#                                           # kernel experiments (2b)
# Writes everything under $OUT (device tool) or ./gpu-out as gpu_results_<parts>.tar.gz (unpack it and copy its
# gpu/results/. over results/, or over results/<gpu>/ for another GPU model: see results/gpu/README.md).
# The tree travels without its .git (a .git found there may be a stale one, from an earlier call): name the commit it
# was taken from, so every result row names it -- either GLM5LAB_GIT_SHA=<sha> in the command, or, before the call,
#   python3 -m glm5lab env --sha > .gpu_sha      (HEAD, "-dirty" when the code differs from it; git-ignored;
#                                                 carry it: [".whl", ".anchor", ".gpu_sha"])
# Without either, rows say "unrecorded" rather than whatever a stale .git answers.
# Parts run one after another and each is isolated: a failing part is logged, the others still run.
set -uo pipefail
# the Python with torch and triton: $PY when given, else the project's .venv (`make setup`), else python3 (the lent
# H200's image, where the tree travels without its .venv)
if [ -z "${PY:-}" ]; then if [ -x "$PWD/.venv/bin/python" ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi; fi
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
stage=$(mktemp -d)/gpu
mkdir -p "$stage"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export GLM5LAB_CACHE=/tmp/glm5lab-cache GLM5LAB_FLASHMLA_DIR=${GLM5LAB_FLASHMLA_DIR:-$PWD/.anchor}
[ -z "${GLM5LAB_GIT_SHA:-}" ] && [ -s .gpu_sha ] && GLM5LAB_GIT_SHA=$(head -c 48 .gpu_sha | tr -cd '0-9a-z-')
export GLM5LAB_GIT_SHA=${GLM5LAB_GIT_SHA:-unrecorded}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
log() { echo "[gpu_run $(date -u +%H:%M:%S)] $*" | tee -a "$stage/gpu_run.log"; }
# the pytest parts on 8 workers (pytest-xdist, in the H200's image) unless PYTEST_ADDOPTS says otherwise: serially
# the kgluon selection of v36-v37 (512 tests) takes over 10 minutes, parallel ~4 (v37 call 2 forgot the export and
# was stopped at 118 passed)
if [ -z "${PYTEST_ADDOPTS+x}" ] && "$PY" -c "import xdist" 2>/dev/null; then export PYTEST_ADDOPTS="-n 8"; fi
parts=${*:-tests bench tp notebooks}
part() {  # part NAME SECONDS CMD...: run one part (if asked for) with a time limit, log its exit status
  local name=$1 limit=$2; shift 2
  case " $parts " in *" $name "*) ;; *) return 0 ;; esac
  log "start $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$stage/$name.log" 2>&1
  local rc=$?
  log "end   $name rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -n 25 "$stage/$name.log"
  pack  # after every part, so a run stopped at its limit still returns what it measured
}
pack() { tar -C "$(dirname "$stage")" -czf "$out/gpu_results_${parts// /_}.tar.gz" gpu; cp "$stage/gpu_run.log" "$out/" 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$stage/nvidia-smi.csv"
"$PY" -m glm5lab env --json > "$stage/env.json" 2>&1; cat "$stage/env.json"
# the GPU model's word (h200, h100, ...): the kernel experiments' file names carry it, so an H100's rows (given for
# an H200 call) are never named as the H200's; commit them under results/$gpu/ when that is not the H200
gpu=$("$PY" -m glm5lab env --slug 2>/dev/null || echo gpu)
echo "bash scripts/gpu_run.sh $parts" > "$stage/command.txt"
export GLM5LAB_OUTER_COMMAND="bash scripts/gpu_run.sh $parts"   # the suite's rows name it (bench.suites.suite_invocation)
# a notebooks-only run reads the GPU measurements already committed under results/
# (results of an EARLIER call are seen only once they are committed: the tree travels, gpu-out does not;
#  notebook 05 alone takes 85-225 s on the H200, hence the 360 s default for the notebooks part)
mkdir -p "$stage/results"
# (so does a bench run of some suite parts only: BENCH_PARTS="indexer attention_stack projection plots")
case " $parts " in *" bench "*) [ -z "${BENCH_PARTS:-}" ] && seed=0 || seed=1 ;; *) seed=1 ;; esac
# (SEED_RESULTS=0: start from an empty results tree)
seed=${SEED_RESULTS:-$seed}
# the committed results are one GPU model's (results/: the H200's; results/<gpu>/: another's, e.g. results/h100/): a
# call seeds from its own model's tree (a call for an H200 may get an H100, whose rows would otherwise read as the
# H200's latest run), or, on a model with no tree, starts from an empty one -- commit its rows under results/<gpu>/
if [ $seed = 1 ]; then
  tree=$("$PY" -m glm5lab.bench.records seed-tree results 2>"$stage/seed_tree.txt")
  tee -a "$stage/gpu_run.log" < "$stage/seed_tree.txt"
  if [ -z "$tree" ]; then
    log "not seeding the committed results: none are this GPU model's (rows of this call start from an empty tree)"
    seed=0
  else
    log "seeding from $tree/ (this GPU model's committed results)"
  fi
fi
if [ $seed = 1 ]; then for d in bench kernels indexer tp notebooks; do
  [ -d "$tree/$d" ] && cp -r "$tree/$d" "$stage/results/"; done
  # the rows each seeded benchmark CSV holds now, so that the end of the call can keep only what this call appended
  "$PY" -m glm5lab.bench.records count "$stage/results" --out "$stage/../rows_before.json"
fi

# 1. kernel correctness at real shapes (pytest -m gpu; files that need vLLM are not collected here)
# (every test file with a `gpu` test: tests/test_gpu_run_script.py checks the list; the two tests that need vLLM too
#  report themselves skipped on a GPU machine without it, such as the lent H200)
gpu_tests=${GPU_TESTS:-tests/test_sparse_mla_kernel.py tests/test_sparse_mla_sm90.py tests/test_fp8_ds_mla.py tests/test_paged_mla_decode.py \
  tests/test_virtual_block_table.py tests/test_indexer_kernels.py tests/test_tensor_parallel.py tests/test_tail_split.py \
  tests/test_wave_spread.py tests/test_tma_gather_probe.py tests/test_gguf_loader_dtype.py}
# (the default 90 s leaves the other default parts their time in one 600 s call and is not enough for every test: on
#  fresh H100s and an H200 with 8 workers all of them took 369-411 s in v62-v64, so run them alone with
#  GPU_TESTS_S=540)
part tests ${GPU_TESTS_S:-90} "$PY" -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
  --junitxml="$stage/gpu_tests.xml" $gpu_tests
# 2. the benchmark suite (kernel vs FlashMLA vs torch; indexer; attention stack; accuracy)
# (GLM5LAB_BENCH_FP8_V4=1, the suite's default here, adds the fp8_ds_mla 'reload' kernel paths beside the default,
#  same inputs; set only for this part, so the kernel experiments time only what they are asked to)
# (the suite's kernels part compiles most of its time on a fresh H200: v32 call 4 killed it at 285 s two-thirds
#  through, call 5 ran it in 67 s on the warm machine. On a fresh machine run it alone, BENCH_PARTS="kernels plots"
#  BENCH_BUDGET_S=460 BENCH_S=520; the defaults keep the bench part inside a 600 s call)
part bench ${BENCH_S:-560} env GLM5LAB_BENCH_FP8_V4=${GLM5LAB_BENCH_FP8_V4:-1} "$PY" -m glm5lab bench --suite full --budget ${BENCH_BUDGET_S:-520} \
  --results "$stage/results" --no-progress ${BENCH_PARTS:+--parts $BENCH_PARTS}
# 2b. kernel experiments only (not in the default parts): the GPU tests of the Gluon kernel (kgluon) and of the
# Triton kernel (ktests), then the kernel
# benchmark with KERNEL_BENCH_ARGS (e.g. "--v5 --no-variants --heads 8 16 64 --tokens 1 8 128 512")
# (KGLUON_K / KTESTS_K are pytest -k expressions: name tests by their full function names -- on the H200 in v43 a short
#  word, -k "tma", matched ~900 tests, none of the ones meant, where it matched only those here)
part kgluon ${KGLUON_S:-150} "$PY" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$stage/gpu_kgluon.xml" \
  tests/test_sparse_mla_sm90.py ${KGLUON_K:+-k "$KGLUON_K"}
part ktests ${GPU_TESTS_S:-150} "$PY" -m pytest -q -p no:cacheprovider -m gpu --junitxml="$stage/gpu_ktests.xml" \
  tests/test_sparse_mla_kernel.py ${KTESTS_K:+-k "$KTESTS_K"}
mkdir -p "$stage/results/kernels"
part kbench ${KBENCH_S:-420} "$PY" -m glm5lab.bench.kernel_bench --out "$stage/results/kernels/kernel_bench_${gpu}_${KBENCH_TAG:-exp}.csv" \
  --summary "$stage/results/kernels/summary_${KBENCH_TAG:-exp}.csv" ${KERNEL_BENCH_ARGS:-}
part kceiling ${KCEILING_S:-90} "$PY" -m glm5lab.bench.gather_ceiling --out "$stage/results/kernels/gather_ceiling_${gpu}.csv" ${KCEILING_ARGS:-}
part kanatomy ${KANATOMY_S:-120} "$PY" -m glm5lab.bench.latency_anatomy --out "$stage/results/kernels/latency_anatomy_${gpu}.csv"
part ksweep ${KSWEEP_S:-200} "$PY" -m glm5lab.bench.latency_anatomy --sweep --out "$stage/results/kernels/small_batch_sweep_${gpu}.csv" ${KSWEEP_ARGS:-}
part kphases ${KPHASES_S:-120} "$PY" -m glm5lab.bench.latency_anatomy --phases --out "$stage/results/kernels/phase_stamps_${gpu}.csv" ${KPHASES_ARGS:-}
part kmerge ${KMERGE_S:-120} "$PY" scripts/merge_probe.py --out "$stage/results/kernels/merge_probe_${gpu}.csv" ${KMERGE_ARGS:-}
# the kernel benchmark once as built and once a PTX edit (scripts/ptx_variant.py: PTX_EDITS, e.g. "l2_256")
part kptx ${KPTX_S:-540} "$PY" scripts/ptx_variant.py --work /tmp/ptx_variant --edits ${PTX_EDITS:-l2_256} -- \
  "$PY" -m glm5lab.bench.kernel_bench --out "$stage/results/kernels/kernel_bench_${gpu}_${KBENCH_TAG:-exp}_{edit}.csv" \
  ${KERNEL_BENCH_ARGS:-}
part kpower ${KPOWER_S:-120} "$PY" -m glm5lab.bench.power_probe --out "$stage/results/kernels/power_probe_${gpu}.csv" ${KPOWER_ARGS:-}
# the TMA gather probe: its GPU test (the rows it gathers), then its rounds and sustained blocks beside the paired
# kernel's gathers alone
part ktma ${KTMA_S:-240} bash -c ""$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_tma_gather_probe.py && \
  "$PY" -m glm5lab.bench.tma_gather_probe --out $stage/results/kernels/tma_gather_probe_${gpu}.csv ${KTMA_ARGS:-}"
# when each program of a grid starts and ends, and on which SM (the dual and paired kernels' wave stamps): the GPU
# tests of the stamps, then the default cases (one wave at 128 tokens, ~two waves at 512) and the plot
part kwave ${KWAVE_S:-300} bash -c ""$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_wave_spread.py && \
  "$PY" -m glm5lab.bench.wave_spread --out $stage/results/kernels/wave_spread_${gpu}.csv \
  --programs $stage/results/kernels/wave_spread_programs_${gpu}.csv.gz --png $stage/results/kernels/wave_spread_${gpu}.png \
  ${KWAVE_ARGS:-}"
# the tail-split prototype (glm5lab.bench.tail_split): its GPU tests, then its plans beside the default in rounds
part ktail ${KTAIL_S:-300} bash -c ""$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_tail_split.py && \
  "$PY" -m glm5lab.bench.tail_split --out $stage/results/kernels/tail_split_${gpu}.csv ${KTAIL_ARGS:-}"
# the top-k before/after (NOTES v51): this tree's top-k kernels against .ab/dsa_indexer_before.py (carry ".ab")
part ktopk ${KTOPK_S:-240} "$PY" scripts/topk_ab.py --before ${TOPK_BEFORE:-.ab/dsa_indexer_before.py} \
  --out "$stage/results/indexer/topk_ab.csv" ${KTOPK_ARGS:-}
# the indexer's decode logits kernel at several tile sizes (NOTES v52)
part klogits ${KLOGITS_S:-240} "$PY" scripts/logits_ab.py --out "$stage/results/indexer/logits_ab.csv" ${KLOGITS_ARGS:-}
# the indexer's prefill logits kernel at several tilings and dot orders (NOTES v60)
part kprefill ${KPREFILL_S:-240} "$PY" scripts/prefill_ab.py --out "$stage/results/indexer/prefill_ab_${gpu}.csv" \
  ${KPREFILL_ARGS:-}
# 3. one tensor-parallel slice (TP8 heads on one GPU; multi-GPU kinds run the same script with more ranks)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part tp ${TP_S:-60} "$PY" scripts/tp_attention_stack.py --world-size 1 --tp 8 --backend nccl --budget 40 \
  --out "$stage/results/tp/tp_attention_stack.csv"
# 4. the notebooks on the gpu profile, reading what the suite wrote
# (01-03 need vLLM or are CPU stories: the device has no vLLM, so the GPU profile runs 04, 05, 05b, 06)
part notebooks ${NOTEBOOKS_S:-360} "$PY" -m glm5lab notebooks run --profile gpu --only ${GPU_NOTEBOOKS:-04 05 06} --results "$stage/results" --no-progress

# the suite's and the notebooks' CSVs grow ~0.8 MB a run and the tree a call carries is capped: in every benchmark
# CSV this call appended to (seeded above), the rows it held before move to *_history.csv.gz beside it
if [ $seed = 1 ]; then
  "$PY" -m glm5lab.bench.records archive-appended "$stage/results" --since "$stage/../rows_before.json" 2>&1 \
    | tee -a "$stage/gpu_run.log"
fi
pack
ls -la "$out"
