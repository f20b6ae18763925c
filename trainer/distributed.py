"""The trainer's ranks: torch.distributed set up from torchrun's environment, and the few
collectives the loop needs.

`flywheel trainer --nproc N` (or `torchrun --nproc-per-node N -m trainer.launch`) starts N ranks.
Each is a full trainer process: it reads its own share of the rollouts partitions, computes the
loss of its own rollouts, and takes part in every step, so the weights stay identical on every
rank. What the ranks exchange (docs/SCALING.md, "Trainer"):

- gradients: summed over ranks (`all_reduce`, in buckets) after each rank's backward, with the
  loss of each rank divided by the GLOBAL token counts, so the sum is the gradient of the global
  batch's loss (what one process would compute on the same rollouts, up to summation order);
- small control objects (batch sizes, rewards for the advantages, metrics, the ship decision,
  the ship's registered version): pickled over a gloo group, so they work beside NCCL on GPUs;
- barriers with a timeout and an error that names the phase and the ranks that did not arrive.

`World.single()` is the one-process trainer: every collective is the identity and nothing is
initialised, so a trainer started without torchrun runs exactly the code it always ran.
The backend is gloo on CPU and NCCL when CUDA is available (`FLYWHEEL_TRAINER_DIST_BACKEND`
overrides it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: launch.py reads WORLD_SIZE before torch
    import torch

log = logging.getLogger(__name__)


class PeerFailure(RuntimeError):
    """Another rank's part of a collective step failed (this rank's own part did not)."""


class BarrierTimeout(RuntimeError):
    """Not every rank reached a barrier within its timeout."""


def torchrun_world_size() -> int:
    """The WORLD_SIZE torchrun set for this process (1 when not started by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from exc


@dataclass
class World:
    """This process's place among the trainer's ranks, and the collectives over them."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 1800.0
    _control: Any = None  # the gloo group for object collectives and barriers

    # --- set-up ----------------------------------------------------------------------------------
    @classmethod
    def single(cls) -> World:
        return cls()

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float = 1800.0) -> World:
        """Join the process group torchrun described (RANK, WORLD_SIZE, MASTER_ADDR...), or
        `single()` when WORLD_SIZE is absent or 1."""
        size = torchrun_world_size()
        if size == 1:
            return cls.single()
        import torch
        import torch.distributed as dist

        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                store=_attempt_store(rank, size, timeout),
                rank=rank,
                world_size=size,
                timeout=timeout,
            )
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        log.info("rank %d of %d (local rank %d, backend %s)", rank, size, local_rank, backend)
        return cls(rank, size, local_rank, backend, timeout_s, control)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # --- collectives -------------------------------------------------------------------------------
    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others' argument is ignored)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def sum(self, value: int) -> int:
        return sum(self.all_gather(int(value)))

    def any(self, flag: bool) -> bool:
        return any(self.all_gather(bool(flag)))

    def barrier(self, phase: str, timeout_s: float | None = None) -> None:
        """Wait until every rank is here; BarrierTimeout naming `phase` and the missing ranks."""
        if not self.distributed:
            return
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s if timeout_s is not None else self.timeout_s)
        group = self._control
        try:
            if self.backend == "gloo" or group is not None:
                dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
            else:  # pragma: no cover - gloo always has monitored_barrier
                dist.barrier()
        except RuntimeError as exc:
            raise BarrierTimeout(
                f"rank {self.rank}: not every rank reached '{phase}' within {timeout.total_seconds():.0f}s "
                f"({exc}); a rank that died is restarted by torchrun (--max-restarts), and the ship "
                "protocol resumes from the saved state"
            ) from exc

    def all_reduce_grads(self, params: list[torch.Tensor], bucket_mb: float = 25.0) -> None:
        """Sum the gradients of `params` over ranks in place, in buckets of about `bucket_mb` MiB.

        A parameter without a gradient (this rank had no rollouts, or the parameter took no part
        in its forward) contributes zeros and receives the sum, so every rank ends with the same
        gradients whatever it computed."""
        if not self.distributed:
            return
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        limit = int(bucket_mb * 2**20)
        bucket: list[torch.Tensor] = []
        size = 0

        def flush() -> None:
            grads = [p.grad for p in bucket]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

        for p in params:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size >= limit:
                flush()
                bucket, size = [], 0
        if bucket:
            flush()


def _attempt_store(rank: int, size: int, timeout: timedelta) -> Any:
    """The rendezvous store of this start, keys prefixed by torchrun's restart count.

    torchrun's agent keeps one store across elastic restarts, so without the prefix a restarted
    rank can read the address a killed rank published in an earlier attempt and fail to connect
    (gloo: "connectFullMesh failed ... Connection refused"), or wait forever on a key that
    attempt already consumed. Under torchrun the agent hosts the store; started by hand with
    MASTER_ADDR/MASTER_PORT, rank 0 hosts it."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"flywheel/attempt-{attempt}", store)


def owned_partitions(partitions: list[int], world: World) -> list[int]:
    """The rollouts partitions rank `world.rank` reads: p % size == rank. A request_id lives on one
    partition (it is the record key), so every rollout is read, and trained, by one rank only."""
    return sorted(p for p in partitions if p % world.size == world.rank)


def allocate(counts: list[int], total: int) -> list[int]:
    """Split a global batch of `total` rollouts over ranks holding `counts` ready rollouts: one at a
    time, round robin over the ranks that still have some, so a rank never gets more than it
    holds and the split is as even as the data allows. Deterministic: every rank computes the
    same split from the same gathered counts."""
    take = [0] * len(counts)
    left = min(total, sum(counts))
    while left > 0:
        for r, n in enumerate(counts):
            if left > 0 and take[r] < n:
                take[r] += 1
                left -= 1
    return take
