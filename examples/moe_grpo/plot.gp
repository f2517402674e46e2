# Reward, routing mismatch, k3 KL and the paired KL ratio (native / replayed routing, same weights
# and tokens) per step for each mode of the flagship demo.
# gnuplot -e "dir='moe_grpo_out'; out='moe_grpo_out/replay.png'" examples/moe_grpo/plot.gp
# CSV columns (main.cpp): 1 step, 2 reward, 8 k3_kl, 26 paired_native_k3, 29 paired_replay_k3,
# 32 rollout_decisions_differing, 40 floor_k3.
if (!exists("dir")) dir = 'moe_grpo_out'
if (!exists("out")) out = dir.'/replay.png'
set terminal pngcairo size 1400,900 font ",10" noenhanced
set output out
set datafile separator ","
set key top left
set grid
modes = "disabled R2 R3"
set multiplot layout 2,2 title "GRPO on an MoE policy: router replay disabled vs R2 vs R3"
set title "mean reward"
set xlabel "step"
plot for [m in modes] dir.'/'.m.'.csv' using 1:2 with lines lw 2 title m
set title "routing mismatch, rollout vs the mode's training pass ((token, layer) decisions that differ)"
plot for [m in modes] dir.'/'.m.'.csv' using 1:32 with lines lw 2 title m
set title "k3 KL(training || rollout) per token, the mode's own old-log-prob pass"
set format y "%.0e"
set logscale y
plot for [m in modes] dir.'/'.m.'.csv' using 1:8 with lines lw 2 title m
set title "paired k3 KL vs rollout, same weights and tokens: native / replayed routes (1: routing adds nothing)"
set format y "%g"
plot for [m in modes] dir.'/'.m.'.csv' using 1:($29 > 0 ? $26 / $29 : NaN) with lines lw 2 title m, \
     1 with lines lc "black" dt 2 notitle
unset multiplot
