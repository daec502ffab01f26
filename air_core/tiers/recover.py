"""Resume from the newest step every saved rank's state exists for, in any tier.

Every rank reports what its node holds (``holdings``: its own local checkpoints and the copies it keeps,
each committed by its manifest), the reports are gathered in one collective, and every rank picks the
same step (``choose``): the newest one newer than the root's newest commit for which each rank of the
world that saved it has a committed part somewhere, of one step and one world size, never mixed. The
pieces a node lacks come from a rank that holds them, over the tier's group, once per node, in rounds of
parallel transfers (one rank of the node receives each, checked against its CRC-32s on arrival; its other
ranks link it from there); the ones on its node are linked, not copied, and each is checked once per node
(by the rank that loads it if that rank is on the node, else by one chosen by the part). The parts are put
together (``assemble``) as one committed checkpoint of the saved world size in ``restore-<rank>/``, which the
adapter loads as it loads a root's: the same verification, the same exact (or ``elastic``) resume. A
sharded part is sent without its DCP data files (``_left``): the load brings the ones its plan reads
(``Bring``), so a replaced node gets the shards its ranks read, not every rank's.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from .. import layout
from ..catalog import read_catalog
from ..dcp.files import METADATA, is_data_file, is_part_metadata
from ..dcp.writer import merge_parts
from ..errors import CorruptCheckpointError
from ..manifest import FileEntry, Manifest
from ..staging import matches, remember
from .local import parse_name, tier_name
from .transfer import (
    EMPTY,
    RESTORE_THREADS,
    Package,
    Received,
    UnsyncedFiles,
    exchange,
    local_storage,
    read_package,
)

logger = logging.getLogger(__name__)
Tier = Literal["local", "replica"]


@dataclass(frozen=True)
class Held:
    """A committed local checkpoint on this node: rank ``saved_rank``'s part of step ``step``."""

    saved_rank: int
    step: int
    world: int
    kind: Tier
    root: str
    node: str


@dataclass(frozen=True)
class Resume:
    """The checkpoint a resume assembled from the tiers, for the adapter to load."""

    root: str
    """A local root holding one committed checkpoint of ``world`` ranks."""
    name: str
    step: int
    world: int
    tier: Tier
    """``replica`` when any part came from a copy (here or from a partner), else ``local``."""
    seconds: float
    """Listing, agreeing, receiving and assembling: the restore's time before the adapter loads."""
    bring: Bring | None = None
    """Brings the DCP data files the assembly left with their holders when a load needs them (None:
    every file is in ``root``); the adapter's reader of ``root`` calls it (``AsyncCheckpointer.bring``)."""


def restore_root(base: str, rank: int) -> str:
    return os.path.join(base, f"restore-{rank:05d}")


def holdings(base: str, node: str) -> list[Held]:
    """Every committed local checkpoint and copy under ``base`` (this node's folder of the job)."""
    held: list[Held] = []
    if not os.path.isdir(base):
        return held
    for entry in sorted(os.listdir(base)):
        kind, _, number = entry.partition("-")
        if kind not in ("rank", "replica") or not number.isdigit():
            continue
        root = os.path.join(base, entry)
        for info in read_catalog(local_storage(root)).committed:
            parsed = parse_name(info.name)
            if parsed is not None:
                tier: Tier = "local" if kind == "rank" else "replica"
                held.append(Held(int(number), parsed[0], parsed[1], tier, root, node))
    return held


def choose(reports: list[list[Held]], newer_than: int | None) -> tuple[int, int] | None:
    """(step, world size) of the newest step after ``newer_than`` (the root's newest commit) whose every
    saved rank's part some report holds; None: the root's (or nothing) is the newest complete state."""
    parts = {(h.step, h.world, h.saved_rank) for report in reports for h in report}
    for step, world in sorted({(s, w) for s, w, _ in parts}, reverse=True):
        if newer_than is not None and step <= newer_than:
            return None
        if all((step, world, s) in parts for s in range(world)):
            return step, world
    return None


def recover(
    base: str, *, rank: int, world_size: int, newer_than: int | None, group: Any, node: str
) -> Resume | None:
    """Every rank, together: the newest complete tier state after step ``newer_than``, assembled in
    ``restore_root(base, rank)``; None when the root's newest commit (or a fresh start) is newer.

    A part that fails its CRC-32s on any rank (damaged on its disk, or torn by a crash of its node) is
    dropped where it was held, and every rank agrees on a step again: a resume never loads a damaged part,
    and never stops on one while an older complete state exists.
    """
    started = time.monotonic()
    while True:
        nodes, reports = zip(*_gather((node, holdings(base, node)), group, world_size), strict=True)
        chosen = choose(list(reports), newer_than)
        if chosen is None:
            return None
        holders = _holders(list(reports), chosen)
        plan = _plan(list(nodes), holders)
        sent = _sent_by(rank, plan, holders)
        found, elsewhere = _assemble_here(base, rank, world_size, chosen, holders, plan, sent, group)
        blamed = _gather(found, group, world_size)
        if not any(blamed):
            break
        _drop(rank, chosen, holders, blamed)
        _gather([], group, world_size)  # every drop done before any rank lists again
    step, world = chosen
    dest = restore_root(base, rank)
    name = tier_name(step, world)
    # every rank has a Bring when any node lacked a part, so the transfers of its loads pair up
    bring = (
        Bring(name, dest, node, rank, world_size, group, plan.senders, sent, elsewhere)
        if plan.rounds
        else None
    )
    used = {s: _here(holders[s], rank) or holders[s][0][1] for s in range(world)}
    tier: Tier = "replica" if any(h.kind == "replica" for h in used.values()) else "local"
    where = ", ".join(
        f"rank {s}: {'here' if _here(holders[s], rank) else f'from node {h.node}'}" for s, h in used.items()
    )
    logger.info("rank %d: resuming from local tier step %d (%s) [%s]", rank, step, tier, where)
    seconds = time.monotonic() - started
    return Resume(dest, name, step, world, tier, seconds, bring)


def _gather(mine: Any, group: Any, world_size: int) -> list[Any]:
    if group is None or world_size == 1:
        return [mine]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _assemble_here(
    base: str,
    rank: int,
    world_size: int,
    chosen: tuple[int, int],
    holders: dict[int, list[tuple[int, Held]]],
    plan: _Plan,
    sent: dict[int, str],
    group: Any,
) -> tuple[list[tuple[int, int]], dict[str, FileEntry]]:
    """Gather the ``chosen`` step's parts in ``restore_root(base, rank)`` and commit it there; the (saved
    rank, holding rank) of each part that failed its check (then nothing is committed), and the files
    left with their holders (``_assemble``). ``sent``: the parts this rank sends (``_sent_by``).

    A part on this node is linked, and checked by one rank of the node (``_one_of``): one read per node,
    not one per rank. A part the node lacks is sent to it once (``_plan``), without its DCP data files
    (``_left``: its sender checks them, and ``Bring`` sends each when a load needs it), checked as it
    arrives, and linked by the node's other ranks; the transfers run in rounds, every pair's at once."""
    step, world = chosen
    name = tier_name(step, world)
    dest = restore_root(base, rank)
    shutil.rmtree(dest, ignore_errors=True)
    parts: dict[int, Received] = _transfer(  # the same rounds on every rank: each transfer pairs up
        plan.rounds,
        rank,
        dest,
        group,
        lambda saved: _without_left(read_package(local_storage(sent[saved]), name)),
    )
    # the parts this rank sends keep their DCP data files here: checked now, so a damaged one is found
    # before the ranks agree, not by the load that asks for it
    unsent = [s for s, root in sent.items() if not _left_whole(root, name)]
    local = {s: here for s in range(world) if s not in parts and (here := _here(holders[s], rank))}
    # each part on this node is checked by one rank of it: one read per node, in parallel over its ranks
    on_node = {s: [r for r, h in holders[s] if h.node == here.node] for s, here in local.items()}
    checks = {s for s, ranks in on_node.items() if rank == _one_of(s, ranks)}
    fetched: dict[int, tuple[str, bytes | None]] = {}
    if plan.links:  # each received part's manifest, if it arrived whole, for the ranks that link it
        checked = _gather({s: _whole(got, name, s) for s, got in parts.items()}, group, world_size)
        for s, by in plan.via.items():
            if by.get(rank, rank) != rank:
                fetched[s] = (restore_root(base, by[rank]), checked[by[rank]][s])
    damaged, elsewhere = _assemble(dest, name, step, world, local, parts, checks, fetched)
    # a fetched part the receiving rank found damaged is blamed by that rank, once
    blamed = [(s, rank if s in local else plan.senders[s]) for s in damaged if s not in fetched]
    return blamed + [(s, rank) for s in unsent if (s, rank) not in blamed], elsewhere


def _whole(received: Received, name: str, saved: int) -> bytes | None:
    """``received``'s manifest if every file sent arrived whole, else None."""
    try:
        _check_received(received, where=f"rank {saved}'s part of {name}")
    except CorruptCheckpointError:
        return None
    return received.manifest


def _left(manifest: Manifest) -> frozenset[str]:
    """A part's DCP data files (of its folders with a rank's share of ``.metadata``: the local tier's
    sharded saves). A load reads only the ones its plan needs: at the same sharding a rank's own shards
    and every rank's file of whole items, never another rank's shards. So a part a node lacks is sent
    without them, and ``Bring`` sends each one a load asks for."""
    folders = {
        f.path.rpartition("/")[0] for f in manifest.files if is_part_metadata(f.path.rpartition("/")[2])
    }
    return frozenset(
        f.path
        for f in manifest.files
        if f.path.rpartition("/")[0] in folders and is_data_file(f.path.rpartition("/")[2])
    )


def _kept(manifest: Manifest) -> frozenset[str]:
    """The files of a part sent at recovery: all but its DCP data files (``_left``)."""
    return frozenset(f.path for f in manifest.files) - _left(manifest)


def _without_left(package: Package) -> Package:
    """``package`` without its DCP data files (``_left``)."""
    manifest = Manifest.from_json(package.manifest, where=f"{package.root}/{package.name}")
    return replace(package, only=_kept(manifest))


def _check_received(received: Received, *, where: str) -> Manifest:
    """``received``'s manifest once every file sent (``_kept``) arrived whole."""
    manifest = Manifest.from_json(received.manifest, where=where)
    return received.check(where=where, only=_kept(manifest))


def _left_whole(root: str, name: str) -> bool:
    """Whether the DCP data files of the part ``name`` held in ``root`` match their CRC-32s (remembered:
    a check of them by this rank's own assembly or load right after does not read them again)."""
    where = f"{root}/{name}"
    manifest = Manifest.from_json(local_storage(root).read_bytes(layout.manifest_path(name)), where=where)
    left = _left(manifest)
    entries = [f for f in manifest.files if f.path in left]
    return all(matches(layout.local_path(root, f.path), f, remember=True) for f in entries)


def _sent_by(rank: int, plan: _Plan, holders: dict[int, list[tuple[int, Held]]]) -> dict[int, str]:
    """The parts ``rank`` sends to a node that lacks them: saved rank -> the root it holds it in."""
    sent = {}
    for saved, sender in plan.senders.items():
        if sender == rank and plan.via[saved] and (held := _here(holders[saved], rank)) is not None:
            sent[saved] = held.root
    return sent


@dataclass(frozen=True)
class Bring:
    """The DCP data files a resume left with the ranks that hold them (``_left``), sent when a load needs
    them. ``DcpReader`` calls it on every rank, together, with the files its load plan reads."""

    name: str
    dest: str
    """This rank's restore folder."""
    node: str
    rank: int
    world_size: int
    group: Any = field(repr=False)
    senders: dict[int, int]
    """For each saved rank: the rank that sends its part's files."""
    sent: dict[int, str]
    """The parts this rank sends: saved rank -> the root it holds it in."""
    elsewhere: dict[str, FileEntry]
    """The files this rank's restore was assembled without (their ``rank``: the part's saved rank)."""

    def __call__(self, paths: set[str]) -> dict[str, str]:
        """Every rank, together: the files of ``paths`` this rank's restore was assembled without, brought
        into it (path -> local path), and meanwhile the ones other ranks ask of this one sent. A file
        several ranks of a node ask for (ranks that share its folder: ``local_dir``) is received once, by
        one of them (spread by file), and checked against its CRC-32 as it arrives; the others link it
        from there (a job grown from fewer ranks reads slices of the same files on every rank).

        Raises:
            CorruptCheckpointError: a file arrived damaged (after every rank's transfers are done).
        """
        started = time.monotonic()
        wanted = sorted(paths & self.elsewhere.keys())
        lacking = [p for p in wanted if not os.path.exists(layout.local_path(self.dest, p))]
        folder = (self.node, os.path.dirname(self.dest))
        asks = _gather((folder, [(self.elsewhere[p].rank, p) for p in lacking]), self.group, self.world_size)
        receiver, pending = _bring_plan(asks, self.senders)
        got = _transfer(
            _rounds(pending),
            self.rank,
            self.dest,
            self.group,
            lambda key: replace(
                read_package(local_storage(self.sent[key[0]]), self.name), only=frozenset(key[1])
            ),
        )
        damaged = [p for (_, files), received in got.items() if not _arrived(received, files) for p in files]
        linked = [p for p in lacking if receiver[folder, p] != self.rank]
        if any(receiver[where, p] != r for r, (where, asked) in enumerate(asks) for _, p in asked):
            bad = _gather(damaged, self.group, self.world_size)  # what each receiver got damaged
            for p in linked:
                by = receiver[folder, p]
                if p in bad[by]:
                    damaged.append(p)
                else:
                    os.makedirs(os.path.dirname(layout.local_path(self.dest, p)), exist_ok=True)
                    os.link(
                        layout.local_path(restore_root(folder[1], by), p), layout.local_path(self.dest, p)
                    )
        if damaged:
            raise CorruptCheckpointError(
                f"{self.dest}: {damaged[0]} of {self.name} arrived damaged from the rank that keeps it",
                path=damaged[0],
                reason="damaged in transfer",
            )
        if lacking:
            size = sum(self.elsewhere[p].size for p in lacking)
            logger.info(
                "rank %d: brought %d shard file(s) of %s (%d linked from a rank of this node), %.1f MiB, "
                "in %.2f s",
                self.rank, len(lacking), self.name, len(linked), size / 2**20, time.monotonic() - started,
            )  # fmt: skip
        return {p: layout.local_path(self.dest, p) for p in wanted}


Folder = tuple[str, str]
"""Where a rank's restore folder is: its node, and the folder of its ``local_dir`` there."""


def _bring_plan(
    asks: list[tuple[Folder, list[tuple[int, str]]]], senders: dict[int, int]
) -> tuple[dict[tuple[Folder, str], int], list[tuple[int, tuple[int, tuple[str, ...]], int]]]:
    """For the files each rank asks for (its folder; (saved rank, path) pairs): which rank of each folder
    receives each file (one per folder, spread over the ranks asking by file), and the transfers for
    ``_rounds``: (sender, (saved rank, files), receiver), one package per receiver and part."""
    askers: dict[tuple[Folder, str], list[int]] = {}
    for r, (where, asked) in enumerate(asks):
        for _, p in asked:
            askers.setdefault((where, p), []).append(r)
    receiver = {key: ranks[k % len(ranks)] for k, (key, ranks) in enumerate(sorted(askers.items()))}
    pending = []
    for r, (where, asked) in enumerate(asks):
        mine = [(s, p) for s, p in asked if receiver[where, p] == r]
        for saved in sorted({s for s, _ in mine}):
            pending.append((senders[saved], (saved, tuple(p for s, p in mine if s == saved)), r))
    return receiver, pending


def _transfer(
    rounds: list[dict[tuple[int, Any], list[int]]],
    rank: int,
    dest: str,
    group: Any,
    package: Callable[[Any], Package],
) -> dict[Any, Received]:
    """Every rank, together: run ``rounds`` (``_rounds``: (sender, key) -> receivers), this rank sending
    ``package(key)`` where it is the sender and writing what it receives into ``dest`` as it arrives.
    Returns what this rank received, by key."""
    got: dict[Any, Received] = {}
    for transfers in rounds:
        sending, send_to = EMPTY, list[int]()
        for (sender, key), to in transfers.items():
            if sender == rank:  # one package a round at most
                sending, send_to = package(key), to
        sources = {sender: key for (sender, key), to in transfers.items() if rank in to}
        if not send_to and not sources:
            continue
        sinks = {sender: UnsyncedFiles(dest) for sender in sources}
        try:
            for sender, received in exchange(
                sending, send_to, dict(sinks), group, threads=RESTORE_THREADS
            ).items():
                got[sources[sender]] = received
        finally:
            for sink in sinks.values():
                sink.close()
    return got


def _arrived(received: Received, files: tuple[str, ...]) -> bool:
    """Whether the ``files`` asked of a sender arrived whole."""
    try:
        received.check(where="a part's files", only=frozenset(files))
    except CorruptCheckpointError:
        return False
    return True


@dataclass(frozen=True)
class _Plan:
    """Who sends each part a node lacks, to whom, in which round."""

    via: dict[int, dict[int, int]]
    """For each saved rank, each rank without its part: the rank of its node that receives it for it."""
    senders: dict[int, int]
    """For each saved rank: the rank that sends its part."""
    rounds: list[dict[tuple[int, Any], list[int]]]
    """(sender, saved rank) -> receivers; in a round each rank sends one part and receives one at most."""

    @property
    def links(self) -> bool:
        """Whether some rank links a part that another rank of its node receives."""
        return any(r != v for by in self.via.values() for r, v in by.items())


def _plan(nodes: list[str], holders: dict[int, list[tuple[int, Held]]]) -> _Plan:
    """The transfers of a recovery, the same on every rank. Each part a node lacks goes to one rank of it
    (``_receivers``), from a rank of the node that holds the best copy (its own local part before a
    replica), spread over that node's ranks (``_one_of``); then the transfers are packed into rounds, so
    distinct pairs run at once."""
    via = _receivers(nodes, {s: {r for r, _ in hs} for s, hs in holders.items()})
    best = {  # the ranks that read the best copy: its node's, the own local part before a replica
        s: [r for r, h in hs if (h.root, h.kind) == (hs[0][1].root, hs[0][1].kind)]
        for s, hs in holders.items()
    }
    senders = {s: _one_of(s, ranks) for s, ranks in best.items()}
    pending = [(senders[s], s, v) for s in sorted(via) for v in sorted(set(via[s].values()))]
    return _Plan(via, senders, _rounds(pending))


def _rounds(pending: Sequence[tuple[int, Hashable, int]]) -> list[dict[tuple[int, Any], list[int]]]:
    """(sender, package, receiver) transfers packed into rounds, in order: in a round each rank sends one
    package (to one receiver or more) and receives one at most, so distinct pairs run at once."""
    rounds: list[dict[tuple[int, Any], list[int]]] = []
    left = list(pending)
    while left:
        sends: dict[int, Hashable] = {}
        receives: set[int] = set()
        transfers: dict[tuple[int, Any], list[int]] = {}
        later = []
        for sender, package, receiver in left:
            if sends.setdefault(sender, package) != package or receiver in receives:
                later.append((sender, package, receiver))
                continue
            receives.add(receiver)
            transfers.setdefault((sender, package), []).append(receiver)
        rounds.append(transfers)
        left = later
    return rounds


def _receivers(nodes: list[str], holding: dict[int, set[int]]) -> dict[int, dict[int, int]]:
    """For each saved rank, and each rank not in ``holding[saved]`` (the ranks that hold its part): the
    rank that receives the part for it. On a node whose ranks all see the same parts (they share the
    node's folder), one rank of the node receives it for all (``_one_of``), so the node's receives and
    their CRC-32s run in parallel. Else each rank receives for itself."""
    ranks = {n: [r for r, m in enumerate(nodes) if m == n] for n in nodes}
    shared = {n for n, rs in ranks.items() if all(len({r in h for r in rs}) == 1 for h in holding.values())}
    return {
        s: {r: _one_of(s, ranks[n]) if n in shared else r for r, n in enumerate(nodes) if r not in has}
        for s, has in holding.items()
    }


def _one_of(saved: int, ranks: list[int]) -> int:
    """The rank among ``ranks`` (of one node) that handles rank ``saved``'s part there: ``saved`` itself if
    it is one (at the same world size it loads that part, so its load trusts its own check), else one
    chosen by ``saved``, so a node's parts are spread over its ranks and handled in parallel."""
    return saved if saved in ranks else sorted(ranks)[saved % len(ranks)]


def _drop(
    rank: int,
    chosen: tuple[int, int],
    holders: dict[int, list[tuple[int, Held]]],
    blamed: list[list[tuple[int, int]]],
) -> None:
    """Every rank: forget the damaged parts this rank held (their manifests go: no longer committed)."""
    name = tier_name(*chosen)
    for finder, found in enumerate(blamed):
        for saved, holder in found:
            logger.warning(
                "rank %d: rank %d's part of %s (held by rank %d) failed its CRC-32 check on rank %d; "
                "dropped, and the ranks agree on a step again",
                rank, saved, name, holder, finder,
            )  # fmt: skip
            held = _here(holders[saved], holder)
            if holder == rank and held is not None:
                local_storage(held.root).remove(layout.manifest_path(name))


def _holders(reports: list[list[Held]], chosen: tuple[int, int]) -> dict[int, list[tuple[int, Held]]]:
    """For each saved rank of the ``chosen`` step, every (reporting rank, part) that holds its part, the
    one to send first: own local checkpoints before copies, then the lowest rank."""
    found: dict[int, list[tuple[int, Held]]] = {}
    for r, report in enumerate(reports):
        for h in report:
            if (h.step, h.world) == chosen:
                found.setdefault(h.saved_rank, []).append((r, h))
    return {s: sorted(hs, key=lambda e: (e[1].kind != "local", e[0])) for s, hs in found.items()}


def _here(holders: list[tuple[int, Held]], rank: int) -> Held | None:
    """The part among ``holders`` that ``rank``'s node holds (its best), or None."""
    return next((h for r, h in holders if r == rank), None)


def _assemble(
    dest: str,
    name: str,
    step: int,
    world: int,
    local: dict[int, Held],
    parts: dict[int, Received],
    checks: set[int],
    fetched: dict[int, tuple[str, bytes | None]],
) -> tuple[list[int], dict[str, FileEntry]]:
    """One committed checkpoint of ``world`` ranks in ``dest``: each part's files (linked from this node's
    copy, and for the saved ranks in ``checks`` checked against their CRC-32s; or received: written as
    they arrived, checked here; or ``fetched``: linked from the restore folder of the rank of this node
    that received them), then a manifest naming every file with its rank. Returns the saved ranks whose
    part failed its check or is missing (then no manifest is written), and the files left with their
    holders (``_left``: the manifest does not name them; ``.metadata`` does, and ``Bring`` brings them)."""
    storage = local_storage(dest)
    entries: list[FileEntry] = []
    damaged: list[int] = []
    elsewhere: dict[str, FileEntry] = {}
    launch, versions = "", {}
    for saved in range(world):
        try:
            if saved in parts:  # checked as it arrived; the load right after need not read it again
                manifest = _check_received(parts[saved], where=f"rank {saved}'s part of {name}")
                for f in manifest.files:
                    if f.path in parts[saved].sizes:  # sent (all but ``_left``)
                        remember(layout.local_path(dest, f.path), f.crc32)
            elif saved in fetched:
                manifest = _link_received(*fetched[saved], dest, name)
            else:
                manifest = _link_held(local[saved].root, dest, name, check=saved in checks)
        except CorruptCheckpointError:
            damaged.append(saved)
            continue
        launch, versions = launch or manifest.launch_id, manifest.versions
        left = _left(manifest) if saved in parts or saved in fetched else frozenset()
        for f in manifest.files:
            entry = FileEntry(f.path, f.size, f.crc32, saved)
            if f.path in left:
                elsewhere[f.path] = entry
            else:
                entries.append(entry)
    if not damaged:
        entries += _merged_metadata(dest, entries)
        whole = Manifest(name, step, time.time(), world, launch, tuple(entries), versions)
        storage.write_bytes(layout.manifest_path(name), whole.to_json())
    return damaged, elsewhere


def _merged_metadata(dest: str, entries: list[FileEntry]) -> list[FileEntry]:
    """Each sharded part's DCP folders: the ``.metadata`` made from every rank's share (``dcp.merge_parts``),
    written into ``dest``; their manifest entries (rank 0's files)."""
    shares: dict[str, list[str]] = {}
    for e in entries:
        folder, _, file = e.path.rpartition("/")
        if is_part_metadata(file):
            shares.setdefault(folder, []).append(e.path)
    made = []
    for folder, paths in sorted(shares.items()):
        data = merge_parts(folder, [Path(layout.local_path(dest, p)).read_bytes() for p in paths])
        path = f"{folder}/{METADATA}"
        local_storage(dest).write_bytes(path, data)
        made.append(FileEntry(path, len(data), zlib.crc32(data), 0))
    return made


def _link_received(source: str, part: bytes | None, dest: str, name: str) -> Manifest:
    """Hard-link the files of ``part`` (a part's manifest, None if it arrived damaged) from ``source``, the
    restore folder of the rank of this node that received them and checked them on arrival, so the load
    here trusts that check (``staging.remember``) for the same files.

    Raises:
        CorruptCheckpointError: the part arrived damaged (the receiving rank blames it).
    """
    if part is None:
        where = f"{source}: a part of {name}"
        raise CorruptCheckpointError(f"{where} arrived damaged", path=name, reason="damaged in transfer")
    manifest = Manifest.from_json(part, where=source)
    _link(source, dest, manifest, where=source, check="trusted", leave=_left(manifest))
    return manifest


def _link_held(source: str, dest: str, name: str, *, check: bool) -> Manifest:
    """Hard-link a part held on this node into ``dest`` (``_link``: sizes checked, and with ``check`` the
    CRC-32s too)."""
    where = f"{source}/{name}"
    manifest = Manifest.from_json(local_storage(source).read_bytes(layout.manifest_path(name)), where=where)
    _link(source, dest, manifest, where=where, check="crc" if check else "size")
    return manifest


def _link(
    source: str,
    dest: str,
    manifest: Manifest,
    *,
    where: str,
    check: Literal["size", "crc", "trusted"],
    leave: frozenset[str] = frozenset(),
) -> None:
    """Hard-link the files of ``manifest`` but ``leave`` from ``source`` into ``dest``, each file's size
    checked (``size``), and its CRC-32 too (``crc``: remembered for the load that follows,
    ``staging.matches``); or, ``trusted``, with the CRC-32 another rank of this node checked on arrival
    remembered unread.

    Raises:
        CorruptCheckpointError: a file is missing, or its size (or CRC-32) differs from the manifest.
    """
    for f in manifest.files:
        if f.path in leave:
            continue
        target = layout.local_path(dest, f.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(layout.local_path(source, f.path), target)
        except FileNotFoundError:
            missing = f"{where}: {f.path} is missing"
            raise CorruptCheckpointError(missing, path=f.path, reason="missing") from None
        if check == "trusted":
            remember(target, f.crc32)
        elif os.path.getsize(target) != f.size or (check == "crc" and not matches(target, f, remember=True)):
            raise CorruptCheckpointError(
                f"{where}: {f.path} does not match its manifest", path=f.path, reason="checksum mismatch"
            )
