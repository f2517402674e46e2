# Reward, routing mismatch and k3 KL per step for each mode of the flagship demo.
# gnuplot -e "dir='moe_grpo_out'; out='moe_grpo_out/replay.png'" examples/moe_grpo/plot.gp
if (!exists("dir")) dir = 'moe_grpo_out'
if (!exists("out")) out = dir.'/replay.png'
set terminal pngcairo size 1500,420 font ",10" noenhanced
set output out
set datafile separator ","
set key top left
set grid
modes = "disabled R2 R3"
set multiplot layout 1,3 title "GRPO on a 16-expert top-4 MoE policy: router replay disabled vs R2 vs R3"
set title "mean reward"
set xlabel "step"
plot for [m in modes] dir.'/'.m.'.csv' using 1:2 with lines lw 2 title m
set title "routing mismatch, rollout vs training (fraction of router decisions)"
plot for [m in modes] dir.'/'.m.'.csv' using 1:5 with lines lw 2 title m
set title "k3 KL(training || rollout) per token"
set format y "%.1e"
plot for [m in modes] dir.'/'.m.'.csv' using 1:8 with lines lw 2 title m
unset multiplot
