#!/usr/bin/env bash
# Train one variant of the paper on GSM8K and validate on the seven benchmarks (the paper's sections 3.1-3.3).
#
#   recipes/paper/run.sh MODEL VARIANT [extra hydra overrides...]
#     MODEL    qwen2.5-3b | qwen2.5-7b | gemma-3-4b   (or any HF path via MODEL_PATH=...)
#     VARIANT  grpo | amir_grpo | gspo | amir_gspo
#   environment: NGPUS (per node, default 8), NNODES (default 1), AMIR_DATA (parquet root, default
#   ~/data/amir, written by data_prep), AMIR_OUTPUT (default outputs), BETA (amir.beta_dpo, AMIR variants).
set -euo pipefail
MODEL=${1:?model: qwen2.5-3b | qwen2.5-7b | gemma-3-4b}
VARIANT=${2:?variant: grpo | amir_grpo | gspo | amir_gspo}
shift 2
case "$MODEL" in
  qwen2.5-3b) MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}; BETA=${BETA:-0.1} ;;
  qwen2.5-7b) MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}; BETA=${BETA:-0.2} ;;
  gemma-3-4b) MODEL_PATH=${MODEL_PATH:-google/gemma-3-4b-it}; BETA=${BETA:-0.1} ;;
  *) MODEL_PATH=${MODEL_PATH:?unknown model $MODEL: set MODEL_PATH}; BETA=${BETA:-0.2} ;;
esac
case "$VARIANT" in
  grpo|gspo) AMIR_ARGS=() ;;
  amir_grpo|amir_gspo) AMIR_ARGS=("+amir.beta_dpo=${BETA}") ;;
  *) echo "unknown variant $VARIANT (grpo | amir_grpo | gspo | amir_gspo)" >&2; exit 2 ;;
esac
HERE=$(cd "$(dirname "$0")/.." && pwd)
export AMIR_EXPERIMENT="${MODEL}_${VARIANT}"
exec python3 -m verl.trainer.main_ppo \
  --config-path="$HERE/config" --config-name="paper_${VARIANT}" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  trainer.n_gpus_per_node="${NGPUS:-8}" trainer.nnodes="${NNODES:-1}" \
  "${AMIR_ARGS[@]}" "$@"
