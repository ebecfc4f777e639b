"""Bounds-checked reading of little-endian fields; every overrun is a CodecError."""

import struct

import numpy as np

from rlax_ps.sync.errors import CodecError

_U8, _U16, _U32, _U64, _I64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q", "<q"))


def varint(n: int) -> bytes:
  """LEB128 encoding of a non-negative int."""
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
    return self._fixed(_U8)

  def u16(self) -> int:
    return self._fixed(_U16)

  def u32(self) -> int:
    return self._fixed(_U32)

  def u64(self) -> int:
    return self._fixed(_U64)

  def i64(self) -> int:
    return self._fixed(_I64)

  def varint(self) -> int:
    n = shift = 0
    while True:
      b = self.u8()
      n |= (b & 0x7F) << shift
      if not b & 0x80:
        return n
      shift += 7
      if shift > 63:
        raise CodecError(f"{self.what}: varint longer than 64 bits at offset {self.pos}")

  def varints(self, count: int) -> np.ndarray:
    """`count` varints as an int64 array."""
    return np.array([self.varint() for _ in range(count)], np.int64)

  def done(self):
    if self.pos != self.end:
      raise CodecError(f"{self.what}: {self.end - self.pos} unexpected trailing bytes")


def u8(n: int) -> bytes:
  return _U8.pack(n)


def varints(values) -> bytes:
  """The varints of non-negative integers, concatenated."""
  return b"".join(varint(int(v)) for v in values)


def u16(n: int) -> bytes:
  return _U16.pack(n)


def u32(n: int) -> bytes:
  return _U32.pack(n)


def u64(n: int) -> bytes:
  return _U64.pack(n)


def i64(n: int) -> bytes:
  return _I64.pack(n)
