#!/usr/bin/env python3
"""Cases of verl's optimal token baseline (single- and multi-turn) and GDPO, computed by verl.

The vendored tests/golden/advantage.json has no case of these three advantage estimators, so this
script runs verl's own compute_optimal_token_baseline_advantage,
compute_multi_turn_optimal_token_baseline_advantage and compute_gdpo_outcome_advantage
(verl/trainer/ppo/core_algos.py at the golden vectors' commit, verl-project/verl 1dda039b) on new
inputs on the CPU and writes them in the golden format (tests/golden/README.md) to
tests/ppo/verl_token_baseline/advantage.json, which is committed: the ctest
test_ppo.token_baseline runs test_ppo's advantage golden test on it (MRR_GOLDEN_DIR pointing
there), so a clone needs neither verl nor this script.

Inputs are physical: each token's old log-probability and sum_pi_squared come from a random
softmax over a small vocabulary (sum_pi_squared by verl's calculate_sum_pi_squared_from_logits;
four cases carry the logits, so the test also checks mrr's sum_pi_squared_from_logits).
They cover outcome and dense rewards, padded tails, multi-turn masks with observation spans,
empty responses, singleton, interleaved and unequal groups, a unique and a shared longest
response (handle_zero_tail), rollout IS weights, handle_zero_tail off, another epsilon, groups of
up to 24 responses and a 32 x 256 batch. Everything is float64, with tolerance rtol 1e-9.

GDPO: without reward components verl normalises the summed token rewards (float64 here). With
components (verl's gdpo_reward_keys) verl casts each component's scores to float32 and computes
the group statistics, the weighted sum and the whitening in float32; mrr computes in the caller's
type (docs/ppo.md, deliberate difference 12). Those cases draw float32-exact scores (binary,
halves and uniform) and carry the reference's float32 precision as their tolerance (rtol 1e-5,
atol 1e-5), stated in the case; the test in float holds every case to its float tolerance.

  token_baseline_cases.py --verl SRC [--out DIR] [--seed N]

SRC is a clone of https://github.com/verl-project/verl holding the commit (or a directory tree of
it); the files are extracted as bench/references/reference_bench.py extracts them.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cov_loss_cases import DT, VERL_COMMIT, VERL_REPO, Namespace, load_core_algos, tensor  # noqa: E402

EXACT = {"rtol": 1e-9, "atol": 1e-12}
FLOAT32_REFERENCE = {"rtol": 1e-5, "atol": 1e-5}


def right_padded(gen, rows, cols, empty_rows=(), lengths=None):
    if lengths is None:
        lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    lengths = torch.as_tensor(lengths)
    mask = (torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)).to(DT)
    for r in empty_rows:
        mask[r] = 0
    return mask


def multi_turn(gen, rows, cols, empty_rows=()):
    """Right-padded responses with observation spans (mask 0) between the model's turns."""
    mask = right_padded(gen, rows, cols, empty_rows)
    for r in range(rows):
        n = int(mask[r].sum())
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            if n < 4:
                break
            start = int(torch.randint(1, n - 1, (1,), generator=gen))
            width = int(torch.randint(1, max(2, n // 4), (1,), generator=gen))
            mask[r, start:min(start + width, n - 1)] = 0
    return mask


def policy(gen, core, rows, cols, vocab):
    """Old log-probs of sampled tokens and sum_pi_squared, from random logits (temperature 1)."""
    logits = torch.randn(rows * cols, vocab, generator=gen, dtype=DT) * (0.5 + 3 * torch.rand(rows * cols, 1,
                                                                                               generator=gen, dtype=DT))
    logp = torch.log_softmax(logits, dim=-1)
    token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    old = logp[torch.arange(rows * cols), token].reshape(rows, cols)
    spsq = core.verl_F.calculate_sum_pi_squared_from_logits(logits).reshape(rows, cols)
    return logits, old, spsq


def rewards_of(gen, mask, dense):
    rows, cols = mask.shape
    if dense:
        return torch.randn(rows, cols, generator=gen, dtype=DT) * 0.3 * mask
    out = torch.zeros(rows, cols, dtype=DT)
    for r in range(rows):
        valid = mask[r].nonzero().flatten()
        if len(valid):
            out[r, valid[-1]] = float(torch.randint(0, 2, (1,), generator=gen)) + 0.1 * float(
                torch.randn(1, generator=gen, dtype=DT))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verl", required=True, help="a verl git repository or directory tree holding " + VERL_COMMIT)
    parser.add_argument("--out", default=os.path.join(HERE, "verl_token_baseline"))
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    core = load_core_algos(args.verl, args.workdir or tempfile.mkdtemp(prefix="mrr-token-baseline-"))
    gen = torch.Generator().manual_seed(args.seed)
    cases = []

    # (name, index, mask kind, dense rewards, IS weights, handle_zero_tail, epsilon, lengths, empty rows)
    plans = [
        ("groups4", [0, 0, 0, 0, 1, 1, 1, 1], "padded", False, False, True, None, None, ()),
        ("groups4_dense", [0, 0, 0, 0, 1, 1, 1, 1], "padded", True, False, True, None, None, ()),
        ("interleaved_singleton", [3, 1, 3, 2, 1, 3, 1, 1, 3], "padded", True, False, True, None, None, ()),
        ("unique_longest", [0, 0, 0, 1, 1, 1], "padded", True, False, True, None, [20, 9, 5, 12, 12, 3], ()),
        ("shared_longest", [0, 0, 0, 1, 1, 1], "padded", True, False, True, None, [20, 20, 5, 4, 12, 12], ()),
        ("zero_tail_off", [0, 0, 0, 1, 1, 1], "padded", True, False, False, None, [20, 9, 5, 12, 7, 3], ()),
        ("is_weights", [0, 0, 0, 0, 1, 1, 1, 1], "padded", True, True, True, None, None, ()),
        ("empty_rows", [0, 0, 0, 1, 1, 1, 2, 2], "padded", True, False, True, None, None, (1, 6)),
        ("epsilon", [0, 0, 0, 0, 1, 1], "padded", False, False, True, 1e-3, None, ()),
        ("multi_turn", [0, 0, 0, 0, 1, 1, 1, 1], "multi_turn", True, False, True, None, None, ()),
        ("multi_turn_is", [0, 0, 0, 1, 1, 1, 2, 2, 2], "multi_turn", False, True, True, None, None, (4,)),
        ("multi_turn_zero_tail_off", [5, 5, 7, 7, 7, 9], "multi_turn", True, False, False, None, None, ()),
        ("group24", [0] * 24 + [1] * 17, "multi_turn", True, True, True, None, None, (3, 30)),
    ]
    for fn in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        run = (core.compute_optimal_token_baseline_advantage if fn == "optimal_token_baseline"
               else core.compute_multi_turn_optimal_token_baseline_advantage)
        for name, index, kind, dense, with_is, zero_tail, epsilon, lengths, empty in plans:
            rows, cols, vocab = len(index), 24 if lengths is None else max(lengths) + 3, 16
            if kind == "padded":
                mask = right_padded(gen, rows, cols, empty, lengths)
            else:
                mask = multi_turn(gen, rows, cols, empty)
            logits, old, spsq = policy(gen, core, rows, cols, vocab)
            rewards = rewards_of(gen, mask, dense)
            kwargs = {"handle_zero_tail": zero_tail}
            inputs = {"token_level_rewards": tensor(rewards), "response_mask": tensor(mask), "index": index,
                      "old_log_probs": tensor(old), "sum_pi_squared": tensor(spsq)}
            if name in ("groups4", "multi_turn"):
                inputs["logits"] = tensor(logits)
            if with_is:
                weights = torch.clamp(torch.exp(torch.randn(rows, cols, generator=gen, dtype=DT) * 0.3), max=2.0)
                kwargs["rollout_is_weights"] = weights
                inputs["rollout_is_weights"] = tensor(weights)
            if epsilon is not None:
                kwargs["epsilon"] = epsilon
            adv, ret = run(rewards, mask, np.array(index), old, spsq, **kwargs)
            params = {"handle_zero_tail": zero_tail, **({"epsilon": epsilon} if epsilon is not None else {})}
            cases.append({"name": f"{fn}_{name}_B{rows}_L{cols}", "fn": fn, "params": params, "inputs": inputs,
                          "outputs": {"advantages": tensor(adv), "returns": tensor(ret)}, "tolerance": EXACT})
        # A micro-batch: 8 prompts x 4 responses of up to 256 tokens (the unit tests go to 64 x 4096).
        rows, cols = 32, 256
        index = [r // 4 for r in range(rows)]
        mask = right_padded(gen, rows, cols) if fn == "optimal_token_baseline" else multi_turn(gen, rows, cols)
        _, old, spsq = policy(gen, core, rows, cols, 8)
        rewards = rewards_of(gen, mask, False)
        adv, ret = run(rewards, mask, np.array(index), old, spsq)
        cases.append({"name": f"{fn}_batch_B{rows}_L{cols}", "fn": fn, "params": {},
                      "inputs": {"token_level_rewards": tensor(rewards), "response_mask": tensor(mask),
                                 "index": index, "old_log_probs": tensor(old), "sum_pi_squared": tensor(spsq)},
                      "outputs": {"advantages": tensor(adv), "returns": tensor(ret)}, "tolerance": EXACT})

    # GDPO without components: the summed token rewards, float64.
    for n, (index, dense, norm, epsilon) in enumerate([
            ([0, 0, 0, 0, 1, 1, 1, 1], False, True, 1e-6), ([0, 0, 0, 0, 1, 1, 1, 1], True, False, 1e-6),
            ([2, 0, 2, 1, 0, 2, 1], True, True, 1e-3), (list(range(4)) * 5, False, True, 1e-6)]):
        rows, cols = len(index), 16
        mask = right_padded(gen, rows, cols)
        rewards = rewards_of(gen, mask, dense)
        adv, ret = core.compute_gdpo_outcome_advantage(rewards, mask, np.array(index), epsilon=epsilon,
                                                       norm_adv_by_std_in_grpo=norm)
        cases.append({"name": f"gdpo_summed_{n}_B{rows}", "fn": "gdpo",
                      "params": {"epsilon": epsilon, "norm_adv_by_std_in_grpo": norm},
                      "inputs": {"token_level_rewards": tensor(rewards), "response_mask": tensor(mask),
                                 "index": index},
                      "outputs": {"advantages": tensor(adv), "returns": tensor(ret)}, "tolerance": EXACT})

    # GDPO with reward components, as verl's trainer passes them (non_tensor_batch keys; the
    # response's attention mask gives the position verl writes each score at).
    for n, (index, kinds, weights, norm) in enumerate([
            ([0, 0, 0, 0, 1, 1, 1, 1], ["binary", "half"], None, True),
            ([0, 0, 0, 0, 1, 1, 1, 1], ["binary", "uniform"], [1.0, 0.5], True),
            ([1, 0, 1, 0, 1, 0, 2, 2, 2], ["uniform", "half", "binary"], [0.7, 0.2, 0.1], True),
            ([0, 0, 0, 1, 1, 1], ["binary", "uniform"], [2.0, 1.0], False),
            ([0] * 8 + [1] * 8, ["uniform"], None, True)]):
        rows, cols, prompt = len(index), 16, 4
        mask = right_padded(gen, rows, cols)
        components = []
        for kind in kinds:
            if kind == "binary":
                v = torch.randint(0, 2, (rows,), generator=gen).to(torch.float32)
            elif kind == "half":
                v = torch.randint(0, 3, (rows,), generator=gen).to(torch.float32) / 2
            else:
                v = torch.rand(rows, generator=gen, dtype=torch.float32)
            components.append(v.to(DT))
        keys = [f"r{k}" for k in range(len(kinds))]
        non_tensor = {key: components[k].numpy() for k, key in enumerate(keys)}
        batch = {"prompts": torch.zeros(rows, prompt, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], dim=1)}
        config = Namespace(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
        rewards = torch.zeros(rows, cols, dtype=DT)
        adv, ret = core.compute_gdpo_outcome_advantage(rewards, mask, np.array(index), norm_adv_by_std_in_grpo=norm,
                                                       config=config, non_tensor_batch=non_tensor, batch=batch)
        params = {"norm_adv_by_std_in_grpo": norm, **({"gdpo_reward_weights": weights} if weights else {}),
                  "note": "verl computes components in float32: the tolerance is the reference's precision"}
        cases.append({"name": f"gdpo_components_{'+'.join(kinds)}_{n}_B{rows}", "fn": "gdpo", "params": params,
                      "inputs": {"token_level_rewards": tensor(rewards), "response_mask": tensor(mask),
                                 "index": index, "reward_components": tensor(torch.stack(components))},
                      "outputs": {"advantages": tensor(adv.to(DT)), "returns": tensor(ret.to(DT))},
                      "tolerance": FLOAT32_REFERENCE})

    meta = {"generator": "tests/ppo/token_baseline_cases.py", "seed": args.seed,
            "references": f"{VERL_REPO}@{VERL_COMMIT[:8]}", "torch": torch.__version__,
            "functions": "verl.trainer.ppo.core_algos.compute_optimal_token_baseline_advantage, "
                         "compute_multi_turn_optimal_token_baseline_advantage, compute_gdpo_outcome_advantage; "
                         "verl.utils.torch_functional.calculate_sum_pi_squared_from_logits"}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "advantage.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "family": "advantage", "cases": cases}, f, separators=(",", ":"))
    print(f"token_baseline_cases: wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
