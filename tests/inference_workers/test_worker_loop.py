"""The worker loop against a real parameter server on 127.0.0.1: leases, versions, resyncs,
and preemption (SIGTERM releases within the grace period; SIGKILL leases expire)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference_workers.continuous import ContinuousBatch
from inference_workers.loop import Worker
from inference_workers.sampler import generate
from inference_workers.worker_config import WorkerConfig
from param_server.client import ParamServerClient, RetryPolicy, routes_of, sample_logprobs
from param_server.protos import param_server_pb2 as pb
from param_server.server import ParamServer, ServerConfig
from rlax_ps import sync
from rlax_ps.sync import device
from rlax_ps.models import ModelConfig, Transformer, flatten_params
from rlax_ps.tasks import get_task
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train.rl import group_of, routing_shape
from rlax_ps.train.rollouts import BatchShape, check_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "t-secret", "worker": "w-secret", "viewer": "v-secret"}
TOKENIZER = CharTokenizer()
MODEL = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=64)
CONFIG = ModelConfig(vocab_size=TOKENIZER.vocab_size, **MODEL)
SMALL = dict(prompts_per_lease=2, prompts_per_call=2, samples_per_prompt=3, max_new_tokens=6,
             lease_wait_s=0.2, lease_deadline_s=60.0, backoff_initial_s=0.05)


@pytest.fixture(scope="module")
def versions():
  v0 = {k: np.asarray(v) for k, v in flatten_params(Transformer(CONFIG, rngs=nnx.Rngs(0))).items()}
  rng = np.random.default_rng(1)
  v1 = {k: (v + (rng.random(v.shape) < 0.02) * 0.01).astype(np.float32) for k, v in v0.items()}
  return [v0, v1]


@pytest.fixture
def server(tmp_path):
  config = ServerConfig(storage_dir=str(tmp_path / "ps"), port=0, reap_interval_s=0.05,
                        compact_in_background=False, threads=32, wal_fsync=False,
                        trainer_token=TOKENS["trainer"], worker_token=TOKENS["worker"],
                        viewer_token=TOKENS["viewer"])
  s = ParamServer(config).start()
  yield s
  s.stop(grace=0)


def client(server, role):
  return ParamServerClient(server.address, token=TOKENS[role], role=role, timeout_s=10.0,
                           retry=RetryPolicy(deadline_s=5.0))


def enqueue_addition(trainer, n, seed=0):
  examples = get_task("addition", max_digits=2).examples("train", seed, n)
  prompts = [pb.Prompt(id=f"p{i}", text=e.prompt, task="addition", extra=e.answer.encode())
             for i, e in enumerate(examples)]
  trainer.enqueue_prompts(prompts)
  return [p.id for p in prompts]


def same_held(policy, params, fmt="bf16"):
  want = sync.held_state(params, fmt)
  got = policy.held_state()
  return all(np.asarray(got[k]).tobytes() == want[k].tobytes() for k in want)


def run_until_stopped(worker, monkeypatch, chunks=1):
  """worker.run(), stopped after `chunks` decode chunks with only salvage_s of grace left:
  it hands its running prompts back at the next look."""
  step, seen = ContinuousBatch.step, []

  def stopping_step(batch):
    out = step(batch)
    seen.append(out)
    if len(seen) == chunks:
      worker.request_stop(grace_s=worker.config.salvage_s)
    return out

  with monkeypatch.context() as m:
    m.setattr(ContinuousBatch, "step", stopping_step)
    return worker.run()


def test_worker_completes_leases_and_submits_scored_groups(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 4)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=2, **SMALL))
    start = time.monotonic()
    stats = worker.run()
    wall = time.monotonic() - start
    assert stats.leases == 2 and stats.groups_submitted == 4
    # The speed it reports counts decoding time only: at least the whole run's average.
    assert stats.tokens / wall <= worker._tokens_per_s < float("inf")
    # run() waits for its heartbeat thread: one left inside gRPC aborts the interpreter's exit
    assert not any(t.name == "worker-heartbeat" for t in threading.enumerate())
    take = trainer.take_rollouts(min_version=0, max_n=10)
    assert sorted(r.group.prompt_id for r in take.rollouts) == sorted(ids)
    for r in take.rollouts:
      assert r.group.policy_version == 0 and len(r.group.samples) == 3
      for s in r.group.samples:
        assert 0 < len(s.token_ids) <= 6 and s.reward in (0.0, 1.0)
        assert len(sample_logprobs(s)) == len(s.token_ids)
        assert np.all(sample_logprobs(s) <= 0)
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.prompts_queued == 0


def test_new_version_is_picked_up_between_leases(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
    worker.run()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker.config.max_leases = 2
    worker.run()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
    assert worker.stats.versions_applied == [0, 1]  # the delta, not a second keyframe
    made = sorted(r.group.policy_version for r in trainer.take_rollouts(0, 10).rollouts)
    assert made == [0, 0, 1, 1]


def test_the_server_sees_each_new_version_at_once_not_a_heartbeat_interval_later(server, versions):
  # The server asks for a heartbeat every 10 s; the worker reports at registration and
  # after each version it applies, so status and metrics never show a stale version long.
  assert server.config.heartbeat_interval_s == 10.0
  with client(server, "trainer") as trainer, client(server, "worker") as wc, \
      client(server, "viewer") as viewer:
    def held_versions():
      return [w.version for w in viewer.stats().workers]

    def wait_for(want):
      deadline = time.monotonic() + 3.0
      while held_versions() != want and time.monotonic() < deadline:
        time.sleep(0.05)
      return held_versions()

    enqueue_addition(trainer, 40)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
      assert wait_for([-1]) == [-1]  # registered, holding nothing yet
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
      assert wait_for([0]) == [0]
      trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
      assert wait_for([1]) == [1]
    finally:
      worker.request_stop(30.0)
      thread.join(30)


def test_a_version_published_while_a_lease_waits_samples_its_prompts(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    lease = wc.lease

    def lease_across_a_publication(*args, **kwargs):
      got = lease(*args, **kwargs)  # the worker checked the version before this call
      trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
      return got

    wc.lease = lease_across_a_publication
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
    worker.run()
    assert worker.stats.versions_applied == [0, 1]
    made = [r.group.policy_version for r in trainer.take_rollouts(0, 10).rollouts]
    assert made == [1, 1]


def test_prefetched_update_waits_for_the_batch_boundary(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker.prefetch(1)  # what the heartbeat thread does while a batch is generating
    assert worker.policy.version == 0 and same_held(worker.policy, versions[0])
    assert worker.apply_prefetched()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])


@pytest.mark.parametrize("in_flight", [False, True], ids=["at_the_drain", "in_flight"])
def test_a_version_published_mid_generation(server, versions, monkeypatch, in_flight):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)
    # In flight, one row per prompt: its three samples one after another.
    config = WorkerConfig(max_leases=2, in_flight_updates=in_flight, decode_chunk_steps=1,
                          rows_per_prompt=1 if in_flight else 0, **SMALL)
    worker = Worker(wc, CONFIG, TOKENIZER, config)
    step = ContinuousBatch.step

    def publish_after_the_first_chunk(batch):
      out = step(batch)
      if worker.stats.leases == 1 and trainer.latest_version() == 0:
        trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
        worker.prefetch(1)  # what the heartbeat thread does while a batch is generating
      return out

    monkeypatch.setattr(ContinuousBatch, "step", publish_after_the_first_chunk)
    worker.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  assert worker.stats.versions_applied == [0, 1] and same_held(worker.policy, versions[1])
  assert worker._batch.rows_per_prompt == (1 if in_flight else 3)
  first, second = [[(groups[p].policy_version, groups[p].metadata["last_version"])
                    for p in pair] for pair in (("p0", "p1"), ("p2", "p3"))]
  assert second == [(1, "1"), (1, "1")]  # the second lease starts on the new version
  if in_flight:  # the first lease's groups went on with the new weights
    assert first == [(0, "1"), (0, "1")]
  else:  # the new version waited for them to finish
    assert first == [(0, "0"), (0, "0")]


def test_a_stopped_worker_hands_back_begun_samples_that_the_next_one_finishes(
    server, versions, monkeypatch):
  """SIGTERM's grace runs low mid-generation: the running prompts go back with their begun
  samples, and the next worker draws them on with the same seeds: the samples are exactly
  those of an uninterrupted run."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    first = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    run_until_stopped(first, monkeypatch)
    assert first.stats.groups_submitted == 0 and first.stats.prompts_released == 2
    assert first.stats.samples_salvaged == 6  # 2 prompts x 3 samples, each begun
    with client(server, "worker") as wc2:
      wc2.register("peek")
      lease = wc2.lease(2, deadline_s=30)
      begun = {p.id: [pb.Sample(token_ids=s.token_ids, logprobs_f32=s.logprobs_f32)
                      for s in p.partial] for p in lease.prompts}
      assert all(0 < len(s.token_ids) < 24 for ps in begun.values() for s in ps)
      # One begun sample altered on its way back: the next worker must write it as given.
      altered = begun["p0"][0]
      altered.token_ids[-1] = (altered.token_ids[-1] + 1) % TOKENIZER.vocab_size
      wc2.release(lease, partial=[pb.PartialRollouts(prompt_id=pid, samples=ps)
                                  for pid, ps in begun.items()])
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    second.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  assert sorted(groups) == ["p0", "p1"] and second.stats.groups_submitted == 2
  examples = get_task("addition", max_digits=2).examples("train", 0, 2)
  for pid, group in groups.items():
    assert group.metadata["resumed_samples"] == "3" and group.policy_version == 0
    head = TOKENIZER.encode_prompt(examples[int(pid[1:])].prompt)
    want = generate(second.policy.model, [head] * 3, second._seeds(pid, 0, 0, 3),
                    second.params)  # what an uninterrupted worker draws
    for j, (s, w, before) in enumerate(zip(group.samples, want, begun[pid])):
      k = len(before.token_ids)
      assert list(s.token_ids[:k]) == list(before.token_ids)
      if (pid, j) == ("p0", 0):  # drawn on from the altered token
        assert s.token_ids[k - 1] != w.tokens[k - 1]
        continue
      assert list(s.token_ids) == w.tokens.tolist()
      lp = sample_logprobs(s)
      np.testing.assert_array_equal(lp[:k], sample_logprobs(before))  # as first drawn
      np.testing.assert_allclose(lp[k:], w.sampling_logprobs[k:], atol=1e-5)


def test_a_stop_hands_back_running_prompts_with_their_samples_and_waiting_ones_as_they_are(
    server, versions, monkeypatch):
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4, prompts_per_lease=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)  # one lease of four; two decode, two wait for a slot
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    stats = run_until_stopped(worker, monkeypatch)
    assert stats.prompts_released + stats.groups_submitted == 4
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.prompts_queued == stats.prompts_released
    with client(server, "worker") as peek:
      peek.register("peek")
      back = peek.lease(4, deadline_s=30).prompts
  begun = sorted(p.id for p in back if p.partial)
  assert len(begun) == 2 - stats.groups_submitted and len(back) - len(begun) == 2


def test_begun_samples_travel_with_their_experts_under_routing_replay(server, monkeypatch):
  """Mixture of experts: the begun samples go back with their routes; the next worker's
  groups carry every token's experts, as an uninterrupted run's, and the trainer takes them."""
  moe = CONFIG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  params = {k: np.asarray(v) for k, v in flatten_params(Transformer(moe, rngs=nnx.Rngs(0))).items()}
  config = WorkerConfig(max_leases=1, routing_replay=True, max_new_tokens=24,
                        decode_chunk_steps=4, **{k: v for k, v in SMALL.items()
                                                 if k != "max_new_tokens"})
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    first = Worker(wc, moe, TOKENIZER, config)
    run_until_stopped(first, monkeypatch)
    assert first.stats.samples_salvaged > 0 and first.stats.groups_submitted < 2
    second = Worker(wc, moe, TOKENIZER, config)
    second.run()
    taken = trainer.take_rollouts(0, 10).rollouts
  assert len(taken) == 2 and any("resumed_samples" in t.group.metadata for t in taken)
  shape = BatchShape(groups=2, samples=3, prompt_len=32, response_len=24,
                     **routing_shape(moe, {"routing_replay": True}))
  examples = get_task("addition", max_digits=2).examples("train", 0, 2)
  for t in taken:
    check_group(group_of(t, TOKENIZER), shape)  # every token's experts, in range and distinct
    pid = t.group.prompt_id
    head = TOKENIZER.encode_prompt(examples[int(pid[1:])].prompt)
    want = generate(second.policy.model, [head] * 3, second._seeds(pid, 0, 0, 3),
                    second.params, record_routes=True)
    for s, w in zip(t.group.samples, want):
      assert list(s.token_ids) == w.tokens.tolist()
      np.testing.assert_array_equal(routes_of(s.routes), w.routes)


def test_begun_samples_that_do_not_fit_are_drawn_afresh(server, versions, caplog):
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    with client(server, "worker") as other:  # a worker of another model hands it back
      other.register("other")
      lease = other.lease(1, deadline_s=30)
      other.release(lease, partial=[pb.PartialRollouts(prompt_id="p0", samples=[
          pb.Sample(token_ids=[10 ** 6], logprobs=[-1.0])])])
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    worker.run()
    (r,) = trainer.take_rollouts(0, 10).rollouts
  assert "resumed_samples" not in r.group.metadata and len(r.group.samples) == 3
  assert all(10 ** 6 not in s.token_ids for s in r.group.samples)
  assert "the begun samples of prompt p0 are drawn afresh: begun[0].tokens" in caplog.text


def test_salvage_must_leave_part_of_the_grace_period():
  with pytest.raises(ValueError, match=r"WorkerConfig.salvage_s: expected a number of seconds "
                                       r"in \[0, grace_s=25.0\), got 25.0"):
    WorkerConfig(salvage_s=25.0)


def test_a_publisher_on_device_seals_fingerprints_that_the_worker_checks_on_device(
    server, versions, monkeypatch):
  on_device = [{k: jnp.asarray(v) for k, v in sync.held_state(p, "bf16").items()}
               for p in versions]
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    host0 = {k: np.asarray(v) for k, v in on_device[0].items()}
    keyframe = sync.encode(None, host0, "bf16", version=0,
                           fingerprints=device.fingerprints_of(on_device[0]))
    trainer.publish(keyframe.to_bytes())
    host1, printed = device.publish_state(host0, on_device[0], on_device[1])
    trainer.publish(sync.encode(host0, host1, "bf16", version=1, fingerprints=printed,
                                base_checksums=keyframe.checksums).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.policy.on_device_checks = True  # as on an accelerator
    pulled = []
    monkeypatch.setattr(worker.policy, "_pulled_checksum", pulled.append)
    assert worker.sync_weights()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
    assert pulled == [] and worker.stats.versions_applied[-1] == 1


def test_vigor_allocation_spends_the_whole_budget(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    config = WorkerConfig(max_leases=1, **dict(SMALL, allocator="vigor", samples_per_prompt=4))
    stats = Worker(wc, CONFIG, TOKENIZER, config).run()
    groups = [r.group for r in trainer.take_rollouts(0, 10).rollouts]
    assert stats.groups_submitted == 2 and len(groups) == 2
    assert sum(len(g.samples) for g in groups) == 8
    assert all(len(g.samples) >= 2 for g in groups)  # VIGOR's first round: m0 = 2 each


def test_routing_replay_sends_each_tokens_experts_that_the_trainer_accepts(server):
  moe = CONFIG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  params = {k: np.asarray(v) for k, v in flatten_params(Transformer(moe, rngs=nnx.Rngs(0))).items()}
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    config = WorkerConfig(max_leases=1, routing_replay=True,
                          **dict(SMALL, allocator="vigor", samples_per_prompt=4))
    assert Worker(wc, moe, TOKENIZER, config).run().groups_submitted == 2
    taken = trainer.take_rollouts(0, 10).rollouts
  shape = BatchShape(groups=2, samples=4, prompt_len=32, response_len=6,
                     **routing_shape(moe, {"routing_replay": True}))
  for t in taken:
    group = group_of(t, TOKENIZER)
    check_group(group, shape)  # every token's experts, in range and distinct
    assert group.prompt_routes.shape == (len(group.prompt_tokens), 2, 2)
    assert [len(r) for r in group.response_routes] == [len(r) - 1 for r in group.responses]
  with pytest.raises(ValueError, match="WorkerConfig.routing_replay: expected False for a model "
                                       "without mixture-of-experts layers"):
    Worker(wc, CONFIG, TOKENIZER, config)


def test_a_group_the_server_refuses_releases_its_prompt_and_the_others_go_on(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    submit = wc.submit_rollouts

    def refuse_the_first(lease_id, group):  # a group the server would refuse, as it would
      if group.prompt_id == "p0":
        wc.max_request_bytes = 10
      try:
        return submit(lease_id, group)
      finally:
        wc.max_request_bytes = 0

    wc.submit_rollouts = refuse_the_first
    stats = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL)).run()
    assert (stats.groups_refused, stats.groups_submitted) == (1, 1)
    assert [r.group.prompt_id for r in trainer.take_rollouts(0, 10).rollouts] == ["p1"]
    st = trainer.stats()
    assert (st.prompts_queued, st.prompts_leased) == (1, 0)  # p0 is back in the queue


def test_checksum_mismatch_triggers_a_keyframe_resync(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    delta = sync.encode(versions[0], versions[1], "bf16", version=1)
    name = next(n for n in delta.tensors if delta.changes(n).kind == "sparse")
    var = worker.policy._vars[name]
    var.set_value(var[...] * 2)  # the held copy went bad
    trainer.publish(delta.to_bytes())
    worker.sync_weights()
    assert worker.stats.resyncs == 1
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])


def test_unreachable_server_is_retried_with_backoff(versions):
  wc = ParamServerClient("127.0.0.1:1", token="x", role="worker", timeout_s=1.0,
                         retry=RetryPolicy(deadline_s=0.2))
  worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  threading.Timer(1.5, worker.request_stop).start()
  stats = worker.run()
  assert stats.reconnects >= 2 and stats.leases == 0


# ---------------------------------------------------------------- preemption (subprocesses)

def spawn_worker(tmp_path, address, **flags):
  config = tmp_path / "worker_config.py"
  config.write_text(textwrap.dedent(f"""
      import ml_collections
      def get_config():
        return ml_collections.ConfigDict(dict(
            tokenizer=dict(kind="char"), model=dict(vocab_size=0, **{MODEL!r})))
      """))
  args = [f"--{k}={v}" for k, v in flags.items()]
  env = dict(os.environ, RLAX_PS_WORKER_TOKEN=TOKENS["worker"], JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(
      [sys.executable, "-m", "rlax_ps", "worker", f"--address={address}", f"--config={config}",
       *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(cond, timeout, what):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_sigterm_releases_leases_within_the_grace_period(server, versions, tmp_path):
  with client(server, "trainer") as trainer:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 32)
    proc = spawn_worker(tmp_path, server.address, prompts_per_lease=32, prompts_per_call=1,
                        samples_per_prompt=4, max_new_tokens=16, grace_s=8)
    try:
      wait_for(lambda: trainer.stats().prompts_leased > 0, 180, "the worker's first lease")
      proc.send_signal(signal.SIGTERM)
      sent = time.monotonic()
      rc = proc.wait(timeout=30)
      took = time.monotonic() - sent
    finally:
      proc.kill()
      out = proc.stdout.read()
      proc.stdout.close()
    assert rc == 0, out
    assert took < 8 + 2, out
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.leases_expired == 0
    assert st.prompts_queued > 0  # released, not answered
    assert st.prompts_queued + st.rollouts_accepted == 32


def test_sigkill_leaves_leases_that_expire_and_are_served_again(server, versions, tmp_path):
  with client(server, "trainer") as trainer, client(server, "worker") as other:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 32)
    proc = spawn_worker(tmp_path, server.address, prompts_per_lease=32, prompts_per_call=1,
                        samples_per_prompt=4, max_new_tokens=16, lease_deadline_s=2)
    try:
      wait_for(lambda: trainer.stats().prompts_leased > 0, 180, "the worker's first lease")
      proc.kill()
      proc.wait(timeout=30)
    finally:
      proc.kill()
      proc.stdout.close()
    wait_for(lambda: trainer.stats().leases_expired > 0, 30, "the lease to expire")
    other.register("other")
    lease = other.lease(32, 30.0, wait_s=5.0)
    answered = trainer.stats().rollouts_accepted
    assert lease.prompts and {p.id for p in lease.prompts} <= set(ids)
    assert len(lease.prompts) + answered == 32


class ManyStops(CharTokenizer):
  """Every digit also ends a turn, so a random model's samples end turns often."""

  @property
  def stop_ids(self):
    return (self.eos_id,) + tuple(self.encode("0123456789"))


def test_an_environment_answers_turns_and_its_replies_reach_the_trainer_marked(server, versions):
  from algorithms.environments import ENVIRONMENTS, register_environment
  from rlax_ps.train.rollouts import build_batch

  @register_environment("test_ok")
  def ok():
    def reply(messages, reference):
      assert [m["role"] for m in messages[::2]] == ["assistant"] * ((len(messages) + 1) // 2)
      assert all(m == {"role": "tool", "content": "<ok>"} for m in messages[1::2])
      return None if len(messages) >= 5 else "<ok>"  # two replies, then done
    return reply

  tok = ManyStops()
  try:
    with client(server, "trainer") as trainer, client(server, "worker") as wc:
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
      enqueue_addition(trainer, 2)
      worker = Worker(wc, CONFIG, tok, WorkerConfig(
          max_leases=1, environment="test_ok", max_turns=3,
          **dict(SMALL, max_new_tokens=24)))
      stats = worker.run()
      assert stats.groups_submitted == 2 and stats.replies > 0
      take = trainer.take_rollouts(min_version=0, max_n=10)
  finally:
    ENVIRONMENTS.pop("test_ok")
  reply = tok.encode("<ok>")
  marked = 0
  for r in take.rollouts:
    for s in r.group.samples:
      ids, lp = np.asarray(s.token_ids), sample_logprobs(s)
      seen = np.frombuffer(s.observed, np.uint8).astype(bool) if s.observed else np.zeros(
          len(ids), bool)
      # Each reply follows a stop token, is "<ok>" (or the start of it, at the budget), and
      # carries log-prob 0; at most two replies (the environment's own limit).
      starts = [k for k in range(len(ids)) if seen[k] and (k == 0 or not seen[k - 1])]
      assert len(starts) <= 2 and int(seen.sum()) <= 2 * len(reply)
      for k in starts:
        assert int(ids[k - 1]) in tok.stop_ids
        assert ids[k:k + len(reply)].tolist() == reply[:len(ids) - k]
      assert np.all(lp[seen] == 0) and np.all(lp[~seen] < 0)
      marked += len(starts)
    group = group_of(r, tok)
    batch = build_batch([group], BatchShape(groups=1, samples=3, prompt_len=16,
                                            response_len=24))
    for j, s in enumerate(group.responses):
      seen = group.observed[j] if group.observed and group.observed[j] is not None else 0
      np.testing.assert_array_equal(batch["policy_tokens"][0, j, :len(s)], 1 - np.asarray(seen))
  assert marked == stats.replies


def test_a_stopped_multi_turn_run_is_continued_as_if_never_interrupted(
    server, versions, tmp_path, monkeypatch):
  """Multi-turn partial rollouts: the replies a sample had travel with it (the environment
  sees the whole conversation again), a reply not fed whole is asked for again, and the
  groups equal an uninterrupted run's on another server."""
  from algorithms.environments import ENVIRONMENTS, register_environment

  @register_environment("test_turns")
  def turns():
    def reply(messages, reference):
      assert [m["role"] for m in messages] == ["assistant", "tool"] * (len(messages) // 2) + [
          "assistant"]
      return None if len(messages) >= 5 else f"<{len(messages)}>"
    return reply

  tok = ManyStops()
  config = WorkerConfig(max_leases=1, environment="test_turns", max_turns=3,
                        **dict(SMALL, max_new_tokens=24, decode_chunk_steps=4))
  other = ParamServer(ServerConfig(storage_dir=str(tmp_path / "ps2"), port=0, threads=8,
                                   compact_in_background=False, wal_fsync=False,
                                   trainer_token=TOKENS["trainer"],
                                   worker_token=TOKENS["worker"])).start()
  try:
    groups = []
    for place, stop in ((other, False), (server, True)):
      with client(place, "trainer") as trainer, client(place, "worker") as wc:
        trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
        enqueue_addition(trainer, 2)
        worker = Worker(wc, CONFIG, tok, config)
        if stop:  # after three chunks some samples have had replies, some wait for one
          assert run_until_stopped(worker, monkeypatch, chunks=3).samples_salvaged > 0
          worker = Worker(wc, CONFIG, tok, config)
        worker.run()
        groups.append({r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts})
  finally:
    other.stop(grace=0)
    ENVIRONMENTS.pop("test_turns")
  whole, resumed = groups
  assert sorted(whole) == sorted(resumed) == ["p0", "p1"]
  assert any("resumed_samples" in g.metadata for g in resumed.values())
  replied = 0
  for pid in whole:
    for a, b in zip(resumed[pid].samples, whole[pid].samples):
      assert list(a.token_ids) == list(b.token_ids) and a.observed == b.observed
      replied += bool(b.observed.strip(b"\x00"))
  assert replied  # some samples got replies


def test_a_worker_without_the_environment_will_not_resume_replies_as_its_own_tokens():
  from param_server.client import make_sample
  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig())
  begun = make_sample([5, 6, 7], 0.0, logprobs=np.zeros(3), observed=np.array([0, 1, 0], bool))
  with pytest.raises(ValueError, match="partial sample 0: holds an environment's replies"):
    worker._begun_sample(("lease", "p0"), 0, begun)
  plain = make_sample([5, 6, 7], 0.0, logprobs=np.zeros(3))
  assert worker._begun_sample(("lease", "p0"), 0, plain).tokens.tolist() == [5, 6, 7]


def test_a_reply_not_fed_whole_is_left_out_of_a_partial_rollout():
  from inference_workers.decoding import Sample
  from param_server.client import sample_observed
  seen = np.array([0, 0, 1, 1, 0, 0, 1], bool)  # two replies given, the second cut short
  sample = Sample(np.arange(7, dtype=np.int32), -np.ones(7, np.float32), -np.ones(7, np.float32),
                  "length", routes=np.zeros((6, 1, 2), np.int32), observed=seen)
  cut = Worker._begun(sample, False, ["r1", "r2", "r3"])  # r3: asked, not yet fed
  assert list(cut.token_ids) == [0, 1, 2, 3, 4, 5] and cut.finish_reason == ""
  assert sample_observed(cut).tolist() == seen[:6].tolist()
  assert json.loads(cut.metadata["replies"]) == ["r1"] and len(routes_of(cut.routes)) == 5
  whole = Worker._begun(sample, True, ["r1", "r2"])  # finished: kept whole
  assert len(whole.token_ids) == 7 and whole.finish_reason == "length"
  assert json.loads(whole.metadata["replies"]) == ["r1", "r2"]


def test_a_reward_model_scores_the_prompts_of_task_reward_model(server, versions):
  from inference_workers.reward_scoring import RewardScorer
  from tests.models.hf_fixtures import FIXTURES
  rm = os.path.join(FIXTURES, "qwen3_reward")
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    trainer.enqueue_prompts([pb.Prompt(id=f"j{i}", text=t, task="reward_model")
                             for i, t in enumerate(("say hi", "say bye"))])
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, reward_model=rm, reward_model_dtype="float32", **SMALL))
    worker.run()
    rollouts = trainer.take_rollouts(0, 10).rollouts
  assert sorted(r.group.prompt_id for r in rollouts) == ["j0", "j1"]
  scorer = RewardScorer(rm, TOKENIZER, "float32")
  for r in rollouts:
    head = TOKENIZER.encode_prompt({"j0": "say hi", "j1": "say bye"}[r.group.prompt_id])
    want = scorer.scores([head + list(s.token_ids) for s in r.group.samples])
    np.testing.assert_allclose([s.reward for s in r.group.samples], want, rtol=1e-5)
    assert len(set(want.tolist())) > 1  # the samples differ and so do their scores


def test_bad_batching_settings_are_named():
  with pytest.raises(ValueError, match=r"WorkerConfig.rows_per_prompt: expected an int in "
                                       r"\[0, samples_per_prompt=4\]"):
    WorkerConfig(samples_per_prompt=4, rows_per_prompt=5)
  with pytest.raises(ValueError, match="WorkerConfig.decode_chunk_steps"):
    WorkerConfig(decode_chunk_steps=0)
  with pytest.raises(ValueError, match="WorkerConfig.environment: expected '' with "
                                       "allocator='vigor'"):
    WorkerConfig(environment="calculator", allocator="vigor")
  with pytest.raises(ValueError, match="WorkerConfig.max_turns: expected an int >= 0"):
    WorkerConfig(max_turns=-1)
  with pytest.raises(ValueError, match="WorkerConfig.environment_threads: expected a positive"):
    WorkerConfig(environment_threads=0)


def test_an_environment_that_raises_is_logged_and_its_error_is_the_reply(caplog):
  from algorithms.environments import ENVIRONMENTS, register_environment

  @register_environment("test_raises")
  def raises():
    def env(messages, reference):
      raise RuntimeError("no network")
    return env

  try:
    worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(environment="test_raises", **SMALL))
    key = ("lease", "p0")
    worker._started[key] = (pb.Prompt(id="p0", text="1+1="), 0)
    tokens = np.asarray(TOKENIZER.encode("2") + [TOKENIZER.eos_id])
    with caplog.at_level("WARNING"):
      ids = worker._respond(key, 0, tokens, np.zeros(len(tokens), bool))
  finally:
    ENVIRONMENTS.pop("test_raises")
  assert TOKENIZER.decode(ids) == "error: RuntimeError: no network"
  assert "environment 'test_raises' raised on prompt p0 (1 so far)" in caplog.text
