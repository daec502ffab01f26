"""Files in other libraries' formats, built as ``serializer.Bundle`` s so they take the async path.

``safetensors_file`` lays out what ``safetensors.torch.save_file`` writes (an 8-byte header length, a
JSON header padded with spaces to 8 bytes, then each tensor's bytes in order): the snapshot copies the
tensors like any others, and the writer thread writes the header and the bytes, so a Hugging Face
checkpoint's weights cost the training loop a host copy, not a serialization.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

from .serializer import Bundle

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    **{
        getattr(torch, name): code
        for name, code in (
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e5m2", "F8_E5M2"),
            ("uint16", "U16"),
            ("uint32", "U32"),
            ("uint64", "U64"),
        )
        if hasattr(torch, name)
    },
}


def safetensors_file(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Bundle:
    """``tensors`` as the bytes of a ``.safetensors`` file (``safetensors.torch.load_file`` reads it).

    Raises:
        ValueError: a tensor of a dtype safetensors has no name for, or a name used twice.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    items: list[object] = [b""]
    for name, tensor in tensors.items():
        code = _DTYPES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"safetensors has no dtype for {name!r} ({tensor.dtype})")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
        items.append(tensor)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    items[0] = struct.pack("<Q", len(text)) + text
    return Bundle(items, raw=True)
