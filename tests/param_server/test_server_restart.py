"""kill -9 of a server process, restart on the same storage: nothing acknowledged is lost.
While a server lives, no second one opens its storage.

Also: half-written versions are discarded, and a pull broken mid-stream resumes.
"""

import os
import threading
import time

import numpy as np
import pytest

from param_server.client import ParamServerError, PullProgress, RetryPolicy
from param_server.protos import param_server_pb2 as pb
from param_server.server import ParamServer, ServerConfig
from rlax_ps.folder_lock import FolderInUse
from param_server.weights import WeightStore
from ports import free_port
from ps_testlib import CHUNK, apply_blobs, client_for, perturbed, publish_chain, tiny_weights
from rlax_ps import sync


def prompts(n):
  return [pb.Prompt(id=f"p{i}", text=f"prompt {i}") for i in range(n)]


def group(pid, version=0):
  return pb.RolloutGroup(prompt_id=pid, policy_version=version,
                         samples=[pb.Sample(token_ids=[1, 2], reward=0.5, logprobs=[-1.0, -2.0])])


def kill9(proc):
  proc.kill()  # SIGKILL
  proc.wait()


def test_kill9_and_restart_keeps_every_acknowledged_change(tmp_path, server_process):
  storage = tmp_path / "ps"
  proc, address = server_process(storage)
  trainer, worker = client_for(address, "trainer"), client_for(address, "worker")
  worker.register("w")
  versions = publish_chain(trainer, 3)
  pulled = [bytes(b) for b in worker.pull(None)]
  trainer.enqueue_prompts(prompts(6))
  # Deadlines far past the restart: a fresh machine's server compiles its codec first.
  lease = worker.lease(4, deadline_s=900)
  worker.submit_rollouts(lease.lease_id, group(lease.prompts[0].id))
  worker.submit_rollouts(lease.lease_id, group(lease.prompts[1].id))
  take = trainer.take_rollouts(max_n=1, ack_deadline_s=900)
  before = trainer.stats()
  with pytest.raises(FolderInUse, match=f"--storage_dir {storage}: in use by another "
                                         f"parameter server \\(pid {proc.pid}"):
    ParamServer(ServerConfig(storage_dir=str(storage), port=0))  # while the first lives
  kill9(proc)  # its lock goes with it

  proc, address = server_process(storage)
  trainer, worker2 = client_for(address, "trainer"), client_for(address, "worker")
  after = trainer.stats()
  for field in ("prompts_queued", "prompts_leased", "leases_active", "rollouts_ready", "rollouts_in_flight",
                "rollouts_accepted"):
    assert getattr(after, field) == getattr(before, field), field
  assert after.versions.latest_version == 2
  assert [bytes(b) for b in worker2.pull(None)] == pulled
  np.testing.assert_array_equal(apply_blobs(worker2.pull(None))["embed"].view(np.uint16),
                                sync.held_state(versions[-1], "bf16")["embed"].view(np.uint16))
  # The lease survived: a retry is acknowledged, the rest can be submitted, the take acked.
  wid = worker.worker_id
  assert worker2.submit_rollouts(lease.lease_id, group(lease.prompts[1].id), worker_id=wid).duplicate
  worker2.submit_rollouts(lease.lease_id, group(lease.prompts[2].id), worker_id=wid)
  assert trainer.ack(take) == 1
  rest = trainer.take_rollouts(max_n=10)
  assert [r.prompt.id for r in rest.rollouts] == [lease.prompts[1].id, lease.prompts[2].id]
  for c in (trainer, worker, worker2):
    c.close()


def test_kill9_under_concurrent_submissions_loses_no_acknowledged_rollout(tmp_path, server_process):
  storage = tmp_path / "ps"
  proc, address = server_process(storage)
  trainer = client_for(address, "trainer")
  trainer.enqueue_prompts(prompts(400))
  acked, stop = [], threading.Event()

  def work(k):
    c = client_for(address, "worker", retry=RetryPolicy(deadline_s=0.5))
    c.register(f"w{k}")
    try:
      while not stop.is_set():
        lease = c.lease(5, deadline_s=60)
        for p in lease.prompts:
          reply = c.submit_rollouts(lease.lease_id, group(p.id))
          acked.append((p.id, reply.rollout_id))
    except ParamServerError:
      pass  # the server died under us
    finally:
      c.close()

  threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
  for t in threads:
    t.start()
  while len(acked) < 40:
    threading.Event().wait(0.01)
  kill9(proc)
  stop.set()
  for t in threads:
    t.join()
  proc, address = server_process(storage)
  trainer = client_for(address, "trainer")
  taken = trainer.take_rollouts(max_n=1000)
  got = {(r.prompt.id, r.rollout_id) for r in taken.rollouts}
  assert set(acked) <= got
  assert len({pid for pid, _ in got}) == len(got)  # each prompt answered once
  stats = trainer.stats()
  assert stats.prompts_queued + stats.prompts_leased + len(got) == 400
  trainer.close()


def commit(store, blob):
  writer = store.begin_publish(len(blob))
  for off in range(0, len(blob), CHUNK):
    writer.write(off, blob[off:off + CHUNK])
  return store.commit(writer)[0]


def test_a_half_written_version_is_discarded_on_restart(tmp_path):
  storage = str(tmp_path / "ps")
  store = WeightStore(storage, chunk_bytes=CHUNK)
  w0 = tiny_weights()
  w1 = perturbed(w0, 0.1, 1)
  commit(store, sync.encode(None, w0, version=0).to_bytes())
  commit(store, sync.encode(w0, w1, version=1).to_bytes())
  # A crash after writing v2's array but before its commit marker, and one mid-receive.
  w2 = perturbed(w1, 0.1, 2)
  store._write_array(os.path.join(store.blob_dir, "v000000000002-d000000000001.zarr"),
                     sync.encode(w1, w2, version=2).to_bytes())
  store._write_array(os.path.join(store.tmp_dir, "partial.zarr"), b"\0" * 100)
  again = WeightStore(storage, chunk_bytes=CHUNK)
  assert again.latest == 1
  assert sorted(os.listdir(again.blob_dir)) == sorted(
      f"v{v:012d}-{k}.{ext}" for v, k in ((0, "k"), (1, "d000000000000")) for ext in ("zarr", "json"))
  assert os.listdir(again.tmp_dir) == []
  assert commit(again, sync.encode(w1, w2, version=2).to_bytes()).version == 2  # v2 can be published again


def _big_keyframe(n=1 << 18):
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(n,)).astype(np.float32)}  # 512 KiB as bf16: 128 chunks of 4 KiB


def test_a_client_dying_mid_pull_resumes_from_its_last_chunk(server, trainer, worker):
  weights = _big_keyframe()
  trainer.publish(sync.encode(None, weights, version=0).to_bytes())
  progress = PullProgress()

  def die_after_some(chunk):
    if chunk.offset >= 20 * CHUNK:
      raise KeyboardInterrupt("worker preempted")

  with pytest.raises(KeyboardInterrupt):
    worker.pull(None, progress=progress, on_chunk=die_after_some)
  held_bytes = progress.partial_filled
  assert held_bytes > 0 and not progress.done
  end = time.monotonic() + 10  # the dead pull's stream may send on until the server sees it gone
  while server.weights.pinned:
    assert time.monotonic() < end, "the dead pull's stream did not end"
    time.sleep(0.01)
  served_before = server.servicer.bytes_served
  blobs = worker.pull(progress=progress)
  assert progress.resumed_bytes == held_bytes
  # At most the chunk in flight when the client died is sent twice.
  assert server.servicer.bytes_served - served_before <= len(blobs[0]) - held_bytes + CHUNK
  np.testing.assert_array_equal(apply_blobs(blobs)["w"].view(np.uint16),
                                sync.held_state(weights, "bf16")["w"].view(np.uint16))


def test_a_pull_survives_a_server_kill9_and_resumes(tmp_path, server_process):
  storage, port = tmp_path / "ps", free_port()
  proc, address = server_process(storage, f"--port={port}")
  weights = _big_keyframe()
  with client_for(address, "trainer") as trainer:
    trainer.publish(sync.encode(None, weights, version=0).to_bytes())
  worker = client_for(address, "worker")
  progress, restarted = PullProgress(), []

  def kill_once(chunk):
    if not restarted and chunk.offset >= 10 * CHUNK:
      kill9(proc)
      restarted.append(server_process(storage, f"--port={port}"))

  blobs = worker.pull(None, progress=progress, on_chunk=kill_once)
  assert restarted and progress.attempts >= 2 and progress.resumed_bytes >= 10 * CHUNK
  np.testing.assert_array_equal(apply_blobs(blobs)["w"].view(np.uint16),
                                sync.held_state(weights, "bf16")["w"].view(np.uint16))
  worker.close()


def test_calls_and_watch_ride_out_a_server_restart(tmp_path, server_process):
  storage, port = tmp_path / "ps", free_port()
  proc, address = server_process(storage, f"--port={port}")
  patient = RetryPolicy(deadline_s=60)
  trainer = client_for(address, "trainer", retry=patient)
  watcher = client_for(address, "worker", retry=patient)
  w0 = tiny_weights()
  trainer.publish(sync.encode(None, w0, version=0).to_bytes())
  seen, first = [], threading.Event()

  def watch():
    for info in watcher.watch(after_version=-1, timeout_s=60):
      seen.append(info.latest_version)
      first.set()
      if info.latest_version == 1:
        return

  thread = threading.Thread(target=watch)
  thread.start()
  assert first.wait(30)
  kill9(proc)
  restart = threading.Timer(0.3, lambda: server_process(storage, f"--port={port}"))
  restart.start()
  trainer.publish(sync.encode(w0, perturbed(w0, 0.1, 1), version=1).to_bytes())  # retried until it is back
  restart.join()
  thread.join(60)
  assert seen == [0, 1]
  trainer.close()
  watcher.close()


def test_a_storage_folder_keeps_its_id_and_another_folder_has_another(tmp_path):
  """The id a trainer tells a server that lost its state by: the same across restarts on one
  folder, in every GetLatest and TakeRollouts reply; another folder's differs."""
  from ps_testlib import small_config
  ids = []
  for folder in ("a", "a", "b"):
    with ParamServer(small_config(tmp_path / folder)) as server, \
        client_for(server, "trainer") as tc:
      info, take = tc.version_info(), tc.take_rollouts(0, 1)
      assert info.store_id == take.store_id != ""
      ids.append(info.store_id)
  assert ids[0] == ids[1] != ids[2]
  assert (tmp_path / "a" / "STORE").read_text().strip() == ids[0]


@pytest.mark.parametrize("held", ["shorter", "same_size"])
def test_a_pull_resumed_into_another_update_of_its_version_begins_it_again(
    server, trainer, worker, held):
  """A pull holding the start of another v0 keyframe (a new run's, a lost server's): the
  server resumes by version and base alone. An update of another size is begun again
  from byte 0 (a longer one ran past the bytes held: DATA_LOSS); one of the same size joined to the held bytes does not decode, and is
  pulled again whole (it ended the worker with a CodecError)."""
  weights = _big_keyframe()
  blob = sync.encode(None, weights, version=0).to_bytes()
  trainer.publish(blob)
  half = len(blob) // 2
  if held == "shorter":
    start = bytearray(len(blob) - 64)
    start[:half] = blob[:half]
  else:  # the same size, another header (so another crc32 of it)
    start = bytearray(blob)
    start[20] ^= 0xFF
  progress = PullProgress(have_version=None, partial=start, partial_filled=half,
                          partial_version=0, partial_base=-1)
  worker._unfinished = (None, progress)  # what a pull that broke there leaves
  updates = worker.pull_updates(None)
  assert len(updates) == 1 and updates[0].version == 0
  got = sync.apply(None, updates[0])
  np.testing.assert_array_equal(got["w"].view(np.uint16),
                                sync.held_state(weights, "bf16")["w"].view(np.uint16))
