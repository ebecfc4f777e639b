"""Helpers for the RL trainer tests: the tiny RL config, an in-process parameter server on
127.0.0.1, and a fake worker that answers leased prompts with scripted rollout groups."""

import contextlib
import os
import threading
import time

import numpy as np

from param_server.client import ParamServerClient, Prompt, RetryPolicy, RolloutGroup, make_sample
from param_server.server import ParamServer, ServerConfig
from rlax_ps import config_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "t-secret", "worker": "w-secret", "viewer": "v-secret"}


def rl_config(variant="tiny", path="configs/rl_local.py"):
  return config_files.load(os.path.join(REPO, path), variant)


def save_warm_start(folder, seed=3):
  """A tiny random model (char tokenizer's vocabulary) saved as an HF export in `folder`,
  as `init_from_hf` takes it; returns the model."""
  from flax import nnx

  from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
  from rlax_ps.tokenizers import CharTokenizer
  tok = CharTokenizer()
  model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32,
                                  intermediate_size=64, num_layers=1, num_heads=4,
                                  num_kv_heads=2, head_dim=8, max_position_embeddings=64),
                      rngs=nnx.Rngs(seed))
  save_hf_checkpoint(model, str(folder))
  tok.save(str(folder))
  return model


def start_server(storage_dir, port=0):
  config = ServerConfig(storage_dir=str(storage_dir), port=port, reap_interval_s=0.05,
                        compact_in_background=False, threads=32, wal_fsync=False,
                        trainer_token=TOKENS["trainer"], worker_token=TOKENS["worker"],
                        viewer_token=TOKENS["viewer"])
  return ParamServer(config).start()


@contextlib.contextmanager
def fake_fleet(tmp, samples=4):
  """A parameter server in `tmp`/ps with a FakeWorker of `samples` answering it: yields (the
  trainer's client, the worker), both stopped after."""
  server = start_server(tmp / "ps")
  worker = FakeWorker(server.address, samples=samples).start()
  try:
    with client(server.address, "trainer") as tc:
      yield tc, worker
  finally:
    worker.stop()
    server.stop(grace=0)


def verl_fixture(name):
  """(data, its batch, groups, samples a group, the real samples' mask [rows * N], tokens a
  sample) of tests/fixtures/verl/`name` (made by tests/fixtures/make_verl_fixtures.py)."""
  import json
  with open(os.path.join(REPO, "tests", "fixtures", "verl", name)) as f:
    data = json.load(f)
  batch = data["batch"]
  return (data, batch, batch["groups"], batch["n"], np.asarray(batch["sample_mask"]) > 0,
          len(batch["policy_tokens"][0]))


def verl_batch(fixture):
  """(batch, the reference's log-probs [rows * N, T]) of a verl fixture's batch (its `batch`
  entry) as the trainer packs it: one row per group, padding samples masked; with the
  critic's `values` where the fixture has them."""
  import jax.numpy as jnp
  g, n, t = fixture["groups"], fixture["n"], len(fixture["policy_tokens"][0])
  f = lambda k: jnp.asarray(np.asarray(fixture[k], np.float32))  # noqa: E731
  batch = {"rewards": f("scores").reshape(g, n), "sample_mask": f("sample_mask").reshape(g, n),
           "row_group": jnp.arange(g, dtype=jnp.int32), "row_ids": jnp.arange(g, dtype=jnp.int32),
           "response_lens": jnp.asarray(fixture["lens"], jnp.int32).reshape(g, n),
           "response_tokens": jnp.ones((g, n, t), jnp.int32),
           "policy_tokens": f("policy_tokens").reshape(g, n, t),
           "behaviour_logp": f("behaviour_logp").reshape(g, n, t)}
  if "values" in fixture:
    batch["values"] = f("values").reshape(g, n, t)
  return batch, f("ref_logp")


def tb_events(directory):
  """The Event protos of every TensorBoard file in `directory` (TFRecord framing: length,
  its crc, data, its crc), in file order."""
  import glob
  import struct
  from tensorboardX.proto import event_pb2
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      yield event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 16 + length


def tb_scalars(directory, tag):
  """(step, value) of every point of `tag` in the TensorBoard files of `directory`."""
  return [(e.step, v.simple_value) for e in tb_events(directory) for v in e.summary.value
          if v.tag == tag]


def client(address, role):
  return ParamServerClient(address, token=TOKENS[role], role=role, timeout_s=10.0,
                           retry=RetryPolicy(deadline_s=10.0))


class FakeWorker:
  """Leases prompts and submits groups of `samples` random responses (reward 1 on even
  samples, behaviour log-probs -1.5) with the latest version, until `limit` groups (then
  held-out prompts alone) or `stop()`. `submitted` holds the accepted rollout ids,
  `prompts` each one's prompt (held-out ones' too). With
  `uniform_every` = u > 0, every u-th group (the 1st, the (u+1)-th, ...) has all rewards 0;
  `uniform` holds their ids.
  Group i says that i % 3 of its samples were resumed from a stopped worker's
  (`resumed_samples`). A held-out prompt the trainer sends (eval.on_workers) gets one answer,
  or eval_samples of them, the first passed where its index in its set is even; `evaluated`
  holds those rollout ids."""

  def __init__(self, address, *, samples=4, limit=None, vocab=60, max_len=6, seed=0,
               uniform_every=0):
    self.client = client(address, "worker")
    self.samples, self.limit, self.vocab, self.max_len = samples, limit, vocab, max_len
    self.uniform_every, self.uniform = uniform_every, set()
    self.rng = np.random.default_rng(seed)
    self.submitted: list[int] = []
    self.prompts: dict[int, Prompt] = {}
    self.evaluated: list[int] = []
    self.errors: list[BaseException] = []  # what ended the thread early, if anything
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def start(self):
    self.client.register("fake")
    self._thread.start()
    return self

  def stop(self):
    """Stops it (started or not, again or not)."""
    self._stop.set()
    if self._thread.ident is not None:
      self._thread.join(30)
    self.client.close()

  def group(self, prompt_id, version, uniform=False):
    samples = []
    for j in range(self.samples):
      toks = self.rng.integers(3, self.vocab, int(self.rng.integers(1, self.max_len + 1)))
      reward = 0.0 if uniform else float(j % 2 == 0)
      samples.append(make_sample(toks, reward, logprobs=np.full(len(toks), -1.5)))
    return RolloutGroup(prompt_id=prompt_id, samples=samples, policy_version=version,
                        metadata={"resumed_samples": str(len(self.submitted) % 3)})

  def _run(self):
    try:
      self._loop()
    except BaseException as e:  # the test reads it: a dead fake worker must not look idle
      self.errors.append(e)
      raise

  def _loop(self):
    while not self._stop.is_set():
      if self.client.latest_version() < 0:
        time.sleep(0.05)
        continue
      done = self.limit is not None and len(self.submitted) >= self.limit
      # (past its limit: held-out prompts alone, found among what is queued)
      lease = self.client.lease(256 if done else 1, 60.0, wait_s=0.2)
      version = self.client.latest_version()  # what it samples with: read after the wait
      rest = [p.id for p in lease.prompts if done and "eval" not in p.metadata]
      if rest:
        self.client.release(lease.lease_id, rest)
        time.sleep(0.05)
      for p in lease.prompts:
        if p.id in rest:
          continue
        if "eval" in p.metadata:
          even = int(p.id.rsplit("-", 1)[1]) % 2 == 0
          answers = [make_sample([5, 6], float(even and j == 0), logprobs=[-1.0, -1.0],
                                 metadata={"passed": str(int(even and j == 0))})
                     for j in range(int(p.metadata.get("eval_samples", 1)))]
          reply = self.client.submit_rollouts(lease.lease_id, RolloutGroup(
              prompt_id=p.id, samples=answers, policy_version=version))
          self.evaluated.append(int(reply.rollout_id))
          self.prompts[int(reply.rollout_id)] = p
          continue
        uniform = bool(self.uniform_every) and len(self.submitted) % self.uniform_every == 0
        reply = self.client.submit_rollouts(lease.lease_id, self.group(p.id, version, uniform))
        self.submitted.append(int(reply.rollout_id))
        self.prompts[int(reply.rollout_id)] = p
        if uniform:
          self.uniform.add(int(reply.rollout_id))
