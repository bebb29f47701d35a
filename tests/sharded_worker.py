"""One rank of the sharded-target equality test (tests/test_sharding.py), launched by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/sharded_worker.py MODEL DATA OUT DRAFTER ARCH

Loads MODEL sharded over the ranks (FSDP2), takes the tapped features of every sequence in DATA, trains two steps
with the drafter replicated (DRAFTER=ddp) or sharded too (DRAFTER=fsdp), ARCH dflash or dflash2, and rank 0 writes
what it saw to OUT (the run's checkpoint lands in OUT.run/).
"""

import sys

import torch
import torch.distributed as dist

from flashdraft.training.distributed import end_distributed
from flashdraft.training.sharding import is_sharded, load_sharded_target
from flashdraft.training.trainer import TrainConfig, Trainer


def main(model_dir: str, data_file: str, out_file: str, drafter: str, arch: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    target = load_sharded_target(model_dir, "float32", "cpu")
    assert is_sharded(target.model)
    data = torch.load(data_file)
    taps = [0, target.num_layers - 2, target.num_layers - 1]
    with torch.no_grad():
        features = [target.features(item["input_ids"][None], taps)[0] for item in data]
    cfg = TrainConfig(out_dir=out_file + ".run", num_layers=1, block_size=4, num_anchors=6, max_steps=2, batch_size=1,
                      grad_accum=1, mask_token_id=3, target_layer_ids=taps[:2], progress=False, save_every=100,
                      lr=1e-2, warmup_ratio=0.0, arch=arch, shard_drafter=drafter == "fsdp")  # fmt: skip
    trainer = Trainer(target, data, cfg)
    assert is_sharded(trainer.draft) == (drafter == "fsdp")
    history = trainer.fit()
    whole = trainer.exportable_drafter()
    if dist.get_rank() == 0:
        torch.save(
            {
                "features": features,
                "history": history,
                "draft": whole.state_dict(),
                # every rank holds its slice of each layer tensor: (rows here, rows in all)
                "rows": [(p.to_local().shape[0], p.shape[0]) for p in target.layers[0].parameters()],
            },
            out_file,
        )
    del (
        trainer,
        target,
        whole,
    )  # the sharded modules hold the process group (flashdraft/training/distributed.py)
    end_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:6])
