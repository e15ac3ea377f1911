#!/usr/bin/env bash
# Builds, on a fresh CPU machine, everything the prepared GPU calls carry (docs/gpu.md, "The next GPU
# session"), into the git-ignored folders they name, so the first device call can start at once:
#
#   shared/wheels/torchao-0.18.0-*.whl   torchao for FP8 (the GPU machine has no network)      ~3.4 MB
#   shared/data/wiki-gpt2/               the wiki corpus in exact GPT-2 tokens (FP8 vs bf16)   ~3.9 MB
#   runs/gpu-task/{train,data}           a trained chase-task model and its held-out sets       ~7 MB
#                                        (trained_exits: batched exits at matched accuracy)
#   runs/huginn-carry/                   held-out text + tokenizer.json for the huginn step           ~0.8 MB
#   data/medium.zip                      the medium corpus bundle with the GPT-2 tokenizer      ~26 MB
#                                        (the r = 12 reproduction, docs/reproduce.md; its own call)
#   runs/gpu-task-loop/{train,data}      the main job's loop-only model (depth_batching: the engine)  ~3 MB
#
#   bash bench/gpu/prepare_carry.sh [STEPS]     STEPS: the task model's training steps (default 2600, the
#                                               demo's own; fewer is faster and less accurate)
#
# Each part is skipped when it is already in place; a part that fails stops the script (non-zero exit)
# and leaves the earlier parts. The task model is the looped run of `rdepth demo` (task mode, seed 0,
# no baseline, no geometry analysis, no exit sweep) with the model and difficulties the demo had before
# issue 38 (`--preset task --train-difficulties 1,4`, which docs/gpu.md's figures are of); only its newest checkpoint and the held-out data
# are kept (the training shard stays behind: the GPU calls do not read it).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-2600}
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "prepare_carry: STEPS must be a positive integer, got '$STEPS'" >&2; exit 2; }
t0=$SECONDS

if ! ls shared/wheels/torchao-0.18.0-*.whl >/dev/null 2>&1; then
    echo "== torchao wheel"
    mkdir -p shared/wheels
    python3 -m pip download --quiet --disable-pip-version-check --no-deps torchao==0.18.0 -d shared/wheels
fi

if [[ ! -f shared/data/wiki-gpt2/train.bin ]]; then
    echo "== wiki corpus in GPT-2 tokens ($((SECONDS - t0)) s)"
    python3 -m rdepth prepare --corpus wiki --tokenizer gpt2 --out shared/data/wiki-gpt2
fi

if [[ ! -f runs/huginn-carry/tokenizer.json ]]; then
    echo "== Huginn-size carry: held-out text and a 65,536-token tokenizer.json ($((SECONDS - t0)) s)"
    PYTHONPATH=. python3 bench/gpu/huginn_scale.py prepare --out runs/huginn-carry
fi

if [[ ! -f data/medium.zip ]]; then
    echo "== the medium corpus bundle ($((SECONDS - t0)) s)"
    python3 -m rdepth prepare --corpus medium --tokenizer gpt2 --out data/medium-gpt2 --bundle data/medium.zip
fi

if [[ ! -f runs/gpu-task/train/checkpoints/latest ]]; then
    echo "== the task model: rdepth demo, looped run only, $STEPS steps ($((SECONDS - t0)) s)"
    work=$(mktemp -d /tmp/gpu-task.XXXXXX)
    python3 -m rdepth demo --out "$work" --baselines none --no-analyze --no-sweep --max-steps "$STEPS" \
        --checkpoint-every "$STEPS" --loop-budgets 1,4,12 --preset task --train-difficulties 1,4
    rm -rf runs/gpu-task.partial && mkdir -p runs/gpu-task.partial/train/checkpoints runs/gpu-task.partial/data
    for f in config.json summary.json environment.json; do
        [[ -f "$work/train/$f" ]] && cp "$work/train/$f" runs/gpu-task.partial/train/
    done
    [[ -e "$work/train/tokenizer" ]] && cp -r "$work/train/tokenizer" runs/gpu-task.partial/train/
    latest=$(head -n 1 "$work/train/checkpoints/latest")   # a text file naming the newest step_NNNNNN
    cp -r "$work/train/checkpoints/$latest" "$work/train/checkpoints/latest" runs/gpu-task.partial/train/checkpoints/
    for f in "$work"/data/*; do
        case $(basename "$f") in train*) ;; *) cp -r "$f" runs/gpu-task.partial/data/ ;; esac
    done
    cp "$work/demo.json" runs/gpu-task.partial/ 2>/dev/null || true
    rm -rf runs/gpu-task && mv runs/gpu-task.partial runs/gpu-task
    rm -rf "$work"
fi
if [[ ! -f runs/gpu-task-loop/train/checkpoints/latest ]]; then
    echo "== the main job's loop-only model (task_loop, difficulties 1-8): rdepth demo, looped run only ($((SECONDS - t0)) s)"
    work=$(mktemp -d /tmp/gpu-task-loop.XXXXXX)
    python3 -m rdepth demo --out "$work" --baselines none --no-analyze --no-sweep --train-difficulties 1,8 --seed 0
    rm -rf runs/gpu-task-loop.partial && mkdir -p runs/gpu-task-loop.partial/train/checkpoints runs/gpu-task-loop.partial/data
    for f in config.json summary.json environment.json; do
        [[ -f "$work/train/$f" ]] && cp "$work/train/$f" runs/gpu-task-loop.partial/train/
    done
    [[ -e "$work/train/tokenizer" ]] && cp -r "$work/train/tokenizer" runs/gpu-task-loop.partial/train/
    latest=$(head -n 1 "$work/train/checkpoints/latest")
    cp -r "$work/train/checkpoints/$latest" "$work/train/checkpoints/latest" runs/gpu-task-loop.partial/train/checkpoints/
    for f in "$work"/data/*; do
        case $(basename "$f") in train*) ;; *) cp -r "$f" runs/gpu-task-loop.partial/data/ ;; esac
    done
    rm -rf runs/gpu-task-loop && mv runs/gpu-task-loop.partial runs/gpu-task-loop
    rm -rf "$work"
fi
echo "== carry ready ($((SECONDS - t0)) s): $(du -sh shared/wheels shared/data/wiki-gpt2 runs/huginn-carry runs/gpu-task runs/gpu-task-loop data/medium.zip | awk '{print $2" "$1}' | paste -sd' ')"
