"""What the worker-loop tests share: a tiny model and its char tokenizer, role tokens,
clients of a test server, addition prompts, and a worker stopped mid-generation."""

import os
import zlib

import numpy as np
from flax import nnx

from algorithms.verifiers.base import VerifierResult
from inference_workers.continuous import ContinuousBatch
from param_server.client import ParamServerClient, RetryPolicy
from param_server.protos import PROMPT_SEED
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from rlax_ps.models import ModelConfig, Transformer, flatten_params
from rlax_ps.tasks import get_task
from rlax_ps.tokenizers import CharTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "t-secret", "worker": "w-secret", "viewer": "v-secret"}
TOKENIZER = CharTokenizer()
MODEL = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=64)
CONFIG = ModelConfig(vocab_size=TOKENIZER.vocab_size, **MODEL)
SMALL = dict(prompts_per_lease=2, prompts_per_call=2, samples_per_prompt=3, max_new_tokens=6,
             lease_wait_s=0.2, lease_deadline_s=60.0, backoff_initial_s=0.05)


def start_server(storage_dir, port=0, **settings):
  """A parameter server on 127.0.0.1 (`port`, 0: a free one) storing in `storage_dir`, with
  the tests' TOKENS and ServerConfig `settings`; the caller stops it."""
  from param_server.server import ParamServer, ServerConfig
  return ParamServer(ServerConfig(**{
      **dict(storage_dir=str(storage_dir), port=port, reap_interval_s=0.05,
             compact_in_background=False, threads=32, wal_fsync=False,
             trainer_token=TOKENS["trainer"], worker_token=TOKENS["worker"],
             viewer_token=TOKENS["viewer"]), **settings})).start()


def client(server, role):
  return ParamServerClient(server.address, token=TOKENS[role], role=role, timeout_s=10.0,
                           retry=RetryPolicy(deadline_s=5.0))


def addition_prompts(n, seed=0):
  """n addition prompts p0, p1, ..., each with its sampling seed, as an RL trainer feeds."""
  examples = get_task("addition", max_digits=2).examples("train", seed, n)
  return [pb.Prompt(id=f"p{i}", text=e.prompt, task="addition", extra=e.answer.encode(),
                    metadata={PROMPT_SEED: f"{seed}-{i}"})
          for i, e in enumerate(examples)]


def enqueue_addition(trainer, n, seed=0):
  prompts = addition_prompts(n, seed)
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


def stopped_first_worker(worker, trainer, params, monkeypatch):
  """`worker` run on 2 addition prompts (`params` published as version 0) and stopped after
  its first decode chunk: it hands their begun samples back (`run_until_stopped`)."""
  trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
  enqueue_addition(trainer, 2)
  run_until_stopped(worker, monkeypatch)
  return worker


class TextCodes:
  """A verifier whose reward names the text it scored (a checksum of it); `texts` maps each
  reward given back to its text."""

  def __init__(self):
    self.texts = {}

  def __call__(self, text, reference):
    code = float(zlib.crc32(text.encode()) % (1 << 20))
    self.texts[code] = text
    return VerifierResult(code, False)


class ManyStops(CharTokenizer):
  """Every digit also ends a turn, so a random model's samples end turns often."""

  @property
  def stop_ids(self):
    return (self.eos_id,) + tuple(self.encode("0123456789"))


class PublishingClient:
  """A server with one keyframe published and no prompts; `pulls`: the versions pulled from."""

  def __init__(self, keyframe):
    self.keyframe, self.pulls = keyframe, []

  def register(self, name):
    return "w1"

  def heartbeat(self, version=-1, tokens_per_s=0.0, **kwargs):
    return pb.HeartbeatReply(latest_version=0)

  def latest_version(self):
    return 0

  def version_info(self):
    return pb.VersionInfo(latest_version=self.latest_version(), fmt=self.keyframe.fmt)

  def pull_updates(self, have_version=None):
    self.pulls.append(have_version)
    return [sync.Update.from_bytes(self.keyframe.to_bytes())]


def params_of(config, seed=0):
  """A fresh `config` model's params, flat, on the host."""
  return {k: np.asarray(v) for k, v in
          flatten_params(Transformer(config, rngs=nnx.Rngs(seed))).items()}


def published(config, fmt="bf16", version=0, base=None, *, fields=True):
  """(an update of `config`'s weights as its trainer publishes it, with its model fields
  unless `fields` is False; its params): a keyframe unless `base` (the last version's
  params) is given."""
  params = params_of(config, seed=version)
  return sync.Update.from_bytes(sync.encode(
      base, params, fmt, version=version,
      model=config.forward_fields() if fields else None).to_bytes()), params


def assert_refused_whole(message: str, policy) -> None:
  """A WeightsDoNotFit message says what to give the worker, in one line, and the policy
  applied nothing."""
  assert "do not fit this worker's model" in message
  assert "the trainer's config" in message and "init_from_hf" in message
  assert "\n" not in message
  assert policy.version is None
