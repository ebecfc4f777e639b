"""Chunked transport: no chunk over the limit; the reassembler accepts only the exact sequence."""

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.wire import CHUNK_OVERHEAD


@pytest.fixture(scope="module")
def update():
  rng = np.random.default_rng(0)
  params = {"a.kernel": (rng.standard_normal((40, 50)) * 0.02).astype(BF16),
            "b": rng.standard_normal(9).astype(BF16)}
  return sync.encode(None, params, version=2)


def reassemble(chunks, **limits):
  r = sync.Reassembler(**limits)
  results = [r.feed(c) for c in chunks]
  assert all(x is None for x in results[:-1])
  return results[-1], r


@pytest.mark.parametrize("max_bytes", [CHUNK_OVERHEAD + 1, 100, 1000, 1 << 20])
def test_chunks_respect_the_limit_and_reassemble_exactly(update, max_bytes):
  chunks = list(update.chunks(max_bytes))
  assert all(len(c) <= max_bytes for c in chunks)
  out, r = reassemble(chunks, max_chunk_bytes=max_bytes)
  assert r.complete and r.finish() is out
  assert out.to_bytes() == update.to_bytes()


def test_out_of_order_and_duplicate_chunks_are_rejected(update):
  chunks = list(update.chunks(500))
  r = sync.Reassembler()
  r.feed(chunks[0])
  with pytest.raises(sync.CodecError, match="out-of-order chunk: expected index 1, got 2"):
    r.feed(chunks[2])
  r = sync.Reassembler()
  r.feed(chunks[0])
  r.feed(chunks[1])
  with pytest.raises(sync.CodecError, match="duplicate chunk: expected index 2, got 1"):
    r.feed(chunks[1])


def test_oversized_chunks_and_updates_are_rejected(update):
  chunks = list(update.chunks(1000))
  with pytest.raises(sync.CodecError, match="chunk oversized: 1000 bytes, limit 999"):
    sync.Reassembler(max_chunk_bytes=999).feed(chunks[0])
  with pytest.raises(sync.CodecError, match=f"update oversized: {update.nbytes} bytes, limit 100"):
    sync.Reassembler(max_total_bytes=100).feed(chunks[0])


def test_truncated_chunks_and_sequences_are_rejected(update):
  chunks = list(update.chunks(1000))
  with pytest.raises(sync.CodecError, match="chunk 0 truncated"):
    sync.Reassembler().feed(chunks[0][:-1])
  with pytest.raises(sync.CodecError, match="chunk truncated"):
    sync.Reassembler().feed(chunks[0][:10])
  r = sync.Reassembler()
  for c in chunks[:-1]:
    r.feed(c)
  want = f"truncated: {len(chunks) - 1} of {len(chunks)} chunks"
  with pytest.raises(sync.CodecError, match=want):
    r.finish()


def test_chunks_of_another_update_and_extra_chunks_are_rejected(update):
  other = sync.encode(None, {"b": np.zeros(3, BF16)}, version=9)
  r = sync.Reassembler()
  r.feed(next(update.chunks(500)))
  with pytest.raises(sync.CodecError, match="belongs to another update"):
    r.feed(list(other.chunks(500))[0])
  single = list(other.chunks(1 << 20))
  r = sync.Reassembler()
  assert r.feed(single[0]).version == 9
  with pytest.raises(sync.CodecError, match="after the update was complete"):
    r.feed(single[0])


def test_a_chunk_with_corrupted_data_fails_the_digest(update):
  chunks = [bytearray(c) for c in update.chunks(700)]
  chunks[1][-1] ^= 0xFF
  r = sync.Reassembler()
  with pytest.raises(sync.CodecError, match="corrupted"):
    for c in chunks:
      r.feed(bytes(c))


def test_chunk_limit_below_the_header_is_a_value_error(update):
  with pytest.raises(ValueError, match=f"max_bytes must exceed .* {CHUNK_OVERHEAD} bytes, got 10"):
    next(update.chunks(10))
