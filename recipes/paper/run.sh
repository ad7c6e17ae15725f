#!/usr/bin/env bash
# Train one variant of the paper on GSM8K and validate on the seven benchmarks (the paper's sections 3.1-3.3).
#
#   recipes/paper/run.sh MODEL VARIANT [extra hydra overrides...]
#     MODEL    qwen2.5-3b | qwen2.5-7b | gemma-3-4b   (or any HF path via MODEL_PATH=...)
#     VARIANT  grpo | amir_grpo | gspo | amir_gspo       the paper's recipes (paper_VARIANT.yaml)
#              official_grpo | official_amir_grpo        the official AMIR-GRPO run's settings (paper_official_*.yaml;
#                                                        docs/paper.md, "The official run, point by point"; needs bitsandbytes)
#   a model's own settings come from config/paper_model/MODEL.yaml where there is one (gemma-3-4b: LoRA off the
#   vision tower).
#   environment: NGPUS (per node, default 8), NNODES (default 1), AMIR_DATA (parquet root, default
#   ~/data/amir, written by data_prep), AMIR_OUTPUT (default outputs), BETA (amir.beta_dpo of the AMIR
#   variants: default per model for amir_grpo / amir_gspo, the official command's 0.2 for official_amir_grpo).
set -euo pipefail
MODEL=${1:?model: qwen2.5-3b | qwen2.5-7b | gemma-3-4b}
VARIANT=${2:?variant: grpo | amir_grpo | gspo | amir_gspo | official_grpo | official_amir_grpo}
shift 2
USER_BETA=${BETA:-}
case "$MODEL" in
  qwen2.5-3b) MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}; BETA=${BETA:-0.1} ;;
  qwen2.5-7b) MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}; BETA=${BETA:-0.2} ;;
  gemma-3-4b) MODEL_PATH=${MODEL_PATH:-google/gemma-3-4b-it}; BETA=${BETA:-0.1} ;;
  *) MODEL_PATH=${MODEL_PATH:?unknown model $MODEL: set MODEL_PATH}; BETA=${BETA:-0.2} ;;
esac
case "$VARIANT" in
  grpo|gspo|official_grpo) AMIR_ARGS=() ;;
  amir_grpo|amir_gspo) AMIR_ARGS=("+amir.beta_dpo=${BETA}") ;;
  official_amir_grpo) AMIR_ARGS=(${USER_BETA:+"amir.beta_dpo=${USER_BETA}"}) ;;  # the recipe states 0.2
  *) echo "unknown variant $VARIANT (grpo | amir_grpo | gspo | amir_gspo | official_grpo | official_amir_grpo)" >&2
     exit 2 ;;
esac
if [[ $VARIANT == official_* && " $* " != *"optim.optimizer_impl="* ]] && ! python3 -c "import bitsandbytes" 2>/dev/null; then
  echo "recipes/paper/run.sh: $VARIANT uses bitsandbytes' AdamW8bit (the official run's adamw_8bit), and" \
       "bitsandbytes does not import here: pip install bitsandbytes, or add actor_rollout_ref.actor.optim.optimizer=AdamW" \
       "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim (verl's AdamW: a difference from the official run)" >&2
  exit 2
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
MODEL_ARGS=()  # a model's own settings, where it needs any: config/paper_model/MODEL.yaml
if [[ -f "$HERE/config/paper_model/${MODEL}.yaml" ]]; then MODEL_ARGS=("+paper_model=${MODEL}"); fi
export AMIR_EXPERIMENT="${MODEL}_${VARIANT}"
exec python3 -m verl.trainer.main_ppo \
  --config-path="$HERE/config" --config-name="paper_${VARIANT}" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  trainer.n_gpus_per_node="${NGPUS:-8}" trainer.nnodes="${NNODES:-1}" \
  "${MODEL_ARGS[@]}" "${AMIR_ARGS[@]}" "$@"
