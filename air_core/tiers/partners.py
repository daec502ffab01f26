"""Who keeps a copy of whose local checkpoint.

A rank's partners are ``rank + j x local_world_size`` (j = 1 .. replication_factor - 1, modulo the
world): the same local rank on the next nodes, so a copy never shares its original's node, and a node
loss (all ``local_world_size`` ranks of one node) leaves every lost rank's state on another node as
long as ``replication_factor`` is at most the number of nodes (NVIDIA's resiliency extension chooses
its replication groups the same way). The copies travel on a gloo group of every rank kept for the tier
(``side_groups.TIER``), so they move over TCP from host memory, whatever the training's backend, and
never on its group.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def local_world_size(world_size: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE`` (every rank on one node without it)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world_size


def copies(world_size: int, per_node: int, replication_factor: int, *, owner: str) -> int:
    """The replicas each rank's local checkpoint gets: ``replication_factor - 1``, but at most one per
    other node (a warning says so when fewer nodes than copies are there)."""
    nodes = max(world_size // max(per_node, 1), 1)
    wanted = replication_factor - 1
    if wanted > nodes - 1:
        if wanted > 0:
            logger.warning(
                "%s: replication_factor=%d but the job has %d node(s) of %d rank(s): each local checkpoint "
                "gets %d copy(ies) on other nodes; a node loss falls back to the root's checkpoints.",
                owner,
                replication_factor,
                nodes,
                per_node,
                nodes - 1,
            )
        wanted = nodes - 1
    return wanted


def partners(rank: int, world_size: int, per_node: int, n: int) -> list[int]:
    """The ranks that keep copies of ``rank``'s local checkpoint."""
    return [(rank + j * per_node) % world_size for j in range(1, n + 1)]


def sources(rank: int, world_size: int, per_node: int, n: int) -> list[int]:
    """The ranks whose local checkpoints ``rank`` keeps copies of."""
    return [(rank - j * per_node) % world_size for j in range(1, n + 1)]


def node_name() -> str:
    """This node's name in reports: ``AIR_NODE_NAME`` (tests give each simulated node one), else the host."""
    import socket

    return os.environ.get("AIR_NODE_NAME") or socket.gethostname()
