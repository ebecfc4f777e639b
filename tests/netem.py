"""A TCP link on 127.0.0.1 that behaves like a slow, lossy network between two regions: a
bandwidth limit, a one-way latency, stalls (no byte passes, the connections stay open) and
cuts (every connection reset, as a dropped route or a NAT that forgot it), for testing
what crosses it (`Link(server.port, rate_bytes_s=2e6, latency_s=0.05)`).

Each direction of each connection has a reader thread, which queues what it receives (at
most `queue_bytes` plus what is in flight for `latency_s`: a bottleneck's buffer, so the
sender is held back by TCP as on a real slow link), and a writer thread, which passes each
piece on once it is due and the rate (one budget per direction, shared by the
connections, as one bottleneck) allows.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time

PIECE = 16 << 10  # bytes read at a time
TICK_S = 0.01  # the writer sends at most this long's worth of bytes at once


class _Direction:
  """One direction of one connection: src -> (queued, delayed, paced) -> dst."""

  def __init__(self, link: "Link", key: int, src: socket.socket, dst: socket.socket,
               downstream: bool):
    self.link, self.key, self.src, self.dst, self.downstream = link, key, src, dst, downstream
    self.queue: collections.deque[list] = collections.deque()  # [due, bytes]
    self.queued = 0
    self.cond = threading.Condition()
    self.eof = False  # src closed: pass on what is queued, then close
    self.closed = False  # reset: stop at once
    self.limit = link.queue_bytes + int(link.rate_bytes_s * link.latency_s)
    threading.Thread(target=self._read, daemon=True).start()
    threading.Thread(target=self._write, daemon=True).start()

  def _read(self) -> None:
    while True:
      with self.cond:
        while self.queued >= self.limit and not self.closed:
          self.cond.wait(0.05)
        if self.closed:
          return
      try:
        data = self.src.recv(PIECE)
      except OSError:
        data = b""
      with self.cond:
        if not data:
          self.eof = True
        else:
          self.queue.append([time.monotonic() + self.link.latency_s, data])
          self.queued += len(data)
        self.cond.notify_all()
      if not data:
        return

  def _write(self) -> None:
    link = self.link
    while True:
      with self.cond:
        while not self.queue and not self.closed and not self.eof:
          self.cond.wait(0.05)
        if self.closed or (self.eof and not self.queue):
          break
        due, data = self.queue[0]
      piece = data[:max(1, int(link.rate_bytes_s * TICK_S))] if link.rate_bytes_s else data
      wait = max(due - time.monotonic(), 0.0) or link.take(self.downstream, len(piece))
      if wait > 0 or link.stalled.is_set() or self.key in link.stalled_connections:
        link.wait(min(wait, 0.05) if wait > 0 else 0.05)
        continue
      try:
        self.dst.sendall(piece)
      except OSError:
        break
      with self.cond:
        if len(piece) == len(data):
          self.queue.popleft()
        else:
          self.queue[0][1] = data[len(piece):]
        self.queued -= len(piece)
        self.cond.notify_all()
      if self.downstream:
        link.passed(self.key, len(piece))
    link.end(self.key, reset=False)

  def stop(self) -> None:
    with self.cond:
      self.closed = True
      self.cond.notify_all()


class Link:
  """Listens on 127.0.0.1:`port`, each connection relayed to 127.0.0.1:`target_port`.

  `rate_bytes_s` (0: unlimited; shared by all connections) and `latency_s` apply to each
  direction; `stalled` (an Event) holds every byte while set, `stalled_connections` those
  of the connections named; `cut()` resets every open connection;
  `cut_every_bytes`: each connection is reset once it has carried that many bytes
  towards the client (0: never). `bytes_down`: bytes passed towards the clients."""

  def __init__(self, target_port: int, *, rate_bytes_s: float = 0.0, latency_s: float = 0.0,
               queue_bytes: int = 64 << 10, cut_every_bytes: int = 0):
    self.target = ("127.0.0.1", target_port)
    self.rate_bytes_s, self.latency_s = float(rate_bytes_s), float(latency_s)
    self.queue_bytes, self.cut_every_bytes = queue_bytes, cut_every_bytes
    self.stalled = threading.Event()
    self.stalled_connections: set[int] = set()  # keys (`busiest()`) of connections held
    self.bytes_down = 0
    self.cuts = 0
    self.connections = 0
    self._closed = threading.Event()
    self._lock = threading.Lock()
    self._open: dict[int, dict] = {}  # key -> sockets, directions, bytes carried down
    self._free_at = {True: 0.0, False: 0.0}  # per direction: when the next byte may go
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.port = self._listener.getsockname()[1]
    self.address = f"127.0.0.1:{self.port}"
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        down, _ = self._listener.accept()
        up = socket.create_connection(self.target)
      except OSError:
        return
      for s in (down, up):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self._lock:
        self.connections += 1
        key = self.connections
        entry = self._open[key] = dict(sockets=(down, up), carried=0, directions=[])
      entry["directions"] += [_Direction(self, key, up, down, downstream=True),
                              _Direction(self, key, down, up, downstream=False)]

  def passed(self, key: int, n: int) -> None:
    """Counts bytes passed towards a client; resets its connection past cut_every_bytes."""
    with self._lock:
      self.bytes_down += n
      entry = self._open.get(key)
      if entry is None:
        return
      entry["carried"] += n
      due = self.cut_every_bytes and entry["carried"] >= self.cut_every_bytes
    if due:
      self.end(key, reset=True)

  def busiest(self) -> int:
    """The key of the open connection that has carried the most bytes towards its client."""
    with self._lock:
      return max(self._open, key=lambda k: self._open[k]["carried"])

  def take(self, downstream: bool, n: int) -> float:
    """0 when `n` bytes may go now in that direction (they are counted against the rate,
    which all connections share, as one bottleneck), else the seconds to wait."""
    if not self.rate_bytes_s:
      return 0.0
    with self._lock:
      now = time.monotonic()
      free_at = max(self._free_at[downstream], now - TICK_S)
      if free_at > now:
        return free_at - now
      self._free_at[downstream] = free_at + n / self.rate_bytes_s
      return 0.0

  def wait(self, seconds: float) -> None:
    self._closed.wait(seconds)

  def end(self, key: int, reset: bool) -> None:
    """Close a connection: both sockets shut (waking their threads); `reset`: with an RST
    (linger 0), counted as a cut."""
    with self._lock:
      entry = self._open.pop(key, None)
      if entry is None:
        return
      self.cuts += reset
    for d in entry["directions"]:
      d.stop()
    for s in entry["sockets"]:
      with contextlib.suppress(OSError):
        if reset:
          s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RDWR)
      with contextlib.suppress(OSError):
        s.close()

  def cut(self) -> None:
    """Reset every open connection (the clients reconnect through the link)."""
    with self._lock:
      keys = list(self._open)
    for key in keys:
      self.end(key, reset=True)

  def close(self) -> None:
    self._closed.set()
    self._listener.close()
    self.cut()

  def __enter__(self) -> "Link":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
