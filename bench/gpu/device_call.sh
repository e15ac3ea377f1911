#!/usr/bin/env bash
# One prepared device call (docs/gpu.md, "The next GPU session"): named steps, run in order from the
# repository root on the GPU machine, each under its own time limit and all under one budget, so a
# slow step cannot eat the ones after it. Every step writes $OUT/<step>.log (and its own files under
# $OUT/<step>/); the tail of each log is printed, so the device reply's output tail holds the figures.
#
#   bash bench/gpu/device_call.sh REVISION STEP [STEP ...]      (CALL_BUDGET_S: the whole call, default 450)
#
# Steps: tests, train, train_fused, noise, train_autotune, fp8, trained_exits, spread, spread_spans,
# decode_autotune, huginn, ouro, depth_batching, engine_graph, speculation, hrm_text, vllm_vs_serve (see step_*
# below).
# The machine has no network: the package runs from the checkout (PYTHONPATH), torchao comes from a
# carried wheel (fp8), the trained task model from carried runs/gpu-task (trained_exits).
set -u -o pipefail

ONE=0
if [[ ${1:-} == --one ]]; then ONE=1; shift; fi  # internal: run one step (under the caller's timeout)
REV=${1:?usage: device_call.sh REVISION STEP [STEP ...]}
shift
: "${OUT:?OUT must name the folder results go to}"
BUDGET=${CALL_BUDGET_S:-450}
START=$SECONDS
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SUITE=(python3 -m bench.gpu_suite --revision "$REV")

use_torchao() {  # torchao from the carried wheel (shared/wheels/), unless the machine has it
    if ! python3 -c "import torchao" 2>/dev/null && ls shared/wheels/torchao-*.whl >/dev/null 2>&1; then
        # into a folder of its own (no write to the system's packages); the wheel's top-level test/ would
        # shadow the standard library's on PYTHONPATH, so it goes
        python3 -m pip install -q --no-deps --no-index --target /tmp/torchao shared/wheels/torchao-*.whl &&
            rm -rf /tmp/torchao/test && export PYTHONPATH=$PYTHONPATH:/tmp/torchao
    fi
}
step_tests() {  # every CUDA-only test (graph replay, span graphs, compiled pieces, the compiled fused head,
               # FP8, pinned copies)
    use_torchao
    # only the files that hold gpu tests: collecting the rest would import packages the machine may lack
    # (a collection error stops the whole run)
    python3 -m pytest -q -m gpu $(grep -l 'mark\.gpu' tests/test_*.py)
}
step_train() {  # the baseline: training at the defaults, and the loss head alone
    "${SUITE[@]}" --out "$OUT/train" --sections train,loss --budget-s "$1"
}
step_train_fused() {  # the fused loss head in train_step, one compiled region per loop step
    "${SUITE[@]}" --out "$OUT/train_fused" --sections train --budget-s "$1" --train-compile-scope step \
        --train-set fused_loss=true --train-set state_noise=counter
}
step_noise() {  # the start-state draw alone: sequence against counter noise (eager and compiled), kernels
    mkdir -p "$OUT/noise"
    python3 bench/noise_draw.py --device cuda --compile --repeats 10 --json "$OUT/noise/noise_draw.json"
}
step_train_autotune() {  # the same with Inductor's max-autotune (no CUDA graphs): minutes of compiling
    "${SUITE[@]}" --out "$OUT/train_autotune" --sections train --budget-s "$1" --train-compile-scope step \
        --train-set fused_loss=true --train-set compile_mode=max-autotune-no-cudagraphs
}
step_fp8() {  # FP8 training against bf16 on the same tokens (torchao from the carried wheel; the wiki corpus in
              # GPT-2 tokens from the carried shared/data/wiki-gpt2 where it came, else random ids)
    use_torchao
    local data=()
    [[ -f shared/data/wiki-gpt2/train.bin ]] && data=(--fp8-data shared/data/wiki-gpt2)
    "${SUITE[@]}" --out "$OUT/fp8" --sections fp8 --budget-s "$1" "${data[@]}"
}
step_trained_exits() {  # batch 32 and 128 on the demo's trained task model (answer accuracy per setting)
    mkdir -p "$OUT/trained_exits"
    python3 bench/batched_exits.py --checkpoint runs/gpu-task/train --data runs/gpu-task/data --task-difficulty 4 \
        --batches 32,128 --k-max 12 --policy kl --tau 1e-3,1e-2 --agreement 0.98 --check-every 2 --prompt 16 \
        --tokens 47 --quantile 0.9,0.75 --warmup 2 --repeats 5 --device cuda --dtype bfloat16 --graphs \
        --json "$OUT/trained_exits/batched_exits.json"
}
step_spread() {  # the exit spread at batch 32 and 128 (batch quantiles included), whole-cache reads
    "${SUITE[@]}" --out "$OUT/spread" --sections spread --budget-s "$1" --check-every 2
}
step_spread_spans() {  # the same, each decoder reading the written span in sizes of 64 (span_buckets)
    "${SUITE[@]}" --out "$OUT/spread_spans" --sections spread --budget-s "$1" --check-every 2 --span-buckets 64
}
step_decode_autotune() {  # batch-1 decode, the default mode then max-autotune on the same card (kernels per token)
    "${SUITE[@]}" --out "$OUT/decode_default" --sections decode --budget-s $(($1 * 2 / 5)) &&
        "${SUITE[@]}" --out "$OUT/decode_autotune" --sections decode --budget-s $(($1 * 3 / 5)) \
            --decode-compile-mode max-autotune-no-cudagraphs
}

step_depth_batching() {  # continuous depth batching on the card (issue 51, call 3): the main job's loop-only model
                        # (carried runs/gpu-task-loop: bench/gpu/prepare_carry.sh), selection on half A, widths 32-256
    mkdir -p "$OUT/depth_batching"
    python3 bench/depth_batching.py --run runs/gpu-task-loop/train --data runs/gpu-task-loop/data --device cuda \
        --problems "${DB_PROBLEMS:-128}" --widths "${DB_WIDTHS:-32,64,128,256}" --rounds 3 --splits 200 \
        --ticks "${DB_TICKS:-eager,compiled}" --ahead "${DB_AHEAD:-1,4}" \
        --json "$OUT/depth_batching/depth_batching.json"
    # (the compiled tick compiles one graph per width and rule, and one more per width for --ahead 4: DB_TICKS=eager
    # or DB_AHEAD=1 if the step's limit is short; ahead 4 reads the device once every 4 ticks: the host's sync)
}

step_engine_graph() {  # the engine's graph ticks on the card (issues 62 and 68): the main job's loop-only model
                      # (carried runs/gpu-task-loop), the rule chosen on half A, B = 32-256, against the eager engine
                      # at F and the lock-step decoder; then random weights of that layout at the paper's width (768,
                      # head 64) and Huginn's (5280, head 96), the trained rule's exit spread replayed (engine_width)
    local run=runs/gpu-task-loop
    mkdir -p "$OUT/engine_graph"
    python3 bench/depth_batching.py --run $run/train --data $run/data --device cuda --problems "${DB_PROBLEMS:-128}" \
        --widths "${DB_WIDTHS:-32,64,128,256}" --rounds 3 --splits 200 --ticks "${GRAPH_TICKS:-eager,graph,compiled-graph}" \
        --ahead 1,4 --json "$OUT/engine_graph/depth_batching.json"
    python3 bench/engine_width.py --run $run/train --data $run/data --device cuda --widths-d 768 --head-dim 64 \
        --batch 64 --ticks eager,graph --rounds 3 --json "$OUT/engine_graph/width_paper.json"
    python3 bench/engine_width.py --run $run/train --data $run/data --device cuda --widths-d 5280 --head-dim 96 \
        --batch 64 --ticks eager,graph --rounds 3 --json "$OUT/engine_graph/width_huginn.json"
}

step_speculation() {  # loop speculation at batch 1 on random weights with a constructed agreement (issue 64): the
                      # paper preset with every draft kept (state scale 0) and with some rejected (0.2), and
                      # Huginn-0125's sizes at 16 loops (bench/gpu/speculation_scale.py)
    mkdir -p "$OUT/speculation"
    for scale in 0 0.2; do
        python3 bench/gpu/speculation_scale.py --shape paper --state-scale $scale --device cuda --dtype bfloat16 \
            --draft-loops 1,2 --tokens 4,8 --json "$OUT/speculation/paper_$scale.json"
    done
    python3 bench/gpu/speculation_scale.py --shape huginn --state-scale 0.2 --loops 16 --device cuda --dtype bfloat16 \
        --draft-loops 1,4 --tokens 4,8 --new-tokens 32 --rounds 2 --json "$OUT/speculation/huginn_0.2.json"
}

step_huginn() {  # Huginn-0125's published config at its real size (random weights): import-hf and the GPU
                # recipe's commands (docs/ecosystem.md), each timed with the card's peak memory
    PYTHONPATH=. python3 bench/gpu/huginn_scale.py run --carry runs/huginn-carry --work /tmp/huginn \
        --out "$OUT/huginn" --budget-s "$1"
}

step_ouro() {  # Ouro-1.4B's published config at its real size (random weights, carried runs/ouro-carry: text and
              # a 49,152-token tokenizer): import-hf, sweep with the gate, generate, the engine (issue 53)
    PYTHONPATH=. python3 bench/gpu/ouro_scale.py run --carry runs/ouro-carry --work /tmp/ouro \
        --out "$OUT/ouro" --budget-s "$1"
}

step_vllm_vs_serve() {  # vLLM with rdepth's plugin against rdepth serve's engine, the paper preset at 4 loops per
                       # group, B = 32-256 (issue 65): needs vllm installed on the machine (the script says so if not)
    python3 bench/gpu/vllm_vs_serve.py --out "$OUT/vllm_vs_serve" --preset paper --loops 4 --batches 32,64,128,256
}

step_hrm_text() { python3 bench/gpu/hrm_text_scale.py --out "$OUT/hrm_text" --revision "$REV" --budget-s "$1"; }  # HRM-Text-1B-sized random weights: the looped adapter against the class, batch 1 and 32 (docs/results/paper.md)
if ((ONE)); then  # --one REVISION STEP SECONDS
    "step_$1" "$2"
    exit $?
fi

declare -A LIMIT=([tests]=90 [train]=150 [train_fused]=150 [train_autotune]=240 [fp8]=150 [trained_exits]=100
                  [spread]=120 [spread_spans]=120 [decode_autotune]=240 [noise]=60
                  [huginn]=330 [ouro]=330 [depth_batching]=300 [engine_graph]=420 [speculation]=300 [hrm_text]=240 [vllm_vs_serve]=300)
for name in "$@"; do  # every name checked before anything runs
    if ! declare -F "step_$name" >/dev/null; then
        echo "== unknown step $name (choose from ${!LIMIT[*]})"; exit 2
    fi
done
for name in "$@"; do
    left=$((BUDGET - (SECONDS - START)))
    limit=${LIMIT[$name]}
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "== $name skipped: ${left}s of the call's budget left"; continue
    fi
    echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
    # the suite plans inside its budget; the step's own timeout stops anything that does not
    timeout "$limit" bash "$0" --one "$REV" "$name" $((limit - 20)) >"$OUT/$name.log" 2>&1
    echo "== $name rc $? after $((SECONDS - START))s"
    tail -n 45 "$OUT/$name.log"
done
# The device tool returns at most 8 files from $OUT: everything goes back as one archive.
if [[ -n $(ls -A "$OUT") ]]; then
    (cd "$OUT" && tar czf /tmp/device_call.tgz . && find . -mindepth 1 -delete && mv /tmp/device_call.tgz .) &&
        echo "== $OUT/device_call.tgz: every step's log and files"
fi
