#!/usr/bin/env python3
"""PyTorch-eager references for bench_device_cuda, measured on the GPU at hand.

bench/baselines/h100_pytorch.json holds these figures for one H100, measured elsewhere; on any
other card (an H200, a later H100 driver) a comparison needs the reference run on the same card.
This script writes a JSON file of the same shape, so

    python3 bench/torch/pytorch_baselines_cuda.py --out /tmp/same_card.json
    MRR_BASELINES=/tmp/same_card.json build/bench/device/bench_device_cuda

prints mrr's kernels beside PyTorch eager on one card. CUDA events around each call, median of
--reps after warm-ups; fresh inputs from a fixed seed (normal logits, as bench_device_cuda's).

What each reference computes (the eager code a trainer runs today):
- softmax_topk_eager_us: softmax over E, top-k, renormalise (Qwen3-MoE / HF).
- replay_gather_eager_us: gather the k logits at given ids, softmax over them (the renormalised
  weights of replayed routes, mrr's replay).
- ds_grouped_eager_us: HF DeepSeek-V3's gate after the logits: sigmoid, + bias, groups' top-2
  sums, top-4 groups, masked_fill 0.0, top-8, gather, renormalise, x 2.5.
- permute_eager_us: rows of x [T, H] (bf16) gathered into expert order (index_select of the
  stable argsort of the ids).
- gae_verl_loop_us: verl's compute_gae_advantage_return (a Python loop over time) + masked_whiten.
"""
import argparse
import json
import statistics

import torch


def timed_us(fn, reps=21, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 28  # 1 GiB of float32
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    a.normal_()
    us = timed_us(lambda: b.copy_(a), 11)
    return 2 * a.numel() * 4 / (us * 1e-6) / 1e9  # GB/s, read + write


def softmax_topk(z, k):
    p = torch.softmax(z, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(p, k, dim=-1)
    return ids, w / w.sum(dim=-1, keepdim=True)


def replay_gather(z, ids):
    return torch.softmax(torch.gather(z, 1, ids), dim=-1)


def ds_grouped(z, bias, k, groups, topk_groups, scale):
    t, e = z.shape
    scores = z.sigmoid()
    choice = scores + bias.unsqueeze(0)
    group_scores = choice.view(t, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, -1)
    masked = choice.masked_fill(~score_mask.bool(), 0.0)
    ids = torch.topk(masked, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale


def permute(x, ids, k):
    order = torch.argsort(ids.flatten(), stable=True)
    return x.index_select(0, order // k)


def masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    var = (centered * centered * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)  # unbiased, as verl's masked_var
    return (values - mean) * torch.rsqrt(var + 1e-8)


def gae_verl(rewards, values, mask, gamma=0.99, lam=0.95):
    nextvalues, lastgaelam = 0, 0
    advantages_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (bench_device_cuda's MRR_BASELINES)")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--gae-reps", type=int, default=3, help="the Python loop takes about half a second a call")
    args = ap.parse_args()
    torch.manual_seed(1)
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    out = {"device": dev, "torch": torch.__version__, "d2d_copy_GBps_rw": bw, "gating": []}
    k = 8
    for t, e in ((4096, 256), (65536, 64), (65536, 256)):
        z = torch.randn(t, e, device="cuda")
        ids, _ = softmax_topk(z, k)
        row = {"T": t, "E": e, "k": k,
               "softmax_topk_eager_us": timed_us(lambda: softmax_topk(z, k), args.reps),
               "replay_gather_eager_us": timed_us(lambda: replay_gather(z, ids), args.reps)}
        if e == 256:
            bias = 0.01 * (torch.arange(e, device="cuda") % 7).float()
            row["ds_grouped_eager_us"] = timed_us(lambda: ds_grouped(z, bias, k, 8, 4, 2.5), args.reps)
        row["limit_us_at_copy_bw"] = (t * e * 4 + t * k * 8) / (bw * 1e9) * 1e6
        out["gating"].append(row)
        print(f"T={t} E={e}: " + ", ".join(f"{key} {val:.1f}" for key, val in row.items() if key.endswith("_us")),
              flush=True)
    t, h, e = 65536, 2048, 256
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, _ = softmax_topk(torch.randn(t, e, device="cuda"), k)
    out["permute"] = {"T": t, "H": h, "E": e, "k": k, "permute_eager_us": timed_us(lambda: permute(x, ids, k), 11),
                      "limit_us_at_copy_bw": 2 * t * k * h * 2 / (bw * 1e9) * 1e6}
    print(f"permute: {out['permute']['permute_eager_us']:.1f} us", flush=True)
    x = None  # frees the rows before GAE
    b, l = 512, 4096
    r, v = torch.randn(b, l, device="cuda"), torch.randn(b, l, device="cuda")
    m = (torch.rand(b, l, device="cuda") < 0.9).float()
    out["gae"] = {"B": b, "L": l, "gae_verl_loop_us": timed_us(lambda: gae_verl(r, v, m), args.gae_reps, warmup=1),
                  "limit_us_at_copy_bw": b * l * 4 * 5 / (bw * 1e9) * 1e6}
    print(f"gae: {out['gae']['gae_verl_loop_us']:.0f} us; device {dev}, copy {bw:.0f} GB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
