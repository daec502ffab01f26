"""Training data: a resumable sampler and a local NVMe cache that prefetches remote files in order."""

from .cache import FileCache, PrefetchingSampler, RemoteFiles
from .sampler import ResumableSampler

__all__ = ["FileCache", "PrefetchingSampler", "RemoteFiles", "ResumableSampler"]
