"""Versioned weight storage: the latest keyframe and the delta chain after it, on disk.

Each publication is kept as the exact `Update` bytes it arrived as, in a 1-D
uint8 tensorstore (zarr3) array chunked like the wire, so a pull streams byte
ranges: no decoding, and no per-client copy (chunks read once are kept in a
cache shared by all pulls, bounded by `cache_bytes`). A version is
committed by writing its JSON marker atomically after its array is complete;
on restart an array without a marker (a half-written version) is deleted and
never served. When the deltas after the keyframe outweigh it, a background
compaction materialises the latest weights (checking every checksum) and
stores them as a new keyframe; `delta_history` older deltas stay for workers
that lag. A publisher's scheduled keyframe comes after the delta of its version
and is stored beside it (as a compacted one is), so a worker one version behind
still pulls the delta.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import mmap
import os
import shutil
import threading
import uuid

import numpy as np
import tensorstore as ts
from absl import logging

from param_server import errors, payloads
from param_server.durable import fsync_dir, write_durably


@dataclasses.dataclass(frozen=True)
class Blob:
  """One stored publication (or compacted keyframe)."""
  version: int
  base_version: int | None
  fmt: str
  nbytes: int
  sha256: str
  tensors: dict  # name -> [shape, dtype]

  @property
  def name(self) -> str:
    kind = "k" if self.base_version is None else f"d{self.base_version:012d}"
    return f"v{self.version:012d}-{kind}"

  @property
  def is_keyframe(self) -> bool:
    return self.base_version is None


@dataclasses.dataclass(frozen=True)
class WeightLimits:
  max_publish_bytes: int = 64 << 30
  max_chunk_bytes: int = 4 << 20
  # Deltas before the newest keyframe kept for workers that lag.
  delta_history: int = 4
  # Decode every keyframe on publication to check its checksums.
  verify_keyframes: bool = True
  # Compact in a background thread (False: inline, for deterministic tests).
  compact_in_background: bool = True
  # Bytes of stored chunks kept in memory, shared by all pulls (0: read every chunk from disk).
  cache_bytes: int = 32 << 20  # a window of chunks that concurrent pullers share


def _array_spec(path: str, nbytes: int | None = None, chunk: int | None = None) -> dict:
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
  if nbytes is not None:
    spec["metadata"] = {
        "shape": [nbytes], "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, min(chunk, nbytes))]}},
        "codecs": [{"name": "bytes"}]}
  return spec


class PublishWriter:
  """Streams one publication's chunks, in order, to a file in the store's tmp folder (hashed
  on the way); `WeightStore.commit` verifies and stores it from there. So receiving a
  publication costs a chunk of memory, not its size."""

  def __init__(self, store: "WeightStore", total_bytes: int):
    self.store = store
    self.total = total_bytes
    self.received = 0
    self.sha256 = hashlib.sha256()
    self.path = os.path.join(store.tmp_dir, uuid.uuid4().hex + ".publication")
    self._file = open(self.path, "wb")

  def write(self, offset: int, data: bytes) -> None:
    limits = self.store.limits
    if len(data) > limits.max_chunk_bytes:
      raise errors.ResourceExhausted("data", f"expected a chunk of at most {limits.max_chunk_bytes} bytes, "
                                     f"got {len(data)}")
    if offset != self.received:
      raise errors.InvalidArgument("offset", f"expected {self.received} (chunks in order), got {offset}")
    if self.received + len(data) > self.total:
      raise errors.InvalidArgument(
          "data", f"expected {self.total} bytes in all (total_bytes), got at least {self.received + len(data)}")
    self._file.write(data)
    self._file.flush()  # readable from the file at once: a relay streams it on as it arrives
    self.sha256.update(data)
    self.received += len(data)

  @contextlib.contextmanager
  def mapped(self):
    """The received bytes, mapped read-only (pages are read from disk as they are touched;
    `drop` gives them back)."""
    self._file.close()
    with open(self.path, "rb") as f:
      data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
      yield data
    finally:
      # A view of it still held (by an error's traceback) keeps it open until gc.
      with contextlib.suppress(BufferError):
        data.close()

  def abort(self) -> None:
    self._file.close()
    with contextlib.suppress(FileNotFoundError):
      os.remove(self.path)


def drop(data: mmap.mmap, start: int, stop: int) -> None:
  """Gives the mapped pages of bytes [start, stop) back (they stay in the page cache), so
  reading a whole publication never holds more than the part being read."""
  start -= start % mmap.PAGESIZE
  stop = min(stop, len(data))
  if stop > start:
    data.madvise(mmap.MADV_DONTNEED, start, stop - start)


class WeightStore:
  """The stored versions; thread-safe. Readers pin blobs so compaction never deletes one mid-pull."""

  def __init__(self, root: str, *, limits: WeightLimits = WeightLimits(), chunk_bytes: int = 4 << 20):
    self.limits = limits
    self.chunk_bytes = chunk_bytes
    self.blob_dir = os.path.join(root, "weights")
    self.tmp_dir = os.path.join(root, "weights_tmp")
    os.makedirs(self.blob_dir, exist_ok=True)
    shutil.rmtree(self.tmp_dir, ignore_errors=True)  # half-received publications
    os.makedirs(self.tmp_dir)
    self._lock = threading.RLock()
    self.changed = threading.Condition(self._lock)
    self.keyframe: Blob | None = None
    self.deltas: dict[int, Blob] = {}  # version -> delta ending at that version
    self.latest = -1
    self._pins: dict[str, int] = {}
    self._doomed: set[str] = set()
    self._compacting = False
    self.compactions = 0
    self._cache: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()
    self._cache_used = 0
    self._results: dict[str, int] = {}  # blob name -> its results' seal digest (read once)
    self._recover()

  # ------------------------------------------------------------ disk layout

  def _path(self, blob: Blob) -> str:
    return os.path.join(self.blob_dir, blob.name + ".zarr")

  def _marker(self, blob: Blob) -> str:
    return os.path.join(self.blob_dir, blob.name + ".json")

  def _recover(self) -> None:
    blobs = []
    for fname in sorted(os.listdir(self.blob_dir)):
      if fname.endswith(".json"):
        with open(os.path.join(self.blob_dir, fname)) as f:
          blob = Blob(**json.load(f))
        if os.path.exists(self._path(blob)):
          blobs.append(blob)
        else:
          logging.warning("weights: marker %s has no array; dropping it", fname)
          os.remove(os.path.join(self.blob_dir, fname))
    names = {b.name for b in blobs}
    for fname in os.listdir(self.blob_dir):
      if fname.endswith(".zarr") and fname[:-5] not in names:
        logging.warning("weights: discarding half-written version %s", fname)
        shutil.rmtree(os.path.join(self.blob_dir, fname), ignore_errors=True)
      elif fname.endswith(".tmp"):
        os.remove(os.path.join(self.blob_dir, fname))
    keyframes = [b for b in blobs if b.is_keyframe]
    if not keyframes:
      return
    self.keyframe = max(keyframes, key=lambda b: b.version)
    self.deltas = {b.version: b for b in blobs if not b.is_keyframe}
    # The latest version is the end of the delta chain that starts at the keyframe.
    self.latest = self.keyframe.version
    while True:
      nxt = [b for b in self.deltas.values() if b.base_version == self.latest]
      if not nxt:
        break
      self.latest = nxt[0].version
    for b in keyframes:
      if b is not self.keyframe:
        self._delete(b)
    for b in list(self.deltas.values()):
      if b.version > self.latest:
        logging.warning("weights: delta %s does not chain from the keyframe; dropping it", b.name)
        self._delete(b)
        del self.deltas[b.version]
    logging.info("weights: recovered keyframe v%d, latest v%d, %d deltas",
                 self.keyframe.version, self.latest, len(self.deltas))

  def _delete(self, blob: Blob) -> None:
    if self._pins.get(blob.name):
      self._doomed.add(blob.name)
      return
    for key in [k for k in self._cache if k[0] == blob.name]:
      self._cache_used -= self._cache.pop(key).nbytes
    self._results.pop(blob.name, None)  # (one entry a version: a long run's grew for good)
    if os.path.exists(self._marker(blob)):
      os.remove(self._marker(blob))
    shutil.rmtree(self._path(blob), ignore_errors=True)

  # ------------------------------------------------------------ publishing

  def begin_publish(self, total_bytes: int) -> PublishWriter:
    if total_bytes <= 0:
      raise errors.InvalidArgument("total_bytes", f"expected > 0 on the first chunk, got {total_bytes}")
    if total_bytes > self.limits.max_publish_bytes:
      raise errors.ResourceExhausted(
          "total_bytes", f"expected at most {self.limits.max_publish_bytes}, got {total_bytes}")
    return PublishWriter(self, total_bytes)

  def _validate(self, info: payloads.PayloadInfo) -> None:
    """Checks a publication's header against the stored chain; raises naming the field."""
    if self.keyframe is None:
      if not info.is_keyframe:
        raise errors.FailedPrecondition(
            "base_version", f"expected a keyframe (nothing published yet), got a delta on v{info.base_version}")
      if info.version < 0:
        raise errors.InvalidArgument("version", f"expected >= 0, got {info.version}")
      return
    if info.is_keyframe and info.version == self.latest and self.keyframe.version < self.latest:
      if info.results != self._results_at_latest():
        raise errors.FailedPrecondition(  # (a keyframe of that version goes beside its delta)
            "version", f"v{info.version} is a keyframe of weights other than the stored "
            f"v{self.latest} (its result seal differs)")
    elif info.version <= self.latest:
      raise errors.FailedPrecondition(
          "version", f"expected a version above the latest v{self.latest}, got v{info.version}")
    if not info.is_keyframe and info.base_version != self.latest:
      raise errors.FailedPrecondition(
          "base_version", f"expected the latest version v{self.latest}, got v{info.base_version}")
    if not info.is_keyframe and info.bases is not None and info.bases != self._results_at_latest():
      raise errors.FailedPrecondition(  # (made from other weights of that version number:
          "base_version", f"v{info.version} is a delta from weights other than the stored "
          f"v{self.latest} (its base seal differs); send it as a keyframe")  # a stale trainer)
    fmt, tensors = self.keyframe.fmt, self.keyframe.tensors
    if info.fmt != fmt:
      raise errors.FailedPrecondition("fmt", f"expected the model's format {fmt!r}, got {info.fmt!r}")
    if set(info.tensors) != set(tensors):
      missing = sorted(set(tensors) - set(info.tensors))
      extra = sorted(set(info.tensors) - set(tensors))
      raise errors.FailedPrecondition(
          "tensors", f"expected the model's tensors; missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, dtype) in info.tensors.items():
      if name not in tensors:
        raise errors.FailedPrecondition("tensors", f"expected a tensor of the model, got unknown {name!r}")
      want_shape, want_dtype = tensors[name]
      if list(shape) != list(want_shape) or dtype != want_dtype:
        raise errors.FailedPrecondition(
            f"tensors[{name!r}]", f"expected shape {tuple(want_shape)} {want_dtype}, got {tuple(shape)} {dtype}")

  def commit(self, writer: PublishWriter) -> tuple[Blob, bool]:
    """Validates a fully received publication and makes it the latest version; returns
    (blob, duplicate). The publication is read from its file a part at a time: a keyframe
    is verified tensor by tensor, then stored chunk by chunk."""
    if writer.received != writer.total:
      raise errors.InvalidArgument("total_bytes", f"stream ended after {writer.received} of {writer.total} bytes")
    try:
      with writer.mapped() as data:
        blob, duplicate = self._store(data, writer.sha256.hexdigest())
    finally:
      writer.abort()  # its file: stored now, or refused
    if not duplicate:
      self._maybe_compact()
    return blob, duplicate

  def _store(self, data: mmap.mmap, sha: str) -> tuple[Blob, bool]:
    try:
      keyframe = self.keyframe  # a delta names its tensors by the model's layout
      info = payloads.read_info(data, None if keyframe is None else keyframe.tensors)
    except payloads.CodecError as e:
      raise errors.InvalidArgument("data", f"not a valid update: {e}") from None
    with self._lock:
      same = self._stored_already(info, sha)
      if same is not None:
        return same, True
      self._validate(info)
    try:
      payloads.verify(data, decode_keyframe=self.limits.verify_keyframes,
                      layout=None if keyframe is None else keyframe.tensors,
                      done=functools.partial(drop, data))
    except payloads.CodecError as e:
      raise errors.InvalidArgument("data", f"v{info.version} fails its checks: {e}") from None
    blob = Blob(info.version, info.base_version, info.fmt, len(data), sha,
                {k: [list(s), d] for k, (s, d) in info.tensors.items()})
    tmp = os.path.join(self.tmp_dir, uuid.uuid4().hex + ".zarr")
    try:
      self._write_array(tmp, data)
      with self._lock:
        same = self._stored_already(info, sha)  # stored while this one verified
        if same is not None:
          return same, True
        self._validate(info)  # again: another publisher may have won the race meanwhile
        os.replace(tmp, self._path(blob))
        fsync_dir(self.blob_dir)
        write_durably(self._marker(blob), json.dumps(dataclasses.asdict(blob)))
        self._results[blob.name] = info.results
        self._install(blob)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    return blob, False

  def _write_array(self, path: str, data) -> None:
    self._write_parts(path, [data], len(data),
                      done=functools.partial(drop, data) if isinstance(data, mmap.mmap) else None)

  def _write_parts(self, path: str, parts: list, total: int, *, done=None, hasher=None) -> None:
    """Writes the concatenation of `parts` (buffers, `total` bytes) as the array at `path`,
    a chunk at a time (a chunk that spans parts is assembled alone), so no second copy of
    the blob is made; `hasher` (e.g. hashlib.sha256()) sees every byte in order, and
    `done(start, stop)` is told each range once it is written."""
    array = ts.open(_array_spec(path, total, self.chunk_bytes), create=True, delete_existing=True).result()
    pending, at, held = [], 0, 0
    for part in parts:
      view, pos = np.frombuffer(part, dtype=np.uint8), 0
      while pos < view.size:
        take = min(view.size - pos, self.chunk_bytes - held)
        pending.append(view[pos:pos + take])
        pos, held = pos + take, held + take
        if held == self.chunk_bytes or at + held == total:
          piece = pending[0] if len(pending) == 1 else np.concatenate(pending)
          array[at:at + held].write(piece).result()
          if hasher is not None:
            hasher.update(piece)
          if done is not None:
            done(at, at + held)
          at, pending, held = at + held, [], 0
    if at != total:
      raise ValueError(f"parts hold {at} bytes, expected {total}")

  def _stored_already(self, info: payloads.PayloadInfo, sha: str) -> Blob | None:
    """The stored blob that makes a publication (`info`, its bytes' `sha`) redundant: itself
    (a retry), or for a keyframe of the latest version, a keyframe of the same weights there
    (compacted from the deltas meanwhile)."""
    if info.version != self.latest:
      return None
    for same in self._blobs_at(self.latest):
      if same.sha256 == sha or (same.is_keyframe and info.is_keyframe
                                and self._results_of(same) == info.results):
        return same
    return None

  def _results_at_latest(self) -> int:
    """The seal digest of the latest version's results (its blobs there share it)."""
    return self._results_of(self._blobs_at(self.latest)[0])

  def _results_of(self, blob: Blob) -> int:
    """The seal digest of a stored blob's results (its header, read once)."""
    if blob.name not in self._results:
      self._results[blob.name] = payloads.read_stored_info(self._reader(blob), blob.nbytes).results
    return self._results[blob.name]

  def _blobs_at(self, version: int) -> list[Blob]:
    """The stored blobs ending at `version` (its delta, and a keyframe compacted there)."""
    return [b for b in (self.keyframe, self.deltas.get(version)) if b is not None and b.version == version]

  def _install(self, blob: Blob) -> None:
    if blob.is_keyframe:
      old = self.keyframe
      self.keyframe = blob
      if old is not None and old.version != blob.version:
        self._delete(old)
      self._trim_history()
    else:
      self.deltas[blob.version] = blob
    self.latest = max(self.latest, blob.version)
    self.changed.notify_all()

  def _trim_history(self) -> None:
    before = sorted(v for v in self.deltas if v <= self.keyframe.version)
    for v in before[:max(0, len(before) - self.limits.delta_history)]:
      self._delete(self.deltas.pop(v))

  # ------------------------------------------------------------ compaction

  def _maybe_compact(self) -> None:
    with self._lock:
      if self._compacting or self.keyframe is None:
        return
      chain = self._chain(self.keyframe.version, self.latest) or []
      if sum(b.nbytes for b in chain) <= self.keyframe.nbytes:
        return
      self._compacting = True
      blobs = [self.keyframe] + chain
      for b in blobs:
        self._pin(b)
    if self.limits.compact_in_background:
      threading.Thread(target=self._compact, args=(blobs,), name="compaction", daemon=True).start()
    else:
      self._compact(blobs)

  def _compact(self, blobs: list[Blob]) -> None:
    # Written aside, then renamed: the trainer may publish a keyframe of this version meanwhile.
    tmp = os.path.join(self.tmp_dir, uuid.uuid4().hex + ".zarr")
    try:
      target = blobs[-1]
      info = payloads.read_stored_info(self._reader(target), target.nbytes)
      model = info.model  # the publisher's model fields: on its keyframes alone
      if model is None:
        model = payloads.read_stored_info(self._reader(blobs[0]), blobs[0].nbytes).model
      # The keyframe read a tensor at a time: one model in memory.
      weights = payloads.materialize(self._reader(blobs[0]), blobs[0].nbytes,
                                     (self.read_all(b) for b in blobs[1:]))
      parts = payloads.keyframe_parts(weights, target.fmt, target.version,
                                      fingerprints=info.fingerprinted, model=model)
      total, sha = sum(memoryview(p).nbytes for p in parts), hashlib.sha256()
      self._write_parts(tmp, parts, total, hasher=sha)  # views of the weights
      del parts, weights
      blob = Blob(target.version, None, target.fmt, total, sha.hexdigest(), self.keyframe.tensors)
      with self._lock:
        if self.keyframe.version >= blob.version:  # the trainer published a keyframe meanwhile
          return
        os.replace(tmp, self._path(blob))
        fsync_dir(self.blob_dir)
        write_durably(self._marker(blob), json.dumps(dataclasses.asdict(blob)))
        self._install(blob)
        self.compactions += 1
      logging.info("weights: compacted %d updates into keyframe v%d", len(blobs), blob.version)
    except Exception:  # A bad chain must not take the server down; it keeps serving deltas.
      logging.exception("weights: compaction to v%d failed", blobs[-1].version)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)  # (gone once stored)
      with self._lock:
        for b in blobs:
          self._unpin(b)
        self._compacting = False

  # ------------------------------------------------------------ serving

  def info(self) -> dict:
    with self._lock:
      if self.keyframe is None:
        return dict(latest_version=-1, keyframe_version=-1, oldest_delta_base=-1, fmt="",
                    keyframe_bytes=0, delta_chain_bytes=0)
      chain = self._chain(self.keyframe.version, self.latest) or []
      bases = [b.base_version for b in self.deltas.values() if self._chain(b.base_version, self.latest)]
      return dict(latest_version=self.latest, keyframe_version=self.keyframe.version,
                  oldest_delta_base=min(bases, default=self.latest), fmt=self.keyframe.fmt,
                  keyframe_bytes=self.keyframe.nbytes, delta_chain_bytes=sum(b.nbytes for b in chain))

  def _chain(self, have: int, target: int) -> list[Blob] | None:
    """The deltas that bring `have` to `target`, or None when they are not all stored."""
    out, v = [], target
    while v != have:
      blob = self.deltas.get(v)
      if blob is None or blob.base_version < have:
        return None
      out.append(blob)
      v = blob.base_version
    return out[::-1]

  def plan(self, have: int | None) -> list[Blob]:
    """The cheapest list of blobs that brings `have` (None: nothing) to the latest version; pinned."""
    with self._lock:
      if self.keyframe is None:
        raise errors.NotFound("have_version", "nothing has been published yet")
      if have is not None and have > self.latest:
        raise errors.FailedPrecondition(
            "have_version", f"expected at most the latest version v{self.latest}, got v{have}; "
            "pull without have_version to resynchronise")
      full = [self.keyframe] + (self._chain(self.keyframe.version, self.latest) or [])
      plan = full
      if have is not None and have >= 0:
        deltas = self._chain(have, self.latest)
        if deltas is not None and sum(b.nbytes for b in deltas) <= sum(b.nbytes for b in full):
          plan = deltas
      for b in plan:
        self._pin(b)
      return plan

  def _pin(self, blob: Blob) -> None:
    self._pins[blob.name] = self._pins.get(blob.name, 0) + 1

  def _unpin(self, blob: Blob) -> None:
    self._pins[blob.name] -= 1
    if not self._pins[blob.name]:
      del self._pins[blob.name]
      if blob.name in self._doomed:
        self._doomed.discard(blob.name)
        self._delete(blob)

  @property
  def pinned(self) -> int:
    """Blobs held by pulls under way (none is deleted by compaction until released)."""
    with self._lock:
      return len(self._pins)

  def release(self, plan: list[Blob]) -> None:
    with self._lock:
      for b in plan:
        self._unpin(b)

  def open_array(self, blob: Blob):
    return ts.open(_array_spec(self._path(blob))).result()

  def read_range(self, blob: Blob, array, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of a pinned blob; whole stored chunks are served from a shared cache."""
    whole = start % self.chunk_bytes == 0 and stop == min(start + self.chunk_bytes, blob.nbytes)
    key = (blob.name, start)
    if whole:
      with self._lock:
        hit = self._cache.get(key)
        if hit is not None:
          self._cache.move_to_end(key)
          return hit
    data = array[start:stop].read().result()
    if whole and data.nbytes <= self.limits.cache_bytes:
      with self._lock:
        if key not in self._cache and blob.name not in self._doomed:
          self._cache[key] = data
          self._cache_used += data.nbytes
          while self._cache_used > self.limits.cache_bytes:
            self._cache_used -= self._cache.popitem(last=False)[1].nbytes
    return data

  def _reader(self, blob: Blob):
    """read(start, stop) of a stored blob: a new array of those bytes, uncached."""
    array = self.open_array(blob)
    return lambda start, stop: array[start:stop].read().result()

  def read_all(self, blob: Blob) -> np.ndarray:
    return self.open_array(blob).read().result()
