"""The PyTorch extension's routing on CUDA tensors (mrr/torch/cuda.hpp through
examples/torch_extension) beside PyTorch eager doing the same in the same process, at the gating
sizes of bench/baselines/h100_pytorch.json. This is what a Python trainer calls: the device
router's view kernels on torch's tensors, current stream and caching allocator, with autograd.

    python3 bench/torch/bench_torch_cuda_routing.py        # needs a GPU, CUDA torch and nvcc

Times are CUDA events around each call (median of 21 after 5 warm-ups), the Python call included.
check=False is the kernel path (nothing waits); check=True adds the one synchronisation that turns
a bad row into an error. The limit is reading the fp32 logits once at the measured copy bandwidth.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "torch_extension"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mrr_torch  # noqa: E402
from pytorch_baselines_cuda import ds_grouped, timed_us  # noqa: E402  (CUDA events, the median)


def timed(fn, reps=21, warm=5):
    return timed_us(fn, reps, warm)


def copy_bandwidth():
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = timed(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6)  # bytes read + written per second


def main():
    mt = mrr_torch.load()
    if not (torch.cuda.is_available() and mt.has_cuda):
        print("bench_torch_cuda_routing: needs a GPU and the extension's CUDA half; skipped")
        return 0
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'T':>6} {'E':>4} {'k':>2} | {'mrr route':>10} {'+check':>8} {'torch topk':>10} | "
          f"{'mrr replay':>10} {'torch gather':>12} | {'mrr fwd+bwd':>11} {'torch fwd+bwd':>13} | {'limit':>6}  (us) | "
          "rows whose torch.topk differs")
    for T, E in [(4096, 64), (4096, 256), (65536, 64), (65536, 256)]:
        k = 8
        router = mt.Router(E, k, pre_softmax=True, normalize_topk=True)
        logits = torch.randn(T, E, device="cuda")
        upstream = torch.randn(T, k, device="cuda")

        def torch_route(z):
            p = torch.softmax(z, dim=-1)
            w, i = torch.topk(p, k, dim=-1)
            return w / w.sum(dim=-1, keepdim=True), i

        _, ids = torch_route(logits)

        def torch_replay(z):
            w = torch.softmax(z, dim=-1).gather(1, ids)
            return w / w.sum(dim=-1, keepdim=True)

        ours = timed(lambda: router.route(logits, check=False))
        ours_checked = timed(lambda: router.route(logits))
        theirs = timed(lambda: torch_route(logits))
        ours_replay = timed(lambda: router.replay(logits, ids, check=False))
        theirs_replay = timed(lambda: torch_replay(logits))
        z = logits.clone().requires_grad_(True)

        def ours_fb():
            w = router.route(z, check=False)[0]
            torch.autograd.backward(w, upstream)

        def theirs_fb():
            w = torch_route(z)[0]
            torch.autograd.backward(w, upstream)

        fb_ours, fb_theirs = timed(ours_fb), timed(theirs_fb)
        # mrr's ids are the CPU router's (the parity bar). torch.topk of torch's own GPU softmax can
        # break near-ties of the rounded probabilities otherwise: those rows are counted, not asserted.
        got = router.route(logits)[1]
        assert torch.equal(got.cpu(), router.route(logits.cpu())[1]), "GPU ids differ from the CPU router's"
        differ = int((got != ids).any(dim=1).sum())
        limit = T * E * 4 / (bw / 2) * 1e6
        print(f"{T:>6} {E:>4} {k:>2} | {ours:>10.1f} {ours_checked:>8.1f} {theirs:>10.1f} | "
              f"{ours_replay:>10.1f} {theirs_replay:>12.1f} | {fb_ours:>11.1f} {fb_theirs:>13.1f} | {limit:>6.1f}       | {differ}")
    # DeepSeek-V3's gate with its correction bias (set from Python: the fused kernel reads the
    # device router's copy) beside the HF gate in eager PyTorch.
    T, E, k = 65536, 256, 8
    router = mt.Router(E, k, score_function="sigmoid", normalize_topk=True, scaling_factor=2.5, num_groups=8,
                       group_topk=4, use_expert_bias=True)
    bias = 0.01 * (torch.arange(E, device="cuda") % 7).float()
    router.set_expert_bias(bias)
    logits = torch.randn(T, E, device="cuda")
    ours = timed(lambda: router.route(logits, check=False))
    ours_checked = timed(lambda: router.route(logits))
    theirs = timed(lambda: ds_grouped(logits, bias, k, 8, 4, 2.5))
    got = router.route(logits)[1].cpu()
    same = int((got == router.route(logits.cpu())[1]).all(dim=1).sum())
    print(f"DeepSeek-V3 gate, T={T} E={E} k={k}, expert bias: mrr route {ours:.1f} us (+check {ours_checked:.1f}), "
          f"torch eager {theirs:.1f} us ({theirs / ours:.1f}x); ids equal the CPU router's in {same} of {T} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
