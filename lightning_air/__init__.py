"""Lightning adapter: ``AirCheckpointIO`` (a ``CheckpointIO`` plugin) and ``AirCallback``.

trainer = Trainer(plugins=[AirCheckpointIO(staging_dir="/nvme/air")], callbacks=[AirCallback(),
                  ModelCheckpoint(dirpath="s3://bucket/run", every_n_train_steps=100, save_top_k=-1)])
trainer.fit(model, ckpt_path=latest_checkpoint("s3://bucket/run"))  # None on the first launch
"""

from .callback import AirCallback
from .checkpoint_io import NEWEST, AirCheckpointIO, latest_checkpoint
from .strategy import AirFSDPStrategy, AirModelParallelStrategy

__all__ = [
    "AirCallback",
    "AirCheckpointIO",
    "AirFSDPStrategy",
    "AirModelParallelStrategy",
    "NEWEST",
    "latest_checkpoint",
]
