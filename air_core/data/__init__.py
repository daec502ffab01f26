"""Training data: a resumable sampler and a local NVMe cache that prefetches remote files in order."""

from ..data_cache import FileCache, PrefetchingSampler, RemoteFiles
from .sampler import ResumableSampler

__all__ = ["FileCache", "PrefetchingSampler", "RemoteFiles", "ResumableSampler"]
