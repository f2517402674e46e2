"""The mrr torch extension end to end: replay across re-packed micro-batches, rollout imports
(vLLM, SGLang), gradients against torch autograd, error types, route files read by the numpy
reader, and the Megatron-compatible RouterReplay."""

import base64
import gc
import importlib
import sys

import numpy as np
import pytest
import torch

E, L, K = 8, 2, 2  # experts, MoE layers, experts per token


def memory_store(mt, mode="R2", **extra):
    config = {"mode": mode, **extra}
    if mode == "R3":
        config.setdefault("enable_rollout_routing_replay", True)
    return mt.open_route_file(config, E, L, K)


def distinct_ids(rows, generator, num_experts=E, k=K):
    """Random expert ids [rows, k], no expert twice in a row (int64)."""
    return torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(rows)])


def worst_ids(logits, k=K):
    """The k lowest-scoring experts of each row: never what native top-k picks."""
    return torch.topk(logits, k, largest=False).indices


# --- (1) R2: record in old_log_prob, replay through a re-packed, reordered micro-batch ----------


def test_r2_round_trip_repacked_and_reordered(mt):
    g = torch.Generator().manual_seed(1)
    router = mt.Router(E, K)
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    assert replay.mode == "R2" and not store.is_file

    # Padded [3, 6]: sequence 101 is left-padded (4 tokens), 102 full (6), 103 right-padded (3).
    uids = torch.tensor([101, 102, 103])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    replay.begin_pass("old_log_prob")
    assert replay.action == "record"
    replay.set_micro_batch_padded(uids, mask)
    recorded = {}  # (layer, uid, position) -> ids
    for layer in range(L):
        logits = torch.randn(18, E, generator=g)
        _, ids = router.route(logits)
        _, rec_ids = replay.route(router, layer, logits)
        assert torch.equal(rec_ids, ids)
        for b in range(3):
            pos = 0
            for s in range(6):
                if mask[b, s]:
                    recorded[(layer, int(uids[b]), pos)] = rec_ids[b * 6 + s]
                    pos += 1
    assert len(recorded) == L * 13
    assert replay.stats()["recorded_rows"] == L * 13

    # Packed: 103 first, then 101's positions 2..3, 102 whole, 101's positions 0..1, 2 padding rows.
    p_uids = torch.tensor([103, 101, 102, 101])
    first = torch.tensor([0, 2, 0, 0])
    lengths = [3, 2, 6, 2]
    cu = torch.tensor([0, 3, 5, 11, 13])
    keys = [(int(u), int(f) + i) for u, f, n in zip(p_uids, first, lengths) for i in range(n)]
    replay.begin_pass("actor_update")
    assert replay.action == "replay_forward"
    replay.set_micro_batch_packed(p_uids, cu, first, total_rows=15)
    changed = 0
    for layer in range(L):
        logits = torch.randn(15, E, generator=g)  # the policy moved: other logits
        weights, ids = replay.route(router, layer, logits)
        assert ids.dtype == torch.int64 and ids.shape == (15, K)
        for row, (uid, pos) in enumerate(keys):
            assert torch.equal(ids[row], recorded[(layer, uid, pos)]), (layer, uid, pos)
        native = router.route(logits)[1][:13]
        changed += int((native != ids[:13]).any(dim=1).sum())
        # The weights are the current logits' weights of the replayed experts.
        expected, _ = router.replay(logits[:13], ids[:13])
        assert torch.allclose(weights[:13], expected, atol=0, rtol=0)
    assert changed > 0, "the new logits route differently, so the test shows replay at work"
    assert replay.stats()["replayed_rows"] == L * 13


def test_recompute_queue_is_fifo(mt):
    g = torch.Generator().manual_seed(2)
    router = mt.Router(E, K)
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    replay.set_activation_recompute(True)
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_packed(torch.tensor([7]), torch.tensor([0, 4]))
    rec = replay.route(router, 0, torch.randn(4, E, generator=g))[1]
    replay.begin_pass("actor_update")
    replay.route(router, 0, torch.randn(4, E, generator=g))
    assert replay.queued(0) == 1
    replay.begin_pass("actor_recompute")
    assert replay.action == "replay_backward"
    assert torch.equal(replay.route(router, 0, torch.randn(4, E, generator=g))[1], rec)
    assert replay.queued(0) == 0
    with pytest.raises(mt.RouteStoreError, match="no queued routes"):
        replay.route(router, 0, torch.randn(4, E, generator=g))


def test_revert_route_after_a_failed_forward(mt):
    # The trainer's layer fails after routing: revert_route drops the ids the update forward
    # queued, and gives a failed recompute's ids back for its retry.
    g = torch.Generator().manual_seed(3)
    router = mt.Router(E, K)
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    replay.set_activation_recompute(True)
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_packed(torch.tensor([7, 8]), torch.tensor([0, 4, 8]))
    rec = replay.route(router, 0, torch.randn(8, E, generator=g))[1]
    replay.begin_pass("actor_update")
    replay.route(router, 0, torch.randn(8, E, generator=g))
    replay.revert_route(0)  # that forward failed later: its ids must not be recomputed with
    assert replay.queued(0) == 0
    replay.route(router, 0, torch.randn(8, E, generator=g))
    assert replay.queued(0) == 1
    replay.begin_pass("actor_recompute")
    replay.route(router, 0, torch.randn(8, E, generator=g))
    replay.revert_route(0)  # the recompute failed after routing: its ids come back
    assert replay.queued(0) == 1
    replay.revert_route(0)  # nothing left to undo
    assert replay.queued(0) == 1
    assert torch.equal(replay.route(router, 0, torch.randn(8, E, generator=g))[1], rec)
    assert replay.queued(0) == 0


# --- (2) R3: vLLM's routed_experts [n - 1, layers, k], last token native ----------------------


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.uint16, np.int64, "torch.int32"])
def test_vllm_import_r3_last_token_native(mt, dtype):
    g = torch.Generator().manual_seed(3)
    n, uid = 6, 42
    logits = [torch.randn(n, E, generator=g) for _ in range(L)]
    # Rollout routes that disagree with the trainer's own top-k on every token.
    routed = torch.stack([worst_ids(logits[layer][: n - 1]) for layer in range(L)], dim=1)  # [n-1, L, k]
    array = routed.to(torch.int32) if dtype == "torch.int32" else routed.numpy().astype(dtype)
    store = memory_store(mt, "R3")
    store.import_vllm(uid, array)
    assert store.contains(uid) and store.recorded_positions(uid) == n - 1

    router = mt.Router(E, K)
    replay = mt.Replay(store)
    replay.begin_pass("old_log_prob")  # R3 replays in every training pass
    assert replay.action == "replay_forward"
    replay.set_micro_batch_padded(torch.tensor([uid]), torch.ones(1, n, dtype=torch.int64))
    for layer in range(L):
        _, ids = replay.route(router, layer, logits[layer])
        assert torch.equal(ids[: n - 1], routed[:, layer].long())
        assert torch.equal(ids[n - 1], router.route(logits[layer])[1][n - 1])  # position n-1: native
    assert replay.stats()["native_rows"] == L
    assert replay.stats()["replayed_rows"] == L * (n - 1)


def test_vllm_import_uint16_above_256_experts(mt):
    # Recent vLLM returns uint16 when the model has more than 256 experts.
    experts = 300
    store = mt.open_route_file({"mode": "R3", "enable_rollout_routing_replay": True}, experts, L, K)
    routed = np.array([[[299, 256], [0, 298]], [[257, 1], [299, 2]]], dtype=np.uint16)  # [2, L, k]
    store.import_vllm(77, routed, first_position=3)
    ids, found = store.lookup(1, torch.tensor([77, 77, 77]), torch.tensor([3, 4, 5]))
    assert found.tolist() == [True, True, False]
    assert ids[:2].tolist() == [[0, 298], [299, 2]] and ids[2].tolist() == [-1, -1]


@pytest.mark.parametrize("in_file", [False, True])
def test_lookup_into_int64_int32_and_uint8(mt, tmp_path, in_file):
    # The same ids whatever dtype a lookup asks for; rows not recorded are -1 (255 in uint8).
    config = {"mode": "R2", "record_file": str(tmp_path / "r.mrr")} if in_file else {"mode": "R2"}
    store = mt.open_route_file(config, E, L, K)
    ids = distinct_ids(6, torch.Generator().manual_seed(5))
    store.record(1, torch.full((6,), 9), torch.arange(6), ids)
    uids, positions = torch.full((8,), 9), torch.arange(8)
    wide, found = store.lookup(1, uids, positions)
    assert wide.dtype == torch.int64 and found.tolist() == [True] * 6 + [False] * 2
    assert torch.equal(wide[:6], ids) and (wide[6:] == -1).all()
    for dtype, missing in ((torch.int64, -1), (torch.int32, -1), (torch.uint8, 255)):
        got, got_found = store.lookup(1, uids, positions, dtype=dtype)
        assert got.dtype == dtype and got.shape == (8, K) and torch.equal(got_found, found)
        assert torch.equal(got[:6].long(), ids) and (got[6:] == missing).all()
    with pytest.raises(mt.InvalidArgumentError, match="'dtype' is torch.float32"):
        store.lookup(1, uids, positions, dtype=torch.float32)
    wider = mt.open_route_file({"mode": "R2"}, 300, L, K)  # 8-bit ids cannot hold 300 experts' ids
    with pytest.raises(mt.InvalidArgumentError, match="8-bit ids cannot hold the expert ids of 300 experts"):
        wider.lookup(0, uids, positions, dtype=torch.uint8)


def test_vllm_import_checks_ids_and_shape(mt):
    store = memory_store(mt, "R3")
    bad = np.tile(np.arange(K, dtype=np.uint16), (3, L, 1))  # distinct experts per token and layer
    bad[1, 0, 1] = E  # one past the last expert
    with pytest.raises(mt.InvalidArgumentError, match=r"routed_experts\[1, 0, 1\] = 8 is outside \[0, 8\)"):
        store.import_vllm(5, bad)
    with pytest.raises(mt.InvalidArgumentError, match="3 layers but the model has 2"):
        store.import_vllm(5, np.zeros((3, 3, K), dtype=np.int32))
    with pytest.raises(mt.InvalidArgumentError, match="'routed_experts' has numpy dtype float32"):
        store.import_vllm(5, np.zeros((3, L, K), dtype=np.float32))
    repeat = np.tile(np.arange(K, dtype=np.uint8), (3, L, 1))
    repeat[2, 1, K - 1] = repeat[2, 1, 0]  # a token listing one expert twice: never a top-k
    with pytest.raises(mt.InvalidArgumentError, match=r"routed_experts\[2, 1, %d\] = 0 repeats an expert" % (K - 1)):
        store.import_vllm(5, repeat)
    assert not store.contains(5)


# --- (3) SGLang: base64 int32 payloads, routed_experts_start_len ---------------------------------


def b64(array):
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode()


def test_sglang_chunks_with_start_len_equal_one_import(mt):
    g = torch.Generator().manual_seed(4)
    rows, uid = 7, 9
    routed = torch.stack([distinct_ids(rows, g) for _ in range(L)], dim=1).numpy()  # [rows, L, k]
    whole = memory_store(mt, "R3")
    whole.import_sglang(uid, b64(routed))
    chunked = memory_store(mt, "R3")
    chunked.import_sglang(uid, b64(routed[:3]))                 # the prefix, first request
    chunked.import_sglang(uid, b64(routed[3:]), start_len=3)    # continuation: routed_experts_start_len=3
    assert chunked.recorded_positions(uid) == whole.recorded_positions(uid) == rows
    uids, positions = torch.full((rows,), uid), torch.arange(rows)
    for layer in range(L):
        a, found_a = whole.lookup(layer, uids, positions)
        b, found_b = chunked.lookup(layer, uids, positions)
        assert bool(found_a.all()) and bool(found_b.all())
        assert torch.equal(a, torch.from_numpy(routed[:, layer]).long())
        assert torch.equal(a, b)
    # A gap (a chunk starting past what was imported) leaves positions without routes.
    gap = memory_store(mt, "R3")
    gap.import_sglang(uid, b64(routed[3:]), start_len=3)
    _, found = gap.lookup(0, uids, positions)
    assert found.tolist() == [False] * 3 + [True] * 4


def test_rows_per_decoder_layer_with_dense_layers_import_through_moe_layers(mt):
    # SGLang's capturer: [rows, num_hidden_layers, k], zeros where a layer is dense (here the first
    # one and the one between the MoE layers); the model's MoE layer i is decoder layer moe[i].
    g = torch.Generator().manual_seed(8)
    rows, uid, decoder = 5, 21, L + 2
    moe = [1, 3]  # L = 2 MoE layers of 4 decoder layers
    full = np.zeros((rows, decoder, K), dtype=np.int32)
    for layer in moe:
        full[:, layer] = distinct_ids(rows, g).numpy()
    uids, positions = torch.full((rows,), uid), torch.arange(rows)
    for how in ("sglang", "vllm"):
        store = memory_store(mt, "R3")
        with pytest.raises(mt.InvalidArgumentError, match="give moe_layers"):
            store.import_vllm(uid, torch.from_numpy(full))
        if how == "sglang":
            store.import_sglang(uid, b64(full), moe_layers=moe, num_hidden_layers=decoder)
        else:
            store.import_vllm(uid, torch.from_numpy(full), moe_layers=moe)
        for i, layer in enumerate(moe):
            ids, found = store.lookup(i, uids, positions)
            assert bool(found.all()) and torch.equal(ids, torch.from_numpy(full[:, layer]).long())
    store = memory_store(mt, "R3")
    with pytest.raises(mt.InvalidArgumentError, match="give 'moe_layers' and 'num_hidden_layers' together"):
        store.import_sglang(uid, b64(full), moe_layers=moe)
    with pytest.raises(mt.InvalidArgumentError, match="does not follow the one before it"):
        store.import_vllm(uid, full, moe_layers=moe[::-1])
    with pytest.raises(mt.InvalidArgumentError, match="'moe_layers' must hold ints"):
        store.import_vllm(uid, full, moe_layers=[1.0] * len(moe))
    assert not store.contains(uid)


def test_sglang_payload_errors(mt):
    store = memory_store(mt, "R3")
    # 10 int32 values are not whole rows of L * k = 4.
    with pytest.raises(mt.InvalidArgumentError, match=r"40 bytes, not a whole number of int32 rows .*16 bytes each"):
        store.import_sglang(1, b64(np.zeros(10)))
    with pytest.raises(mt.InvalidArgumentError, match="not base64"):
        store.import_sglang(1, "AAAA*AAA")
    with pytest.raises(mt.InvalidArgumentError, match="not a multiple of 4"):
        store.import_sglang(1, b64(np.zeros(4))[:-1])
    with pytest.raises(mt.InvalidArgumentError, match=r"outside \[0, 8\)"):
        store.import_sglang(1, b64(np.full((1, L, K), -1)))
    assert not store.contains(1)


# --- (4) gradients against torch autograd --------------------------------------------------------


def reference_weights(logits, ids, pre_softmax):
    """The pure-torch formula: pre-softmax = softmax over all experts, gather, renormalise;
    Megatron's default = gather the k logits, softmax over them."""
    if pre_softmax:
        w = torch.softmax(logits, dim=-1).gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits.gather(1, ids), dim=-1)


@pytest.mark.parametrize("pre_softmax", [True, False])
@pytest.mark.parametrize("replayed", [False, True])
def test_gradient_matches_torch_autograd(mt, pre_softmax, replayed):
    g = torch.Generator().manual_seed(5)
    T, k = 16, 3
    router = mt.Router(E, k, pre_softmax=pre_softmax, normalize_topk=pre_softmax or None)
    base = torch.randn(T, E, generator=g)
    upstream = torch.randn(T, k, generator=g)

    z = base.clone().requires_grad_(True)
    if replayed:
        given = distinct_ids(T, g, k=k)
        weights, ids = router.replay(z, given)
        assert torch.equal(ids, given)
    else:
        weights, ids = router.route(z)
        assert torch.equal(ids, torch.topk(base, k).indices)
    assert ids.dtype == torch.int64
    (weights * upstream).sum().backward()

    z_ref = base.clone().requires_grad_(True)
    w_ref = reference_weights(z_ref, ids, pre_softmax)
    (w_ref * upstream).sum().backward()
    assert torch.allclose(weights, w_ref, atol=1e-6, rtol=0)
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-6, rtol=0)
    assert z.grad.abs().max() > 1e-3  # a real gradient was compared


def test_router_may_be_dropped_before_backward(mt):
    g = torch.Generator().manual_seed(9)
    base, upstream = torch.randn(4, E, generator=g), torch.randn(4, K, generator=g)
    z = base.clone().requires_grad_(True)
    router = mt.Router(E, K, pre_softmax=True, normalize_topk=True)
    weights, ids = router.route(z)
    del router  # the weights' graph node keeps mrr's router alive
    gc.collect()
    (weights * upstream).sum().backward()
    z_ref = base.clone().requires_grad_(True)
    (reference_weights(z_ref, ids, pre_softmax=True) * upstream).sum().backward()
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-6, rtol=0)


# --- (5) errors map to typed Python exceptions --------------------------------------------------


def test_missing_replay_file_is_route_file_error(mt, tmp_path):
    path = tmp_path / "absent.mrr"
    with pytest.raises(mt.RouteFileError) as info:
        mt.open_route_file({"mode": "R2", "replay_file": str(path)}, E, L, K)
    message = str(info.value)
    assert "actor_rollout_ref.actor.router_replay.replay_file" in message and str(path) in message
    assert isinstance(info.value, mt.RouteStoreError) and isinstance(info.value, RuntimeError)


def test_config_errors(mt):
    with pytest.raises(mt.ConfigError, match="unknown router replay mode 'R4'") as info:
        mt.open_route_file({"mode": "R4"}, E, L, K)
    assert isinstance(info.value, ValueError)
    with pytest.raises(mt.ConfigError, match="R3 replays the rollout engine's routes"):
        mt.open_route_file({"actor_rollout_ref.actor.router_replay.mode": "R3"}, E, L, K)
    with pytest.raises(mt.ConfigError, match="unknown key actor_rollout_ref.actor.router_replay.modes"):
        mt.open_route_file({"modes": "R2"}, E, L, K)
    with pytest.raises(mt.ConfigError, match="unknown key trainer.total_epochs"):
        mt.open_route_file({"trainer.total_epochs": 1}, E, L, K)
    # Full keys and bools as verl writes them are accepted.
    store = mt.open_route_file(
        {"actor_rollout_ref.actor.router_replay.mode": "R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay": True},
        E, L, K,
    )
    assert store.mode == "R3" and store.enable_rollout_routing_replay and store.replay_file is None


def test_out_of_range_id_is_never_wrapped(mt):
    router = mt.Router(E, K)
    logits = torch.randn(2, E)
    ids = torch.tensor([[0, 1], [2**32 + 3, 4]], dtype=torch.int64)
    with pytest.raises(mt.InvalidArgumentError, match=r"'ids'\[1, 0\] = 4294967299 is outside \[0, 8\)"):
        router.replay(logits, ids)
    with pytest.raises(mt.InvalidArgumentError, match="4294967299"):
        mt.validate_ids(ids, E)
    store = memory_store(mt, "R2")
    with pytest.raises(mt.InvalidArgumentError, match="4294967299"):
        store.record(0, torch.tensor([1, 1]), torch.tensor([0, 1]), ids)
    assert not store.contains(1)


def test_layouts_refuse_float_tensors_and_masks_that_are_not_0_1(mt):
    # Each of these used to be truncated or wrapped silently (uid 10.7 -> 10, mask 256 -> 0, an
    # additive float mask -> every row padding).
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    with pytest.raises(mt.InvalidArgumentError, match="'uids' has dtype Float"):
        replay.set_micro_batch_padded(torch.tensor([10.7]), torch.ones(1, 3, dtype=torch.long))
    # A trainer's [B, S] response token ids in place of the [B] sequence ids: named as such.
    with pytest.raises(mt.InvalidArgumentError, match=r"one sequence id per row, \[B\] \(not the rows' token ids\)"):
        replay.set_micro_batch_padded(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(mt.InvalidArgumentError, match=r"'attention_mask'\[0, 1\] = 256"):
        replay.set_micro_batch_padded(torch.tensor([10]), torch.tensor([[0, 256, 1, 1]]))
    with pytest.raises(mt.InvalidArgumentError, match="'attention_mask' has dtype Float"):
        replay.set_micro_batch_padded(torch.tensor([10]), torch.tensor([[torch.finfo(torch.float32).min, 0.0]]))
    with pytest.raises(mt.InvalidArgumentError, match="'cu_seqlens' has dtype Float"):
        replay.set_micro_batch_packed(torch.tensor([1]), torch.tensor([0.0, 2.9]))
    with pytest.raises(mt.InvalidArgumentError, match="'first_positions' has dtype Float"):
        replay.set_micro_batch_packed(torch.tensor([1]), torch.tensor([0, 3]), torch.tensor([0.9]))
    replay.set_micro_batch_padded(torch.tensor([10]), torch.tensor([[0, 1, 1]], dtype=torch.bool))  # bool is fine
    # Negative int64 uids are the same 64 bits everywhere (a hash in an int64 tensor).
    store.record(0, torch.tensor([-5]), torch.tensor([0]), torch.tensor([[1, 2]]))
    assert store.contains(-5) and store.contains(2**64 - 5)
    assert store.recorded_positions(-5) == 1
    with pytest.raises(mt.InvalidArgumentError, match="outside a 64-bit sequence id"):
        store.contains(2**64)
    # A row listing an expert twice is refused before anything is stored.
    with pytest.raises(mt.InvalidArgumentError, match="repeats expert id 4"):
        store.record(0, torch.tensor([7]), torch.tensor([0]), torch.tensor([[4, 4]]))
    assert not store.contains(7)


def test_activation_recompute_switched_on_inside_the_update_pass(mt):
    router = mt.Router(E, K)
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_packed(torch.tensor([3]), torch.tensor([0, 4]))
    rec = replay.route(router, 0, torch.randn(4, E))[1]
    replay.begin_pass("actor_update")
    replay.set_activation_recompute(True)  # after begin_pass: still queues this pass's forwards
    replay.route(router, 0, torch.randn(4, E))
    assert replay.queued(0) == 1
    replay.begin_pass("actor_recompute")
    assert torch.equal(replay.route(router, 0, torch.randn(4, E))[1], rec)


def test_activation_recompute_for_some_layers_only(mt):
    router = mt.Router(E, K)
    store = memory_store(mt, "R2")
    replay = mt.Replay(store)
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_packed(torch.tensor([3]), torch.tensor([0, 4]))
    recorded = [replay.route(router, layer, torch.randn(4, E))[1] for layer in range(L)]
    replay.set_activation_recompute([0])  # Megatron's partial recompute: layer 0 only
    assert replay.activation_recompute() and replay.activation_recompute(0)
    assert not replay.activation_recompute(1)
    replay.begin_pass("actor_update")
    for layer in range(L):
        replay.route(router, layer, torch.randn(4, E))
    assert [replay.queued(layer) for layer in range(L)] == [1] + [0] * (L - 1)
    replay.begin_pass("actor_recompute")
    assert torch.equal(replay.route(router, 0, torch.randn(4, E))[1], recorded[0])
    with pytest.raises(mt.RouteStoreError, match="not among those set_activation_recompute"):
        replay.route(router, 1, torch.randn(4, E))
    with pytest.raises(mt.InvalidArgumentError, match="outside the store"):
        replay.set_activation_recompute([L])
    replay.set_activation_recompute([])
    assert not replay.activation_recompute()


def test_wrong_dtype_and_shape_name_the_argument(mt):
    router = mt.Router(E, K)
    logits = torch.randn(3, E)
    with pytest.raises(mt.InvalidArgumentError, match="'logits' has dtype Double, expected Float"):
        router.route(logits.double())
    with pytest.raises(mt.InvalidArgumentError, match=r"'logits' must be 2-D"):
        router.route(logits[0])
    with pytest.raises(mt.InvalidArgumentError, match=r"'ids' must be \[rows, 2\]"):
        router.replay(logits, torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(mt.InvalidArgumentError, match="'ids' has dtype Float"):
        router.replay(logits, torch.zeros(3, 2))
    with pytest.raises(mt.InvalidArgumentError, match="'ids' has 2 rows for 3 rows of logits"):
        router.replay(logits, torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(mt.InvalidArgumentError, match="repeats expert id 5"):
        router.replay(logits, torch.tensor([[0, 1], [5, 5], [2, 3]]))
    replay = mt.Replay(memory_store(mt, "R2"))
    replay.begin_pass("old_log_prob")
    replay.set_micro_batch_packed(torch.tensor([1]), torch.tensor([0, 2]))
    with pytest.raises(mt.InvalidArgumentError, match="logits have 3 rows but the micro-batch layout has 2"):
        replay.route(router, 0, logits)
    with pytest.raises(mt.InvalidArgumentError, match="unknown pass 'rollout'"):
        replay.begin_pass("rollout")


# --- (6) a route file written here, read by examples/python/read_routes.py ----------------------


def test_route_file_read_by_numpy_reader(mt, tmp_path, repo_root):
    g = torch.Generator().manual_seed(6)
    path = tmp_path / "routes.mrr"
    store = mt.open_route_file({"mode": "R2", "record_file": str(path)}, E, L, K)
    assert store.is_file and store.record_file == str(path)
    router = mt.Router(E, K)
    replay = mt.Replay(store)
    replay.begin_pass("old_log_prob")
    uids, lengths = torch.tensor([11, 12]), [5, 3]
    replay.set_micro_batch_packed(uids, torch.tensor([0, 5, 8]))
    recorded = [replay.route(router, layer, torch.randn(8, E, generator=g))[1] for layer in range(L)]
    store.close()

    sys.path.insert(0, str(repo_root / "examples" / "python"))
    try:
        read_routes = importlib.import_module("read_routes")
    finally:
        sys.path.pop(0)
    f = read_routes.RouteFile(path)
    start = 0
    for uid, n in zip(uids.tolist(), lengths):
        routes = f.routes(uid)  # int32 [positions, layers, k]
        assert routes.shape == (n, L, K)
        for layer in range(L):
            assert np.array_equal(routes[:, layer].astype(np.int64), recorded[layer][start : start + n].numpy())
        start += n

    # And mrr reads it back as a replay file.
    again = mt.open_route_file({"mode": "R2", "replay_file": str(path)}, E, L, K)
    ids, found = again.lookup(1, torch.tensor([12, 11]), torch.tensor([2, 4]))
    assert bool(found.all())
    assert torch.equal(ids, torch.stack([recorded[1][7], recorded[1][4]]))


# --- (7) Megatron's RouterReplay API ------------------------------------------------------------


@pytest.fixture
def megatron(mt):
    RouterReplay = mt.RouterReplay
    RouterReplay.clear_global_router_replay_instances()
    yield RouterReplay
    RouterReplay.clear_global_router_replay_instances()


def default_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=-1)


def test_megatron_record_then_replay_forward(mt, megatron):
    Action = mt.RouterReplayAction
    assert [a.value for a in Action] == ["record", "replay_forward", "replay_backward"]
    g = torch.Generator().manual_seed(7)
    layers = [megatron(), megatron()]
    assert megatron.global_router_replay_instances == layers

    megatron.set_global_router_replay_action(Action.RECORD)
    first = [torch.softmax(torch.randn(5, E, generator=g), -1) for _ in layers]
    for layer, scores in zip(layers, first):
        layer.get_replay_topk(scores, K, default_compute_topk=default_topk)
    recorded = megatron.get_recorded_data()
    assert all(torch.equal(r, torch.topk(s, K).indices) for r, s in zip(recorded, first))

    megatron.clear_global_indices()
    assert megatron.get_recorded_data() == [None, None]
    megatron.set_replay_data(recorded)
    megatron.set_global_router_replay_action(Action.REPLAY_FORWARD)
    for layer, ids in zip(layers, recorded):
        scores = torch.softmax(torch.randn(5, E, generator=g), -1)  # new scores, same experts
        probs, top = layer.get_replay_topk(scores, K, default_compute_topk=default_topk)
        assert torch.equal(top, ids) and top.dtype == torch.int64
        assert torch.equal(probs, scores.gather(1, ids))

    megatron.clear_global_router_replay_action()
    assert all(layer.router_replay_action is None for layer in layers)
    with pytest.raises(ValueError, match="1 layers of indices for 2"):
        megatron.set_replay_data(recorded[:1])


def test_megatron_replay_backward_is_fifo(mt, megatron):
    layer = megatron()
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[4, 5], [6, 7]])
    layer.set_target_indices(a)
    layer.set_target_indices(b)
    layer.set_router_replay_action(mt.RouterReplayAction.REPLAY_BACKWARD)
    scores = torch.rand(2, E)
    assert torch.equal(layer.get_replay_topk(scores, K)[1], a)
    assert torch.equal(layer.get_replay_topk(scores, K)[1], b)
    with pytest.raises(mt.InvalidArgumentError, match="no queued indices"):
        layer.get_replay_topk(scores, K)


def test_megatron_invalid_ids_are_rejected(mt, megatron):
    layer = megatron()
    layer.set_router_replay_action(mt.RouterReplayAction.REPLAY_FORWARD)
    scores = torch.rand(2, E)
    layer.set_target_indices(torch.tensor([[0, 1], [2**32 + 3, 4]]))
    with pytest.raises(mt.InvalidArgumentError, match="4294967299 is outside"):
        layer.get_replay_topk(scores, K)
    layer.set_target_indices(torch.tensor([[0, 1], [3, 3]]))
    with pytest.raises(mt.InvalidArgumentError, match="repeats expert id 3"):
        layer.get_replay_topk(scores, K)
    layer.set_target_indices(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(mt.InvalidArgumentError, match=r"expected \[2, 2\]"):
        layer.get_replay_topk(scores, K)
    checked = megatron(num_experts=E)  # checks on arrival too
    with pytest.raises(mt.InvalidArgumentError, match="outside"):
        checked.set_target_indices(torch.tensor([[0, E]]))


def test_megatron_failed_calls_leave_the_queues_as_they_were(mt, megatron):
    layers = [megatron(num_experts=E), megatron(num_experts=E)]
    good, bad = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, E]])
    with pytest.raises(mt.InvalidArgumentError, match="outside"):
        megatron.set_replay_data([good, bad])  # layer 1 is bad: layer 0 is not set either
    assert [len(layer.replay_backward_list) for layer in layers] == [0, 0]
    assert layers[0].target_topk_idx is None
    # A recompute that fails its checks keeps its queued indices for the retry.
    layer = megatron()
    layer.set_target_indices(good)
    layer.set_router_replay_action(mt.RouterReplayAction.REPLAY_BACKWARD)
    with pytest.raises(mt.InvalidArgumentError, match=r"expected \[3, 2\]"):
        layer.get_replay_topk(torch.rand(3, E), K)
    assert len(layer.replay_backward_list) == 1
    assert torch.equal(layer.get_replay_topk(torch.rand(2, E), K)[1], good)
    # Ids are checked against the scores' width, not only num_experts: a clear error, not a gather's.
    narrow = megatron(num_experts=E)
    narrow.set_target_indices(torch.tensor([[1, 6]]))
    narrow.set_router_replay_action(mt.RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(mt.InvalidArgumentError, match="have 4 experts but this RouterReplay was made with num_experts=8"):
        narrow.get_replay_topk(torch.rand(1, 4), K)
    plain = megatron()
    plain.set_target_indices(torch.tensor([[1, 6]]))
    plain.set_router_replay_action(mt.RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(mt.InvalidArgumentError, match="6 is outside"):
        plain.get_replay_topk(torch.rand(1, 4), K)


def test_megatron_replay_mask_static_buffers_and_inference_boundary(mt, megatron):
    Action = mt.RouterReplayAction
    layers = [megatron(), megatron()]
    # Megatron calls default_compute_topk positionally when no action is set.
    calls = []

    def positional(scores, topk, num_groups, group_topk):
        calls.append((num_groups, group_topk))
        return torch.topk(scores, topk, dim=-1)

    layers[0].get_replay_topk(torch.rand(3, E), K, 2, 1, positional)
    assert calls == [(2, 1)]
    # replay_mask: the masked rows replay the given indices in order, the others route natively.
    scores = torch.rand(4, E)
    mask = torch.tensor([True, False, True, False])
    target = torch.tensor([[0, 1], [2, 3]])
    megatron.set_replay_data([target, target], replay_mask=mask)
    megatron.set_global_router_replay_action(Action.REPLAY_FORWARD)
    probs, top = layers[0].get_replay_topk(scores, K, default_compute_topk=default_topk)
    native = torch.topk(scores, K).indices
    assert torch.equal(top[mask], target) and torch.equal(top[~mask], native[~mask])
    assert torch.equal(probs, scores.gather(1, top))
    # The recompute replays every row as that forward routed it (it was handed the 2 masked rows
    # alone, "[2, 2], expected [4, 2]", before), on scores that now route natively otherwise.
    megatron.set_global_router_replay_action(Action.REPLAY_BACKWARD)
    _, again = layers[0].get_replay_topk(torch.rand(4, E), K, default_compute_topk=default_topk)
    assert torch.equal(again, top)
    with pytest.raises(mt.InvalidArgumentError, match="replay_mask selects 2 rows but there are 3"):
        megatron.set_replay_data([torch.zeros(3, K, dtype=torch.long)] * 2, replay_mask=mask)
    # Static buffers [max_tokens, layers, k]: recorded indices are copied into each layer's view.
    buffer = torch.full((6, 2, K), -1, dtype=torch.long)
    megatron.set_global_static_buffers(buffer)
    megatron.set_global_router_replay_action(Action.RECORD)
    layers[1].get_replay_topk(scores, K, default_compute_topk=default_topk)
    assert torch.equal(buffer[:4, 1], native) and bool((buffer[4:, 1] == -1).all())
    assert layers[1].get_recorded_indices().data_ptr() == buffer[:, 1].data_ptr()
    with pytest.raises(mt.InvalidArgumentError, match="expected \\[max_tokens, 2 layers, k\\]"):
        megatron.set_global_static_buffers(torch.zeros(6, 3, K, dtype=torch.long))
    megatron.clear_global_static_buffers()
    assert all(layer.static_buffer is None for layer in layers)
    # The inference model's instances: those made after mark_inference_boundary.
    assert megatron.get_inference_instances() == layers
    megatron.mark_inference_boundary()
    inference = megatron()
    assert megatron.get_inference_instances() == [inference]


def test_megatron_save_and_load_through_route_file(mt, megatron, tmp_path):
    g = torch.Generator().manual_seed(8)
    layers = [megatron() for _ in range(L)]
    megatron.set_global_router_replay_action(mt.RouterReplayAction.RECORD)
    for layer in layers:
        layer.get_replay_topk(torch.rand(4, E, generator=g), K, default_compute_topk=default_topk)
    recorded = megatron.get_recorded_data()
    uids, positions = [3, 3, 4, 4], [0, 1, 0, 1]
    path = tmp_path / "megatron.mrr"
    store = mt.open_route_file({"mode": "R2", "record_file": str(path)}, E, L, K)
    megatron.save_recorded(store, uids, positions)
    store.close()

    megatron.clear_global_indices()
    reader = mt.open_route_file({"mode": "R2", "replay_file": str(path)}, E, L, K)
    megatron.load_replay_data(reader, [4, 3], [1, 0])  # another order
    assert all(torch.equal(layer.target_topk_idx, r[[3, 0]]) for layer, r in zip(layers, recorded))
    with pytest.raises(mt.RouteStoreError, match="no route for sequence 4 position 2"):
        megatron.load_replay_data(reader, [3, 4], [1, 2])


def test_megatron_pipeline_stages_save_and_load_their_own_layers(mt, megatron, tmp_path):
    # Two pipeline stages, one MoE layer each, write one route file of both layers (each rank its
    # own layers: layers=[the file's layer]); the whole model, and each stage, read it back.
    g = torch.Generator().manual_seed(9)
    uids, positions = [5, 5, 5], [0, 1, 2]
    path = tmp_path / "stages.mrr"
    store = mt.open_route_file({"mode": "R2", "record_file": str(path)}, E, L, K)
    recorded = []
    for stage in range(L):
        megatron.clear_global_router_replay_instances()
        layer = megatron()
        megatron.set_global_router_replay_action(mt.RouterReplayAction.RECORD)
        layer.get_replay_topk(torch.rand(3, E, generator=g), K, default_compute_topk=default_topk)
        recorded.append(layer.get_recorded_indices())
        with pytest.raises(mt.InvalidArgumentError, match="give layers="):
            megatron.save_recorded(store, uids, positions)
        megatron.save_recorded(store, uids, positions, layers=[stage])
    store.close()
    reader = mt.open_route_file({"mode": "R2", "replay_file": str(path)}, E, L, K)
    megatron.clear_global_router_replay_instances()
    whole = [megatron() for _ in range(L)]
    megatron.load_replay_data(reader, uids, positions)
    assert all(torch.equal(layer.target_topk_idx, r) for layer, r in zip(whole, recorded))
    megatron.clear_global_router_replay_instances()
    last = megatron()
    megatron.load_replay_data(reader, uids, positions, layers=[L - 1])
    assert torch.equal(last.target_topk_idx, recorded[L - 1])
    with pytest.raises(mt.InvalidArgumentError, match=r"layers\[0\] = %d does not follow" % L):
        megatron.load_replay_data(reader, uids, positions, layers=[L])
    with pytest.raises(mt.InvalidArgumentError, match="layers names 2 layers for 1 instances"):
        megatron.load_replay_data(reader, uids, positions, layers=[0, 1])


def deepseek_v3_gate(logits, bias, k, groups, topk_groups, scale):
    """DeepSeek-V3's gate after the matmul, in float64, as Megatron computes it: sigmoid, + bias for
    selection, groups scored by their top-2 sums, the other groups' experts masked with -inf (mrr's
    default; HF's 0.0 picks the same experts while the kept scores are positive), top-k, weights
    from the unbiased scores, renormalised and scaled."""
    t, e = logits.shape
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    group_scores = choice.view(t, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, -1).bool()
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=k, dim=-1)[1]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale


def test_expert_bias_set_from_python_moves_the_selection(mt):
    """Router.set_expert_bias: DeepSeek-V3's gate with its correction bias, against the gate's
    formula in float64 (ids as sets per row; weights from the unbiased scores), and the checks."""
    g = torch.Generator().manual_seed(23)
    E, k = 64, 6
    router = mt.Router(E, k, score_function="sigmoid", normalize_topk=True, scaling_factor=2.5, num_groups=8,
                       group_topk=3, use_expert_bias=True)
    assert torch.equal(router.expert_bias, torch.zeros(E))
    logits = torch.randn(500, E, generator=g)
    bias = 0.3 * torch.randn(E, generator=g)
    bias[[3, 40]] = 2.0  # two experts every row must take
    router.set_expert_bias(bias)
    assert torch.equal(router.expert_bias, bias)
    w, ids = router.route(logits)
    ref_ids, _ = deepseek_v3_gate(logits, bias, k, 8, 3, 2.5)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    assert torch.allclose(w.double(), 2.5 * logits.double().sigmoid().gather(1, ids) /
                          logits.double().sigmoid().gather(1, ids).sum(dim=1, keepdim=True), atol=1e-6, rtol=0)
    assert bool(((ids == 3).any(dim=1) & (ids == 40).any(dim=1)).all())
    # Without the bias the selection is another one; a list sets it too.
    router.set_expert_bias([0.0] * E)
    assert not torch.equal(router.route(logits)[1], ids)
    with pytest.raises(mt.InvalidArgumentError, match="use_expert_bias = false"):
        mt.Router(E, k).set_expert_bias(bias)
    with pytest.raises(mt.InvalidArgumentError, match="63 entries for 64 experts"):
        router.set_expert_bias(bias[:63])
    with pytest.raises(mt.InvalidArgumentError, match="not finite"):
        router.set_expert_bias(torch.full((E,), float("nan")))
    with pytest.raises(mt.InvalidArgumentError, match="must be 1-D"):
        router.set_expert_bias(bias.view(8, 8))
