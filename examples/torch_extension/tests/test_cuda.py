"""The extension on CUDA tensors (mrr/torch/cuda.hpp through cuda_router.cu): the device router
on torch's current stream, its backward, replay through the controller with ids crossing to the
host store, and errors. Skipped unless torch sees a GPU and the extension was built with CUDA
(mrr_torch.load() does that where nvcc is found)."""

import gc

import numpy as np
import pytest
import torch

E, L, K = 64, 2, 6


@pytest.fixture
def mt(mt):
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible to torch")
    if not mt.extension().has_cuda:
        pytest.skip("the extension was built without CUDA (no nvcc, or MRR_TORCH_CUDA=0)")
    return mt


def reference_weights(logits, ids, pre_softmax):
    """The pure-torch formula (as in test_extension.py)."""
    if pre_softmax:
        w = torch.softmax(logits, dim=-1).gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits.gather(1, ids), dim=-1)


def distinct_ids(rows, generator, num_experts=E, k=K):
    return torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(rows)])


ROUTERS = {
    "softmax_pre": dict(pre_softmax=True, normalize_topk=True),
    "softmax_post": dict(),
    "sigmoid_grouped_scaled": dict(
        score_function="sigmoid", normalize_topk=True, scaling_factor=2.5, num_groups=8, group_topk=3
    ),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_cuda_route_equals_cpu_router(mt, name):
    g = torch.Generator().manual_seed(11)
    router = mt.Router(E, K, **ROUTERS[name])
    logits = torch.randn(2000, E, generator=g)
    w_cpu, ids_cpu = router.route(logits)
    w, ids = router.route(logits.cuda())
    assert ids.is_cuda and w.is_cuda and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ids_cpu)
    assert torch.allclose(w.cpu(), w_cpu, atol=1e-6, rtol=0)
    # Replaying what was chosen gives the same weights.
    w2, ids2 = router.replay(logits.cuda(), ids)
    assert torch.equal(ids2, ids) and torch.allclose(w2, w, atol=1e-6, rtol=0)


def test_cuda_padded_rows_are_read_in_place(mt):
    g = torch.Generator().manual_seed(12)
    router = mt.Router(E, K, pre_softmax=True)
    big = torch.randn(300, E + 7, generator=g).cuda()
    view = big[:, :E]  # row stride E + 7: no copy is made
    assert not view.is_contiguous()
    _, ids = router.route(view)
    assert torch.equal(ids, router.route(view.contiguous())[1])


@pytest.mark.parametrize("pre_softmax", [True, False])
@pytest.mark.parametrize("replayed", [False, True])
def test_cuda_gradient_matches_torch_autograd(mt, pre_softmax, replayed):
    g = torch.Generator().manual_seed(5)
    T = 512
    router = mt.Router(E, K, pre_softmax=pre_softmax, normalize_topk=pre_softmax or None)
    base = torch.randn(T, E, generator=g).cuda()
    upstream = torch.randn(T, K, generator=g).cuda()
    z = base.clone().requires_grad_(True)
    if replayed:
        given = distinct_ids(T, g).cuda()
        weights, ids = router.replay(z, given)
        assert torch.equal(ids, given)
    else:
        weights, ids = router.route(z)
        assert torch.equal(ids, torch.topk(base, K).indices)
    (weights * upstream).sum().backward()
    assert z.grad.is_cuda

    z_ref = base.clone().requires_grad_(True)
    w_ref = reference_weights(z_ref, ids, pre_softmax)
    (w_ref * upstream).sum().backward()
    assert torch.allclose(weights, w_ref, atol=1e-6, rtol=0)
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-6, rtol=0)
    assert z.grad.abs().max() > 1e-3

    # The CPU router's backward on the same ids: the same gradient.
    z_cpu = base.cpu().requires_grad_(True)
    w_cpu, _ = router.replay(z_cpu, ids.cpu())
    (w_cpu * upstream.cpu()).sum().backward()
    assert torch.allclose(z.grad.cpu(), z_cpu.grad, atol=1e-6, rtol=0)


def test_cuda_bf16_logits(mt):
    g = torch.Generator().manual_seed(6)
    router = mt.Router(E, K, pre_softmax=True, normalize_topk=True)
    z = torch.randn(256, E, generator=g).cuda().to(torch.bfloat16).requires_grad_(True)
    weights, ids = router.route(z)
    assert weights.dtype == torch.float32
    w_cpu, ids_cpu = router.route(z.detach().float().cpu())  # the same values, widened
    assert torch.equal(ids.cpu(), ids_cpu) and torch.allclose(weights.cpu(), w_cpu, atol=1e-6, rtol=0)
    upstream = torch.randn(256, K, generator=g).cuda()
    (weights * upstream).sum().backward()
    assert z.grad.dtype == torch.bfloat16
    z_ref = z.detach().float().requires_grad_(True)
    (reference_weights(z_ref, ids, True) * upstream).sum().backward()
    assert torch.allclose(z.grad.float(), z_ref.grad, atol=1e-2, rtol=1e-2)  # bf16 rounding of the gradient


def test_cuda_runs_on_the_current_stream(mt):
    g = torch.Generator().manual_seed(7)
    router = mt.Router(E, K, pre_softmax=True)
    base = torch.randn(4096, E, generator=g).cuda()
    logits = torch.zeros_like(base)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()  # torch's pool streams do not wait for the legacy default stream
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # keep the side stream busy (tens of ms)...
        logits.copy_(base)  # ...so the logits are written late, and only on `side`
        weights, ids = router.route(logits)
        upstream = torch.ones_like(weights)
        z = logits.clone().requires_grad_(True)
        w2, _ = router.route(z)
        (w2 * upstream).sum().backward()
    side.synchronize()
    # A call on another stream would have read the zeros (ties: experts 0..k-1 in every row).
    assert torch.equal(ids, torch.topk(base, K).indices)
    assert torch.allclose(z.grad, _softmax_pre_grad(base, ids), atol=1e-6, rtol=0)


def _softmax_pre_grad(base, ids):
    """d sum(weights) / d logits for pre_softmax without renormalisation (autograd, same device)."""
    z = base.clone().requires_grad_(True)
    torch.softmax(z, dim=-1).gather(1, ids).sum().backward()
    return z.grad


def test_cuda_bad_rows_raise_the_cpu_routers_errors(mt):
    router = mt.Router(8, 2)
    logits = torch.randn(3, 8).cuda()
    for dtype in (torch.int64, torch.int32):
        ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=dtype).cuda()
        assert torch.equal(router.replay(logits, ids)[1].cpu(), ids.cpu().long())
    wrapped = torch.tensor([[0, 1], [2**32 + 3, 4], [5, 6]]).cuda()
    with pytest.raises(mt.InvalidArgumentError, match="4294967299"):
        router.replay(logits, wrapped)
    with pytest.raises(mt.InvalidArgumentError, match="row 2"):
        router.replay(logits, torch.tensor([[0, 1], [2, 3], [5, 5]]).cuda())  # expert 5 twice
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(mt.InvalidArgumentError, match="row 1"):
        router.route(bad)
    with pytest.raises(mt.InvalidArgumentError, match="'ids' is on cpu"):
        router.replay(logits, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    with pytest.raises(mt.InvalidArgumentError, match="dtype"):
        router.route(logits.double())
    for check in (True, False):  # the fused kernel never reads a row as if it had 8 columns
        with pytest.raises(mt.InvalidArgumentError, match=r"expected \[3, 8\]"):
            router.route(torch.randn(3, 5).cuda(), check=check)


def test_cuda_router_may_be_dropped_before_backward(mt):
    g = torch.Generator().manual_seed(9)
    base, upstream = torch.randn(64, E, generator=g).cuda(), torch.randn(64, K, generator=g).cuda()
    z = base.clone().requires_grad_(True)
    router = mt.Router(E, K, pre_softmax=True, normalize_topk=True)
    weights, ids = router.route(z)
    del router
    gc.collect()
    (weights * upstream).sum().backward()
    z_ref = base.clone().requires_grad_(True)
    (reference_weights(z_ref, ids, True) * upstream).sum().backward()
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("store_kind", ["memory", "file"])
def test_cuda_r2_record_then_replay_through_the_controller(mt, store_kind, tmp_path):
    g = torch.Generator().manual_seed(13)
    router = mt.Router(E, K, pre_softmax=True, normalize_topk=True)
    config = {"mode": "R2"}
    if store_kind == "file":
        config["record_file"] = str(tmp_path / "routes.mrr")
    store = mt.open_route_file(config, E, L, K)
    replay = mt.Replay(store)

    uids = torch.tensor([7, 8, 9])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])  # 10 real tokens, 5 padding
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_padded(uids, mask)
    recorded = []
    for layer in range(L):
        logits = torch.randn(15, E, generator=g).cuda()
        logits[mask.flatten().cuda() == 0] = float("nan")  # uninitialised padding
        _, ids = replay.route(router, layer, logits)
        real = mask.flatten().bool().cuda()
        assert torch.equal(ids[real], torch.topk(torch.softmax(logits[real], -1), K).indices)
        recorded.append(ids[real].cpu())
    assert replay.stats()["recorded_rows"] == L * 10
    if store_kind == "file":
        store.close()
        store = mt.open_route_file({"mode": "R2", "replay_file": config["record_file"]}, E, L, K)
        replay = mt.Replay(store)

    # The update: the same tokens packed without padding, logits moved on; replay gives the recorded ids.
    replay.begin_pass("actor_update")
    replay.set_micro_batch_packed(uids, torch.tensor([0, 3, 8, 10]), torch.tensor([0, 0, 0]))
    for layer in range(L):
        z = (torch.randn(10, E, generator=g) * 3).cuda().requires_grad_(True)
        weights, ids = replay.route(router, layer, z)
        assert ids.is_cuda and torch.equal(ids.cpu(), recorded[layer])
        assert not torch.equal(ids, torch.topk(z.detach(), K).indices)  # the native choice moved away
        (weights * torch.arange(K, device="cuda")).sum().backward()
        z_ref = z.detach().clone().requires_grad_(True)
        (reference_weights(z_ref, ids, True) * torch.arange(K, device="cuda")).sum().backward()
        assert torch.allclose(weights, reference_weights(z.detach(), ids, True), atol=1e-6, rtol=0)
        assert torch.allclose(z.grad, z_ref.grad, atol=1e-6, rtol=0)
    assert replay.stats()["replayed_rows"] == L * 10 and replay.stats()["mask_free_replays"] == L


def test_cuda_r3_vllm_routes_last_token_native(mt):
    g = torch.Generator().manual_seed(14)
    n, uid = 9, 77
    logits = [torch.randn(n, E, generator=g) for _ in range(L)]
    routed = torch.stack([torch.topk(lg[: n - 1], K, largest=False).indices for lg in logits], dim=1)
    store = mt.open_route_file({"mode": "R3", "enable_rollout_routing_replay": True}, E, L, K)
    store.import_vllm(uid, routed.numpy().astype(np.uint8))
    router = mt.Router(E, K)
    replay = mt.Replay(store)
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_padded(torch.tensor([uid]), torch.ones(1, n, dtype=torch.int64))
    for layer in range(L):
        _, ids = replay.route(router, layer, logits[layer].cuda())
        assert torch.equal(ids[: n - 1].cpu(), routed[:, layer])
        assert torch.equal(ids[n - 1].cpu(), torch.topk(logits[layer][n - 1], K).indices)
    assert replay.stats()["native_rows"] == L


def test_cuda_megatron_router_replay_with_cuda_scores(mt, tmp_path):
    RouterReplay, Action = mt.RouterReplay, mt.RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()
    try:
        g = torch.Generator().manual_seed(15)
        layers = [RouterReplay() for _ in range(L)]
        RouterReplay.set_global_router_replay_action(Action.RECORD)
        topk = lambda s, k, num_groups=None, group_topk=None: torch.topk(s, k, dim=-1)  # noqa: E731
        for layer in layers:
            layer.get_replay_topk(torch.softmax(torch.randn(12, E, generator=g), -1).cuda(), K, default_compute_topk=topk)
        recorded = RouterReplay.get_recorded_data()
        assert all(r.is_cuda for r in recorded)
        uids, positions = torch.full((12,), 5), torch.arange(12)
        path = tmp_path / "megatron.mrr"
        f = mt.open_route_file({"mode": "R2", "record_file": str(path)}, E, L, K)
        RouterReplay.save_recorded(f, uids, positions)
        f.close()
        RouterReplay.clear_global_indices()
        RouterReplay.load_replay_data(mt.open_route_file({"mode": "R2", "replay_file": str(path)}, E, L, K), uids, positions)
        RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
        for layer, ids in zip(layers, recorded):
            scores = torch.softmax(torch.randn(12, E, generator=g), -1).cuda()
            probs, top = layer.get_replay_topk(scores, K)
            assert top.is_cuda and torch.equal(top, ids)
            assert torch.equal(probs, scores.gather(1, ids))
    finally:
        RouterReplay.clear_global_router_replay_instances()


def test_cuda_check_false_hands_back_the_row_status(mt):
    router = mt.Router(8, 2)
    logits = torch.randn(5, 8).cuda()
    logits[3, 1] = float("nan")
    weights, ids, status = router.route(logits, check=False)  # no error, nothing waited for
    assert status.is_cuda and status.dtype == torch.uint8
    assert status.cpu().tolist()[:3] == [0, 0, 0] and status[3] != 0 and status[4] == 0
    good = torch.tensor([[0, 1]] * 5).cuda()
    _, _, status = router.replay(logits[[0, 1, 2, 4]], good[:4], check=False)
    assert not bool(status.any())
    with pytest.raises(mt.InvalidArgumentError, match="row 3"):
        router.route(logits)  # check=True (the default) raises


def test_cuda_deepseek_v3_with_expert_bias(mt):
    """DeepSeek-V3's gate (256 experts, 8 groups keep 4, top-8, sigmoid + correction bias) on CUDA
    logits: the fused segment kernel reads the bias from the device router. The device's and the
    host's exp differ in the last bit, so a near-tie may resolve otherwise in a few rows (as the C++
    tests allow); weights agree where the ids do. A bias set after the first CUDA call reaches the
    GPU too."""
    g = torch.Generator().manual_seed(5)
    router = mt.Router(256, 8, score_function="sigmoid", normalize_topk=True, scaling_factor=2.5, num_groups=8,
                       group_topk=4, use_expert_bias=True)
    logits = torch.randn(4000, 256, generator=g)
    router.route(logits.cuda())  # the CUDA router exists before the bias is set
    bias = 0.05 * torch.randn(256, generator=g)
    router.set_expert_bias(bias.cuda())
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        w_cpu, ids_cpu = router.route(x.float())
        w, ids = router.route(x.cuda())
        same = (ids.cpu() == ids_cpu).all(dim=1)
        assert int(same.sum()) >= 0.99 * len(same)
        assert torch.allclose(w.cpu()[same], w_cpu[same], atol=1e-5, rtol=0)
    # The bias is what moved the selection (fp32 logits, with and without it).
    biased = router.route(logits.cuda())[1]
    router.set_expert_bias(torch.zeros(256))
    assert not torch.equal(router.route(logits.cuda())[1], biased)
