"""The hand-rolled PullChunk (de)serialiser agrees byte for byte with the protobuf library."""

import numpy as np
import pytest

from param_server.protos import param_server_pb2 as pb
from param_server.pull_wire import decode_pull_chunk, encode_pull_chunk

CASES = [
    dict(update_index=0, update_count=1, version=0, base_version=-1, update_bytes=5, offset=0),
    dict(update_index=3, update_count=9, version=1 << 40, base_version=7, update_bytes=1 << 33, offset=1 << 32),
    dict(update_count=0, version=12),
]


@pytest.mark.parametrize("fields", CASES)
@pytest.mark.parametrize("data", [b"", b"abc", bytes(range(256)) * 70])
def test_encoding_matches_protobuf(fields, data):
  assert encode_pull_chunk(np.frombuffer(data, np.uint8), **fields) == pb.PullChunk(
      data=data, **fields).SerializeToString()


@pytest.mark.parametrize("fields", CASES)
def test_decoding_reads_what_protobuf_wrote(fields):
  raw = pb.PullChunk(data=b"payload", **fields).SerializeToString()
  chunk = decode_pull_chunk(raw)
  for name, value in fields.items():
    assert getattr(chunk, name) == value, name
  assert bytes(chunk.data) == b"payload"


def test_decoding_rejects_truncation():
  raw = pb.PullChunk(data=b"payload", version=3).SerializeToString()
  with pytest.raises(ValueError, match="truncated"):
    decode_pull_chunk(raw[:-2])
  for wire_type, size in ((1, 8), (5, 4)):  # a field unknown to it, cut short: as protobuf
    cut = raw + bytes([(15 << 3) | wire_type]) + bytes(size - 2)
    with pytest.raises(Exception):
      pb.PullChunk.FromString(cut)
    with pytest.raises(ValueError, match="PullChunk: truncated fixed-size field"):
      decode_pull_chunk(cut)
    assert decode_pull_chunk(cut + b"\0\0").version == 3  # whole: passed over
