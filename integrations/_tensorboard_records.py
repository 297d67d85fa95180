"""Event records checksummed in C instead of Python.

TensorBoard's ``RecordWriter`` frames every event with two masked CRC-32C checksums, and without
TensorFlow it computes them with a Python loop over every byte (``tensorflow_stub``'s
``crc32c``): about 20 ms for the 125 kB event of one record of a 4-layer GPT-2, on the event
writer's thread, holding the GIL that the training thread needs. ``google-crc32c`` (the
``[tensorboard]`` extra) computes the same checksum in C (hardware-accelerated where the CPU has
it) in tens of microseconds. The file's bytes are identical; only who computes them changes.
"""

from __future__ import annotations

import struct
from typing import Any

#: set on a record writer whose ``write`` is ours, so that it is replaced once
_MARK = "_tensorlens_fast_crc"


def _masked(crc: int) -> int:
    # TFRecord's mask: rotate right by 15 bits, add a constant (tensorboard's masked_crc32c)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def fast_records(file_writer: Any) -> bool:
    """Have the event file writer of a torch ``FileWriter`` checksum its records with
    ``google-crc32c``; ``False`` (nothing changed) without the package or where the writer is not
    the ``RecordWriter`` this was written for (another tensorboard version keeps the slow path)."""
    try:
        import google_crc32c
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        return False
    record_writer = getattr(getattr(getattr(file_writer, "event_writer", None), "_async_writer", None), "_writer", None)
    if not isinstance(record_writer, RecordWriter):
        return False
    if getattr(record_writer, _MARK, False):
        return True
    if type(record_writer).write is not RecordWriter.write or "write" in vars(record_writer):
        return False  # someone else's writer: leave it as it is
    out = record_writer._writer
    value = google_crc32c.value

    def write(data: bytes) -> None:
        # the same framing as RecordWriter.write: length, its masked CRC, data, its masked CRC
        header = struct.pack("<Q", len(data))
        out.write(header + struct.pack("<I", _masked(value(header))) + data + struct.pack("<I", _masked(value(data))))

    record_writer.write = write  # the writer thread calls record_writer.write(data) on this instance
    setattr(record_writer, _MARK, True)
    return True
