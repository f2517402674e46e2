#!/usr/bin/env python3
"""Cases of verl's "kl_cov" policy loss, computed by verl's own compute_policy_loss_kl_cov.

The vendored tests/golden/policy_loss.json has no kl_cov case, so this script runs verl's function
(verl/trainer/ppo/core_algos.py at the golden vectors' commit, verl-project/verl 1dda039b) on new
inputs, in float64 on the CPU with torch autograd, and writes the cases in the golden format
(tests/golden/README.md) to tests/ppo/verl_kl_cov/policy_loss.json, which is committed: the ctest
test_ppo.kl_cov runs test_ppo's policy-loss golden test on it (MRR_GOLDEN_DIR pointing there), so
a clone needs neither verl nor this script.

kl_cov selects the valid tokens with the largest covariance of advantage and log-probability; the
choice among covariances tied at the k-th value is torch.topk's (its selection algorithm), so every
case here is drawn until its k-th and (k+1)-th covariances differ (mrr takes the lowest index
among ties, docs/ppo.md). Inputs are GRPO-like (one advantage per response, broadcast over its
tokens) or per-token, with padded tails, fully masked rows, rollout IS weights, every aggregation
mode, data-parallel global batch counts, kl_cov_ratio from verl's default 0.0002 (one token) to
1 (every valid token), up to 32 x 256 tokens.

  kl_cov_cases.py --verl SRC [--out FILE] [--seed N]

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


def load_core_algos(source, workdir):
    dest = os.path.join(workdir, "verl")
    rb.extract("verl", VERL_REPO, VERL_COMMIT, rb.VERL_FILES, source, dest)
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


def actor_config(p):
    """The fields of verl's ActorConfig that compute_policy_loss_kl_cov reads."""
    info = {k: p[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor") if k in p}
    policy = Namespace(loss_mode="kl_cov", kl_cov_ratio=p["kl_cov_ratio"], ppo_kl_coef=p["ppo_kl_coef"])
    return Namespace(policy_loss=policy, global_batch_info=info, clip_ratio=0.2, clip_ratio_low=0.2,
                     clip_ratio_high=0.2, clip_ratio_c=3.0)


def tensor(t):
    return {"shape": list(t.shape), "data": [float(v) for v in t.reshape(-1).tolist()]}


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
    parser.add_argument("--out", default=os.path.join(HERE, "verl_kl_cov", "policy_loss.json"))
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    core = load_core_algos(args.verl, args.workdir or tempfile.mkdtemp(prefix="mrr-kl-cov-"))
    gen = torch.Generator().manual_seed(args.seed)

    plans = []  # (rows, cols, kl_cov_ratio, ppo_kl_coef, agg mode, global info, grpo, weights, empty row)
    for ratio in (0.0002, 0.01, 0.05, 0.2, 0.5, 1.0):
        for grpo in (True, False):
            plans.append((8, 24, ratio, 1.0, "token-mean", {}, grpo, False, False))
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        plans.append((6, 20, 0.1, 0.5, mode, {}, True, False, True))
        plans.append((6, 20, 0.1, 2.0, mode, {}, False, True, False))
    plans.append((6, 20, 0.1, 1.0, "token-mean", {"dp_size": 4, "batch_num_tokens": 300}, True, False, False))
    plans.append((6, 20, 0.1, 1.0, "seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 16}, False, True, False))
    plans.append((6, 20, 0.1, 1.0, "seq-mean-token-sum-norm", {"loss_scale_factor": 64}, True, False, False))
    plans.append((5, 7, 0.3, 0.0, "token-mean", {}, False, False, False))  # coefficient 0: plain -A r
    plans.append((1, 1, 0.0002, 1.0, "token-mean", {}, False, False, False))  # one token
    plans.append((32, 256, 0.0002, 1.0, "token-mean", {}, True, False, False))  # verl's default, one token
    plans.append((32, 256, 0.002, 1.0, "token-mean", {}, True, True, False))  # ~8 of ~4,000 tokens
    plans.append((32, 256, 0.02, 0.1, "seq-mean-token-mean", {}, False, False, True))

    cases = []
    for n, (rows, cols, ratio, coef, mode, info, grpo, weights, empty_row) in enumerate(plans):
        for _ in range(100):
            inputs = draw(gen, rows, cols, grpo, weights, empty_row)
            if separated(inputs, ratio):
                break
        else:
            sys.exit(f"kl_cov_cases: could not draw case {n} without tied covariances at the k-th value")
        params = {"policy_loss": "kl_cov", "loss_agg_mode": mode, "kl_cov_ratio": ratio, "ppo_kl_coef": coef, **info}
        log_prob = inputs["log_prob"].clone().requires_grad_(True)
        loss, metrics = core.compute_policy_loss_kl_cov(inputs["old_log_prob"], log_prob, inputs["advantages"],
                                                        inputs["response_mask"], mode, actor_config(params),
                                                        inputs.get("rollout_is_weights"))
        loss.backward()
        outputs = {"loss": tensor(loss.detach().reshape(())), "grad_log_prob": tensor(log_prob.grad)}
        for key, value in metrics.items():
            outputs["metric:" + key] = float(value)
        name = (f"kl_cov_{'grpo' if grpo else 'token'}_{mode}_r{ratio}_c{coef}_B{rows}_L{cols}"
                f"{'_is' if weights else ''}{'_emptyrow' if empty_row else ''}{'_dp' if info else ''}_{n}")
        cases.append({"name": name, "fn": "policy_loss", "params": params,
                      "inputs": {k: tensor(v) for k, v in inputs.items()}, "outputs": outputs,
                      "tolerance": {"rtol": 1e-9, "atol": 1e-12}})
    meta = {"generator": "tests/ppo/kl_cov_cases.py", "seed": args.seed, "references": f"{VERL_REPO}@{VERL_COMMIT[:8]}",
            "torch": torch.__version__, "function": "verl.trainer.ppo.core_algos.compute_policy_loss_kl_cov"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "family": "policy_loss", "cases": cases}, f, separators=(",", ":"))
    print(f"kl_cov_cases: wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
