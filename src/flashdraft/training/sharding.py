"""A frozen target too large for one GPU, sharded across the ranks of a torchrun job with FSDP2.

    rank 0: whole model on the CPU (from_pretrained)    every rank: the same model on the meta device
                     \\                                   |  fully_shard(each decoder layer), root on the decoder
                      `-- scatter dim-0 shards, broadcast the rest --> each rank holds 1/world of every layer

Why FSDP2 (`fully_shard`) and not tensor parallelism: a TP plan exists only for the families transformers wrote one
for, and none of the hybrids (GatedDeltaNet, Mamba) whose drafters users train now, while FSDP2 shards any module
tree. It is also the right shape for a frozen model: each rank runs its own sequences (data parallel, as the
drafter's DDP already is), and a layer's weights are all-gathered just before its forward and freed after it, so a
rank holds its 1/world of the target plus one or two whole layers at a time. The activations, hence the taps at
`target_layer_ids` and the final hidden state, are computed from the very same weights as in one process.

What stays whole on every rank: the token embedding, the final norm and the LM head. The drafter reads the
embedding (block inputs) and the head (its loss) outside the target's forward, and they are a small part of a large
target (3 GB of 244 for Qwen3.5-122B-A10B; `memory_plan` counts them).

Every FSDP forward is a collective: all ranks must run the same number of target forwards (the trainer gives every
rank the same number of sequences per step), and nothing may run the target on one rank alone (evaluation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..targets.model_parts import decoder_layers
from ..targets.target import Target, TargetError, parse_device, parse_dtype


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of `module` is a DTensor (FSDP2-sharded)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a possibly sharded parameter (a collective for a DTensor: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_decoder(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over the decoder layers of `model` (frozen: no gradient is ever reduced). Each layer is one unit; the
    decoder is the root, keeping the embedding and its final norm whole (ignored), so that one forward prefetches the
    next layer's all-gather while this one computes."""
    from torch.distributed.fsdp import fully_shard

    num_layers = int(_text_config(model).num_hidden_layers)
    layers = decoder_layers(model, num_layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    root = (
        decoder if isinstance(decoder, nn.Module) and any(m is layers for m in decoder.modules()) else model
    )
    in_layers = {id(p) for p in layers.parameters()}
    whole = {p for p in root.parameters() if id(p) not in in_layers}
    fully_shard(root, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    return model


def shard_drafter(draft: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """FSDP2 over a drafter being trained: each layer's attention and the rest of the layer one unit each, fc and
    the norms in the root. The candidate
    selector of a DFlash2 drafter is called piecewise by its loss, outside any FSDP forward, so it stays whole;
    returns its parameters, whose gradients the trainer averages itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in draft.layers:
        # The drafter projects the context's K/V with each layer's attention before running the layer: the
        # attention is its own unit, and `project_kv` gathers its weights as its forward does.
        fully_shard(layer.self_attn, mesh=mesh)
        register_fsdp_forward_method(layer.self_attn, "project_kv")
        fully_shard(layer, mesh=mesh)
    selector = getattr(draft, "candidate_selector", None)
    whole = list(selector.parameters()) if selector is not None else []
    fully_shard(draft, mesh=mesh, ignored_params=set(whole) or None)
    return whole


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@torch.no_grad()
def load_sharded_target(
    name_or_path: str, dtype: torch.dtype | str | None, device: str | torch.device | None
) -> Target:
    """The target `name_or_path` sharded across the initialised process group: rank 0 reads the checkpoint once
    (CPU memory, not GPU), every rank builds the model on the meta device, shards it, and receives its part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..models.packs import resolve_model
    from ..targets.target import default_dtype

    if not (dist.is_available() and dist.is_initialized()):
        raise TargetError("--shard-target needs a process group: launch with torchrun --nproc-per-node N")
    rank = dist.get_rank()
    dev = parse_device(device)
    dtype = parse_dtype(dtype) or default_dtype(dev)
    # One rank fetches a pack, the others wait and find it.
    path = resolve_model(name_or_path) if rank == 0 else None
    dist.barrier()
    path = path or resolve_model(name_or_path, auto_fetch=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None  # training needs none (data is token ids); decoding, which does, never runs sharded
    failure: list[str | None] = [None]
    source = None
    try:
        config = AutoConfig.from_pretrained(path)
        source = AutoModelForCausalLM.from_pretrained(path, dtype=dtype) if rank == 0 else None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        failure = [f"cannot load target {name_or_path!r}: {first}"]
    dist.broadcast_object_list(
        failure, src=0
    )  # every rank stops if rank 0 could not load (none waits forever)
    if failure[0] is not None:
        raise TargetError(failure[0])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    shard_decoder(model, mesh)
    model.to_empty(device=dev)
    if getattr(_text_config(model), "tie_word_embeddings", False):
        model.tie_weights()  # to_empty may have made the head its own tensor again

    # Every parameter and buffer, in the same order on every rank; rank 0 sends, the others receive.
    src = dict(source.named_parameters()) if source is not None else {}
    src_buffers = dict(source.named_buffers()) if source is not None else {}
    for name, param in model.named_parameters():
        full = src[name].to(dev, param.dtype) if rank == 0 else None
        if isinstance(param, DTensor):
            empty = full if full is not None else torch.empty(param.shape, dtype=param.dtype, device=dev)
            part = distribute_tensor(empty, mesh, param.placements or [Shard(0)], src_data_rank=0)
            param.to_local().copy_(part.to_local())
        else:
            if full is not None:
                param.copy_(full)
            dist.broadcast(param.data, src=0)
    for name, buf in model.named_buffers():
        if rank == 0:
            buf.copy_(src_buffers[name].to(dev, buf.dtype))
        dist.broadcast(buf, src=0)
    # Tensors kept as plain attributes (a RoPE's `original_inv_freq`) are neither: still on meta off rank 0.
    modules = dict(source.named_modules()) if source is not None else {}
    for mod_name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                t = getattr(modules[mod_name], attr) if rank == 0 else torch.empty_like(value, device="cpu")
                t = t.to(dev).contiguous()
                dist.broadcast(t, src=0)
                setattr(module, attr, t)
    if source is not None:
        model.generation_config = source.generation_config
    del source, src, src_buffers, modules
    return Target(model, tokenizer, name=name_or_path)
