"""Lossless compression of the packed batch columns (storage format 2).

Each column is a little-endian numpy array. Its bytes are shuffled by significance (all
first bytes of the elements, then all second bytes, ...: sign and exponent bytes of float
norms repeat far more than mantissa bytes) and compressed with zstd. On 200-step x
1,000-layer blocks of float32 grad norms this stores about 3.1 bytes per value against 4
raw (zstd alone: 3.7); the low mantissa bits of a float32 are noise and bound what any
lossless codec can do. Decoding returns the exact bytes that were encoded.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ampwatch.server.series import COMPRESSED_FORMAT

LEVEL = 3  # higher levels gain < 0.5% on these columns at 3x the CPU
# zstd contexts are not thread-safe and FastAPI runs endpoints on a thread pool: one each
_contexts = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_contexts, "compressor"):
        _contexts.compressor = zstandard.ZstdCompressor(level=LEVEL)
    return _contexts.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_contexts, "decompressor"):
        _contexts.decompressor = zstandard.ZstdDecompressor()
    return _contexts.decompressor

# bytes per element of each packed column of `models.Batch`
ITEMSIZE = {"scalars": 8, "present": 1, "layer_grad": 4, "act_step": 8, "act_absmax": 4,
            "act_dtype": 1, "act_time": 4, "act_grad_zero": 4}


def encode_column(data: bytes, itemsize: int) -> bytes:
    """Byte-shuffled, zstd-compressed `data` (a whole number of `itemsize` elements)."""
    if itemsize > 1:
        data = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()
    return _compressor().compress(data)


def decode_column(data: bytes, itemsize: int) -> bytes:
    """Inverse of `encode_column`."""
    raw = _decompressor().decompress(data)
    if itemsize > 1:
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()
    return raw


def encode_columns(row: dict) -> dict:
    """A raw batch row (`storage.new_batch_row`) in its stored, compressed form."""
    encoded = {k: encode_column(v, ITEMSIZE[k]) if k in ITEMSIZE and v is not None else v
               for k, v in row.items()}
    encoded["format"] = COMPRESSED_FORMAT
    return encoded
