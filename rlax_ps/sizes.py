"""Byte counts as people read them, for status lines and tables."""

from __future__ import annotations


def human_bytes(n: float) -> str:
  """`n` bytes in the binary unit that shows it: a small model's keyframe reads in KiB, a
  large one's in GiB, not as 0.0 MiB or 16,384.0 MiB."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n:,.0f} B"
