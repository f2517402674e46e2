#!/usr/bin/env bash
# Installs what is missing, builds the flagship example (examples/moe_grpo) and trains the same
# MoE policy with GRPO three times — router replay disabled, R2 and R3 — for a fixed budget, then
# prints a table, writes one CSV per mode and a plot (docs/flagship.md explains what they show).
# Extra key=value arguments go to every run (e.g. steps=40 seed=3).
set -euo pipefail
# shellcheck source=configure.sh
source "$(dirname "${BASH_SOURCE[0]}")/configure.sh"
cmake --build "$build" --parallel "$jobs" --target moe_grpo

out="${MRR_DEMO_OUT:-$build/moe_grpo_demo}"
mkdir -p "$out"
steps="${MRR_DEMO_STEPS:-80}"
summaries=()
for mode in disabled R2 R3; do
  line="$("$build/examples/moe_grpo/moe_grpo" mode="$mode" steps="$steps" out="$out" "$@" | grep '^summary')"
  summaries+=("$line")
done

echo
printf '%-9s %13s %13s %19s %17s %12s %15s %9s\n' mode final_reward first_reward "mismatch(rollout)" "tokens w/ mismatch" "mean k3 KL" "mean |dlogp|" "old/upd"
for line in "${summaries[@]}"; do
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
  printf '%-9s %13.3f %13.3f %18.4f%% %16.2f%% %12.3e %15.3e %8.3f%%\n' \
    "$(field mode)" "$(field final_reward)" "$(field first_reward)" \
    "$(awk -v x="$(field mismatch_decisions)" 'BEGIN{print 100*x}')" \
    "$(awk -v x="$(field mismatch_tokens)" 'BEGIN{print 100*x}')" \
    "$(field k3_kl)" "$(field mean_abs_dlogp)" \
    "$(awk -v x="$(field update_mismatch)" 'BEGIN{print 100*x}')"
done
echo "(final_reward: mean over the last quarter of the steps; mismatch: router decisions of the training"
echo " old-log-prob pass that differ from the rollout's; old/upd: old-log-prob vs update passes)"
echo
echo "CSVs: $out/{disabled,R2,R3}.csv"
if command -v gnuplot >/dev/null 2>&1; then
  gnuplot -e "dir='$out'; out='$out/replay.png'" "$root/examples/moe_grpo/plot.gp"
  echo "plot: $out/replay.png"
else
  echo "plot: skipped (gnuplot not found; apt-get install gnuplot-nox)"
fi
