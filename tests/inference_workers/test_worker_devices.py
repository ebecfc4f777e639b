"""A worker on several local devices (worker.devices, worker.tensor_parallel): the held
weights split over the tensor axis and kept split through keyframes and deltas, the decode
slots over the data axis, attention per device; it samples what a one-device worker samples."""

import jax
import numpy as np
import pytest

from inference_workers.loop import Worker, worker_mesh
from inference_workers.weights import HeldPolicy
from inference_workers.worker_config import WorkerConfig
from param_server.client import sample_logprobs
from param_server.server import ParamServer, ServerConfig
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, TOKENS, client, enqueue_addition, same_held

FOUR = dict(devices=4, tensor_parallel=2)  # data 2 x tensor 2
WIDE = dict(devices=4, tensor_parallel=4)  # tensor 4: wider than the model's 2 kv heads


def _server(path):
  return ParamServer(ServerConfig(
      storage_dir=str(path), port=0, reap_interval_s=0.05, compact_in_background=False,
      threads=32, wal_fsync=False, trainer_token=TOKENS["trainer"],
      worker_token=TOKENS["worker"], viewer_token=TOKENS["viewer"])).start()


def _spec(policy, name):
  return policy.held_state()[name].sharding.spec


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_held_weights_stay_split_over_the_tensor_axis_through_updates(versions, fmt):
  mesh = worker_mesh(WorkerConfig(**FOUR))
  policy = HeldPolicy(CONFIG, fmt, mesh=mesh)
  policy.apply(sync.Update.from_bytes(sync.encode(None, versions[0], fmt, version=0).to_bytes()))
  delta = sync.encode(versions[0], versions[1], fmt, version=1)
  policy.apply(sync.Update.from_bytes(delta.to_bytes()))
  assert policy.version == 1 and same_held(policy, versions[1], fmt)
  q = "layers.0.attn.q_proj.kernel"
  # Split as the trainer splits them: q's heads, the MLP's width (a 99-row vocabulary
  # does not split in 2: the embedding is whole on each device).
  assert _spec(policy, q) == jax.sharding.PartitionSpec(None, "tensor")
  assert _spec(policy, "layers.0.mlp.down_proj.kernel") == jax.sharding.PartitionSpec("tensor")
  if fmt == "int8":  # a scale per output channel follows its codes' split
    assert _spec(policy, q + ".scale") == jax.sharding.PartitionSpec("tensor")
  assert {d.id for d in policy.held_state()[q].sharding.device_set} == {
      d.id for d in jax.local_devices()[:4]}


# ~11 s a case; test_kernels_on_a_mesh holds decoding per device in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_worker_on_four_devices_samples_as_a_worker_on_one(versions, tmp_path, fmt):
  made = {}
  for name, extra in (("one", {}), ("four", FOUR), ("wide", WIDE)):
    server = _server(tmp_path / name)
    try:
      with client(server, "trainer") as trainer, client(server, "worker") as wc:
        trainer.publish(sync.encode(None, versions[0], fmt, version=0).to_bytes())
        enqueue_addition(trainer, 4)
        # int8 weights with an int8 cache: its codes and scales split over the mesh alike.
        config = WorkerConfig(max_leases=2, weights_format=fmt, **SMALL, **extra,
                              kv_cache_dtype="int8" if fmt == "int8" else "")
        worker = Worker(wc, CONFIG, TOKENIZER, config)
        assert worker.run().groups_submitted == 4
        made[name] = {r.group.prompt_id: [(list(s.token_ids), sample_logprobs(s), s.reward)
                                          for s in r.group.samples]
                      for r in trainer.take_rollouts(0, 10).rollouts}
        if extra:  # the weights it sampled with were split, and it held them exactly
          assert "tensor" in str(_spec(worker.policy, "layers.0.mlp.up_proj.kernel"))
          assert same_held(worker.policy, versions[0], fmt)
          cache = worker._batch._dev.slots.cache.suffix_k[0]
          if fmt == "int8":
            assert cache.values.sharding.spec[3] == cache.scales.sharding.spec[3] == "tensor"
          # Each device holds one kv head: on tensor 4 the cache repeats each of the 2.
          heads = cache.shape[3]
          assert heads == {"four": 2, "wide": 4}[name]
          values = cache.values if fmt == "int8" else cache
          assert values.sharding.shard_shape(values.shape)[3] == 1
    finally:
      server.stop(grace=0)
  for name in ("four", "wide"):
    assert made[name].keys() == made["one"].keys() and len(made["one"]) == 4
    for pid, samples in made["one"].items():
      for (tokens, logprobs, reward), (tokens4, logprobs4, reward4) in zip(samples,
                                                                           made[name][pid]):
        assert tokens4 == tokens and reward4 == reward
        np.testing.assert_allclose(logprobs4, logprobs, atol=1e-4)


def test_device_counts_that_do_not_fit_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="WorkerConfig.tensor_parallel"):
    WorkerConfig(devices=4, tensor_parallel=3)
  with pytest.raises(ValueError, match="WorkerConfig.devices"):
    WorkerConfig(devices=-1)
  with pytest.raises(ValueError, match="WorkerConfig.devices: expected at most the"):
    worker_mesh(WorkerConfig(devices=len(jax.local_devices()) + 1))
  with pytest.raises(ValueError, match="WorkerConfig.tensor_parallel"):
    worker_mesh(WorkerConfig(devices=0, tensor_parallel=3))  # 8 local devices
  assert worker_mesh(WorkerConfig()) is None  # one device: placed as before
  assert dict(worker_mesh(WorkerConfig(devices=0)).shape) == {"data": 8, "fsdp": 1,
                                                              "tensor": 1}


@pytest.mark.parametrize("heads,kv_heads,tensor,held", [
    (32, 4, 8, 8),  # Qwen3-30B-A3B on 8 chips: each kv head twice, one a chip
    (28, 4, 8, 4),  # Qwen2.5-7B: 28 query heads do not split in 8, so neither does the cache
    (64, 8, 8, 8),  # as many kv heads as chips: split as they are
    (32, 4, 6, 4),  # 6 chips: not a multiple of 4 kv heads
    (32, 4, 1, 4)])  # no tensor axis
def test_the_cache_repeats_kv_heads_only_where_that_splits_them_one_a_chip(
    heads, kv_heads, tensor, held):
  from inference_workers.shared_prefix import cache_heads
  from rlax_ps.models import ModelConfig
  config = ModelConfig(vocab_size=8, hidden_size=heads * 8, intermediate_size=8, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8)
  mesh = jax.sharding.AbstractMesh((1, 1, tensor), ("data", "fsdp", "tensor"))
  assert cache_heads(config, mesh) == held
  assert cache_heads(config, None) == kv_heads
