"""accelerate_air: asynchronous, committed ``save_state`` and exact resume for Hugging Face Accelerate.

One line: ``accelerator = AirAccelerator(air_plugin=AirPlugin("s3://bucket/run"))``.
"""

from .accelerator import AirAccelerator
from .plugin import AirPlugin

__all__ = ["AirAccelerator", "AirPlugin"]
