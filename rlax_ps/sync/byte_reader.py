"""Bounds-checked reading of little-endian fields and LEB128 varints; every overrun is a
CodecError that names what was being read."""

import struct

from rlax_ps.sync.errors import CodecError

_U16, _U32, _U64 = (struct.Struct(f) for f in ("<H", "<I", "<Q"))


def varint(n: int) -> bytes:
  """LEB128 encoding of a non-negative int."""
  out = bytearray()
  while True:
    b, n = n & 0x7F, n >> 7
    if not n:
      out.append(b)
      return bytes(out)
    out.append(b | 0x80)


class ByteReader:
  """Reads fields from a buffer; `what` names the thing being read in error messages."""

  def __init__(self, buf, what: str, pos: int = 0, end: int | None = None):
    self.buf = memoryview(buf).cast("B")
    self.what = what
    self.pos = pos
    self.end = len(self.buf) if end is None else end

  def take(self, n: int) -> memoryview:
    if n < 0 or self.pos + n > self.end:
      raise CodecError(f"{self.what}: truncated: needs {n} bytes at offset {self.pos}, "
                       f"{self.end - self.pos} left")
    out = self.buf[self.pos:self.pos + n]
    self.pos += n
    return out

  def u8(self) -> int:
    return self.take(1)[0]

  def u16(self) -> int:
    return _U16.unpack(self.take(2))[0]

  def u32(self) -> int:
    return _U32.unpack(self.take(4))[0]

  def u64(self) -> int:
    return _U64.unpack(self.take(8))[0]

  def varint(self) -> int:
    n = shift = 0
    while True:
      b = self.u8()
      if shift == 63 and b > 1:  # (a 10th byte holds the 64th bit alone)
        raise CodecError(f"{self.what}: varint longer than 64 bits at offset {self.pos}")
      n |= (b & 0x7F) << shift
      if not b & 0x80:
        return n
      shift += 7

  def done(self) -> None:
    if self.pos != self.end:
      raise CodecError(f"{self.what}: {self.end - self.pos} unexpected trailing bytes")
