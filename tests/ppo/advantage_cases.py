#!/usr/bin/env python3
"""More GRPO and RLOO cases for advantage.json, computed with PyTorch the way verl computes them.

The vendored tests/golden/advantage.json has groups of at most four responses, whose torch.mean is
a plain running sum. verl's group statistics are torch.mean and torch.std of a group's stacked
scores, and torch sums eight or more values in another order (its vectorised CPU kernel), so a
group of equal scores such as 0.1 or 0.7 has a mean a rounding away from them, which GRPO's
std + epsilon scales by 1 / epsilon into advantages. This script first recomputes every vendored
grpo and rloo case from its inputs and requires its outputs within the case's tolerance (that is
what shows it computes what the reference did), then writes cases with groups of 2 to 300
responses, groups whose scores are all equal (0.1, 0.3, 0.7, 1/3, 2.5), interleaved and singleton
groups. test_ppo runs them with MRR_GOLDEN_DIR pointing at the output folder
(ctest test_ppo.generated).

verl's semantics (verl/trainer/ppo/core_algos.py, grpo and rloo outcome advantages), float64:
scores are the rows' sums; grpo: a singleton group has mean 0 and std 1, else torch.mean and
torch.std of the group's scores; (score - mean) / (std + epsilon), or score - mean without the
std; rloo: a singleton keeps its score, else score n / (n - 1) - mean n / (n - 1); both broadcast
over the response mask.

  advantage_cases.py --check VENDORED.json --out DIR [--seed N]
"""
import argparse
import json
import os
import sys

import torch

DT = torch.float64


def groups_of(index):
    groups = {}
    for i, label in enumerate(index):
        groups.setdefault(label, []).append(i)
    return groups


def outcome(fn, rewards, mask, index, params):
    scores = rewards.sum(dim=-1)
    out = scores.clone()
    for members in groups_of(index).values():
        group = torch.stack([scores[i] for i in members])
        if fn == "grpo":
            if len(members) == 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)  # float32, as verl's
            else:
                mean, std = torch.mean(group), torch.std(group)
            for i in members:
                if params["norm_adv_by_std_in_grpo"]:
                    out[i] = (scores[i] - mean) / (std + params["epsilon"])
                else:
                    out[i] = scores[i] - mean
        else:  # rloo
            if len(members) == 1:
                continue
            n = len(members)
            mean = torch.mean(group)
            for i in members:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    adv = out.unsqueeze(-1) * mask
    return {"advantages": adv, "returns": adv}


def tensor(t):
    return {"shape": list(t.shape), "data": t.reshape(-1).tolist()}


def from_json(t):
    return torch.tensor(t["data"], dtype=DT).reshape(t["shape"])


def check(path):
    with open(path) as f:
        cases = [c for c in json.load(f)["cases"] if c["fn"] in ("grpo", "rloo")]
    if not cases:
        sys.exit(f"{path}: no grpo or rloo cases to check the generator against")
    for c in cases:
        got = outcome(c["fn"], from_json(c["inputs"]["token_level_rewards"]), from_json(c["inputs"]["response_mask"]),
                      c["inputs"]["index"], c.get("params", {}))
        tol = c["tolerance"]
        for key, value in got.items():
            want = from_json(c["outputs"][key])
            if not torch.allclose(value, want, rtol=tol["rtol"], atol=tol["atol"]):
                sys.exit(f"{path}: case {c['name']}: {key} differs from the vendored output; the generator is wrong")
    print(f"{path}: the generator reproduces {len(cases)} vendored grpo / rloo cases")


def case(fn, name, rewards, mask, index, params):
    outputs = outcome(fn, rewards, mask, index, params)
    return {"name": name, "fn": fn, "params": params,
            "inputs": {"token_level_rewards": tensor(rewards), "response_mask": tensor(mask), "index": index},
            "outputs": {k: tensor(v) for k, v in outputs.items()}, "tolerance": {"rtol": 1e-9, "atol": 1e-12}}


def batch(gen, sizes, equal_values, length=9):
    """Rows of groups of the given sizes, interleaved; a group with an equal value has that score
    on every member (the reward on the last real token, zeros before it)."""
    labels = []
    for g, n in enumerate(sizes):
        labels += [100 + 7 * g] * n
    order = torch.randperm(len(labels), generator=gen).tolist()
    index = [labels[i] for i in order]
    rows = len(index)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(DT)
    rewards = torch.zeros(rows, length, dtype=DT)
    value_of = {100 + 7 * g: v for g, v in enumerate(equal_values)}
    for r in range(rows):
        last = int(lengths[r]) - 1
        v = value_of.get(index[r])
        rewards[r, last] = v if v is not None else float(torch.randn((), generator=gen, dtype=DT))
    return rewards, mask, index


def generate(seed):
    gen = torch.Generator().manual_seed(seed)
    equal = [0.1, 0.3, 0.7, 1.0 / 3.0, 2.5]
    shapes = {
        "equal_groups_2_to_12": ([2, 3, 5, 7, 8, 9, 12, 1], equal),
        "equal_groups_16_17_33": ([16, 17, 33, 4], [0.1, 0.7, 0.3]),
        "long_groups_64_300": ([64, 300, 2], [0.7]),
        "random_groups_5_to_40": ([5, 8, 13, 21, 40, 1], []),
    }
    cases = []
    for tag, (sizes, values) in shapes.items():
        rewards, mask, index = batch(gen, sizes, values)
        for norm in (True, False):
            params = {"norm_adv_by_std_in_grpo": norm, "epsilon": 1e-6}
            cases.append(case("grpo", f"grpo_{tag}_norm{int(norm)}", rewards, mask, index, params))
        cases.append(case("rloo", f"rloo_{tag}", rewards, mask, index, {}))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", required=True, help="the vendored advantage.json")
    parser.add_argument("--out", required=True, help="folder for the generated advantage.json")
    parser.add_argument("--seed", type=int, default=19)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)  # verl's singleton placeholders are float32 tensors
    check(args.check)
    os.makedirs(args.out, exist_ok=True)
    cases = generate(args.seed)
    meta = {"generator": "tests/ppo/advantage_cases.py", "seed": args.seed, "torch": torch.__version__}
    with open(os.path.join(args.out, "advantage.json"), "w") as f:
        json.dump({"meta": meta, "family": "advantage", "cases": cases}, f)
    print(f"wrote {len(cases)} cases to {args.out}/advantage.json")


if __name__ == "__main__":
    main()
