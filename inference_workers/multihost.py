"""One worker over every host of a multi-host slice (one jax.distributed job).

Process 0, the leader, runs the Worker: the server, leases, environments, verifiers. Every
other process follows: it holds its share of the weights and of the decode state and makes
the leader's device calls with the same inputs, in the same order, so that each call runs
as one program over every host's devices. What the leader's calls read back (tokens, flags)
is gathered on every process alike (sharding.to_host).

Calls are mirrored at the level of objects whose every method is a device call with host
inputs: the held weights (an update crosses as its bytes), a continuous batch's slots
(continuous.SlotsDevice), a reward model. The leader's messages reach the others through
the devices themselves (multihost_utils.broadcast_one_to_all), in pieces of at most
PIECE_BYTES, so no second network is needed and an update of any size crosses.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from typing import Any, Callable, Iterable

import jax
import numpy as np
from absl import logging

from rlax_ps.sharding import broadcast_int

PIECE_BYTES = 64 << 20
STOP_KEY = "rlax_ps/worker/stop"  # set by a follower stopped by a signal: the leader stops all
_MIN_PIECE = 256  # pieces are padded to powers of two from here: few programs compile


def _broadcast(x: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.broadcast_one_to_all(x))


class Channel:
  """Messages (any picklable value) from process 0 to every other process, in order."""

  def __init__(self):
    self.leader = jax.process_index() == 0

  def send(self, message: Any) -> None:
    if not self.leader:
      raise RuntimeError("Channel.send: only process 0 sends")
    self._cross(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

  def receive(self) -> Any:
    if self.leader:
      raise RuntimeError("Channel.receive: process 0 sends, it does not receive")
    return pickle.loads(self._cross(b""))

  def _cross(self, data: bytes) -> bytes:
    """The leader's `data` on every process: its length, then its pieces."""
    n = broadcast_int(len(data) if self.leader else 0)  # (an int64: 2 GiB and more)
    got = bytearray() if not self.leader else None
    for start in range(0, n, PIECE_BYTES):
      size = min(PIECE_BYTES, n - start)
      piece = np.zeros(max(_MIN_PIECE, 1 << (size - 1).bit_length()), np.uint8)
      if self.leader:
        piece[:size] = np.frombuffer(data, np.uint8, size, start)
      out = _broadcast(piece)
      if got is not None:
        got += out[:size].tobytes()
    return data if got is None else bytes(got)


def _job_client():
  """The jax.distributed job's client: its key-value store reaches process 0 without a
  device call (jax has no public handle on it)."""
  from jax._src import distributed
  return distributed.global_state.client


def ask_leader_to_stop() -> None:
  """A follower stopped by a signal (its host's preemption notice): ask the leader to stop
  the whole job, so that its samples go back through every host's devices in time."""
  try:
    _job_client().key_value_set(STOP_KEY, str(jax.process_index()))
  except Exception as e:  # noqa: BLE001: another asked first, or the job is gone
    logging.info("worker follower: could not ask the leader to stop: %s", e)


def on_stop_asked(stop: Callable[[int], None], poll_s: float = 0.5) -> None:
  """The leader: stop(process) once a follower asks (ask_leader_to_stop); a daemon thread
  polls for it until the job ends."""
  client = _job_client()

  def watch():
    while True:
      try:
        asker = client.key_value_try_get(STOP_KEY)
      except Exception:  # noqa: BLE001: NOT_FOUND until asked; anything else: the job ended
        if _job_client() is None:
          return
        threading.Event().wait(poll_s)
        continue
      stop(int(asker))
      return

  threading.Thread(target=watch, name="follower-stops", daemon=True).start()


def check_same(settings: dict[str, Any], channel: Channel) -> None:
  """ValueError on every process unless each was given process 0's `settings` (a flat dict:
  name -> value): a process that differs names each setting and both values; process 0
  names the processes that differ. Every process must call it."""
  from jax.experimental import multihost_utils
  if channel.leader:
    channel.send(settings)
  theirs = settings if channel.leader else channel.receive()
  odd = sorted(k for k in settings.keys() | theirs.keys()
               if settings.get(k, "(none)") != theirs.get(k, "(none)"))
  differ = np.asarray(multihost_utils.process_allgather(np.int32(bool(odd)))).reshape(-1)
  if not differ.any():
    return
  if odd:
    raise ValueError("this host's settings differ from host 0's: " + "; ".join(
        f"{k}: host 0 {theirs.get(k, '(none)')!r}, here {settings.get(k, '(none)')!r}"
        for k in odd) + "; run the same command on every host")
  raise ValueError(f"the settings of hosts {np.flatnonzero(differ).tolist()} differ from host "
                   f"0's (their logs name them); run the same command on every host")


class Mirror:
  """The leader's end: each call on an object it mirrors goes to the followers first, then
  runs here; one call at a time across threads, so every process makes them in one order."""

  def __init__(self, channel: Channel):
    self.channel = channel
    self._ids = itertools.count()
    self._lock = threading.RLock()

  def make(self, kind: str, settings: dict) -> int:
    """A new mirrored object's key; each follower makes its own copy with
    `makers[kind](**settings)` (see `follow`)."""
    with self._lock:
      key = next(self._ids)
      self.channel.send(("make", key, kind, settings))
    return key

  def mirrored(self, kind: str, obj: Any, settings: dict, methods: Iterable[str]
               ) -> "Mirrored":
    """`obj` with its `methods` mirrored (the followers' copies made as `make` says)."""
    return Mirrored(obj, self, self.make(kind, settings), frozenset(methods))

  def call(self, key: int, method: str, args: tuple, kwargs: dict, run: Callable[[], Any]):
    """run() here, once the followers were told to call `method` of their copy of `key`
    with `args` and `kwargs`."""
    with self._lock:
      self.channel.send(("call", key, method, args, kwargs))
      return run()

  def forget(self, key: int) -> None:
    with self._lock:
      self.channel.send(("forget", key))

  def stop(self, code: int = 0) -> None:
    """Let the followers return `code` from `follow`: the exit status the leader ends with."""
    with self._lock:
      self.channel.send(("stop", code))


class Mirrored:
  """An object whose `methods` are mirrored (Mirror.mirrored); its other attributes are
  read from it as they are."""

  def __init__(self, obj: Any, mirror: Mirror, key: int, methods: frozenset[str]):
    self._obj, self._mirror, self._key, self._methods = obj, mirror, key, methods

  def __getattr__(self, name: str):
    value = getattr(self._obj, name)
    if name not in self._methods:
      return value
    return lambda *args, **kwargs: self._mirror.call(self._key, name, args, kwargs,
                                                     lambda: value(*args, **kwargs))

  def forget(self) -> None:
    """The followers drop their copy (the leader is done with this one)."""
    self._mirror.forget(self._key)


class PolicyCalls:
  """A follower's held weights (weights.HeldPolicy), called as the leader's MirroredPolicy
  says: an update crosses as its bytes."""

  def __init__(self, policy):
    self.policy = policy

  def apply(self, data: bytes, verify: bool = True) -> None:
    from rlax_ps.sync import Update
    self.policy.apply(Update.from_bytes(data), verify=verify)

  def verify_all(self, data: bytes) -> None:
    from rlax_ps.sync import Update
    self.policy.verify_all(Update.from_bytes(data))

  def digest(self) -> int:
    return self.policy.digest()


class MirroredPolicy:
  """The leader's held weights: what changes or reads them on device is mirrored to the
  followers' (PolicyCalls); everything else is the HeldPolicy's own."""

  def __init__(self, policy, mirror: Mirror):
    self._policy, self._mirror = policy, mirror
    self._key = mirror.make("policy", {})

  def __getattr__(self, name: str):
    return getattr(self._policy, name)

  def apply(self, update, *, verify: bool = True) -> None:
    self._mirror.call(self._key, "apply", (update.to_bytes(), verify), {},
                      lambda: self._policy.apply(update, verify=verify))

  def verify_all(self, update) -> None:
    self._mirror.call(self._key, "verify_all", (update.to_bytes(),), {},
                      lambda: self._policy.verify_all(update))

  def digest(self) -> int:
    return self._mirror.call(self._key, "digest", (), {}, self._policy.digest)


def follow(channel: Channel, makers: dict[str, Callable[..., Any]],
           alike: tuple[type[BaseException], ...] = (ValueError,)) -> int:
  """A follower's loop: make, call and forget what the leader says, until it says stop;
  returns the exit status the leader ends with. A call that raises one of `alike` (errors of
  the inputs, which every host meets: a refused update, a resync) raised on the leader too:
  the leader decides what follows, so it is logged and the loop goes on. Any other (this
  host's device or memory failing) is raised: the process leaves, and the leader's next
  call across the hosts fails, rather than the hosts going on in different states."""
  objects: dict[int, Any] = {}
  while True:
    message = channel.receive()
    op = message[0]
    if op == "stop":
      return int(message[1])
    if op == "make":
      _, key, kind, settings = message
      objects[key] = makers[kind](**settings)
    elif op == "forget":
      objects.pop(message[1], None)
    elif op == "call":
      _, key, method, args, kwargs = message
      try:
        getattr(objects[key], method)(*args, **kwargs)
      except alike as e:  # the leader raised the same and handles it
        logging.info("worker follower: %s.%s raised %s: %s (as on the leader)",
                     type(objects[key]).__name__, method, type(e).__name__, e)
    else:
      raise ValueError(f"worker follower: unknown message {op!r} from the leader")
