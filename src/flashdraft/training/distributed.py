"""The process group of a torchrun job: started from torchrun's environment, ended while the interpreter is alive.

Ending it is the delicate half. `destroy_process_group` frees a gloo group only once nothing else holds it, and
two things do after training: a DDP reducer (`Trainer.unwrap` drops it) and, for anything FSDP2 sharded, DTensor's
dispatch caches, which keep the spec of every DTensor op they ran (FSDP2's all-gathers, the optimizer's updates)
and through it the device mesh and its groups. A group still held is freed at interpreter exit instead, where
gloo's threads can abort the process (SIGABRT, "terminate called ...") after the job's work is done: the launcher
then reports a failed run. So the callers drop their sharded modules first, and `end_distributed` empties those
caches before destroying the groups.
"""

from __future__ import annotations

import gc
import importlib
import os

import torch
import torch.distributed as dist

# DTensor's caches that hold meshes (torch 2.13; private, so each one is optional): module, attribute path
_DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),  # op sharding, Python and C++ fast path
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    (
        "torch.distributed.tensor._sharding_prop",
        "ShardingPropagator._propagate_tensor_meta_cached.cache_clear",
    ),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def init_distributed(single_group: bool = False) -> tuple[int, int, str | None]:
    """(rank, world size, device) of this process. torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; gloo on CPU, nccl on
    GPUs. `single_group`: a process group even for one process (a sharded model needs one: FSDP2 at world size 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not single_group:
        return 0, 1, None
    if world <= 1 and "MASTER_ADDR" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return dist.get_rank(), world, f"cuda:{local_rank}"
    dist.init_process_group("gloo")
    return dist.get_rank(), world, "cpu"


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def end_distributed(barrier: bool = True) -> None:
    """Wait for every rank (unless `barrier` is False: the caller's ranks already met), then free the process
    groups now, while the interpreter is fully alive. Drop every sharded module and DDP wrapper first."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if barrier:
        dist.barrier()
    gc.collect()  # FSDP2 modules are reference cycles
    release_dtensor_caches()
    dist.destroy_process_group()
    gc.collect()


def release_dtensor_caches() -> None:
    """Empty DTensor's dispatch caches (module docstring: they hold the device meshes and their groups)."""
    for module_name, path in _DTENSOR_CACHES:
        try:
            obj = importlib.import_module(module_name)
            for name in path.split("."):
                obj = getattr(obj, name)
        except (ImportError, AttributeError):  # another torch: that cache is not there
            continue
        obj()
