"""Training a DFlash drafter (the recipe z-lab never released; paper §3, SpecForge-compatible).

One training step, per sequence of prompt + target-generated answer (S tokens):

    features  = frozen target(sequence), taps at target_layer_ids            [S, T*H]   (online, or read offline)
    anchors   = N random answer positions t with t and t+1 supervised        re-sampled every epoch
    blocks    = [token(t), MASK x (B-1)] at positions t .. t+B-1             embedded by the target's embedding
    hidden    = drafter(blocks, context = all S features, num_blocks = N)    block j sees context < anchor_j
                                                                             and its own block only
    loss      = sum_k w_k CE(lm_head(hidden[j, k]), token[t_j + k]) / sum w  k >= 1, w_k = exp(-(k-1)/gamma),
                                                                             only supervised, in-range labels

Everything a step draws at random comes from generators seeded by (seed, epoch, sequence index), so a run that
is killed and resumed from a checkpoint takes exactly the same steps as one that never stopped, and a run split
over N processes (torchrun, DDP) takes the same steps as one process with the same global batch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..drafter.model import DFlashDraftModel
from ..files import atomic_write, atomic_write_text
from ..progress import progress_bar
from ..targets.target import Target
from .blocks import (
    Blocks,
    TrainError,
    default_gamma,
    draft_hidden_for_blocks,
    draft_hidden_for_padded_blocks,
    has_anchor,
    init_layers_from_target,
    make_blocks,
    pad_blocks,
    sample_anchors,
    slot_weights,
)
from .dataset import image_inputs
from .distributed import rank_and_world
from .export import evaluate_tau
from .loss import selector_loss, target_distribution, weighted_block_loss
from .sharding import is_sharded, shard_drafter

# ---------------------------------------------------------------------------------------------- the trainer


@dataclass
class TrainConfig:
    out_dir: str
    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    gamma: float | None = None  # None: from block size (paper)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    epochs: int = 6
    max_steps: int | None = None  # stop early (the schedule still spans `epochs` unless this is set)
    batch_size: int = 1  # sequences per micro-batch per process
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_length: int = 3072
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    lm_head_chunk: int = 1024
    intermediate_size: int | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    init_from: str | None = None  # start from an existing drafter checkpoint
    init_layers: str = (
        "random"  # new drafter's layers: "random" or "target-top" (copies of the target's top layers)
    )
    kl_weight: float = 0.0  # > 0: add kl_weight * KL(target || draft) per block slot (online features only)
    # "dflash2": a new drafter is DFlash2 (convolutions + candidate selector), and a v1 `init_from` becomes one
    # (its weights kept, the new parts initialised to change nothing); "dflash": v1 (a DFlash2 init_from stays DFlash2).
    arch: str = "dflash"
    selector_weight: float = (
        1.0  # DFlash2: weight of the candidate selector's cross-entropy (loss.selector_loss)
    )
    # The learning curve: every `eval_every` steps, τ on held-out prompts (fixed B) into OUT/eval_log.jsonl.
    eval_every: int = 0
    eval_datasets: tuple[str, ...] = ("gsm8k", "humaneval", "mt-bench")
    eval_samples: int = 8
    eval_max_new_tokens: int = 64
    bf16: bool | None = None  # None: bf16 autocast on CUDA, fp32 on CPU
    # One padded forward per micro-batch (target and drafter) instead of one per sequence: fewer, larger kernels for
    # a GPU that a per-sequence loop leaves waiting on launches (23 % busy on an H100). A CPU pays for the padding
    # instead (0.7x at 512 anchors), so it is opt-in; the device pipeline times both and keeps the faster. The KL term
    # and offline features keep the per-sequence path.
    padded_batches: bool = False
    # The drafter's weights, gradients and AdamW states split over the ranks (FSDP2) instead of replicated (DDP):
    # for drafters whose 16 bytes a parameter do not fit beside the target (memory_plan).
    shard_drafter: bool = False
    # The drafter's layers compiled (torch.compile, one module at a time; `$FLASHDRAFT_COMPILE` gives its options):
    # fused kernels and fewer launches where the shapes repeat (padded micro-batches). The device pipeline times it
    # beside the eager modes and keeps the fastest; same losses either way (tests/test_train.py).
    compile: bool = False
    progress: bool = True
    extra_meta: dict[str, Any] = field(default_factory=dict)


def _rekey_optimizer(state: dict[str, Any], key: dict[Any, Any]) -> dict[str, Any]:
    """An optimizer state dict with its parameters renamed through `key` (index <-> name)."""
    return {
        "state": {key[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]],
    }


def gpu_utilization(device: torch.device) -> int | None:
    """The GPU's busy share (%) over its last sampling period (NVML, as nvidia-smi reports it); None off a GPU or
    without NVML."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.utilization(device))
    except Exception:  # no pynvml / amdsmi, or a driver that does not say
        return None


def _atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


class Trainer:
    """Single-process or DDP (torchrun) training of a drafter on sequences of {input_ids, loss_mask[, features]}."""

    def __init__(
        self,
        target: Target,
        dataset: Sequence[dict[str, torch.Tensor]],
        config: TrainConfig,
        draft: DFlashDraftModel | None = None,
    ) -> None:
        self.target = target
        self.dataset = dataset
        self.cfg = config
        self.rank, self.world = rank_and_world()
        self.device = target.device
        if draft is None:
            if config.init_from:
                draft = DFlashDraftModel.from_pretrained(config.init_from, dtype=torch.float32)
            else:
                if config.mask_token_id is None:
                    raise TrainError("mask_token_id is required for a new drafter")
                draft = DFlashDraftModel.for_target(
                    target.model.config,
                    num_layers=config.num_layers,
                    block_size=config.block_size,
                    mask_token_id=config.mask_token_id,
                    target_layer_ids=config.target_layer_ids,
                    intermediate_size=config.intermediate_size,
                    vocab_size=target.vocab_size,
                    seed=config.seed,
                    input_embedding_scale=target.input_embedding_scale,
                    arch=config.arch,
                )
                if config.init_layers == "target-top":
                    init_layers_from_target(draft, target)
                elif config.init_layers != "random":
                    raise TrainError(
                        f"init_layers must be 'random' or 'target-top', got {config.init_layers!r}"
                    )
        if config.arch == "dflash2":
            draft = draft.as_dflash2()
        self.target_sharded = is_sharded(target.model)
        if self.target_sharded and config.eval_every:
            raise TrainError(
                "--eval-every runs the target on rank 0 alone, which a sharded target cannot do: evaluate the "
                "exported drafter with vLLM / SGLang or `flashdraft eval` instead"
            )
        target.check_drafter(draft.config)
        if config.block_size > draft.config.block_size:
            raise TrainError(
                f"block_size {config.block_size} exceeds the drafter's {draft.config.block_size}"
            )
        self.draft = draft.to(self.device).float().train()
        if config.compile:
            from ..engine.compiled import fresh_options
            from ..kernels.plan import compile_options

            options = compile_options(self.device, training=True)  # no CUDA graphs, nothing frozen:
            for layer in self.draft.layers:  # shapes change with every micro-batch
                layer.compile(dynamic=None, **fresh_options(options))
        self.block_size = config.block_size
        self.gamma = config.gamma or default_gamma(self.block_size)
        self.weights = slot_weights(self.block_size, self.gamma)
        self.use_bf16 = config.bf16 if config.bf16 is not None else self.device.type == "cuda"
        self.model: torch.nn.Module = self.draft
        self.drafter_sharded = config.shard_drafter
        self._replicated: list[torch.nn.Parameter] = []  # drafter parameters left whole by the sharding
        if config.shard_drafter:
            if not (dist.is_available() and dist.is_initialized()):
                raise TrainError(
                    "--shard-drafter needs a process group: launch with torchrun --nproc-per-node N"
                )
            if config.eval_every:
                raise TrainError("--eval-every needs the whole drafter on rank 0: train it replicated")
            self._replicated = shard_drafter(self.draft, self.device)
        elif self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # Gradients as views of DDP's buckets: one copy of them, not two (memory_plan counts one).
            self.model = DDP(
                self.draft,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
        # Sequences with no valid anchor (answers shorter than 2 tokens) cannot teach anything.
        self.indices = [
            i for i in range(len(dataset)) if has_anchor(dataset[i]["loss_mask"][: config.max_length])
        ]
        if not self.indices:
            raise TrainError("no training sequence has two consecutive supervised (answer) tokens")
        self.global_batch = config.batch_size * config.grad_accum * self.world
        self.steps_per_epoch = max(1, len(self.indices) // self.global_batch)
        self.total_steps = config.max_steps or self.steps_per_epoch * config.epochs
        schedule_steps = (
            self.steps_per_epoch * config.epochs if config.max_steps is None else config.max_steps
        )
        # Fused on CUDA: one kernel, and none of foreach's step temporaries (a 2B drafter's 8 GB).
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=config.lr, betas=config.adam_betas, weight_decay=config.weight_decay,
            fused=self.device.type == "cuda",
        )  # fmt: skip
        warmup = max(1, int(round(config.warmup_ratio * schedule_steps)))

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, schedule_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)
        self.step = 0
        self.out_dir = Path(config.out_dir)
        self.ckpt_path = self.out_dir / "checkpoints" / "last.pt"
        self.log_path = self.out_dir / "train_log.jsonl"
        self.eval_path = self.out_dir / "eval_log.jsonl"
        self.wall_s = 0.0
        # What training has seen so far (checkpointed): the learning curve's x axis.
        self.seen = {"sequences": 0, "blocks": 0, "supervised_tokens": 0}

    # ------------------------------------------------------------------ data order
    def _epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.indices), generator=g).tolist()

    def _step_indices(self, step: int) -> tuple[list[list[int]], int]:
        """This rank's micro-batches (lists of dataset indices) for a global optimizer step."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = [self.indices[i] for i in self._epoch_order(epoch)]
        global_ids = order[k * self.global_batch : (k + 1) * self.global_batch]
        mine = global_ids[self.rank :: self.world]  # interleaved shards: same global batch for any world size
        bs = self.cfg.batch_size
        return [mine[i : i + bs] for i in range(0, len(mine), bs)], epoch

    def _features(self, item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the drafter's context features [S, T*H], the target's final hidden states [S, H] when the KL term
        needs them: one more tap of the same forward)."""
        ids = item["input_ids"][: self.cfg.max_length].to(self.device)
        taps = list(self.draft.config.target_layer_ids)
        if "features" in item:
            if self.cfg.kl_weight > 0:
                raise TrainError(
                    "the KL term needs the target's own distribution: train with online features"
                )
            return item["features"][: self.cfg.max_length].to(self.device, torch.float32), None
        images = image_inputs(
            self.target, item, ids[None], "with images"
        )  # its pixels, redone from the files
        if self.cfg.kl_weight <= 0:
            return self.target.features(ids[None], taps, images)[0].float(), None
        both = self.target.features(ids[None], [*taps, self.target.num_layers - 1], images)[0].float()
        h = self.target.hidden_size
        return both[:, : len(taps) * h], both[:, len(taps) * h :]

    def _blocks(self, index: int, epoch: int) -> tuple[dict[str, torch.Tensor], Blocks, int]:
        item = self.dataset[index]
        ids = item["input_ids"][: self.cfg.max_length].long()
        mask = item["loss_mask"][: self.cfg.max_length].bool()
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) * 10_000_019 + index)
        anchors = sample_anchors(mask, self.cfg.num_anchors, g)
        blocks = make_blocks(
            ids, mask, anchors, self.block_size, self.draft.config.mask_token_id, self.weights
        )
        return item, blocks, anchors.numel()

    def _micro_batch_losses(self, mb: list[tuple[dict[str, torch.Tensor], Blocks, int]]):
        """(weighted loss, flat weights, per-supervised-row correctness, blocks) per forward of a micro-batch: one
        forward per sequence, or one padded forward for all of them (`padded_batches`)."""
        mb = [row for row in mb if row[2] > 0]
        if not mb:
            return
        one_by_one = len(mb) == 1 or self.cfg.kl_weight > 0 or "features" in mb[0][0]
        images = any("images" in item or "prompt_inputs" in item for item, _, _ in mb)
        if not self.cfg.padded_batches or one_by_one or images:
            for item, blocks, n in mb:
                features, last_hidden = self._features(item)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
                    hidden = draft_hidden_for_blocks(self.model, self.target, features, blocks, n)
                soft = None
                if last_hidden is not None:  # the target's distribution for each row's label position
                    probs, entropy = target_distribution(self.target, last_hidden, self.cfg.lm_head_chunk)
                    soft = (probs, entropy, (blocks.positions - 1).clamp(0, last_hidden.shape[0] - 1))
                part, correct = weighted_block_loss(
                    self.target, self.draft.config, hidden, blocks.labels, blocks.weights, self.cfg.lm_head_chunk,
                    soft=soft, kl_weight=self.cfg.kl_weight,
                )  # fmt: skip
                yield (
                    part + self._selector_part(hidden, blocks.labels, blocks.weights),
                    blocks.weights,
                    correct,
                    n,
                )
            return
        # Right padding: the target is causal, so a sequence's features do not see the padding after it.
        ids = [item["input_ids"][: self.cfg.max_length] for item, _, _ in mb]
        lengths = [int(x.numel()) for x in ids]
        padded = torch.zeros((len(ids), max(lengths)), dtype=torch.long)
        for i, x in enumerate(ids):
            padded[i, : lengths[i]] = x
        taps = list(self.draft.config.target_layer_ids)
        features = self.target.features(padded.to(self.device), taps).float()
        blocks = pad_blocks([b for _, b, _ in mb], self.block_size, self.draft.mask_token_id)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            hidden = draft_hidden_for_padded_blocks(
                self.model, self.target, features, blocks, self.block_size
            )
        weights = blocks.weights.flatten()
        hidden, labels = hidden.flatten(0, 1), blocks.labels.flatten()
        part, correct = weighted_block_loss(
            self.target, self.draft.config, hidden, labels, weights, self.cfg.lm_head_chunk
        )
        yield part + self._selector_part(hidden, labels, weights), weights, correct, sum(n for _, _, n in mb)

    def _selector_part(
        self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """DFlash2: the candidate selector's weighted cross-entropy (0 for a v1 drafter)."""
        selector = self.draft.candidate_selector
        if selector is None or self.cfg.selector_weight <= 0:
            return hidden.new_zeros((), dtype=torch.float32)
        part, _ = selector_loss(
            selector, self.target, self.draft.config, hidden, labels, weights, self.block_size,
            self.cfg.lm_head_chunk,
        )  # fmt: skip
        return self.cfg.selector_weight * part

    # ------------------------------------------------------------------ one optimizer step
    @torch.enable_grad()  # whatever the caller's mode (the eval and generate commands turn gradients off)
    def train_step(self) -> dict[str, Any]:
        micro_batches, epoch = self._step_indices(self.step)
        prepared = [[self._blocks(i, epoch) for i in mb] for mb in micro_batches]
        # Normalise by the weight of the whole global batch so any split (accumulation, ranks) gives one update.
        local_weight = sum(float(b.weights.sum()) for mb in prepared for _, b, _ in mb)
        total_weight = torch.tensor(local_weight, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(total_weight)
        total_weight = max(float(total_weight), 1e-8)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss_sum = 0.0
        slot_correct = torch.zeros(self.block_size)
        slot_count = torch.zeros(self.block_size)
        n_blocks = 0
        for m, mb in enumerate(prepared):
            sync = m == len(prepared) - 1
            ctx = contextlib.nullcontext()
            if self.drafter_sharded:
                self.draft.set_requires_gradient_sync(sync)  # reduce-scatter once, after the last micro-batch
            elif self.world > 1 and not sync:
                ctx = self.model.no_sync()
            with ctx:
                loss = torch.zeros((), device=self.device)
                for part, weights, correct, n in self._micro_batch_losses(mb):
                    loss = loss + part
                    slots = (torch.arange(weights.numel()) % self.block_size)[weights > 0]
                    slot_correct += torch.bincount(
                        slots, weights=correct.float().cpu(), minlength=self.block_size
                    )
                    slot_count += torch.bincount(slots, minlength=self.block_size).float()
                    n_blocks += n
                # DDP averages gradients over ranks; scale by world so the result is the global weighted sum.
                (loss * self.world / total_weight).backward()
                loss_sum += float(loss.detach())
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        dt = time.perf_counter() - t0
        self.wall_s += dt
        n_sequences = sum(len(mb) for mb in prepared)
        stats = torch.tensor([loss_sum, float(slot_count.sum()), n_blocks, n_sequences], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(stats)
            dist.all_reduce(slot_correct)
            dist.all_reduce(slot_count)
        acc = (slot_correct / slot_count.clamp(min=1)).tolist()
        self.seen["sequences"] += int(stats[3])
        self.seen["blocks"] += int(stats[2])
        self.seen["supervised_tokens"] += int(stats[1])
        return {
            "step": self.step,
            "epoch": epoch,
            "loss": float(stats[0]) / total_weight,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "slot_acc": [round(a, 4) for a in acc[1:]],
            "acc": float(slot_correct[1:].sum() / slot_count[1:].sum().clamp(min=1)),
            "tokens_per_s": float(stats[1]) / dt * 1.0,
            "blocks": int(stats[2]),
            "blocks_per_s": float(stats[2]) / dt,
            "step_s": dt,
            "gpu_util": gpu_utilization(self.device),
            # what the memory plan is checked against on a GPU (None elsewhere)
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            if self.device.type == "cuda"
            else None,
        }

    def _clip_gradients(self) -> torch.Tensor:
        """clip_grad_norm_ over the global gradient; a sharded drafter's norm gathers its shards (and averages the
        gradients of the parameters it keeps whole, which FSDP does not reduce)."""
        if not self.drafter_sharded:
            return torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.max_grad_norm)
        for p in self._replicated:
            if p.grad is not None and self.world > 1:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.draft.parameters() if p.grad is not None]
        sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]  # the same on every rank
        squares = sum((g.float().square().sum() for g in sharded), torch.zeros((), device=self.device))
        dist.all_reduce(squares)  # one collective for all the shards
        total = (
            squares + sum((g.float().square().sum() for g in whole), torch.zeros((), device=self.device))
        ).sqrt()
        coef = min(1.0, self.cfg.max_grad_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def exportable_drafter(self) -> DFlashDraftModel | None:
        """The whole drafter, for export: itself, or for a sharded one its gathered copy on rank 0 (None on the other
        ranks; a collective, call it on every rank)."""
        if not self.drafter_sharded:
            return self.draft
        state = self._full_states(optimizer=False)[0]
        if self.rank != 0:
            return None
        whole = DFlashDraftModel(self.draft.config)
        whole.load_state_dict(state)
        whole.mask_embedding = self.draft.mask_embedding
        return whole

    def _full_states(self, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """A sharded drafter's full model and optimizer states on rank 0, the optimizer's keyed as a replicated
        drafter's are (parameter index), so checkpoints read the same in both modes."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.draft, options=options)
        optim = get_optimizer_state_dict(self.draft, self.optimizer, options=options) if optimizer else {}
        index = {name: i for i, (name, _) in enumerate(self.draft.named_parameters())}
        return model, _rekey_optimizer(optim, index) if optim else optim

    def _load_sharded(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        names = dict(enumerate(name for name, _ in self.draft.named_parameters()))
        optim = _rekey_optimizer(state["optimizer"], names)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.draft, state["draft"], options=options)
        set_optimizer_state_dict(self.draft, self.optimizer, optim, options=options)

    def unwrap(self) -> None:
        """Drop the DDP wrapper once training is over. Its reducer holds the process group, so while it lives
        destroy_process_group cannot free gloo's threads, and they would be torn down at interpreter exit instead
        (an occasional 'terminate called without an active exception', SIGABRT)."""
        if self.model is not self.draft:
            self.model = self.draft
            gc.collect()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.drafter_sharded:
            draft, optim = self._full_states()
        else:
            draft, optim = self.draft.state_dict(), self.optimizer.state_dict()
        return {
            "draft": draft,
            "draft_config": self.draft.config.to_dict(),
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "wall_s": self.wall_s,
            "seen": dict(self.seen),
            "train_config": asdict(self.cfg),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }

    def save_checkpoint(self) -> None:
        if self.rank != 0 and not self.drafter_sharded:
            return
        state = self.state_dict()  # every rank, for a sharded drafter: gathering it is a collective
        if self.rank == 0:
            self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_torch_save(state, self.ckpt_path)

    def load_checkpoint(self, path: Path | None = None) -> bool:
        path = path or self.ckpt_path
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if self.drafter_sharded:
            self._load_sharded(state)
        else:
            self.draft.load_state_dict(state["draft"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.wall_s = state.get("wall_s", 0.0)
        self.seen = dict(state.get("seen", self.seen))
        # map_location moved every tensor to the device; the generators' states are byte tensors on the host
        torch.set_rng_state(state["rng"].cpu())
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
        return True

    @staticmethod
    def _log_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
        """The whole lines of a JSONL log with their records; a line cut short by a kill is skipped."""
        lines = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                lines.append((line, json.loads(line)))
            except json.JSONDecodeError:
                continue
        return lines

    def _truncate_log(self, step: int) -> None:
        """Drop log lines a killed run wrote past its last checkpoint: the resumed run logs those steps again."""
        for path in (self.log_path, self.eval_path):
            if path.exists():
                kept = [line for line, r in self._log_lines(path) if r.get("step", 0) <= step]
                atomic_write_text(path, "".join(f"{line}\n" for line in kept))

    def _evaluated_at(self, step: int) -> bool:
        return any(r.get("step") == step for _, r in self._log_lines(self.eval_path))

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """τ of the drafter as it is now (fixed verify length B, held-out prompts), one line of the learning
        curve in OUT/eval_log.jsonl."""
        self.draft.eval()
        try:
            tau = evaluate_tau(
                self.target, self.draft, list(self.cfg.eval_datasets), self.cfg.eval_samples,
                self.cfg.eval_max_new_tokens, block_size=self.block_size, progress=False,
            )  # fmt: skip
        finally:
            self.draft.train()
        entry = {"step": self.step, **self.seen, "train_wall_s": round(self.wall_s, 1),
                 "tau": {k: round(v["tau"], 4) for k, v in tau.items()}}  # fmt: skip
        with self.eval_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry

    # ------------------------------------------------------------------ the loop
    def fit(self, resume: bool = False, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train to `total_steps` (or `stop_after` more steps, used by tests to simulate a killed run)."""
        if resume and self.load_checkpoint() and self.rank == 0:
            print(f"resumed from {self.ckpt_path} at step {self.step}/{self.total_steps}")
            self._truncate_log(self.step)
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.eval_every and self.rank == 0 and self.step == 0 and not self._evaluated_at(0):
            entry = self.evaluate()  # where the curve starts: the random or --init-from drafter
            print("step 0: τ " + ", ".join(f"{k} {v:.2f}" for k, v in entry["tau"].items()))
        history: list[dict[str, Any]] = []
        end = self.total_steps if stop_after is None else min(self.total_steps, self.step + stop_after)
        progress = progress_bar(self.cfg.progress and self.rank == 0)
        with progress:
            task = progress.add_task("training", total=self.total_steps, completed=self.step)
            while self.step < end:
                stats = self.train_step()
                history.append(stats)
                if self.rank == 0:
                    with self.log_path.open("a") as f:
                        f.write(json.dumps(stats) + "\n")
                    progress.update(
                        task,
                        completed=self.step,
                        description=f"loss {stats['loss']:.3f} acc {stats['acc']:.3f} lr {stats['lr']:.2e} "
                        f"{stats['tokens_per_s']:.0f} tok/s",
                    )
                    if self.step % self.cfg.log_every == 0 and not self.cfg.progress:
                        print(
                            json.dumps({k: stats[k] for k in ("step", "loss", "acc", "lr", "tokens_per_s")})
                        )
                if (
                    self.cfg.eval_every
                    and self.rank == 0
                    and (self.step % self.cfg.eval_every == 0 or self.step == self.total_steps)
                ):
                    entry = self.evaluate()
                    print(
                        f"step {self.step}: τ " + ", ".join(f"{k} {v:.2f}" for k, v in entry["tau"].items())
                    )
                if self.step % self.cfg.save_every == 0 or self.step == end:
                    self.save_checkpoint()
        return history
