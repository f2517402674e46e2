#!/usr/bin/env python3
"""More moe_block.json cases, computed by PyTorch autograd the way the vendored ones are.

The vendored tests/golden/moe_block.json holds 23 small cases (E <= 32, k <= 8, expert counts that
are multiples of 4). This script first recomputes every vendored case from its inputs and requires
its outputs within the case's tolerance (ids exactly): that is what shows it computes what the
reference did. Then it writes the same kinds of cases (the same fn names, params, tolerances) at
shapes the vendored set has none of: one token, k = E, k = 1, expert counts that are not a multiple
of k (33 experts top-8, 25 top-6, 49 top-8), 128 experts, top-12. test_moe_golden runs them with
MRR_GOLDEN_DIR pointing at the output folder (ctest golden.moe_block_generated).

The block (Hugging Face Qwen2/Qwen3-MoE and Mixtral semantics, float64): logits = x W_g^T,
p = softmax(logits); top-k of p (or the given replay ids); weights p at those ids, renormalised when
norm_topk_prob; each expert computes w_down (silu(w_gate x) * (w_up x)); output = the weighted sum.
Gradients are of sum(output * grad_output).

  moe_block_cases.py --check VENDORED.json --out DIR [--seed N]
"""
import argparse
import json
import os
import sys

import torch

F = torch.nn.functional
DT = torch.float64


def block(x, gate_weight, w_gate, w_up, w_down, k, norm, replay_ids=None):
    logits = x @ gate_weight.T
    probs = F.softmax(logits, dim=-1, dtype=DT)
    if replay_ids is None:
        weights, ids = torch.topk(probs, k, dim=-1)  # sorted: descending
    else:
        ids = replay_ids
        weights = probs.gather(1, ids)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(gate_weight.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = (F.silu(h @ w_gate[e].T) * (h @ w_up[e].T)) @ w_down[e].T
        out = out.index_add(0, tok, y * weights[tok, slot, None])
    return logits, probs, ids, weights, out


def tensor(t):
    return {"shape": list(t.shape), "data": t.detach().reshape(-1).tolist()}


def from_json(t, dtype=DT):
    return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])


def evaluate(inputs, params):
    """Forward and backward of one case; returns the outputs by golden key."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("hidden", "gate_weight", "w_gate", "w_up", "w_down")}
    replay = inputs.get("replay_ids")
    logits, probs, ids, weights, out = block(leaves["hidden"], leaves["gate_weight"], leaves["w_gate"], leaves["w_up"],
                                             leaves["w_down"], params["topk"], params["norm_topk_prob"],
                                             None if replay is None else replay.long())
    (out * inputs["grad_output"]).sum().backward()
    result = {"router_logits": logits, "indices": ids, "weights": weights, "output": out}
    for name, leaf in leaves.items():
        result["grad_" + name] = leaf.grad
    return result, probs


def check_vendored(path):
    cases = json.load(open(path))["cases"]
    worst = 0.0
    for c in cases:
        inputs = {name: from_json(t) for name, t in c["inputs"].items()}
        got, _ = evaluate(inputs, c["params"])
        rtol, atol = c["tolerance"]["rtol"], c["tolerance"]["atol"]
        for name, want_json in c["outputs"].items():
            want = from_json(want_json)
            have = got[name].detach().to(DT)
            if name == "indices":
                if not torch.equal(have, want):
                    sys.exit(f"{c['name']}: indices differ from the vendored case")
                continue
            excess = ((have - want).abs() - (atol + rtol * want.abs())).max().item()
            if excess > 0:
                sys.exit(f"{c['name']} {name}: differs from the vendored case beyond its tolerance by {excess:.3g}")
            worst = max(worst, (have - want).abs().max().item())
    print(f"{len(cases)} vendored cases recomputed: ids equal, largest difference {worst:.3g}")


# (tokens, hidden, intermediate, experts, k): what the vendored set does not reach.
SHAPES = [
    (1, 8, 4, 4, 1),
    (7, 5, 3, 8, 8),
    (37, 6, 5, 12, 3),
    (64, 8, 6, 33, 8),
    (64, 8, 6, 25, 6),
    (64, 6, 4, 49, 8),
    (48, 6, 4, 64, 12),
    (40, 4, 3, 128, 2),
]
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def draw_case(family, tokens, hidden, inter, experts, k, replay, gen):
    norm = family != "qwen2_moe"
    while True:
        inputs = {
            "hidden": torch.randn(tokens, hidden, generator=gen, dtype=DT),
            "gate_weight": torch.randn(experts, hidden, generator=gen, dtype=DT) * 0.5,
            "w_gate": torch.randn(experts, inter, hidden, generator=gen, dtype=DT) * 0.3,
            "w_up": torch.randn(experts, inter, hidden, generator=gen, dtype=DT) * 0.3,
            "w_down": torch.randn(experts, hidden, inter, generator=gen, dtype=DT) * 0.3,
            "grad_output": torch.randn(tokens, hidden, generator=gen, dtype=DT),
        }
        if replay:
            inputs["replay_ids"] = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
        outputs, probs = evaluate(inputs, {"topk": k, "norm_topk_prob": norm})
        if replay or k == experts:
            break
        # No near-tie at the k-th choice: a last-bit difference in the gate GEMM must not decide it.
        top = torch.sort(probs, dim=-1, descending=True).values
        if ((top[:, k - 1] - top[:, k]) / top[:, k - 1]).min().item() > 1e-9:
            break
    name = f"{family}_T{tokens}_H{hidden}_I{inter}_E{experts}_k{k}" + ("_replay" if replay else "")
    return {
        "name": name,
        "fn": "moe_block_replay" if replay else "moe_block",
        "params": {"family": family, "num_experts": experts, "topk": k, "norm_topk_prob": norm,
                   "hidden_size": hidden, "intermediate_size": inter, "activation": "silu"},
        "inputs": {name: tensor(t) for name, t in inputs.items()},
        "outputs": {name: tensor(t) for name, t in outputs.items()},
        "tolerance": {"rtol": 1e-9, "atol": 1e-11},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", required=True, help="the vendored moe_block.json, recomputed first")
    parser.add_argument("--out", required=True, help="folder to write moe_block.json into")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    torch.set_num_threads(1)
    check_vendored(args.check)
    gen = torch.Generator().manual_seed(args.seed)
    cases = [draw_case(f, *shape, replay, gen) for shape in SHAPES for f in FAMILIES for replay in (False, True)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_block.json"), "w") as f:
        json.dump({"meta": {"generator": "tests/moe/moe_block_cases.py", "seed": args.seed, "torch": torch.__version__,
                            "semantics": "Hugging Face Qwen2/Qwen3-MoE and Mixtral sparse MoE blocks, float64"},
                   "family": "moe_block", "cases": cases}, f)
    print(f"{len(cases)} cases written to {args.out}/moe_block.json")


if __name__ == "__main__":
    main()
