"""Training data: a local NVMe cache that prefetches remote files in the order the loader reads them."""

from .cache import FileCache, RemoteFiles

__all__ = ["FileCache", "RemoteFiles"]
