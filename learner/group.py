"""The learner group: N ranks of one torch.distributed group (gloo on CPU, NCCL on GPU) as Ray actors.

`LearnerWorker` is one rank and runs in any process; with one rank it needs neither Ray nor a process
group (collectives are no-ops). `LearnerGroup` starts N `LearnerWorker` Ray actors, gives them a
rendezvous address on a free port, and fans each step out: rank r trains on its share of the plan,
DDP all-reduces the gradients, every rank applies the same AdamW update.
"""
from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch

from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.train_step import Collectives, Learner, PackedBatch, pick_device

RESERVED_PORTS = {6379}  # Redis's default port, also Ray's default GCS port: often taken on the host


def free_port(host: str = "127.0.0.1", attempts: int = 16) -> int:
    """A TCP port the OS reports free, never one of RESERVED_PORTS."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in RESERVED_PORTS:
            return port
    raise RuntimeError(f"no free port on {host} after {attempts} attempts")


def grpo_learner(model, cfg: GRPOConfig, collectives: Collectives, wrap) -> Learner:
    """The GRPO learner of a rank (with a frozen reference copy when the loss has a KL term)."""
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.loss.kl_coef > 0 else None
    return Learner(model, cfg, collectives, ref_model=ref, wrap=wrap)


def make_policy(source: PolicyConfig | str | Path):
    """(model, tokenizer) from a PolicyConfig (fresh, seeded) or an HF checkpoint directory."""
    from learner.policy import build_policy
    from core.hf import load_policy

    if isinstance(source, PolicyConfig):
        return build_policy(source)
    return load_policy(source)


class LearnerWorker:
    """One learner rank. Builds the policy, joins the process group (when world > 1), wraps DDP.

    In one process `LearnerWorker(cfg, policy)` is ready at once. As a Ray actor it is built with
    `join=False`; the group asks rank 0 for a rendezvous address on its own node (`rendezvous`) and
    then has every rank `join` it. `make_learner(model, cfg, collectives, wrap)` builds the rank's
    learner (GRPO by default; OPD passes its own), which owns the optimizer and `state()`."""

    def __init__(self, cfg, policy: PolicyConfig | str | Path, rank: int = 0, world: int = 1,
                 dtype: str | None = None, join: bool = True, make_learner=None):
        self.cfg, self.policy, self.rank, self.world, self.dtype = cfg, policy, rank, world, dtype
        self.make_learner = make_learner or grpo_learner
        threads = cfg.learner.threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.learner.seed + rank)
        self.device = pick_device(cfg.learner.device)
        if join:
            self.join(None)

    def rendezvous(self) -> tuple[str, int]:
        """An address on this rank's node where the process group's store can listen."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def join(self, master: tuple[str, int] | None) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if master is None:
                raise ValueError("a learner group of more than one rank needs a master (host, port)")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(minutes=10))
        self.model, self.tokenizer = make_policy(self.policy)
        if self.dtype is not None:
            self.model.to(getattr(torch, self.dtype))
        wrap = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            device = self.device

            def wrap(module):
                return DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                           broadcast_buffers=False)
        self.learner = self.make_learner(self.model, self.cfg, Collectives(self.world, self.device), wrap)

    def train_step(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        return self.learner.train_step(micro_batches)

    def train_plan_step(self, plan, minibatch: int, advantages: dict[str, float],
                        trajectory_versions: dict[str, int] | None = None) -> dict[str, float]:
        """One optimizer step on minibatch `minibatch` of a data-plane plan: this rank reads only its
        own share (`dataplane.loader(plan, rank)`), straight from the shards."""
        import dataplane

        if plan.ranks != self.world:
            raise ValueError(f"plan made for {plan.ranks} ranks, the learner group has {self.world}")
        packs = []
        for b in dataplane.loader(plan, rank=self.rank, minibatches=[minibatch], prefetch=0):
            pb = PackedBatch.from_dataplane(b, advantages, trajectory_versions=trajectory_versions)
            if pb is not None:
                packs.append(pb)
        return self.learner.train_step(packs)

    def learner_call(self, method: str, *args):
        """`method` of this rank's learner (a learner kind's own steps, e.g. OPD's), with the rank's index
        as the first argument."""
        return getattr(self.learner, method)(self.rank, *args)

    def set_policy_version(self, version: int) -> None:
        self.learner.policy_version = int(version)

    def get_policy_version(self) -> int:
        return self.learner.policy_version

    def weights(self, live: bool = False) -> dict[str, torch.Tensor]:
        """Copies on the CPU (one copy from any device), or `live`: the parameter tensors themselves."""
        if live:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def rng_state(self) -> dict:
        from learner.checkpoint import capture_rng

        return capture_rng()

    def save_checkpoint(self, root: str | Path, iteration: int, rng_states: list[dict] | None = None,
                        extra: dict | None = None) -> str:
        from learner.checkpoint import save_checkpoint

        return str(save_checkpoint(root, iteration, self.model, self.tokenizer, self.learner.state(),
                                   rng_states or [self.rng_state()], extra))

    def load_checkpoint(self, path: str | Path) -> dict:
        """Weights, optimizer, schedule, step, version and this rank's RNG from a checkpoint."""
        from learner.checkpoint import load_into

        return load_into(path, self.model, self.learner, self.rank)

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _get_first_error(refs: list) -> list:
    """ray.get of every rank's result, raising on the first failure (live ranks may be stuck waiting
    for the failed one in a collective, so waiting for all would hang)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)


PLACEMENT_WAIT_S = 120.0  # longest wait for the ranks' placement group before it is an error


class LearnerGroup:
    """N learner ranks; one rank runs in this process, more run as Ray actors."""

    def __init__(self, cfg, policy: PolicyConfig | str | Path, num_cpus_per_rank: float = 1.0,
                 dtype: str | None = None, make_learner=None):
        self.cfg = cfg
        self.ranks = cfg.learner.ranks
        self.actors = []
        self.broken = False  # a rank died: the rest cannot leave their collective, only be killed
        self.local: LearnerWorker | None = None
        if self.ranks == 1:
            self.local = LearnerWorker(cfg, policy, dtype=dtype, make_learner=make_learner)
            return
        import ray

        if not ray.is_initialized():
            raise RuntimeError("a learner group of more than one rank needs ray.init() first")
        gpus = 1 if pick_device(cfg.learner.device).type == "cuda" else 0
        cpus = max(num_cpus_per_rank, getattr(cfg.learner, "cpus_per_rank", 0.0))
        Actor = ray.remote(num_cpus=cpus, num_gpus=gpus)(LearnerWorker)
        self.pg, options = None, [{} for _ in range(self.ranks)]
        if cpus or gpus:  # the ranks as one placement group (a bundle per rank), placed by the configured strategy
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v}
            self.pg = placement_group([dict(bundle) for _ in range(self.ranks)], strategy=cfg.learner.placement)
            if not self.pg.wait(timeout_seconds=PLACEMENT_WAIT_S):
                ray.util.remove_placement_group(self.pg)
                raise RuntimeError(f"learner: {self.ranks} ranks of {bundle} ({cfg.learner.placement}) could not be "
                                   f"placed in {PLACEMENT_WAIT_S:.0f}s; the cluster lacks the resources")
            options = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)}
                       for r in range(self.ranks)]
        self.actors = [Actor.options(**options[r]).remote(cfg, policy, r, self.ranks, dtype, join=False,
                                                          make_learner=make_learner)
                       for r in range(self.ranks)]
        # Rank 0 hosts the process group's store, so the address must be on rank 0's node.
        master = ray.get(self.actors[0].rendezvous.remote())
        try:
            _get_first_error([a.join.remote(master) for a in self.actors])
        except Exception:
            self.broken = True  # the other ranks wait in the rendezvous: kill them, do not hang
            self.close()
            raise

    def _call(self, method: str, per_rank_args: list[tuple] | None = None):
        if self.local is not None:
            return [getattr(self.local, method)(*(per_rank_args[0] if per_rank_args else ()))]
        import ray

        refs = [getattr(a, method).remote(*(per_rank_args[r] if per_rank_args else ())) for r, a in enumerate(self.actors)]
        try:
            return _get_first_error(refs)
        except ray.exceptions.RayActorError as exc:
            self.broken = True
            # A lost rank leaves the others inside a collective: the group cannot continue.
            raise RuntimeError(f"a learner rank died during {method} ({type(exc).__name__}); close this group "
                               "and start a new one from the latest checkpoint") from exc

    def train_step(self, per_rank: list[list[PackedBatch]]) -> dict[str, float]:
        """One optimizer step; `per_rank[r]` are rank r's micro-batches. Returns the global metrics."""
        if len(per_rank) != self.ranks:
            raise ValueError(f"train_step got micro-batches for {len(per_rank)} ranks, the group has {self.ranks}")
        return self._call("train_step", [(mbs,) for mbs in per_rank])[0]

    def train_plan_step(self, plan, minibatch: int, advantages: dict[str, float],
                        trajectory_versions: dict[str, int] | None = None) -> dict[str, float]:
        """One optimizer step on a minibatch of a data-plane plan made for this many ranks; each rank
        loads its own share. Returns the global metrics."""
        args = (plan, minibatch, advantages, trajectory_versions)
        return self._call("train_plan_step", [args] * self.ranks)[0]

    def learner_call(self, method: str, *args):
        """`method(rank, *args)` of every rank's learner; rank 0's result (steps return global metrics)."""
        return self._call("learner_call", [(method, *args)] * self.ranks)[0]

    def set_policy_version(self, version: int) -> None:
        self._call("set_policy_version", [(version,)] * self.ranks)

    def weights(self, live: bool = False) -> dict[str, torch.Tensor]:
        """Rank 0's parameters on the CPU (every rank holds the same after a step). `live` with rank 0 in
        this process: its parameter tensors themselves, on its device, no copy, for a consumer in this
        process that copies them before the next step (`Engine.load_weights` does, device to device);
        with Ray ranks `live` is ignored (the weights cross a process boundary as CPU copies)."""
        if self.local is not None:
            return self.local.weights(live)
        import ray

        return ray.get(self.actors[0].weights.remote())

    @property
    def policy_version(self) -> int:
        return self._call("get_policy_version")[0]

    def publish(self, live: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """A new policy version: every rank's version + 1 (the staleness of tokens is counted from it);
        returns the weights to hand to the rollout pool (`RolloutPool.update_weights(state, version)`), or
        with `live` to an in-process worker (`weights(live=True)`)."""
        version = self.policy_version + 1
        self.set_policy_version(version)
        return self.weights(live), version

    def save_checkpoint(self, root: str | Path, iteration: int, extra: dict | None = None) -> Path:
        """`extra`: the loop's own state saved in the same atomic set (learner.checkpoint.save_checkpoint)."""
        rngs = self._call("rng_state")
        if self.local is not None:
            return Path(self.local.save_checkpoint(root, iteration, rngs, extra))
        import ray

        return Path(ray.get(self.actors[0].save_checkpoint.remote(str(root), iteration, rngs, extra)))

    def load_checkpoint(self, path: str | Path) -> dict:
        return self._call("load_checkpoint", [(str(path),)] * self.ranks)[0]

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
            return
        import ray

        if not self.broken:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # a dead or stuck rank: killing below is all that is left
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
