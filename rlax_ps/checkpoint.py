"""Checkpoints of a training run: orbax CheckpointManager, async saves, the last N kept.

Each step directory holds two items: `state` (a pytree of arrays: params, optimizer
state, step, RNG) and `metadata` (a JSON blob: config, data position, and for RL the
published version and the takes not yet acknowledged). A save becomes visible only once
complete (orbax writes to a temporary directory and renames it), so a run killed mid-save
resumes from the last complete one.
Restoring takes an abstract target whose shardings may be those of another mesh.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE, METADATA = "state", "metadata"
# Stamped in every step's metadata. Raise it when a release writes what an older one would
# misread (a new field its readers must know): the older release then refuses the step in a
# line (readable_metadata), where it would fail on the field or resume wrongly.
FORMAT, FORMAT_KEY = 1, "checkpoint_format"
# tensorstore's words for array data cut short or unreadable (a step half written to disk).
_UNREADABLE = ("OUT_OF_RANGE", "DATA_LOSS", "Error reading", "Error opening")


def _unreadable(error: BaseException) -> BaseException | None:
  """The error in `error`'s chain that says a step's files are missing or cut short, or None:
  orbax wraps tensorstore's ValueError in a bare Exception when it reads into shardings."""
  seen = 0
  while error is not None and seen < 16:
    if isinstance(error, (KeyError, FileNotFoundError)) or any(
        m in str(error) for m in _UNREADABLE):
      return error
    error, seen = error.__cause__ or error.__context__, seen + 1
  return None


def readable_metadata(metadata: dict[str, Any], directory: str,
                      step: int | None = None) -> dict[str, Any]:
  """A checkpoint's `metadata` as its readers take it (without the format stamp); ValueError
  where a newer rlax-ps wrote it, in a format this one does not read (a rollback to an older
  release over a newer one's workdir)."""
  saved = dict(metadata)
  written = saved.pop(FORMAT_KEY, 0)
  if isinstance(written, int) and written > FORMAT:
    at = f"step {step} in {directory}" if step is not None else f"the checkpoint in {directory}"
    raise ValueError(f"checkpoint: {at} was written by a newer rlax-ps (checkpoint format "
                     f"{written}; this one reads up to {FORMAT}): resume with that release, or "
                     f"use another workdir (the checkpoint is left as it is)")
  return saved


def _skip_raw_byte_metrics() -> None:
  """orbax (0.12) asks tensorstore for its bytes written before and after each array save,
  to log a throughput; tensorstore (0.1.86) never frees what
  experimental_collect_matching_metrics returns: ~24 objects a save, a trainer's memory
  growing with every checkpoint. None skips the logged figure (orbax's own path for
  "unknown") and the leak; an orbax without the call is left as it is."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils
  except ImportError:
    return
  if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
    tensorstore_utils.get_tensorstore_raw_bytes = lambda *args, **kwargs: None


_skip_raw_byte_metrics()


class Checkpointer:
  """Saves and restores (state pytree, JSON metadata) pairs under one directory."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    """`read_only`: another process's checkpoints (a run that may be saving there): nothing
    in the directory is created, cleaned up or written; only restores and `restore_params`."""
    if max_to_keep < 1:
      raise ValueError(f"checkpoint.max_to_keep: expected >= 1, got {max_to_keep}")
    # A local path, or a URL orbax writes through (gs://bucket/run/checkpoints).
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                             save_interval_steps=0)
      self._manager = ocp.CheckpointManager(
          self.directory, options=options, item_names=(STATE, METADATA),
          item_handlers={STATE: ocp.PyTreeCheckpointHandler(),
                         METADATA: ocp.JsonCheckpointHandler()})
      return
    if "://" not in directory:
      _check_writable(self.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=(STATE, METADATA))

  def save(self, step: int, state: Any, metadata: dict[str, Any]) -> bool:
    """Start saving `state` and `metadata` as `step` (returns at once when async). The
    metadata is written as it is now: an async save writes its JSON later, from a thread,
    and the caller goes on changing what the dict holds."""
    snapshot = json.loads(json.dumps(metadata))
    snapshot[FORMAT_KEY] = FORMAT
    return self._manager.save(
        int(step), args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state),
            METADATA: ocp.args.JsonSave(snapshot)}), force=True)

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None when there is none: an async save under way
    counts from save() on (wait() first for the newest complete one)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def reload(self) -> None:
    """List the steps on disk anew: a running trainer saves new ones and deletes old ones
    (max_to_keep) under a reader."""
    self._manager.reload()

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(state, metadata) of `step` (default: the latest), laid out as `target` says.

    `target` is a pytree of jax.ShapeDtypeStruct with shardings (e.g. on a new mesh), or of
    arrays whose shardings are reused.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct)
        else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    saved = self.metadata(step)  # a newer release's format refused before any array is read
    try:
      restored = self._manager.restore(int(step), args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(abstract)}))
    except Exception as e:
      if (cut := _unreadable(e)) is not None:  # an item or a file missing, data cut short
        raise self._damaged(int(step), cut) from e
      if isinstance(e, ValueError):
        if not any(m in str(e) for m in ("tree structures do not match", "Structure mismatch")):
          raise
        raise ValueError(
            f"checkpoint: step {step} in {self.directory} holds a state laid out otherwise "
            f"than this config's (a changed optimizer?): "
            f"{str(e).split('If this mismatch')[0].strip()}; resume with the settings it was "
            f"written with, or use another workdir") from e
      e.add_note(self._damaged(int(step), e).args[0].replace("is incomplete or damaged",
                                                              "could not be read"))
      raise
    return restored[STATE], saved

  def restore_params(self, target: Any, step: int) -> Any:
    """Only the params of checkpoint `step` (a read-only Checkpointer's), laid out as
    `target` (ShapeDtypeStructs with shardings); the rest of the state is not read."""
    item = {"params": target}
    args = ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)
    try:
      restored = self._manager.restore(int(step), args=ocp.args.Composite(**{STATE: args}))
    except Exception as e:  # files missing or cut: named in a line
      cut = e if isinstance(e, (KeyError, OSError, ValueError)) else _unreadable(e)
      if cut is None:
        raise
      raise self._damaged(int(step), cut) from e
    return restored[STATE]["params"]

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """Only the JSON blob of `step` (default: the latest)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    try:
      restored = self._manager.restore(int(step), args=ocp.args.Composite(**{
          METADATA: ocp.args.JsonRestore()}))
    except (KeyError, OSError, ValueError) as e:
      raise self._damaged(int(step), e) from e
    return readable_metadata(restored[METADATA], self.directory, step)

  def latest_metadata(self) -> dict[str, Any] | None:
    """The JSON blob of the newest complete checkpoint, or None when there is none."""
    step = self.latest_step()
    return None if step is None else self.metadata(step)

  def _damaged(self, step: int, error: Exception) -> ValueError:
    """The error for a step folder that cannot be read (emptied, truncated, half deleted):
    which folder, and what deleting it resumes from."""
    older = [s for s in self.all_steps() if s < step]
    then = (f"resume from step {older[-1]} (an RL run's groups acknowledged for the steps "
            f"after it are not trained again)" if older else "start anew")
    # (the first line; tensorstore appends its whole spec, orbax "See full TensorStore details")
    said = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    said = said.split("See full TensorStore details")[0].rstrip(" .;:")
    return ValueError(f"checkpoint: step {step} in {self.directory} is incomplete or damaged "
                      f"({type(error).__name__}: {said}); delete "
                      f"{os.path.join(self.directory, str(step))} to {then}")

  def saving(self) -> bool:
    """True while an async save is still being written (not yet durable)."""
    return self._manager.is_saving_in_progress()

  def wait(self) -> None:
    """Block until the pending async save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Wait for pending saves and orbax's start-up cleanup of leftover tmp folders, then close:
    a process may exit right after."""
    self._manager.wait_until_finished()
    _await_tmp_cleanup(self._manager)
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _await_tmp_cleanup(manager: ocp.CheckpointManager) -> None:
  """Wait for the removal of unfinished saves' tmp folders that a CheckpointManager starts in
  a thread when it opens. Only its save() awaits it: unawaited, an exit cuts it short (folders
  left, "cannot schedule new futures after shutdown" on stderr). orbax has no public wait for
  it, hence its private one; an orbax without it closes as before."""
  wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
  if callable(wait):
    wait()


def _check_writable(directory: str) -> None:
  """Create `directory` and write a file in it, so that a read-only or wrong checkpoint
  directory stops a run before its first step, not at (or, async, well after) its first save."""
  try:
    os.makedirs(directory, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()  # made and gone: nothing left behind
  except OSError as e:
    raise OSError(e.errno, f"checkpoint.directory: expected a directory this process can "
                  f"write, got {directory} ({e.strerror})") from e
