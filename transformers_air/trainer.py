"""``AirTrainerMixin`` / ``AirTrainer``: the few calls of ``Trainer`` that no callback hook reaches.

``AirTrainerCallback`` does the work through Trainer's hooks. What it cannot reach, and why:

- the checkpoint write: ``Trainer._save_checkpoint`` writes every file synchronously and ``on_save``
  runs only after it, so the method is replaced by the callback's asynchronous, committed save;
- the resume: the callback is never told which folder ``train(resume_from_checkpoint=...)`` loaded, and
  Trainer's own data skip and late RNG restore (``_load_rng_state``) must give way to the session's
  exact position where it restored one;
- the train loader: ``get_train_dataloader`` is where the prepared loader exists before the first
  epoch starts iterating it (``on_train_begin`` comes after Trainer chose how to skip);
- the end of the forward (``compute_loss``): the straggler section ends where backward starts;
- the best model at the end (``_load_best_model``) reads a local folder; the root may be remote;
- the end-of-training clean-up with ``save_total_limit=1`` (``sort_checkpoints``, then ``rmtree``) would
  delete a save still being written: the callback does it through the core after every commit.

Use ``AirTrainer`` in place of ``Trainer``, or put ``AirTrainerMixin`` first in your own subclass's
bases (``class MyTrainer(AirTrainerMixin, SFTTrainer)``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from transformers import Trainer

from air_core import ConfigError
from air_core.tiers import NEWEST

from .callback import AirTrainerCallback, check_arguments
from .internals import SKIP_FIRST_BATCHES, SORT_CHECKPOINTS, check_methods, module_function
from .resume import fetch_folder, stock_checkpoint

if TYPE_CHECKING:  # what the mixin is mixed into, for the type checker
    _Base = Trainer
else:
    _Base = object


class AirTrainerMixin(_Base):
    """Put first in a ``Trainer`` subclass's bases; see the module docstring for what it overrides."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_methods(Trainer)
        check_arguments(kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None)
        callbacks = [  # Trainer builds a callback given as a class; ours is built here, to be found
            c() if isinstance(c, type) and issubclass(c, AirTrainerCallback) else c
            for c in kwargs.pop("callbacks", None) or []
        ]
        ours = [c for c in callbacks if isinstance(c, AirTrainerCallback)]
        if len(ours) > 1:
            raise ConfigError("AirTrainer: pass at most one AirTrainerCallback in callbacks=[...].")
        if not ours:
            callbacks.append(AirTrainerCallback())
        super().__init__(*args, callbacks=callbacks, **kwargs)  # type: ignore[misc]
        self.air_callback: AirTrainerCallback = next(
            c for c in self.callback_handler.callbacks if isinstance(c, AirTrainerCallback)
        )
        """The callback that checkpoints this trainer (``air_callback.session`` during ``train()``)."""
        self.air_callback.bind(self)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As ``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest complete state
        across the tiers: the local tier's (``local_every_n_steps``) when it is newer than the root's,
        else ``latest_checkpoint`` of the root (any URL); ``NEWEST`` does the same, or starts fresh when
        nothing was saved (both refuse a root holding only stock ``Trainer``'s checkpoints, naming the
        newest). Such a resume, or a folder ``latest_checkpoint`` returned, continues each process's data
        position and RNG exactly. Every save is committed before this returns (or raises).
        """
        air = self.air_callback
        failed: BaseException | None = None
        try:
            air.begin(self)
            if resume_from_checkpoint is True or resume_from_checkpoint == NEWEST:
                newest = air.newest()
                session = air.session
                if newest is None and session is not None and session.checkpointer is not None:
                    stock = stock_checkpoint(session.checkpointer)
                    if resume_from_checkpoint is True or stock is not None:
                        root = air.root_of(self.args)
                        raise ValueError(_nothing_committed(root, stock, resume_from_checkpoint))
                resume_from_checkpoint = newest
            air.resume_from(self, resume_from_checkpoint or None)
            with _skip_replaced(air), _cleanup_replaced(self):
                return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as exc:
            failed = exc
            raise
        finally:
            air.end(failed)

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        self.air_callback.track_loader(loader)
        return loader

    def compute_loss(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, *args, **kwargs)
        if model.training:
            self.air_callback.before_backward()
        return loss

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.air_callback.save(self, trial)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.air_callback.restored(checkpoint):
            super()._load_rng_state(checkpoint)

    def _load_best_model(self) -> None:
        """Trainer's, from the best commit's verified local copy (every save committed first)."""
        air, state = self.air_callback, self.state
        best = state.best_model_checkpoint
        session = air.session
        ckpt = session.checkpointer if session is not None else None
        if best is None or session is None or ckpt is None:
            super()._load_best_model()
            return
        air.wait_for_checkpoints()
        entry = best.rstrip("/").rsplit("/", 1)[-1]
        from air_core.session import Place

        owners = session.paths.owners(ckpt, Place(ckpt.config.root, entry))
        if not owners:
            super()._load_best_model()
            return
        state.best_model_checkpoint = fetch_folder(ckpt, owners[-1].name, rank=session.rank)
        try:
            super()._load_best_model()
        finally:
            state.best_model_checkpoint = best


class AirTrainer(AirTrainerMixin, Trainer):
    """transformers' ``Trainer`` with asynchronous, committed checkpoints and an exact resume.

    Same arguments as ``Trainer``; ``callbacks`` may hold one ``AirTrainerCallback`` (its settings; the
    class: its defaults), else a default one is added. Resume with
    ``trainer.train(resume_from_checkpoint=True)`` or ``latest_checkpoint(args.output_dir)``.
    """


def _nothing_committed(root: str, stock: str | None, given: Any) -> str:
    """Stock's message for ``train(resume_from_checkpoint=True)`` with nothing to resume, and where stock
    ``Trainer`` left checkpoints in the root (``stock``: the newest; a project switching to
    ``AirTrainer``), how to resume them: ``NEWEST`` refuses then too, since starting fresh would train
    over that run."""
    message = f"No valid checkpoint found in output directory ({root})"
    if stock is None:
        return message
    argument = "True" if given is True else "transformers_air.NEWEST"
    return (
        f"{message}: AirTrainer committed no checkpoint there, and resume_from_checkpoint={argument} resumes "
        f"committed ones only. The checkpoints there were written by stock Trainer (the newest: {stock}); "
        f"to continue from it, pass its path: train(resume_from_checkpoint={stock!r})."
    )


@contextlib.contextmanager
def _skip_replaced(air: AirTrainerCallback) -> Iterator[None]:
    """During ``train()``: Trainer's skip of a resumed epoch's consumed batches is the callback's for
    the loader whose position the session keeps (``AirTrainerCallback.skips``)."""
    module, name = module_function(SKIP_FIRST_BATCHES)
    original = getattr(module, name)

    @functools.wraps(original)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if air.skips(dataloader, num_batches):
            return dataloader
        return original(dataloader, num_batches)

    setattr(module, name, skip_first_batches)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _cleanup_replaced(trainer: AirTrainerMixin) -> Iterator[None]:
    """During ``train()``: Trainer's end-of-training clean-up (``save_total_limit=1`` with a best
    checkpoint) is the callback's, through the core under the root (``AirTrainerCallback.keep_only_best``),
    and Trainer's listing of the folders to delete is empty. Trainer lists its run folder, which is not
    the root when ``AirTrainerCallback(root=...)`` names another: none of our checkpoints are there."""
    module, name = module_function(SORT_CHECKPOINTS)
    original = getattr(module, name)

    @functools.wraps(original)
    def sort_checkpoints(output_dir: str, *args: Any, **kwargs: Any) -> list[str]:
        trainer.air_callback.keep_only_best(trainer)
        return []

    setattr(module, name, sort_checkpoints)
    try:
        yield
    finally:
        setattr(module, name, original)
