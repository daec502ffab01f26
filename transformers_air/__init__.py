"""transformers_air: asynchronous, committed checkpoints and exact resume for transformers' ``Trainer``.

``trainer = AirTrainer(model, args, train_dataset=...)``, then
``trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))``.
"""

from .callback import AirTrainerCallback
from .resume import latest_checkpoint
from .trainer import AirTrainer, AirTrainerMixin

__all__ = ["AirTrainer", "AirTrainerCallback", "AirTrainerMixin", "latest_checkpoint"]
