"""Bounds-checked reading of little-endian fields; every overrun is a CodecError."""

import struct

import numpy as np

from rlax_ps.sync import loops
from rlax_ps.sync.errors import CodecError

_U8, _U16, _U32, _U64, _I64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q", "<q"))


_ONE_BYTE = [bytes((i,)) for i in range(128)]


def varint(n: int) -> bytes:
  """LEB128 encoding of a non-negative int."""
  if 0 <= n < 128:
    return _ONE_BYTE[n]
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


class ByteReader:
  """Reads fields from a buffer; `what` names the thing being read in error messages."""

  def __init__(self, buf, what: str, pos: int = 0, end: int | None = None):
    self.buf = memoryview(buf)
    self.what = what
    self.pos = pos
    self.end = len(self.buf) if end is None else end

  def take(self, n: int) -> memoryview:
    if n < 0 or self.pos + n > self.end:
      raise CodecError(
          f"{self.what}: truncated: needs {n} bytes at offset {self.pos}, "
          f"{self.end - self.pos} left")
    out = self.buf[self.pos:self.pos + n]
    self.pos += n
    return out

  def _fixed(self, s: struct.Struct) -> int:
    return s.unpack(self.take(s.size))[0]

  def u8(self) -> int:
    p = self.pos
    if p >= self.end:
      self.take(1)  # raises the truncation error
    self.pos = p + 1
    return self.buf[p]

  def u16(self) -> int:
    return self._fixed(_U16)

  def u32(self) -> int:
    return self._fixed(_U32)

  def u64(self) -> int:
    return self._fixed(_U64)

  def i64(self) -> int:
    return self._fixed(_I64)

  def varint(self) -> int:
    buf, p, end = self.buf, self.pos, self.end
    n = shift = 0
    while True:
      if p >= end:
        self.pos = p
        self.take(1)  # raises the truncation error
      b = buf[p]
      p += 1
      n |= (b & 0x7F) << shift
      if not b & 0x80:
        self.pos = p
        return n
      shift += 7
      if shift > 63:
        self.pos = p
        raise CodecError(f"{self.what}: varint longer than 64 bits at offset {self.pos}")

  def varint_list(self, count: int) -> list[int]:
    """`count` varints."""
    return [self.varint() for _ in range(count)]

  def varints(self, count: int) -> np.ndarray:
    """`count` varints (each below 2**63) as an int64 array, read in one compiled pass."""
    out = np.empty(count, np.int64)
    pos = loops.read_varints(np.frombuffer(self.buf, np.uint8), self.pos, self.end, out)
    if pos == -1:
      raise CodecError(f"{self.what}: truncated: {count} varints from offset {self.pos} "
                       f"run past the end")
    if pos == -2:
      raise CodecError(f"{self.what}: a varint of 63 bits or more among {count} from "
                       f"offset {self.pos}")
    self.pos = pos
    return out

  def done(self):
    if self.pos != self.end:
      raise CodecError(f"{self.what}: {self.end - self.pos} unexpected trailing bytes")


def u8(n: int) -> bytes:
  return _U8.pack(n)


def varints(values) -> bytes:
  """The varints of non-negative integers (below 2**64), concatenated."""
  return loops.varint_bytes(np.asarray(values, np.uint64)).tobytes()


def u16(n: int) -> bytes:
  return _U16.pack(n)


def u32(n: int) -> bytes:
  return _U32.pack(n)


def u64(n: int) -> bytes:
  return _U64.pack(n)


def i64(n: int) -> bytes:
  return _I64.pack(n)
