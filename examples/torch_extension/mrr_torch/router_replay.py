"""Megatron-Core's router-replay API (megatron/core/transformer/moe/router_replay.py), backed by mrr.

The names, arguments and behaviour follow Megatron's module, so a Megatron router that calls
``RouterReplay.get_replay_topk`` works unchanged; two things are added:

* replayed indices are checked by mrr before use: each id in [0, num_experts) in its own dtype (an
  int64 2**32 + 3 is an error, never expert 3) and no expert twice in a row; a failure raises
  mrr's InvalidArgumentError (a ValueError) with mrr's message, instead of a gather that silently
  reads the wrong expert or an index error deep inside autograd;
* the recorded indices persist: ``save_recorded`` writes every layer's into an mrr RouteFile
  (keyed by sequence uid and position), ``load_replay_data`` reads them back for any micro-batch
  composition.

Indices come back as int64, torch.topk's dtype.
"""

from enum import Enum

import torch

__all__ = ["RouterReplay", "RouterReplayAction"]


class RouterReplayAction(Enum):
    """What get_replay_topk does (Megatron's names and values)."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


def _ext():
    from . import load

    return load()


def _invalid(message):
    return _ext().InvalidArgumentError(message)


def _as_int64(values, name):
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise _invalid(f"RouterReplay: '{name}' must be a 1-D integer tensor, got {t.dtype} {list(t.shape)}")
    return t.to(torch.int64)


class RouterReplay:
    """One MoE layer's replay state; every instance joins ``global_router_replay_instances`` in
    creation order, which is layer order (Megatron creates one per router)."""

    global_router_replay_instances = []
    # Where the inference model's instances start (mark_inference_boundary); -1: not set.
    _inference_start_idx = -1

    def __init__(self, num_experts=None):
        # num_experts (an addition to Megatron's signature): lets set_target_indices check ids as
        # soon as they arrive; get_replay_topk checks them against the scores' width either way.
        self.num_experts = num_experts
        self.target_topk_idx = None
        self.replay_mask = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.static_buffer = None
        RouterReplay.global_router_replay_instances.append(self)

    # --- all layers at once ---------------------------------------------------------------

    @staticmethod
    def set_replay_data(all_layers_topk_indices, replay_mask=None):
        """Gives layer i the indices all_layers_topk_indices[i] to replay. replay_mask (optional,
        [rows] bool): only the rows where it is True replay (their indices, in order, are the
        layer's); the others route natively (padding). Every layer is checked before any is set."""
        instances = RouterReplay.global_router_replay_instances
        if len(all_layers_topk_indices) != len(instances):
            raise ValueError(
                f"RouterReplay.set_replay_data: {len(all_layers_topk_indices)} layers of indices for "
                f"{len(instances)} RouterReplay instances"
            )
        for layer, (instance, indices) in enumerate(zip(instances, all_layers_topk_indices)):
            instance._check_target(indices, replay_mask, f"set_replay_data: layer {layer}")
        for instance, indices in zip(instances, all_layers_topk_indices):
            instance._set_target(indices, replay_mask)

    @staticmethod
    def get_recorded_data():
        """Every layer's last recorded indices, in layer order (None where nothing was recorded)."""
        return [instance.get_recorded_indices() for instance in RouterReplay.global_router_replay_instances]

    @staticmethod
    def clear_global_indices():
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_indices()

    @staticmethod
    def set_global_router_replay_action(router_replay_action):
        for instance in RouterReplay.global_router_replay_instances:
            instance.set_router_replay_action(router_replay_action)

    @staticmethod
    def clear_global_router_replay_action():
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_router_replay_action()

    @staticmethod
    def clear_global_router_replay_instances():
        RouterReplay.global_router_replay_instances.clear()
        RouterReplay._inference_start_idx = -1

    @staticmethod
    def mark_inference_boundary():
        """Instances created from now on are the inference model's (get_inference_instances)."""
        RouterReplay._inference_start_idx = len(RouterReplay.global_router_replay_instances)

    @staticmethod
    def get_inference_instances():
        """The inference model's instances: all of them until mark_inference_boundary was called."""
        if RouterReplay._inference_start_idx < 0:
            return RouterReplay.global_router_replay_instances
        return RouterReplay.global_router_replay_instances[RouterReplay._inference_start_idx :]

    @staticmethod
    def set_global_static_buffers(static_buffer):
        """Gives layer i the view static_buffer[:, i, :] of a [max_tokens, layers, k] buffer to
        record into (CUDA-graph friendly: recorded indices are copied there)."""
        instances = RouterReplay.global_router_replay_instances
        if static_buffer.dim() != 3 or static_buffer.shape[1] != len(instances):
            raise _invalid(
                f"RouterReplay.set_global_static_buffers: the buffer has shape {list(static_buffer.shape)}; expected "
                f"[max_tokens, {len(instances)} layers, k]"
            )
        for layer, instance in enumerate(instances):
            instance.set_static_buffer(static_buffer[:, layer, :])

    @staticmethod
    def clear_global_static_buffers():
        for instance in RouterReplay.global_router_replay_instances:
            instance.clear_static_buffer()

    # --- persistence through mrr (additions) ----------------------------------------------

    @staticmethod
    def _layers_and_rows(fn, route_file, uids, positions, layers):
        """The (instance, route-file layer) pairs and the rows as int64. `layers`: the route
        file's layer of each instance, in order (a pipeline stage's, or a virtual stage's chunks);
        None: the instances are the file's layers, all of them."""
        instances = RouterReplay.global_router_replay_instances
        if layers is None:
            if len(instances) != route_file.num_layers:
                raise _invalid(
                    f"RouterReplay.{fn}: {len(instances)} RouterReplay instances but the route file holds "
                    f"{route_file.num_layers} layers (under pipeline parallelism, give layers=: the file's layer "
                    "of each of this rank's instances)"
                )
            layers = range(route_file.num_layers)
        layers = [int(layer) for layer in layers]
        if len(layers) != len(instances):
            raise _invalid(f"RouterReplay.{fn}: layers names {len(layers)} layers for {len(instances)} instances")
        for i, layer in enumerate(layers):
            if not 0 <= layer < route_file.num_layers or (i > 0 and layer <= layers[i - 1]):
                raise _invalid(
                    f"RouterReplay.{fn}: layers[{i}] = {layer} does not follow the one before it or is outside the "
                    f"route file's {route_file.num_layers} layers"
                )
        return list(zip(instances, layers)), _as_int64(uids, "uids"), _as_int64(positions, "positions")

    @staticmethod
    def save_recorded(route_file, uids, positions, layers=None):
        """Writes every layer's recorded indices [rows, k] into `route_file` (an mrr RouteFile),
        row i being token (uids[i], positions[i]). `layers`: the file's layer of each instance
        (e.g. range(first, first + n) on a pipeline stage); None: instance i is layer i, and the
        file holds as many layers as there are instances."""
        pairs, uids, positions = RouterReplay._layers_and_rows("save_recorded", route_file, uids, positions, layers)
        for instance, layer in pairs:
            recorded = instance.get_recorded_indices()
            if recorded is None:
                raise _invalid(f"RouterReplay.save_recorded: layer {layer} has recorded nothing")
            route_file.record(layer, uids, positions, recorded.detach().cpu())

    @staticmethod
    def load_replay_data(route_file, uids, positions, layers=None):
        """set_replay_data from `route_file`'s routes of tokens (uids[i], positions[i]); a token
        without a route in some layer is a RouteStoreError naming it. `layers` as for
        save_recorded."""
        pairs, uids, positions = RouterReplay._layers_and_rows("load_replay_data", route_file, uids, positions, layers)
        per_layer = []
        for _, layer in pairs:
            ids, found = route_file.lookup(layer, uids, positions)
            if not bool(found.all()):
                row = int((~found).nonzero()[0, 0])
                raise _ext().RouteStoreError(
                    f"RouterReplay.load_replay_data: layer {layer}: no route for sequence {int(uids[row])} position "
                    f"{int(positions[row])} (row {row}; {route_file.recorded_positions(int(uids[row]))} positions "
                    f"recorded for it)"
                )
            per_layer.append(ids)
        RouterReplay.set_replay_data(per_layer)

    # --- one layer ------------------------------------------------------------------------

    def set_target_indices(self, topk_indices, replay_mask=None):
        """The indices the next REPLAY_FORWARD uses (on the rows where replay_mask, if given, is
        True); also queued for REPLAY_BACKWARD (FIFO)."""
        self._check_target(topk_indices, replay_mask, "set_target_indices")
        self._set_target(topk_indices, replay_mask)

    def _check_target(self, topk_indices, replay_mask, what):
        if self.num_experts is not None:
            _ext().validate_ids(topk_indices, self.num_experts)
        if replay_mask is not None:
            if not isinstance(replay_mask, torch.Tensor) or replay_mask.dtype != torch.bool or replay_mask.dim() != 1:
                raise _invalid(f"RouterReplay.{what}: replay_mask must be a 1-D bool tensor")
            if int(replay_mask.sum()) != topk_indices.shape[0]:
                raise _invalid(
                    f"RouterReplay.{what}: replay_mask selects {int(replay_mask.sum())} rows but there are "
                    f"{topk_indices.shape[0]} rows of indices"
                )

    def _set_target(self, topk_indices, replay_mask):
        self.target_topk_idx = topk_indices
        self.replay_mask = replay_mask
        self.replay_backward_list.append(topk_indices)

    def get_recorded_indices(self):
        return self.recorded_topk_idx

    def record_indices(self, topk_indices):
        """Keeps the indices; with a static buffer set, copies them into its first rows."""
        if self.static_buffer is not None:
            rows = topk_indices.shape[0]
            if rows > self.static_buffer.shape[0] or topk_indices.shape[1:] != self.static_buffer.shape[1:]:
                raise _invalid(
                    f"RouterReplay.record_indices: indices {list(topk_indices.shape)} do not fit the static buffer "
                    f"{list(self.static_buffer.shape)}"
                )
            self.static_buffer[:rows].copy_(topk_indices)
            self.recorded_topk_idx = self.static_buffer[:rows]
        else:
            self.recorded_topk_idx = topk_indices

    def set_static_buffer(self, buffer):
        self.static_buffer = buffer

    def clear_static_buffer(self):
        self.static_buffer = None

    def clear_indices(self):
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_mask = None
        self.replay_backward_list = []

    def set_router_replay_action(self, router_replay_action):
        self.router_replay_action = router_replay_action

    def clear_router_replay_action(self):
        self.router_replay_action = None

    def _replayed(self, indices, scores, topk, what):
        if indices is None:
            raise _invalid(f"RouterReplay.get_replay_topk: {what} has no indices (set_target_indices first)")
        if not isinstance(indices, torch.Tensor):
            raise _invalid(f"RouterReplay.get_replay_topk: {what} indices must be a tensor, got {type(indices).__name__}")
        rows, num_experts = scores.shape[0], scores.shape[-1]
        if indices.dim() != 2 or indices.shape[0] != rows or indices.shape[1] != topk:
            raise _invalid(
                f"RouterReplay.get_replay_topk: {what} indices have shape {list(indices.shape)}, expected "
                f"[{rows}, {topk}] for scores {list(scores.shape)} and topk={topk}"
            )
        if self.num_experts is not None and self.num_experts != num_experts:
            raise _invalid(
                f"RouterReplay.get_replay_topk: scores {list(scores.shape)} have {num_experts} experts but this "
                f"RouterReplay was made with num_experts={self.num_experts}"
            )
        # Against the scores' own width: an index past it would make the gather fail (on a GPU, a
        # device-side assert) rather than raise mrr's error.
        _ext().validate_ids(indices.detach().cpu(), num_experts)
        indices = indices.to(device=scores.device, dtype=torch.int64)
        return scores.gather(1, indices), indices

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """(probs, top_indices) of scores [tokens, experts] under the current action: RECORD
        computes with default_compute_topk and records the indices; REPLAY_FORWARD gathers the
        target indices; REPLAY_BACKWARD the oldest queued ones; no action computes by default."""
        action = self.router_replay_action
        if action == RouterReplayAction.RECORD:
            probs, top_indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(top_indices)
            return probs, top_indices
        if action == RouterReplayAction.REPLAY_FORWARD:
            if self.replay_mask is None:
                return self._replayed(self.target_topk_idx, scores, topk, "REPLAY_FORWARD")
            # Partial replay (Megatron's replay_mask): the masked rows take the target indices, in
            # order; the others keep their native routing.
            mask = self.replay_mask.to(scores.device)
            if mask.shape[0] != scores.shape[0]:
                raise _invalid(
                    f"RouterReplay.get_replay_topk: replay_mask has {mask.shape[0]} rows for scores "
                    f"{list(scores.shape)} (a mask sharded by sequence parallelism is not supported)"
                )
            _, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            indices = native.to(torch.int64).clone()
            indices[mask] = self.target_topk_idx.to(device=scores.device, dtype=torch.int64)
            result = self._replayed(indices, scores, topk, "REPLAY_FORWARD")
            # The recompute (REPLAY_BACKWARD) must route every row as this forward did, the native
            # rows included: the queued entry of these targets becomes the whole indices.
            for i in range(len(self.replay_backward_list) - 1, -1, -1):
                if self.replay_backward_list[i] is self.target_topk_idx:
                    self.replay_backward_list[i] = result[1]
                    break
            return result
        if action == RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise _invalid("RouterReplay.get_replay_topk: REPLAY_BACKWARD with no queued indices")
            # Taken only once checked: a failed recompute leaves the queue as it was for the retry.
            result = self._replayed(self.replay_backward_list[0], scores, topk, "REPLAY_BACKWARD")
            self.replay_backward_list.pop(0)
            return result
        # Megatron passes these positionally here.
        return default_compute_topk(scores, topk, num_groups, group_topk)
