"""How much memory one rank of `flashdraft train` needs, from the configs alone, before anything is loaded.

Per rank (GPU, or the host's RAM on a CPU run), bytes:

    target       P_whole * d_t  +  P_layers * d_t / world  +  2 * max_layer * d_t       sharded (FSDP2): own shard,
                 (P_whole + P_layers) * d_t                                              plus the layer being
                                                                                         all-gathered and the next
    drafter      P_d * (4 weights + 4 grads + 8 AdamW [+ 4 foreach AdamW step temporaries, off CUDA]
                        [+ 2 bf16 autocast copies])           DDP's buckets are the gradients (bucket views)
    features     b * S * taps * H * (d_t + d_t + 4)          hooks' outputs, their concatenation, fp32 copy
    target pass  T * (4H + 2(q + 2kv) + 3 * I_eff) * d_t     one decoder layer at a time, no autograd
    drafter pass b * per_layer(S, Q) * layers * d_a          saved for backward; Q = anchors * B query slots
    loss         chunk * V * 4 * 2  +  b * Q * H * 4         one logit chunk, the hidden gradient

with d_t the target's dtype bytes, d_a the drafter's activation bytes (2 under bf16 autocast), S the sequence
length, b the sequences in a micro-batch (the drafter keeps all of them for one backward; the target runs them one
at a time unless `padded_batches`, T = S or b * S). Parameter counts come from building both models on the meta
device, so any family transformers knows (MoE, hybrids) is counted exactly; the activations are an estimate whose
error against measured peaks is in `benchmarks/memory-plan.md`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 1 << 30
# Beyond the tensors this plan counts: the CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation.
GPU_RESERVE = 0.10
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


class PlanError(ValueError):
    """The run will not fit: the message names what to change."""


@dataclass
class TargetShape:
    """What the plan needs to know of a target, read from its config and its meta-device module tree."""

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_params: list[int]  # per decoder layer
    whole_params: int  # embedding, final norm, LM head (and anything else outside the layers)
    attention_width: int  # (q + 2 kv) heads * head_dim, of the widest mixer
    mlp_width: int  # 3 * the MLP width one token passes through (routed experts * their width + shared)

    @property
    def params(self) -> int:
        return self.whole_params + sum(self.layer_params)


def target_shape(config: Any, name: str = "target") -> TargetShape:
    """Count the target's parameters by building it on the meta device (no memory, no weights); an image-text
    model that has no text-only class (LLaVA, Qwen3-VL, ...) whole, vision tower included, as it is loaded."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ..targets.model_parts import causal_lm_class, decoder_layers, image_text_class

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    whole = image_text_class(config) is not None and not causal_lm_class(config)
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if whole else AutoModelForCausalLM).from_config(config)
    layers = decoder_layers(model, int(text.num_hidden_layers))
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    h = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (h // heads if heads else 0))
    attention = (heads + 2 * kv) * head_dim
    linear = 2 * int(getattr(text, "linear_num_key_heads", 0) or 0) * int(
        getattr(text, "linear_key_head_dim", 0) or 0
    ) + 2 * int(getattr(text, "linear_num_value_heads", 0) or 0) * int(
        getattr(text, "linear_value_head_dim", 0) or 0
    )
    routed = int(getattr(text, "num_experts_per_tok", 0) or 0)
    expert = int(getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0) or 0)
    shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    dense = int(getattr(text, "intermediate_size", 0) or 0)
    mlp = 3 * max(dense, routed * expert + shared)
    return TargetShape(
        name=name,
        hidden_size=h,
        num_layers=len(layer_params),
        vocab_size=int(text.vocab_size),
        layer_params=layer_params,
        whole_params=total - sum(layer_params),
        attention_width=max(attention, linear),
        mlp_width=mlp,
    )


def drafter_params(draft_config: Any) -> int:
    return drafter_shape(draft_config)[0]


def drafter_shape(draft_config: Any) -> tuple[int, int]:
    """(trainable parameters, those of its largest layer) of a drafter, built on the meta device."""
    from ..drafter.model import DFlashDraftModel

    with torch.device("meta"):
        draft = DFlashDraftModel(draft_config)
    total = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return total, max(sum(p.numel() for p in layer.parameters()) for layer in draft.layers)


@dataclass
class PlanRow:
    what: str
    bytes: int
    how: str
    phase: str = (
        "always"  # "always": held for the whole step; "pass": forward/backward; "step": optimizer step
    )


@dataclass
class MemoryPlan:
    target: str
    device: str
    world: int
    shard_target: bool
    shard_drafter: bool
    capacity: int | None  # bytes one rank may use (None: unknown)
    rows: list[PlanRow] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The peak: what is always held, plus the larger of the pass (activations) and the optimizer step (which
        runs once backward has freed the activations)."""
        held = sum(r.bytes for r in self.rows if r.phase == "always")
        pass_ = sum(r.bytes for r in self.rows if r.phase == "pass")
        step = sum(r.bytes for r in self.rows if r.phase == "step")
        return held + max(pass_, step)

    @property
    def usable(self) -> int | None:
        if self.capacity is None:
            return None
        return int(self.capacity * (1 - GPU_RESERVE)) if self.device == "cuda" else self.capacity

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    @property
    def mode(self) -> str:
        t = f"target sharded over {self.world} (FSDP2)" if self.shard_target else "target whole on each rank"
        if self.shard_drafter:
            return f"{t}, drafter sharded (FSDP2)"
        return f"{t}, drafter replicated" + (" (DDP)" if self.world > 1 else "")

    def lines(self) -> list[str]:
        """The plan as plain text lines (the table `--plan` prints)."""
        width = max(len(r.what) for r in self.rows)
        out = [f"memory plan for {self.target}: {self.world} rank(s), {self.mode}"]
        out += [f"  {r.what:<{width}}  {r.bytes / GIB:8.2f} GiB  {r.how}" for r in self.rows]
        out.append(f"  {'per rank':<{width}}  {self.total / GIB:8.2f} GiB")
        if self.capacity is not None:
            room = f"{self.usable / GIB:.1f} GiB usable of {self.capacity / GIB:.1f} GiB"
            out.append(f"  {'available':<{width}}  {room}" + ("" if self.fits else "  -> does not fit"))
        return out

    def refusal(self) -> str | None:
        """One line naming what to change, or None when the run fits."""
        if self.fits:
            return None
        need, have = self.total / GIB, self.usable / GIB
        where = "GPU" if self.device == "cuda" else "host"
        big = max(self.rows, key=lambda r: r.bytes)
        if not self.shard_target and self.rows[0].bytes > 0.4 * self.usable:
            fix = "shard the target over more GPUs: torchrun --nproc-per-node N ... --shard-target"
        elif big.what == "drafter training state" and not self.shard_drafter:
            fix = "shard the drafter's training state too: torchrun --nproc-per-node N ... --shard-drafter"
        elif big.what.startswith("target"):
            fix = "add ranks (torchrun --nproc-per-node N --shard-target), or a 16-bit --target-dtype"
        else:
            fix = (
                "lower --batch-size, --num-anchors or --max-length (more --grad-accum keeps the global batch)"
            )
        return (
            f"this run needs about {need:.1f} GiB per {where} and {have:.1f} GiB is usable "
            f"(largest: {big.what}, {big.bytes / GIB:.1f} GiB); {fix}. `flashdraft train --plan` shows the table"
        )


def plan_training(
    target: TargetShape,
    draft_config: Any,
    *,
    world: int = 1,
    shard_target: bool = False,
    shard_drafter: bool = False,
    batch_size: int = 1,
    seq_len: int = 3072,
    num_anchors: int = 512,
    block_size: int = 16,
    lm_head_chunk: int = 1024,
    target_dtype: torch.dtype = torch.bfloat16,
    bf16: bool = True,
    padded_batches: bool = False,
    kl: bool = False,
    device: str = "cuda",
    capacity: int | None = None,
) -> MemoryPlan:
    d_t = DTYPE_BYTES.get(target_dtype, 4)
    d_a = 2 if bf16 else 4
    h, s, b = target.hidden_size, seq_len, batch_size
    taps = int(draft_config.num_target_features)
    rows: list[PlanRow] = []
    layers = sum(target.layer_params)
    if shard_target:
        shard = target.whole_params + layers / world + 2 * max(target.layer_params)
        how = (
            f"{target.params / 1e9:.2f}B params x {d_t} B: embedding + head whole, layers / {world}, "
            "2 layers all-gathered"
        )
    else:
        shard, how = target.params, f"{target.params / 1e9:.2f}B params x {d_t} B, whole"
    rows.append(PlanRow("target weights", int(shard * d_t), how))

    p_d, p_layer = drafter_shape(draft_config)
    autocast = f" + {p_d / 1e6:.0f}M x 2 B bf16 autocast copies" if bf16 else ""
    if shard_drafter:
        state = p_d * 16 / world + (2 * p_d if bf16 else 0) + 2 * p_layer * 4
        how = f"{p_d / 1e6:.0f}M params x 16 B / {world} (fp32 weights, grads, AdamW){autocast}, 2 layers gathered"
    else:
        state = p_d * (16 + (2 if bf16 else 0))
        how = f"{p_d / 1e6:.0f}M params x 16 B (fp32 weights, grads as DDP's buckets, AdamW){autocast}"
    rows.append(PlanRow("drafter training state", int(state), how))
    share = world if shard_drafter else 1
    if device != "cuda":  # the trainer's AdamW is fused on CUDA; foreach elsewhere, with temporaries
        rows.append(
            PlanRow("optimizer step", p_d * 8 // share, "foreach AdamW temporaries, after backward", "step")
        )
        if world > 1:  # gloo reduces a copy of each gradient bucket (NCCL reduces the bucket in place)
            rows.append(
                PlanRow(
                    "gradient all-reduce", p_d * 4 // share, "gloo's copy of the gradient buckets", "pass"
                )
            )

    rows.append(
        PlanRow(
            "target features",
            b * s * taps * h * (2 * d_t + 4),
            f"{b} seq x {s} tokens x {taps} taps x {h} (hooks, concat, fp32 copy)",
            "pass",
        )
    )
    t_tokens = b * s if padded_batches else s
    pass_bytes = t_tokens * (4 * h + 2 * target.attention_width + target.mlp_width) * d_t
    if kl:
        pass_bytes += s * target.vocab_size * 4 * 2  # the target's distribution over the sequence, fp32
    rows.append(
        PlanRow(
            "target forward", int(pass_bytes), f"{t_tokens} tokens, one layer at a time, no autograd", "pass"
        )
    )

    c = draft_config
    q = min(num_anchors, s) * block_size  # query slots per sequence
    kv_width = c.num_key_value_heads * c.head_dim
    q_width = c.num_attention_heads * c.head_dim
    gqa = c.num_attention_heads // max(1, c.num_key_value_heads)
    # Saved for backward, per drafter layer: the context's K/V (projection, norm, RoPE, repeated for GQA on the
    # dense path) and the block's norms, q/k/v, attention output and MLP.
    ctx = s * kv_width * (2 * 3 + (2 * gqa if device != "cuda" else 0))
    blk = q * (3 * c.hidden_size + 3 * q_width + 2 * kv_width * 3 + 3 * c.intermediate_size + 2 * q_width)
    per_layer = (ctx + blk) * d_a
    # Off CUDA: dense boolean masks, one per layer type, which SDPA turns into a float mask saved by every layer.
    mask = b * q * (s + q) * (len(set(c.layer_types)) + 4 * c.num_hidden_layers) if device != "cuda" else 0
    fused = s * (3 * h) * 4  # fc output, hidden norm (fp32 statistics)
    draft_bytes = (
        b * (per_layer * c.num_hidden_layers + fused) + mask + per_layer * b
    )  # + one layer's gradients
    rows.append(
        PlanRow(
            "drafter activations",
            int(draft_bytes),
            f"{b} seq x {q} query slots ({min(num_anchors, s)} anchors x {block_size}) x {c.num_hidden_layers} layers"
            + (", dense masks" if mask else ", FlexAttention"),
            "pass",
        )
    )
    chunk = min(lm_head_chunk, b * q)
    loss = chunk * target.vocab_size * 4 + b * q * h * 4
    rows.append(
        PlanRow("LM-head loss", loss, f"{chunk}-row chunks x {target.vocab_size} vocab, fp32", "pass")
    )
    return MemoryPlan(
        target=target.name,
        device=device,
        world=world,
        shard_target=shard_target,
        shard_drafter=shard_drafter,
        capacity=capacity,
        rows=rows,
        settings=dict(batch_size=b, seq_len=s, num_anchors=num_anchors, block_size=block_size, bf16=bf16,
                      target_dtype=str(target_dtype).removeprefix("torch."), drafter_params=p_d),
    )  # fmt: skip


def fewest_ranks(target: TargetShape, draft_config: Any, settings: dict[str, Any], limit: int = 64) -> str:
    """' (fits with N ranks and --shard-target: <per-rank GiB>)' for the smallest N that fits, or why none does."""
    if settings.get("capacity") is None:
        return ""
    base = {k: v for k, v in settings.items() if k not in ("world", "shard_target", "shard_drafter")}
    for world in range(1, limit + 1):
        for shard_drafter in (False, True):
            plan = plan_training(target, draft_config, world=world, shard_target=True, shard_drafter=shard_drafter,
                                 **base)  # fmt: skip
            if plan.fits:
                flags = "--shard-target" + (" --shard-drafter" if shard_drafter else "")
                return f" (it fits over {world} ranks with {flags}: {plan.total / GIB:.1f} GiB each)"
    return f" (sharding alone over up to {limit} ranks does not make it fit: shrink the micro-batch)"


def largest_batch(target: TargetShape, draft_config: Any, settings: dict[str, Any], limit: int = 256) -> int:
    """The most sequences per micro-batch that the plan fits (1 when none does, or the capacity is unknown)."""
    if settings.get("capacity") is None:
        return 1
    best = 1
    for b in range(2, limit + 1):
        if not plan_training(target, draft_config, **{**settings, "batch_size": b}).fits:
            break
        best = b
    return best


def device_capacity(device: str, gpu_memory_gib: float | None = None) -> int | None:
    """Bytes one rank may use: the GPU's memory (or `gpu_memory_gib` for planning a GPU run elsewhere), the host's
    available memory for a CPU run."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB)
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            available = int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this host share its memory
        return available // max(1, ranks)
    return None


class _LiveTensors:
    """Bytes of live tensor storages: every storage an op creates, until it is freed (a dispatch mode; the
    storages of the modules and optimisers named at the start are counted from the start)."""

    def __init__(self) -> None:
        import weakref

        self._weakref = weakref
        self.live: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
            return
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.refs[key] = self._weakref.ref(storage)
        self.current += size
        self.peak = max(self.peak, self.current)
        self._weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def refresh(self) -> None:
        """Re-read every live storage's size: FSDP frees a gathered layer by resizing its storage to 0, not by
        dropping it, and no op reports that."""
        for key, ref in list(self.refs.items()):
            storage = ref()
            if storage is not None:
                size = storage.nbytes()
                self.current += size - self.live[key]
                self.live[key] = size
        self.peak = max(self.peak, self.current)


def measured_peak(run: Any, *tracked: Any) -> int:
    """Peak bytes of live tensors while `run()` executes, counting the parameters, buffers, gradients and optimiser
    states of the `tracked` modules and optimisers that already exist."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live = _LiveTensors()
    for thing in tracked:
        if isinstance(thing, torch.optim.Optimizer):
            for t in tree_leaves(thing.state_dict()["state"]):
                if isinstance(t, torch.Tensor):
                    live.add(t)
            continue
        for t in [*thing.parameters(), *thing.buffers()]:
            live.add(t)
            if t.grad is not None:
                live.add(t.grad)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_gather" in func.__name__ or "split_with_sizes_copy" in func.__name__:
                live.refresh()  # FSDP (un)sharding: storages resized in place
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    live.add(t)
            return out

    with Mode():
        run()
    return live.peak
