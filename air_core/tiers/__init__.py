"""The node-local tier: checkpoints every few steps on this node's disk, copies on partner ranks of
other nodes, and a resume from the newest step every rank's state exists for in any tier.

``local.py`` (``LocalTier``: saves, replication, retention), ``partners.py`` (who keeps whose copies),
``transfer.py`` (a commit's files between ranks, verified), ``recover.py`` (what every node holds, the
agreed step, the checkpoint assembled from the pieces). The ``TrainingSession`` owns the tier, and its
gloo group (``side_groups.py``); see ``docs/tiers.md``.
"""

from .local import LocalTier, job_folder, parse_name, rewind, tier_name
from .recover import Held, Resume, choose, holdings, recover

NEWEST = "air:newest"
"""The resume argument an adapter takes for: the newest complete state in any tier (the local tier, a
partner's copy, or the root), or a fresh start when there is none (Lightning's ``ckpt_path``,
transformers' ``resume_from_checkpoint``)."""

__all__ = [
    "NEWEST",
    "Held",
    "LocalTier",
    "Resume",
    "choose",
    "holdings",
    "job_folder",
    "parse_name",
    "recover",
    "rewind",
    "tier_name",
]
