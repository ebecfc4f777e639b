"""Zero-copy (de)serialisation of `PullChunk`, the one message that carries bulk bytes.

The generic protobuf path copies a chunk's data three times per side (into the
message, out of it, into the wire buffer); a keyframe pull then runs at half
the speed of a raw byte stream. These produce and parse exactly the proto3
wire format of `PullChunk` (fields in number order, `data` last), so any gRPC
client sees an ordinary PullChunk; `test_pull_wire.py` checks both directions
against the protobuf library.
"""

from __future__ import annotations

import dataclasses

from param_server.protos import param_server_pb2 as pb
from rlax_ps.sync.byte_reader import varint

_INT_FIELDS = ("update_index", "update_count", "version", "base_version", "update_bytes", "offset")
_NUMBER = {f.name: f.number for f in pb.PullChunk.DESCRIPTOR.fields}
_DATA_TAG = bytes([(_NUMBER["data"] << 3) | 2])


def _varint(n: int) -> bytes:
  """Protobuf varint: negative ints travel as 10-byte two's complement."""
  return varint(n & ((1 << 64) - 1))


@dataclasses.dataclass
class PullChunkView:
  """A parsed PullChunk whose `data` is a memoryview into the received message."""
  update_index: int = 0
  update_count: int = 0
  version: int = 0
  base_version: int = 0
  update_bytes: int = 0
  offset: int = 0
  data: memoryview = memoryview(b"")


def encode_pull_chunk(data, **fields: int) -> bytes:
  """The serialised PullChunk with `fields` and `data` (any buffer), copying `data` once."""
  head = bytearray()
  for name in _INT_FIELDS:
    value = fields.get(name, 0)
    if value:
      head += _varint(_NUMBER[name] << 3) + _varint(value)
  view = memoryview(data).cast("B")
  if view.nbytes:
    head += _DATA_TAG + _varint(view.nbytes)
  return b"".join((head, view))


def decode_pull_chunk(raw: bytes) -> PullChunkView:
  """Parses a serialised PullChunk without copying its data; unknown fields are skipped."""
  view = memoryview(raw)
  chunk = PullChunkView()
  names = {number: name for name, number in _NUMBER.items()}
  pos, end = 0, len(raw)

  def varint() -> int:
    nonlocal pos
    shift = result = 0
    while True:
      if pos >= end:
        raise ValueError("PullChunk: truncated varint")
      b = raw[pos]
      pos += 1
      result |= (b & 0x7F) << shift
      if not b & 0x80:
        return result
      shift += 7

  while pos < end:
    key = varint()
    number, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value = varint()
      if value >= 1 << 63:
        value -= 1 << 64
      if names.get(number) in _INT_FIELDS:
        setattr(chunk, names[number], value)
    elif wire_type == 2:
      n = varint()
      if pos + n > end:
        raise ValueError("PullChunk: truncated bytes field")
      if names.get(number) == "data":
        chunk.data = view[pos:pos + n]
      pos += n
    elif wire_type in (1, 5):
      pos += 8 if wire_type == 1 else 4
      if pos > end:
        raise ValueError("PullChunk: truncated fixed-size field")
    else:
      raise ValueError(f"PullChunk: unsupported wire type {wire_type}")
  return chunk
