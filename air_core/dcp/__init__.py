"""``torch.distributed.checkpoint`` storage backed by the core: sharded saves snapshotted, persisted in
the background and committed like any other save; loads resharded at any world size.

DCP plans (what each rank writes; which slices each rank reads back, at any world size) and runs its
collectives on the training thread, inside ``dcp.save``/``dcp.load``. This package is only storage,
split by role as DCP splits its own:

- ``writer.py``: ``DcpWriter`` only collects what DCP planned for this rank (references, bundled into
  few files in DCP's own file layout: its shards apart from its whole tensors and objects, so a load
  fetches no other rank's shards for a replicated item); ``save`` hands every folder's files to
  ``AsyncCheckpointer.save_files`` in one commit and returns once they are copied into host buffers.
  Rank 0's commit writes each folder's DCP ``.metadata`` before the manifest, so a committed folder is
  a DCP checkpoint that a stock ``FileSystemReader`` reads (on a local copy).
- ``reader.py``: ``DcpReader`` fetches ``.metadata`` and, per rank, only the files holding the slices
  its load plan needs (local cache first, CRC-verified), then lets DCP's ``FileSystemReader`` read them.
- ``planning.py``: ``SavePlans`` reuses the last global plan when a save's plan repeats on every rank
  (agreed in one all-reduce), skipping ``dcp.save``'s four object collectives.
- ``state.py``: a framework's sharded model and optimizers, got and set once for every adapter
  (``model_state``, ``optimizer_state``, ``ShardedState``).
- ``api.py``: the calls every rank makes (``save``, ``load``, ``load_newest``, ``load_into``);
  ``files.py``: DCP's file names in a folder (``dcp_folders``).

Not ``dcp.async_save``: its thread mode runs DCP's collectives on a background thread, which the core
never does (one collective order per process group, owned by the training thread).
"""

from .api import load, load_into, load_newest, save
from .files import dcp_folders
from .planning import SavePlans
from .reader import DcpReader
from .state import SHARDED_OPTIONS, ShardedState, model_state, optimizer_state
from .writer import DcpWriter

__all__ = [
    "SHARDED_OPTIONS",
    "DcpReader",
    "DcpWriter",
    "SavePlans",
    "ShardedState",
    "dcp_folders",
    "load",
    "load_into",
    "load_newest",
    "model_state",
    "optimizer_state",
    "save",
]
