#!/usr/bin/env python3
"""Cases of verl's "kl_cov" and "clip_cov" policy losses, computed by verl's own functions.

The vendored tests/golden/policy_loss.json has no case of these two losses (Cui et al. 2025, the
entropy mechanism of RL for reasoning models), so this script runs verl's compute_policy_loss_kl_cov
and compute_policy_loss_clip_cov (verl/trainer/ppo/core_algos.py at the golden vectors' commit,
verl-project/verl 1dda039b) on new inputs, in float64 on the CPU with torch autograd, and writes the
cases in the golden format (tests/golden/README.md) to tests/ppo/verl_cov_losses/policy_loss.json,
which is committed: the ctest test_ppo.cov_losses runs test_ppo's policy-loss golden test on it
(MRR_GOLDEN_DIR pointing there), so a clone needs neither verl nor this script.

kl_cov selects the valid tokens with the largest covariance of advantage and log-probability; the
choice among covariances tied at the k-th value is torch.topk's (its selection algorithm), so every
kl_cov case is drawn until its k-th and (k+1)-th covariances differ (mrr takes the lowest index
among ties, docs/ppo.md). clip_cov drops up to max(1, int(clip_cov_ratio x tokens)) of its
candidate tokens, picked by torch.randperm when there are more; mrr picks them with a seeded hash
instead, so every clip_cov case is drawn until it has no more candidates than that (then both drop
all of them), and some have none. Inputs are GRPO-like (one advantage per response, broadcast over
its tokens) or per-token, with padded tails, fully masked rows, rollout IS weights, every
aggregation mode, data-parallel global batch counts, up to 32 x 256 tokens.

  cov_loss_cases.py --verl SRC [--out FILE] [--seed N]

SRC is a clone of https://github.com/verl-project/verl holding the commit (or a directory tree of
it); the files are extracted as bench/references/reference_bench.py extracts them.
"""
import argparse
import importlib
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "references"))
import reference_bench as rb  # noqa: E402

VERL_REPO = "verl-project/verl"
VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"  # the golden vectors' verl
DT = torch.float64


def load_core_algos(source, workdir, extra_files=()):
    """verl's core_algos (and any extra_files extracted beside it) from a clone at VERL_COMMIT."""
    dest = os.path.join(workdir, "verl")
    rb.extract("verl", VERL_REPO, VERL_COMMIT, rb.VERL_FILES + list(extra_files), source, dest)
    sys.path.insert(0, dest)
    sys.meta_path.insert(0, rb._StubFinder(["verl", "omegaconf", "tensordict", "transformers"], [dest]))
    groupwise = importlib.import_module("verl.utils.groupwise")
    utils = importlib.import_module("verl.utils")
    utils.as_torch_index, utils.group_mean_std = groupwise.as_torch_index, groupwise.group_mean_std
    return importlib.import_module("verl.trainer.ppo.core_algos")


class Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def get(self, key, default=None):
        return getattr(self, key, default)


COV_KEYS = ("kl_cov_ratio", "ppo_kl_coef", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")


def actor_config(p):
    """The fields of verl's ActorConfig that the two losses read."""
    info = {k: p[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor") if k in p}
    policy = Namespace(loss_mode=p["policy_loss"], **{k: p.get(k) for k in COV_KEYS})
    return Namespace(policy_loss=policy, global_batch_info=info, clip_ratio=p.get("clip_ratio", 0.2),
                     clip_ratio_low=p.get("clip_ratio_low"), clip_ratio_high=p.get("clip_ratio_high"),
                     clip_ratio_c=3.0)


def tensor(t):
    return {"shape": list(t.shape), "data": [float(v) for v in t.reshape(-1).tolist()]}


def masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def clip_cov_candidates(inputs, p):
    """How many tokens clip_cov could drop, and how many it drops at most."""
    mask, adv, lp = inputs["response_mask"], inputs["advantages"], inputs["log_prob"]
    ratio = torch.exp(lp - inputs["old_log_prob"])
    low, high = p["clip_ratio_low"], p["clip_ratio_high"]
    clipped = (-adv * torch.clamp(ratio, 1 - low, 1 + high) > -adv * ratio) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
    near = ((cov - p["clip_cov_lb"]).abs() < 1e-9) | ((cov - p["clip_cov_ub"]).abs() < 1e-9)
    free = (cov > p["clip_cov_lb"]) & (cov < p["clip_cov_ub"]) & (mask > 0) & ~clipped
    return int(free.sum()), max(int(p["clip_cov_ratio"] * mask.sum().item()), 1), bool((near & (mask > 0)).any())


def separated(inputs, ratio):
    """Whether the k-th and (k+1)-th largest covariances differ (so torch.topk's set is unique)."""
    valid = inputs["response_mask"] > 0
    if int(valid.sum()) == 0:
        return True
    adv, lp = inputs["advantages"][valid], inputs["log_prob"][valid]
    cov = (adv - adv.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * ratio))
    if k >= len(cov):
        return True
    top = torch.sort(cov, descending=True).values
    return bool(top[k - 1] != top[k])


def draw(gen, rows, cols, grpo, weights, empty_row):
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = (torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)).to(DT)
    if empty_row and rows > 1:
        mask[rows // 2] = 0
    old = -torch.rand(rows, cols, generator=gen, dtype=DT) * 4 - 0.01
    log_prob = old + torch.randn(rows, cols, generator=gen, dtype=DT) * 0.3
    if grpo:
        advantages = torch.randn(rows, 1, generator=gen, dtype=DT).expand(rows, cols).clone()
    else:
        advantages = torch.randn(rows, cols, generator=gen, dtype=DT)
    inputs = {"old_log_prob": old, "log_prob": log_prob, "advantages": advantages * mask, "response_mask": mask}
    if weights:
        inputs["rollout_is_weights"] = torch.rand(rows, cols, generator=gen, dtype=DT) * 2
    return inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verl", required=True, help="a verl git repository or directory tree holding " + VERL_COMMIT)
    parser.add_argument("--out", default=os.path.join(HERE, "verl_cov_losses", "policy_loss.json"))
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    core = load_core_algos(args.verl, args.workdir or tempfile.mkdtemp(prefix="mrr-cov-losses-"))
    gen = torch.Generator().manual_seed(args.seed)

    # (rows, cols, agg mode, global info, grpo, weights, empty row, loss params)
    plans = []
    for ratio in (0.0002, 0.01, 0.05, 0.2, 0.5, 1.0):
        for grpo in (True, False):
            plans.append((8, 24, "token-mean", {}, grpo, False, False, {"kl_cov_ratio": ratio, "ppo_kl_coef": 1.0}))
    modes = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    for mode in modes:
        plans.append((6, 20, mode, {}, True, False, True, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}))
        plans.append((6, 20, mode, {}, False, True, False, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 2.0}))
    kl = {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}
    plans.append((6, 20, "token-mean", {"dp_size": 4, "batch_num_tokens": 300}, True, False, False, kl))
    plans.append((6, 20, "seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 16}, False, True, False, kl))
    plans.append((6, 20, "seq-mean-token-sum-norm", {"loss_scale_factor": 64}, True, False, False, kl))
    plans.append((5, 7, "token-mean", {}, False, False, False, {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.0}))
    plans.append((1, 1, "token-mean", {}, False, False, False, {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0}))
    plans.append((32, 256, "token-mean", {}, True, False, False, {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 1.0}))
    plans.append((32, 256, "token-mean", {}, True, True, False, {"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}))
    plans.append((32, 256, "seq-mean-token-mean", {}, False, False, True, {"kl_cov_ratio": 0.02, "ppo_kl_coef": 0.1}))
    plans = [(*p[:7], {"policy_loss": "kl_cov", **p[7]}) for p in plans]

    def clip(ratio, lb, ub, low=0.2, high=0.2):
        return {"policy_loss": "clip_cov", "clip_ratio": 0.2, "clip_ratio_low": low, "clip_ratio_high": high,
                "clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub}
    for ratio, lb, ub in ((0.2, 1.0, 5.0), (0.5, 0.5, 5.0), (1.0, -0.5, 0.5), (0.05, 2.0, 3.0), (0.0002, 3.0, 5.0),
                          (0.3, 100.0, 200.0)):  # the last: no candidate at all
        for grpo in (True, False):
            plans.append((8, 24, "token-mean", {}, grpo, False, False, clip(ratio, lb, ub)))
    for mode in modes:
        plans.append((6, 20, mode, {}, True, False, True, clip(0.3, 0.5, 5.0, 0.2, 0.28)))
        plans.append((6, 20, mode, {}, False, True, False, clip(0.3, 0.5, 5.0, 0.1, 0.3)))
    plans.append((6, 20, "token-mean", {"dp_size": 4, "batch_num_tokens": 300}, True, False, False,
                  clip(0.3, 0.5, 5.0)))
    plans.append((6, 20, "seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 16}, False, True, False,
                  clip(0.3, 0.5, 5.0)))
    plans.append((1, 1, "token-mean", {}, False, False, False, clip(0.0002, -1.0, 1.0)))
    plans.append((32, 256, "token-mean", {}, True, True, False, clip(0.05, 1.0, 5.0)))
    plans.append((32, 256, "seq-mean-token-mean", {}, False, False, True, clip(0.1, 2.0, 5.0, 0.2, 0.28)))

    cases = []
    for n, (rows, cols, mode, info, grpo, weights, empty_row, loss) in enumerate(plans):
        params = {"loss_agg_mode": mode, **loss, **info}
        for _ in range(1000):
            inputs = draw(gen, rows, cols, grpo, weights, empty_row)
            if loss["policy_loss"] == "kl_cov":
                if separated(inputs, loss["kl_cov_ratio"]):
                    break
            else:
                candidates, most, near = clip_cov_candidates(inputs, loss)
                if candidates <= most and not near and (candidates > 0 or loss["clip_cov_lb"] >= 100):
                    break
        else:
            sys.exit(f"cov_loss_cases: could not draw case {n} ({loss}) with a unique reference answer")
        torch.manual_seed(n)  # clip_cov's torch.randperm: every candidate is dropped, whatever it draws
        log_prob = inputs["log_prob"].clone().requires_grad_(True)
        function = getattr(core, "compute_policy_loss_" + loss["policy_loss"])
        loss_value, metrics = function(inputs["old_log_prob"], log_prob, inputs["advantages"],
                                       inputs["response_mask"], mode, actor_config(params),
                                       inputs.get("rollout_is_weights"))
        loss_value.backward()
        outputs = {"loss": tensor(loss_value.detach().reshape(())), "grad_log_prob": tensor(log_prob.grad)}
        for key, value in metrics.items():
            outputs["metric:" + key] = float(value)
        knobs = "_".join(f"{k}{loss[k]}" for k in COV_KEYS if k in loss)
        name = (f"{loss['policy_loss']}_{'grpo' if grpo else 'token'}_{mode}_{knobs}_B{rows}_L{cols}"
                f"{'_is' if weights else ''}{'_emptyrow' if empty_row else ''}{'_dp' if info else ''}_{n}")
        cases.append({"name": name, "fn": "policy_loss", "params": params,
                      "inputs": {k: tensor(v) for k, v in inputs.items()}, "outputs": outputs,
                      "tolerance": {"rtol": 1e-9, "atol": 1e-12}})
    meta = {"generator": "tests/ppo/cov_loss_cases.py", "seed": args.seed,
            "references": f"{VERL_REPO}@{VERL_COMMIT[:8]}", "torch": torch.__version__,
            "functions": "verl.trainer.ppo.core_algos.compute_policy_loss_kl_cov, compute_policy_loss_clip_cov"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "family": "policy_loss", "cases": cases}, f, separators=(",", ":"))
    print(f"cov_loss_cases: wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
