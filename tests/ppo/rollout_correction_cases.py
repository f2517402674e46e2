#!/usr/bin/env python3
"""Cases of verl's rollout rejection sampling and its "bypass_mode" policy loss, computed by verl.

The vendored tests/golden/rollout_correction.json holds IS weights only. This script runs verl's
rollout_corr_helper (verl/trainer/ppo/rollout_corr_helper.py at the golden vectors' commit,
verl-project/verl 1dda039b) on new inputs, in float64 on the CPU:
  - compute_rollout_rejection_mask: every rollout_rs option (token_k1..k3, seq_sum_k1..k3,
    seq_mean_k1..k3, seq_max_k2/k3), chained options, shared and per-option thresholds, k1 bounds
    given as "lower_upper" or as an upper bound alone, log-ratios beyond the +-20 safety bound,
    padded tails and empty rows;
  - compute_rollout_correction_and_rejection_mask: IS weights, rejection and the off-policy
    metrics together, prefixed "rollout_corr/";
  - core_algos.compute_policy_loss_bypass_mode with torch autograd: loss_type ppo_clip and
    reinforce, with and without IS weights and rejection, every aggregation mode.
It writes them in the golden format (tests/golden/README.md) to
tests/ppo/verl_rollout_correction/{rollout_correction,policy_loss}.json, which are committed: the
ctest test_ppo.rollout_rejection runs test_ppo's golden tests of those two families on them
(MRR_GOLDEN_DIR pointing there), so a clone needs neither verl nor this script.

  rollout_correction_cases.py --verl SRC [--out DIR] [--seed N]

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
sys.path.insert(0, HERE)
from cov_loss_cases import DT, VERL_COMMIT, VERL_REPO, Namespace, load_core_algos, tensor  # noqa: E402


class DataProto:
    """The one use of verl.protocol.DataProto here: a dict of tensors under .batch."""

    def __init__(self, tensors):
        self.batch = dict(tensors)

    @classmethod
    def from_dict(cls, tensors):
        return cls(tensors)


def load(source, workdir):
    core = load_core_algos(source, workdir, ["verl/trainer/ppo/rollout_corr_helper.py"])
    helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    helper.DataProto = DataProto
    return helper, core


def draw_mask(gen, rows, cols, empty_row):
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = (torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)).to(DT)
    if empty_row and rows > 1:
        mask[rows // 2] = 0
    return mask


def draw_log_ratio(gen, rows, cols, sigma, extreme):
    x = torch.randn(rows, cols, generator=gen, dtype=DT) * sigma
    if extreme:  # a few beyond the +-20 safety bound
        pick = torch.rand(rows, cols, generator=gen, dtype=DT) < 0.05
        x = torch.where(pick, torch.sign(x) * (20 + torch.rand(rows, cols, generator=gen, dtype=DT) * 10), x)
    return x


RS_PLANS = [
    # (rollout_rs, rollout_rs_threshold)
    ("token_k1", "0.5_2.0"), ("token_k1", "2.0"), ("token_k1", 1.5), ("token_k2", "0.05"), ("token_k2", 0.5),
    ("token_k3", "0.02"), ("seq_sum_k1", "0.2_5.0"), ("seq_sum_k1", "3.0"), ("seq_sum_k2", "0.5"),
    ("seq_sum_k3", "0.3"), ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", "0.01"), ("seq_mean_k3", "0.01"),
    ("seq_max_k2", "0.2"), ("seq_max_k3", "0.1"),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.02"), ("token_k2,seq_max_k2", "0.3"),
    (" token_k3 , seq_sum_k2 ,", "0.1, 1.0"), ("token_k3,token_k3", "0.05"),
    ("seq_sum_k1,seq_mean_k1,token_k1", "2.0"), ("seq_max_k3,seq_mean_k2,token_k2", "0.2,0.02,0.1"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verl", required=True, help="a verl git repository or directory tree holding " + VERL_COMMIT)
    parser.add_argument("--out", default=os.path.join(HERE, "verl_rollout_correction"))
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    helper, core = load(args.verl, args.workdir or tempfile.mkdtemp(prefix="mrr-rollout-correction-"))
    gen = torch.Generator().manual_seed(args.seed)
    tolerance = {"rtol": 1e-9, "atol": 1e-12}

    correction = []
    shapes = [(8, 24, 0.3, False, False), (6, 20, 0.05, True, False), (5, 16, 1.0, False, True)]
    for n, (rs, threshold) in enumerate(RS_PLANS):
        for rows, cols, sigma, empty_row, extreme in shapes:
            mask = draw_mask(gen, rows, cols, empty_row)
            log_ratio = draw_log_ratio(gen, rows, cols, sigma, extreme)
            modified, metrics = helper.compute_rollout_rejection_mask(log_ratio, mask, rs, threshold)
            outputs = {"response_mask": tensor(modified)}
            outputs.update({"metric:" + k: float(v) for k, v in metrics.items()})
            name = f"rs_{rs.strip().replace(' ', '').replace(',', '+').strip('+')}_{threshold}_B{rows}_L{cols}_s{sigma}"
            name += ("_emptyrow" if empty_row else "") + ("_extreme" if extreme else "") + f"_{n}"
            correction.append({"name": name, "fn": "rollout_rejection_mask",
                               "params": {"rollout_rs": rs, "rollout_rs_threshold": threshold},
                               "inputs": {"log_ratio": tensor(log_ratio), "response_mask": tensor(mask)},
                               "outputs": outputs, "tolerance": tolerance})
    for rows, cols in ((1, 1), (64, 512)):  # one token; a real micro-batch
        mask = draw_mask(gen, rows, cols, rows > 1)
        log_ratio = draw_log_ratio(gen, rows, cols, 0.1, rows > 1)
        rs, threshold = "token_k1,seq_mean_k3,seq_max_k2", "0.5_2.0,0.005,2.0"
        modified, metrics = helper.compute_rollout_rejection_mask(log_ratio, mask, rs, threshold)
        outputs = {"response_mask": tensor(modified)}
        outputs.update({"metric:" + k: float(v) for k, v in metrics.items()})
        correction.append({"name": f"rs_chain_B{rows}_L{cols}", "fn": "rollout_rejection_mask",
                           "params": {"rollout_rs": rs, "rollout_rs_threshold": threshold},
                           "inputs": {"log_ratio": tensor(log_ratio), "response_mask": tensor(mask)},
                           "outputs": outputs, "tolerance": tolerance})

    # IS weights, rejection and off-policy metrics together.
    combos = [
        ({"rollout_is": "token", "rollout_is_threshold": 2.0}, None, None),
        ({"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True},
         "token_k3", "0.05"),
        ({"rollout_is": None}, "seq_mean_k1,token_k2", "0.8_1.25,0.1"),
        ({"rollout_is": "token", "rollout_is_threshold": "0.8_1.2", "rollout_is_batch_normalize": True},
         "seq_max_k3", "0.2"),
        ({"rollout_is": None}, None, None),
    ]
    for n, (is_params, rs, threshold) in enumerate(combos):
        for rows, cols, empty_row in ((8, 24, False), (6, 20, True)):
            mask = draw_mask(gen, rows, cols, empty_row)
            rollout = -torch.rand(rows, cols, generator=gen, dtype=DT) * 4 - 0.01
            old = rollout + torch.randn(rows, cols, generator=gen, dtype=DT) * 0.2
            kwargs = dict(is_params)
            weights, modified, metrics = helper.compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, rollout_rs=rs, rollout_rs_threshold=threshold, **kwargs)
            outputs = {"response_mask": tensor(modified)}
            if weights is not None:
                outputs["weights"] = tensor(weights.batch["rollout_is_weights"])
            outputs.update({"metric:" + k: float(v) for k, v in metrics.items()})
            params = {**is_params, "rollout_rs": rs, "rollout_rs_threshold": threshold}
            correction.append({"name": f"correction_{n}_B{rows}_L{cols}{'_emptyrow' if empty_row else ''}",
                               "fn": "rollout_correction_and_rejection_mask", "params": params,
                               "inputs": {"old_log_prob": tensor(old), "rollout_log_prob": tensor(rollout),
                                          "response_mask": tensor(mask)},
                               "outputs": outputs, "tolerance": tolerance})

    # bypass_mode: old_log_prob is the rollout's.
    losses = []
    modes = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    corrections = [
        {"rollout_is": None, "rollout_rs": None},
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None},
        {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True,
         "rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.4"},
        {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "rollout_rs": "seq_mean_k3,token_k2",
         "rollout_rs_threshold": "0.02,0.08"},
    ]
    plans = []
    for loss_type in ("ppo_clip", "reinforce"):
        for k, corr in enumerate(corrections):
            plans.append((loss_type, corr, modes[k % len(modes)], {}))
        for mode in modes:
            plans.append((loss_type, corrections[3], mode, {}))
    plans.append(("reinforce", corrections[2], "token-mean", {"dp_size": 4, "batch_num_tokens": 300}))
    plans.append(("ppo_clip", corrections[1], "seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 16}))
    for n, (loss_type, corr, mode, info) in enumerate(plans):
        rows, cols = 6, 20
        mask = draw_mask(gen, rows, cols, n % 3 == 0)
        old = -torch.rand(rows, cols, generator=gen, dtype=DT) * 4 - 0.01
        log_prob = (old + torch.randn(rows, cols, generator=gen, dtype=DT) * 0.15).requires_grad_(True)
        advantages = torch.randn(rows, 1, generator=gen, dtype=DT).expand(rows, cols).clone() * mask
        rc = {"loss_type": loss_type, **corr}
        policy = Namespace(loss_mode="bypass_mode", rollout_correction=rc)
        clip = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
        config = Namespace(policy_loss=policy, global_batch_info=dict(info), clip_ratio_c=3.0, **clip)
        loss, metrics = core.compute_policy_loss_bypass_mode(old, log_prob, advantages, mask, mode, config)
        loss.backward()
        outputs = {"loss": tensor(loss.detach().reshape(())), "grad_log_prob": tensor(log_prob.grad)}
        outputs.update({"metric:" + k: float(v) for k, v in metrics.items()})
        params = {"policy_loss": "bypass_mode", "loss_agg_mode": mode, **clip, **info,
                  **{"rollout_correction." + k: v for k, v in rc.items()}}
        losses.append({"name": f"bypass_{loss_type}_{mode}_{n}", "fn": "policy_loss", "params": params,
                       "inputs": {"old_log_prob": tensor(old), "log_prob": tensor(log_prob.detach()),
                                  "advantages": tensor(advantages), "response_mask": tensor(mask)},
                       "outputs": outputs, "tolerance": tolerance})

    meta = {"generator": "tests/ppo/rollout_correction_cases.py", "seed": args.seed,
            "references": f"{VERL_REPO}@{VERL_COMMIT[:8]}", "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    for family, cases, functions in (
            ("rollout_correction", correction, "verl.trainer.ppo.rollout_corr_helper.compute_rollout_rejection_mask, "
                                               "compute_rollout_correction_and_rejection_mask"),
            ("policy_loss", losses, "verl.trainer.ppo.core_algos.compute_policy_loss_bypass_mode")):
        path = os.path.join(args.out, family + ".json")
        with open(path, "w") as f:
            json.dump({"meta": {**meta, "functions": functions}, "family": family, "cases": cases}, f,
                      separators=(",", ":"))
        print(f"rollout_correction_cases: wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
