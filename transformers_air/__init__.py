"""transformers_air: asynchronous, committed checkpoints and exact resume for transformers' ``Trainer``.

``trainer = AirTrainer(model, args, train_dataset=...)``, then
``trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))``, or with the local tier
(``AirTrainerCallback(local_every_n_steps=...)``) ``trainer.train(resume_from_checkpoint=NEWEST)``.
"""

from air_core.tiers import NEWEST

from .callback import AirTrainerCallback
from .resume import latest_checkpoint
from .trainer import AirTrainer, AirTrainerMixin

__all__ = ["NEWEST", "AirTrainer", "AirTrainerCallback", "AirTrainerMixin", "latest_checkpoint"]
