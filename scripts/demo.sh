#!/usr/bin/env bash
# Installs what is missing, builds the flagship example (examples/moe_grpo) and trains the same
# MoE policy with GRPO three times — router replay disabled, R2 and R3 — for a fixed budget, on
# each of MRR_DEMO_SEEDS (default "1 2"), then prints a table, writes one CSV per mode and seed and
# a plot (docs/flagship.md explains what they show).
# Extra key=value arguments go to every run (e.g. steps=40; a seed= given here means one seed).
# The quick configuration (default) is the issue #18 model: 64 experts, top-8 (Qwen3's ratio), 4 MoE
# layers, hidden 128, with an fp8 rollout (MRR_DEMO_ROLLOUT=bf16 for a bf16 one); MRR_DEMO_MODEL=small
# runs the earlier 16-expert top-4, 2-layer model instead.
set -euo pipefail
# Sourced inside a function, so that configure.sh's "$@" (extra CMake arguments) is empty, not
# this script's key=value arguments.
configure() {
  # shellcheck source=configure.sh
  source "$(dirname "${BASH_SOURCE[0]}")/configure.sh"
}
configure
cmake --build "$build" --parallel "$jobs" --target moe_grpo

out="${MRR_DEMO_OUT:-$build/moe_grpo_demo}"
mkdir -p "$out"
steps="${MRR_DEMO_STEPS:-30}"
for a in "$@"; do  # a steps= given here goes to every run (after ours): report that count
  case "$a" in steps=*|trainer.total_training_steps=*) steps="${a#*=}" ;; esac
done
read -r -a seeds <<<"${MRR_DEMO_SEEDS:-1}"
model=()
if [[ "${MRR_DEMO_MODEL:-realistic}" != small ]]; then
  m=actor_rollout_ref.model
  model=("$m.num_experts=64" "$m.moe_topk=8" "$m.num_layers=4" "$m.hidden_size=128"
         "actor_rollout_ref.rollout.dtype=${MRR_DEMO_ROLLOUT:-fp8}")
fi
if [[ "${1:-}" == full ]]; then
  # The grid of issue #18: modes x regimes x seeds, each run's CSV <mode>_<regime>.seed<N>.csv and a
  # table (also <out>/grid.txt). Modes: disabled, R2, R3, disabled+TIS, R3+TIS (verl's token-level
  # rollout correction, threshold 2). Regimes: on-policy (1 update per batch) and off-policy (4 and 8
  # updates per batch: ppo_mini_batch_size = batch / 4, batch / 8). Seeds: MRR_DEMO_SEEDS (default
  # "1 2 3"). Collapse: the first step from which the reward's 5-step moving average stays below
  # half its running peak, or the k3 KL above 1e-2, for 5 consecutive steps ("-": none).
  shift
  read -r -a seeds <<<"${MRR_DEMO_SEEDS:-1 2 3}"
  out="${MRR_DEMO_OUT:-$build/moe_grpo_grid}"
  mkdir -p "$out"
  batch=16
  # A part of the grid: MRR_DEMO_GRID_MODES (e.g. "disabled R2 R3") and MRR_DEMO_GRID_REGIMES (e.g.
  # "off8"); MRR_DEMO_JOBS runs that many trainings at once (each on one OpenMP thread).
  read -r -a grid_modes <<<"${MRR_DEMO_GRID_MODES:-disabled R2 R3 disabled+TIS R3+TIS}"
  all_regimes=("on:$batch" "off4:$((batch / 4))" "off8:$((batch / 8))")
  regimes=()
  for r in "${all_regimes[@]}"; do
    [[ " ${MRR_DEMO_GRID_REGIMES:-on off4 off8} " == *" ${r%%:*} "* ]] && regimes+=("$r")
  done
  jobs_max="${MRR_DEMO_JOBS:-1}"
  start=$SECONDS
  # MRR_DEMO_GRID_TABLE_ONLY=1: no training, the table of the CSVs already in $out (a grid trained
  # in parts).
  [[ "${MRR_DEMO_GRID_TABLE_ONLY:-0}" == 1 ]] && seeds_to_train=() || seeds_to_train=("${seeds[@]}")
  pids=(); names=()
  for seed in "${seeds_to_train[@]}"; do
    for regime in "${regimes[@]}"; do
      for gm in "${grid_modes[@]}"; do
        tis=(); mode="${gm%+TIS}"
        [[ "$gm" == *+TIS ]] && tis=(algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2)
        name="${gm/+/_}_${regime%%:*}.seed$seed"
        run=("$build/examples/moe_grpo/moe_grpo" --no-progress mode="$mode" steps="$steps" seed="$seed" out="$out"
             data.train_batch_size="$batch" actor_rollout_ref.actor.ppo_mini_batch_size="${regime#*:}"
             name="$name" "${model[@]}" "${tis[@]}" "$@")
        # Each run's output in <out>/<name>.log; a run that fails (or prints no summary) fails the
        # grid once every run has ended, with its log's last lines.
        if (( jobs_max > 1 )); then
          OMP_NUM_THREADS=1 "${run[@]}" >"$out/$name.log" 2>&1 &
          pids+=("$!"); names+=("$name")
          while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
        else
          "${run[@]}" >"$out/$name.log" 2>&1 || true
          names+=("$name")
        fi
      done
    done
  done
  failed=()
  for i in "${!names[@]}"; do
    status=0
    if (( jobs_max > 1 )); then wait "${pids[$i]}" || status=$?; fi
    if (( status != 0 )) || ! grep -q '^summary' "$out/${names[$i]}.log"; then failed+=("${names[$i]}"); fi
  done
  if (( ${#failed[@]} > 0 )); then
    for name in "${failed[@]}"; do
      echo "moe_grpo run $name failed; the end of $out/$name.log:" >&2
      tail -n 5 "$out/$name.log" >&2
    done
    exit 1
  fi
  {
    printf '%-13s %-5s %7s  %-20s %9s %8s %9s %9s %8s  %s\n' mode regime reward "(per seed)" decisions tokens "k3 mean" \
      "floor k3" "F(2)" "collapse step per seed"
    for regime in "${regimes[@]}"; do
      for gm in "${grid_modes[@]}"; do
        files=()
        for seed in "${seeds[@]}"; do files+=("$out/${gm/+/_}_${regime%%:*}.seed$seed.csv"); done
        awk -F, -v mode="$gm" -v regime="${regime%%:*}" '
          FNR == 1 { ++f; for (i = 1; i <= NF; ++i) c[$i] = i; rows = 0; peak = -1; run = 0; collapse[f] = "-"; next }
          {
            ++n; ++rows; r[f, rows] = $c["reward"]
            dec += $c["rollout_decisions_differing"]; tok += $c["rollout_mismatch_tokens"]; k3 += $c["k3_kl"]
            fl += $c["floor_k3"]; f2 += $c["f2"]
            ma = 0; m = rows < 5 ? rows : 5; for (i = rows - m + 1; i <= rows; ++i) ma += r[f, i]; ma /= m
            if (ma > peak) peak = ma
            bad = (rows >= 5 && ma < peak / 2) || $c["k3_kl"] > 1e-2
            run = bad ? run + 1 : 0
            if (run == 5 && collapse[f] == "-") collapse[f] = $c["step"] - 4
            last[f] = rows
          }
          END {
            tot = 0; per = ""; col = ""
            for (s = 1; s <= f; ++s) {
              t = int(last[s] / 4); if (t < 1) t = 1
              v = 0; for (i = last[s] - t + 1; i <= last[s]; ++i) v += r[s, i]; v /= t
              tot += v; per = per (s > 1 ? "/" : "") sprintf("%.3f", v); col = col (s > 1 ? " " : "") collapse[s]
            }
            printf "%-13s %-5s %7.3f  %-20s %8.2f%% %7.2f%% %9.3e %9.3e %7.4f%%  %s\n", mode, regime, tot / f,
              "(" per ")", 100 * dec / n, 100 * tok / n, k3 / n, fl / n, 100 * f2 / n, col
          }' "${files[@]}"
      done
    done
    echo "(${#seeds[@]} seeds: ${seeds[*]}; $steps steps per run; $((SECONDS - start)) s; model: ${model[*]:-small}."
    echo " reward: mean of the last quarter of the steps; decisions / tokens: rollout vs the mode's old-log-prob"
    echo " pass, R3 paper definitions; k3: the mode's own pass vs the rollout; floor: two training passes, other"
    echo " micro-batch composition; F(2): tokens with max(p/q, q/p) > 2. Collapse rule: see scripts/demo.sh.)"
  } | tee "$out/grid.txt"
  echo "CSVs: $out/<mode>_<regime>.seed<N>.csv"
  exit 0
fi
for a in "$@"; do
  case "$a" in seed=*|trainer.seed=*) seeds=("${a#*=}") ;; esac
done
modes=(disabled R2 R3)
# The first seed's CSVs are <mode>.csv (plot.gp draws them), the others <mode>.seed<N>.csv.
csv_name() { if [[ "$2" == "${seeds[0]}" ]]; then echo "$1"; else echo "$1.seed$2"; fi; }
for seed in "${seeds[@]}"; do
  for mode in "${modes[@]}"; do
    "$build/examples/moe_grpo/moe_grpo" mode="$mode" steps="$steps" seed="$seed" out="$out" \
      name="$(csv_name "$mode" "$seed")" "${model[@]}" "$@" | grep '^summary' >/dev/null
  done
done

# Per mode, pooled over the seeds' CSVs: final reward (mean of the last quarter of the steps, per
# seed), means and medians over steps. The median of a per-step value is robust to a single
# outlier step (one bf16 step can dominate a mean).
summarize() {
  awk -F, -v mode="$1" '
    function median(a, n,   i, j, t, b) {
      for (i = 1; i <= n; ++i) b[i] = a[i]
      for (i = 2; i <= n; ++i) { t = b[i]; for (j = i - 1; j >= 1 && b[j] > t; --j) b[j + 1] = b[j]; b[j + 1] = t }
      return n % 2 ? b[(n + 1) / 2] : (b[n / 2] + b[n / 2 + 1]) / 2
    }
    FNR == 1 { ++f; for (i = 1; i <= NF; ++i) c[$i] = i; next }
    {
      ++n; rows[f]++; reward[f, rows[f]] = $c["reward"]
      mis += $c["rollout_mismatch_decisions"]; tok += $c["rollout_mismatch_tokens"]
      dec += $c["rollout_decisions_differing"]; f2 += $c["f2"]; fl += $c["floor_k3"]
      dlogp += $c["mean_abs_dlogp"]; upd += $c["update_mismatch_decisions"]; secs += $c["wall_seconds"]
      k3[n] = $c["k3_kl"]; k3sum += $c["k3_kl"]
      nat[n] = $c["paired_native_k3"]; rep[n] = $c["paired_replay_k3"]
      natsum += $c["paired_native_k3"]; repsum += $c["paired_replay_k3"]; worse += ($c["paired_native_k3"] > $c["paired_replay_k3"])
      if ($c["paired_replay_k3"] > 0) ratio[++nr] = $c["paired_native_k3"] / $c["paired_replay_k3"]
    }
    END {
      per_seed = ""; total = 0
      for (s = 1; s <= f; ++s) {
        tail = int(rows[s] / 4); if (tail < 1) tail = 1
        r = 0; for (i = rows[s] - tail + 1; i <= rows[s]; ++i) r += reward[s, i]
        r /= tail; total += r; per_seed = per_seed (s > 1 ? "/" : "") sprintf("%.3f", r)
      }
      printf "%-9s %6.3f %-13s %8.2f%% %7.3f%% %6.2f%%  %9.3e %9.3e %9.3e  %9.3e  %9.3e %9.3e %5.2fx  %9.3e %9.3e %5.2fx %4.0f%%  %9.3e  %7.3f%%  %s\n",
        mode, total / f, "(" per_seed ")", 100 * dec / n, 100 * mis / n, 100 * tok / n, median(k3, n), k3sum / n,
        fl / n, f2 / n, median(nat, n), median(rep, n),
        median(ratio, nr), natsum / n, repsum / n, (repsum > 0 ? natsum / repsum : 0), 100 * worse / n,
        dlogp / n, 100 * upd / n, secs
    }' "${@:2}"
}

echo
printf '%-9s %-20s %-26s  %-29s  %-9s  %-9s  %-60s  %-9s %8s\n' "" "final reward" "rollout mismatch" \
  "own k3 KL vs rollout" "floor k3" "F(2)" "paired k3 KL (same weights+tokens): native vs replayed routes" "mean" \
  "old/upd"
printf '%-9s %6s %-13s %9s %8s %7s  %9s %9s %9s  %9s  %9s %9s %6s  %9s %9s %6s %5s  %9s  %8s\n' mode mean \
  "(per seed)" decisions experts tokens median mean "" "" "med nat" "med rep" ratio "mean nat" "mean rep" ratio \
  "n>r" "|dlogp|" ""
total=0
for mode in "${modes[@]}"; do
  files=()
  for seed in "${seeds[@]}"; do files+=("$out/$(csv_name "$mode" "$seed").csv"); done
  line="$(summarize "$mode" "${files[@]}")"
  echo "${line% *}"
  total="$(awk -v a="$total" -v b="${line##* }" 'BEGIN{print a + b}')"
done
echo "(${#seeds[@]} seed(s): ${seeds[*]}; $steps steps per run; training time ${total%.*} s in total; model:"
echo " ${model[*]:-the small default (16 experts, top-4, 2 layers, bf16 rollout)}."
echo " final reward: mean of the last quarter of the steps, per seed; rollout mismatch, the mode's"
echo " old-log-prob pass vs the rollout: (token, layer) decisions whose expert set differs (the R3 paper's"
echo " definition), differing experts, tokens with >= 1 differing layer; floor: k3 between two training"
echo " passes of the same weights and tokens in different micro-batch compositions; F(2): tokens with"
echo " max(p/q, q/p) > 2; paired: on the step's"
echo " weights and the rollout's tokens, the training engine routed natively vs replaying the rollout's"
echo " routes, whatever the mode: medians over steps and the median of the per-step ratio, means and"
echo " their ratio, n>r: steps where native routing's KL is the larger; own k3: the mode's old-log-prob"
echo " pass vs the rollout; old/upd: old-log-prob vs update passes. Over the steps of every seed.)"
echo
echo "CSVs: $out/{disabled,R2,R3}[.seed<N>].csv"
if command -v gnuplot >/dev/null 2>&1; then
  gnuplot -e "dir='$out'; out='$out/replay.png'" "$root/examples/moe_grpo/plot.gp"
  echo "plot: $out/replay.png (seed ${seeds[0]})"
else
  echo "plot: skipped (gnuplot not found; apt-get install gnuplot-nox)"
fi
