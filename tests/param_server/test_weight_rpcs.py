"""Publish / GetLatest / Pull / Watch over gRPC: happy paths, compaction, and every bad-payload class."""

import threading

import grpc
import numpy as np
import pytest

from param_server.client import ParamServerError
from param_server.protos import param_server_pb2 as pb
from param_server.protos import param_server_pb2_grpc as pb_grpc
from ps_testlib import CHUNK, TOKENS, apply_blobs, client_for, perturbed, publish_chain, tiny_weights
from rlax_ps import sync
from rlax_ps.sync import fingerprints, wire


def held(weights, fmt="bf16"):
  return sync.held_state(weights, fmt)


def assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k


def test_pull_from_nothing_reaches_the_latest_weights_exactly(trainer, worker):
  versions = publish_chain(trainer, 4)
  blobs = worker.pull(None)
  assert sync.read_header(bytes(blobs[0])).is_keyframe
  assert_same(apply_blobs(blobs), held(versions[-1]))
  assert worker.latest_version() == 3


def test_pull_from_a_held_version_sends_only_deltas(trainer, worker):
  versions = publish_chain(trainer, 4)
  blobs = worker.pull(1)
  headers = [sync.read_header(bytes(b)) for b in blobs]
  assert [(h.base_version, h.version) for h in headers] == [(1, 2), (2, 3)]
  assert_same(apply_blobs(blobs, held(versions[1])), held(versions[3]))


def test_pull_at_the_latest_version_is_empty(trainer, worker):
  publish_chain(trainer, 2)
  assert worker.pull(1) == []


def test_int8_chain_round_trips(trainer, worker):
  versions = publish_chain(trainer, 3, fmt="int8")
  assert_same(apply_blobs(worker.pull(None)), held(versions[-1], "int8"))


def test_get_latest_describes_the_chain(trainer, viewer):
  assert viewer.version_info().latest_version == -1
  publish_chain(trainer, 3)
  info = viewer.version_info()
  assert (info.latest_version, info.keyframe_version, info.fmt) == (2, 0, "bf16")
  assert info.delta_chain_bytes > 0 and info.keyframe_bytes > info.delta_chain_bytes


def test_watch_streams_each_new_version(trainer, worker):
  publish_chain(trainer, 1)
  seen, got_two = [], threading.Event()

  def watch():
    for info in worker.watch(after_version=-1, timeout_s=10):
      seen.append(info.latest_version)
      if info.latest_version >= 2:
        got_two.set()
        return

  t = threading.Thread(target=watch)
  t.start()
  w1 = perturbed(tiny_weights(), 0.05, 1)
  trainer.publish(sync.encode(tiny_weights(), w1, version=1).to_bytes())
  trainer.publish(sync.encode(w1, perturbed(w1, 0.05, 2), version=2).to_bytes())
  assert got_two.wait(10)
  t.join()
  assert seen[0] == 0 and seen[-1] == 2 and seen == sorted(set(seen))


def test_publish_takes_an_update_or_its_bytes_and_names_anything_else(trainer, worker):
  weights = tiny_weights()
  assert trainer.publish(sync.encode(None, weights, "bf16", version=0)).info.latest_version == 0
  held, want = apply_blobs(worker.pull()), sync.held_state(weights, "bf16")
  assert all(np.array_equal(held[k].view(np.uint16), want[k].view(np.uint16)) for k in want)
  with pytest.raises(TypeError, match="update_bytes: expected the bytes of an rlax_ps.sync.Update, "
                     "got dict"):
    trainer.publish(weights)


def test_a_server_holding_one_runs_versions_refuses_another_runs_even_after_a_restart(
    start_server, tmp_path):
  server = start_server()
  weights = [tiny_weights(0), tiny_weights(1), tiny_weights(2)]
  with client_for(server, "trainer") as t:
    t.publish(sync.encode(None, weights[0], "bf16", version=0), run="run-a")
    with pytest.raises(ParamServerError, match=r"FAILED_PRECONDITION: run: this server holds "
                       r"the versions of another run \(run-a, up to v0\)"):
      t.publish(sync.encode(None, weights[1], "bf16", version=1), run="run-b")
    assert t.latest_version() == 0  # nothing of it kept
    t.publish(sync.encode(weights[0], weights[1], "bf16", version=1), run="run-a")
  server.stop(grace=0)
  again = start_server(storage_dir=server.config.storage_dir)
  with client_for(again, "trainer") as t:
    with pytest.raises(ParamServerError, match="another run \\(run-a, up to v1\\)"):
      t.publish(sync.encode(None, weights[2], "bf16", version=2), run="run-b")
    t.publish(sync.encode(None, weights[2], "bf16", version=2))  # no run said: not checked


def test_a_retried_publication_is_acknowledged_as_duplicate(trainer):
  blob = sync.encode(None, tiny_weights(), version=0).to_bytes()
  assert not trainer.publish(blob).duplicate
  assert trainer.publish(blob).duplicate
  assert trainer.version_info().latest_version == 0


def test_compaction_builds_a_keyframe_and_keeps_history(start_server):
  server = start_server(delta_history=2)
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker:
    versions = publish_chain(trainer, 12, density=0.5)  # dense deltas: the chain soon outweighs the keyframe
    info = trainer.version_info()
    assert info.keyframe_version > 0 and server.weights.compactions >= 1
    assert info.delta_chain_bytes <= info.keyframe_bytes
    blobs = worker.pull(None)
    assert sync.read_header(bytes(blobs[0])).version == info.keyframe_version
    assert_same(apply_blobs(blobs), held(versions[-1]))
    kept_before = [v for v in server.weights.deltas if v <= info.keyframe_version]
    assert len(kept_before) == 2
    lagging = min(kept_before) - 1
    assert_same(apply_blobs(worker.pull(lagging), held(versions[lagging])), held(versions[-1]))


def test_compaction_keeps_the_seals_and_model_fields_of_the_chain(start_server, tmp_path):
  """A compacted keyframe keeps what the updates it replaces carried: the fingerprint seal
  (workers on accelerators check on device) and the publishing model's config fields
  (workers refuse another model's weights), which the chain's keyframe alone carries."""
  server = start_server(delta_history=2)
  model = {"rope_theta": 10000.0, "num_heads": 2}
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker:
    versions = publish_chain(trainer, 12, density=0.5, fingerprints=True, model=model)
    assert server.weights.compactions >= 1
    keyframe = sync.Update.from_bytes(bytes(worker.pull(None)[0]))
    assert keyframe.is_keyframe and keyframe.fingerprinted and keyframe.version > 0
    assert keyframe.model == model
    want = held(versions[keyframe.version])
    keyframe.check_fingerprints(fingerprints.of_state(want))
  plain = start_server(delta_history=2, storage_dir=tmp_path / "plain")
  with client_for(plain, "trainer") as trainer, client_for(plain, "worker") as worker:
    publish_chain(trainer, 12, density=0.5)
    assert plain.weights.compactions >= 1
    keyframe = sync.Update.from_bytes(bytes(worker.pull(None)[0]))
    assert not keyframe.fingerprinted and keyframe.model is None


def _publish_error(client, blob):
  with pytest.raises(ParamServerError) as info:
    client.publish(blob)
  return info.value


def _shaped(weights, **changes):
  out = dict(weights)
  out.update(changes)
  return out


@pytest.mark.parametrize("make_blob, code, field", [
    (lambda w, w1: sync.encode(w, w1, version=1, base_version=0).to_bytes(),
     grpc.StatusCode.FAILED_PRECONDITION, "version"),
    (lambda w, w1: sync.encode(w, w1, version=5, base_version=0).to_bytes(),
     grpc.StatusCode.FAILED_PRECONDITION, "base_version"),
    (lambda w, w1: sync.encode(None, w1, version=1).to_bytes()[:-10],
     grpc.StatusCode.INVALID_ARGUMENT, "data"),
    (lambda w, w1: b"not an update at all",
     grpc.StatusCode.INVALID_ARGUMENT, "data"),
    (lambda w, w1: sync.encode(None, _shaped(w1, embed=np.zeros((8, 8), np.float32)), version=3).to_bytes(),
     grpc.StatusCode.FAILED_PRECONDITION, "tensors\\['embed'\\]"),
    (lambda w, w1: sync.encode(None, _shaped(w1, extra=np.zeros(3, np.float32)), version=3).to_bytes(),
     grpc.StatusCode.FAILED_PRECONDITION, "tensors"),
    (lambda w, w1: sync.encode(None, w1, "int8", version=3).to_bytes(),
     grpc.StatusCode.FAILED_PRECONDITION, "fmt"),
    (lambda w, w1: sync.encode(_shaped(w, extra=np.zeros(3, np.float32)),  # another model's delta
                               _shaped(w1, extra=np.ones(3, np.float32)), version=2).to_bytes(),
     grpc.StatusCode.INVALID_ARGUMENT, "data: not a valid update: update 2: made for other tensors"),
])
def test_bad_publications_are_rejected_and_change_nothing(trainer, worker, make_blob, code, field):
  versions = publish_chain(trainer, 2)  # latest v1
  before = worker.pull(None)
  err = _publish_error(trainer, make_blob(versions[0], perturbed(versions[1], 0.1, 9)))
  assert err.code == code and field.replace("\\", "") in err.details.replace("\\", "")
  assert trainer.version_info().latest_version == 1
  assert [bytes(b) for b in worker.pull(None)] == [bytes(b) for b in before]


def test_a_corrupted_keyframe_fails_its_checksum(trainer):
  blob = bytearray(sync.encode(None, tiny_weights(), version=0).to_bytes())
  blob[-5] ^= 0xFF  # inside the last tensor's section (header order: sorted names)
  err = _publish_error(trainer, bytes(blob))
  assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.details.startswith("data")
  assert f"'{max(tiny_weights())}'" in err.details and "checksum" in err.details
  assert trainer.version_info().latest_version == -1


def test_a_corrupted_delta_fails_its_digest(trainer):
  versions = publish_chain(trainer, 1)
  blob = bytearray(sync.encode(versions[0], perturbed(versions[0], 0.2, 3), version=1).to_bytes())
  blob[-2] ^= 0xFF
  err = _publish_error(trainer, bytes(blob))
  assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.details.startswith("data")
  assert "corrupted" in err.details
  assert trainer.version_info().latest_version == 0


def test_a_keyframe_with_a_wrong_checksum_is_rejected(trainer):
  held_w = held(tiny_weights())
  names = sorted(held_w)
  blob = wire.build("bf16", 0, None, [(n, held_w[n].shape, held_w[n].dtype, wire.RAW) for n in names],
                    [held_w[n].tobytes() for n in names], {},
                    [sync.checksum(held_w[n]) ^ (n == "embed") for n in names], None, None).to_bytes()
  err = _publish_error(trainer, blob)
  assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in err.details and "embed" in err.details


def test_the_first_publication_must_be_a_keyframe(trainer):
  w = tiny_weights()
  err = _publish_error(trainer, sync.encode(w, perturbed(w, 0.1, 1), version=1).to_bytes())
  assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "base_version" in err.details


def _raw_publish(server, chunks, token="trainer"):
  channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
  stub = pb_grpc.ParamServerStub(channel)
  try:
    with pytest.raises(grpc.RpcError) as info:
      stub.Publish(iter(chunks), metadata=(("authorization", f"Bearer {TOKENS[token]}"),), timeout=10)
    return info.value
  finally:
    channel.close()


def test_an_oversized_chunk_is_resource_exhausted(server, trainer):
  blob = sync.encode(None, tiny_weights(), version=0).to_bytes()
  err = _raw_publish(server, [pb.PublishChunk(total_bytes=len(blob), data=blob[:CHUNK + 1])])
  assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "data" in err.details()
  huge = _raw_publish(server, [pb.PublishChunk(total_bytes=4 << 20, data=bytes(4 << 20))])
  assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert trainer.version_info().latest_version == -1


@pytest.mark.parametrize("chunks, code, field", [
    ([pb.PublishChunk(total_bytes=1 << 50, data=b"x")], grpc.StatusCode.RESOURCE_EXHAUSTED, "total_bytes"),
    ([pb.PublishChunk(total_bytes=0, data=b"x")], grpc.StatusCode.INVALID_ARGUMENT, "total_bytes"),
    ([pb.PublishChunk(total_bytes=10, data=b"xx"), pb.PublishChunk(offset=5, data=b"yy")],
     grpc.StatusCode.INVALID_ARGUMENT, "offset"),
    ([pb.PublishChunk(total_bytes=10, data=b"xx")], grpc.StatusCode.INVALID_ARGUMENT, "total_bytes"),
    ([], grpc.StatusCode.INVALID_ARGUMENT, "chunks"),
])
def test_malformed_publish_streams_name_the_field(server, trainer, chunks, code, field):
  err = _raw_publish(server, chunks)
  assert err.code() == code and err.details().startswith(field)
  assert trainer.version_info().latest_version == -1


def test_pull_validates_have_version(trainer, worker):
  with pytest.raises(ParamServerError) as nothing:
    worker.pull(None)
  assert nothing.value.code == grpc.StatusCode.NOT_FOUND
  publish_chain(trainer, 2)
  with pytest.raises(ParamServerError) as ahead:
    worker.pull(7)
  assert ahead.value.code == grpc.StatusCode.FAILED_PRECONDITION and "have_version" in ahead.value.details
  with pytest.raises(ParamServerError) as negative:
    worker.pull(-5)
  assert negative.value.code == grpc.StatusCode.INVALID_ARGUMENT and "have_version" in negative.value.details


def test_stats_count_rejections_and_bytes_served(trainer, worker, viewer):
  publish_chain(trainer, 2)
  blobs = worker.pull(None)
  with pytest.raises(ParamServerError):
    worker.pull(99)
  stats = viewer.stats()
  assert stats.bytes_served == sum(len(b) for b in blobs)
  assert stats.errors == 1


def test_a_trainer_dying_mid_publish_leaves_the_latest_version(server, trainer, worker):
  publish_chain(trainer, 1)
  blob = sync.encode(None, tiny_weights(1), version=1).to_bytes()
  assert len(blob) > CHUNK  # the stream dies after its first chunk

  def dying_stream():
    yield pb.PublishChunk(total_bytes=len(blob), offset=0, data=blob[:CHUNK])
    raise RuntimeError("trainer preempted")

  channel = grpc.insecure_channel(server.address)
  with pytest.raises((grpc.RpcError, RuntimeError)):
    pb_grpc.ParamServerStub(channel).Publish(
        dying_stream(), metadata=(("authorization", f"Bearer {TOKENS['trainer']}"),), timeout=10)
  channel.close()
  assert trainer.version_info().latest_version == 0
  trainer.publish(blob)
  assert worker.latest_version() == 1


def test_a_retried_delta_is_a_duplicate_even_after_compaction(start_server):
  server = start_server()
  with client_for(server, "trainer") as trainer:
    versions = publish_chain(trainer, 1)
    for v in range(1, 4):  # unrelated weights each time: the chain soon outweighs the keyframe
      versions.append(tiny_weights(seed=v))
      delta = sync.encode(versions[-2], versions[-1], version=v).to_bytes()
      trainer.publish(delta)
      if trainer.version_info().keyframe_version == v:
        break
    assert trainer.version_info().keyframe_version == v  # compacted at the latest version
    assert trainer.publish(delta).duplicate


def test_background_compaction_serves_the_same_weights(start_server):
  server = start_server(compact_in_background=True)
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker:
    versions = publish_chain(trainer, 8, density=0.5)
    for _ in range(200):  # until the compaction thread has installed its keyframe
      if server.weights.compactions and not server.weights._compacting:
        break
      threading.Event().wait(0.05)
    assert server.weights.compactions >= 1
    assert_same(apply_blobs(worker.pull(None)), held(versions[-1]))
    assert_same(apply_blobs(worker.pull(0), held(versions[0])), held(versions[-1]))
