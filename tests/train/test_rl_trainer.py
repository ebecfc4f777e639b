"""The RL trainer in process against a real parameter server on 127.0.0.1, fed by a fake
worker: steps take whole groups, versions are published and decode to the trainer's
weights, groups are acknowledged only once checkpointed, prompts are paced, and a restart
republishes a keyframe of the next version."""

import collections
import json
import os
import shutil
import signal
import threading
import time
import types
from unittest import mock

import jax
import numpy as np
import pytest

from param_server.client import (ParamServerClient, ParamServerError, RetryPolicy, RolloutGroup,
                                  make_sample)
from param_server.protos import PROMPT_SEED, SCORE_ERROR
from param_server.protos import param_server_pb2 as pb
from rl_testlib import (REPO, TOKENS, FakeWorker, client, fake_fleet, rl_config,
                        save_warm_start, start_server, tb_scalars)
from rlax_ps import sync
from rlax_ps.sync.bits import BF16
from rlax_ps.models import load_hf_checkpoint
from rlax_ps.models.params import flatten_params
from rlax_ps.tokenizers import make_tokenizer
from rlax_ps.train.publisher import flat_params
from rlax_ps.teacher import Teacher, score_retokenized
from rlax_ps.train.events import open_jsonl, read_jsonl
from rlax_ps.train import rl as rl_module
from rlax_ps.train.rl import PendingTake, RLTrainer, TakeTimeout, server_retry


def _config(**rl):
  c = rl_config("tiny")
  c.eval.num_examples = 2
  c.eval.batch_size = 2
  for k, v in rl.items():
    c.rl[k] = v
  return c


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _with_reward_parts(group_of_worker):
  """The fake worker's groups with reward parts, as worker.reward_terms sends them: each
  sample's reward as its task part, and a think_format part of 1 on its first sample; its
  last sample has a malformed one. A group with no resumed samples says a verifier raised on
  its second sample (scored 0)."""
  def group(*args, **kwargs):
    g = group_of_worker(*args, **kwargs)
    for j, s in enumerate(g.samples):
      s.metadata.update({"reward/task": repr(s.reward), "reward/think_format": str(int(j == 0))})
    g.samples[-1].metadata["reward/length"] = "nan"
    if g.metadata["resumed_samples"] == "0":
      g.samples[1].metadata[SCORE_ERROR] = "1"
    return g
  return group


def _adaptive_entropy(config):
  """loss.adaptive_entropy with a target above any entropy: the coefficient rises from 0.01
  by 0.005 after each step."""
  config.loss.adaptive_entropy = True
  config.loss.entropy_coef, config.loss.entropy_target = 0.01, 100.0


def _kl_control(config, warm):
  """verl's adaptive KL in the rewards from 0.01, and TRL's reference sync at step 3 (the
  reference: the warm start `warm`)."""
  config.loss.kl_in_reward, config.loss.kl_estimator = 0.01, "k1"
  config.loss.kl_target, config.loss.kl_horizon = 1e-6, 16
  config.rl.ref_sync_steps, config.rl.ref_mixup_alpha = 3, 0.5
  config.init_from_hf = warm


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("rl")
  server = start_server(tmp / "ps")
  worker = FakeWorker(server.address, samples=4)
  worker.group = _with_reward_parts(worker.group)
  worker.start()
  config = _config(steps=4, micro_batches=2)  # exact (test_rl_loss); here: wired through
  config.loss.logits_chunk = 4
  config.worker.max_new_tokens = 16  # the fake responses (at most 6) pack to 8 (response_buckets)
  config.export.every_steps, config.export.max_to_keep = 2, 1
  for name in ("step_000000", "mine"):  # an older run's periodic export, and a user's folder
    os.makedirs(tmp / "rl" / "exports" / name)
  config.worker.top_p = 0.95  # what pass@k samples with (the fake worker ignores it)
  config.eval.on_workers, config.eval.every_steps = True, 1  # the fake worker answers
  config.eval.rounds_pass_k = 2
  _adaptive_entropy(config)
  save_warm_start(str(tmp / "warm"))
  _kl_control(config, str(tmp / "warm"))
  exported_at = {}
  logged = []  # each step's metrics
  mixes = []  # (step, reference before, policy, reference after) of each reference sync

  def keep_params(path=None):  # the weights each export was asked to write
    exported_at[os.path.basename(path or "hf")] = {
        k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
    return export(path)

  with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp / "rl"), tc) as tr:
    export, tr.export_hf = tr.export_hf, keep_params
    log_step = tr._log_step
    tr._log_step = lambda record, metrics: (logged.append(dict(metrics)),
                                            log_step(record, metrics))
    mix = tr._mix_reference

    def recorded_mix(ref, params):
      before = flat_params(jax.device_get(tr.ref_params))  # (donated to the mix)
      after = mix(ref, params)
      mixes.append((tr.step, before, flat_params(jax.device_get(tr.state.params)),
                    flat_params(jax.device_get(after))))
      return after

    tr._mix_reference = recorded_mix
    summary = tr.train()
    kl_beta = tr.kl_beta
    params = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
    enqueued = tr.feed.position
    compiled = {k: f.done() for k, f in tr._compiles.items()}
    precompiled_steps = tr.precompiled_steps
  worker.stop()
  with client(server.address, "viewer") as vc:
    stats = vc.stats()
  with client(server.address, "worker") as wc:
    updates = [sync.Update.from_bytes(bytes(b)) for b in wc.pull(None)]
  with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp / "rl"), tc) as again:
    restarted = dict(step=again.step, kl_beta=again.kl_beta,
                     kl_beta_input=float(again._kl_beta_input()),
                     ref_params=flat_params(jax.device_get(again.ref_params)))
  yield dict(tmp=tmp, summary=summary, params=params, stats=stats, updates=updates,
             worker=worker, enqueued=enqueued, server=server, config=config,
             exported_at=exported_at, compiled=compiled, precompiled_steps=precompiled_steps,
             logged=logged, mixes=mixes, kl_beta=kl_beta, restarted=restarted)
  server.stop(grace=0)


def test_each_step_trains_on_whole_distinct_groups(run):
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  assert [s["step"] for s in steps] == [1, 2, 3, 4]
  ids = [i for s in steps for i in s["rollout_ids"]]
  assert all(len(s["rollout_ids"]) == 4 for s in steps)  # rl.groups_per_step
  assert len(ids) == len(set(ids)) and set(ids) <= set(run["worker"].submitted)
  assert run["summary"]["rollout_groups_trained"] == 16
  # Samples a stopped worker began, as the groups said (the i-th submitted: i % 3 of them).
  resumed = {r: i % 3 for i, r in enumerate(run["worker"].submitted)}
  assert [s["resumed_samples"] for s in steps] == [
      sum(resumed[i] for i in s["rollout_ids"]) for s in steps]
  assert run["summary"]["samples_resumed"] == sum(resumed[i] for i in ids) > 0
  # Samples a worker's verifier raised on (one in each group with none resumed).
  assert [s["score_errors"] for s in steps] == [
      sum(resumed[i] == 0 for i in s["rollout_ids"]) for s in steps]
  assert run["summary"]["samples_score_errors"] == sum(resumed[i] == 0 for i in ids) > 0
  # A step trains its groups in their prompts' order, whatever order they came in; each
  # prompt carries its sampling seed, of the run's seed and its feed position (any worker,
  # in any workdir, samples it alike), and a held-out one its round's.
  prompts = run["worker"].prompts
  assert all([prompts[r].id for r in s["rollout_ids"]] == sorted(prompts[r].id for r in
                                                                 s["rollout_ids"]) for s in steps)
  seed = run["config"].seed
  assert {prompts[r].metadata[PROMPT_SEED] for r in ids} == {
      f"{seed}-s0-{prompts[r].id.rsplit('-', 1)[1]}" for r in ids}
  held = [prompts[r] for r in run["worker"].evaluated]
  assert {p.metadata[PROMPT_SEED] for p in held} == {
      f"{seed}-eval{p.metadata['eval']}-{p.metadata['eval_set']}-{p.id.rsplit('-', 1)[1]}-"
      f"{p.metadata.get('eval_samples', 0)}" for p in held}
  # The fake worker rewards half of each group: the batch's mean reward is 0.5.
  assert all(s["reward_mean"] == pytest.approx(0.5) for s in steps)
  # Its responses hold 1 to 6 tokens, under the 16-token budget: none is truncated, and the
  # rows packed them in 8 response positions, not 16.
  assert all(1 <= s["response_len_mean"] <= s["response_len_max"] <= 6 for s in steps)
  assert all(s["truncated_frac"] == 0.0 for s in steps)
  assert all(s["response_capacity"] == 8 for s in steps)
  # The step was compiled ahead for both capacities of the 16-token budget (4 rows each),
  # and the steps ran the one compiled for 8.
  assert set(run["compiled"]) == {(4, 8), (4, 16)}
  assert run["precompiled_steps"] == len(steps)
  assert all(0 < s["entropy"] for s in steps)  # the trainer's policy, from the loss pass


def test_the_adaptive_entropy_coefficient_is_each_steps_input_and_logged(run):
  """Step 1 applies none (no entropy measured before it), step k the coefficient after step
  k - 1: through the micro-batched steps compiled ahead, the bonus is that times the entropy
  (token-mean). The controller's state is in the checkpoint."""
  from rlax_ps.checkpoint import Checkpointer
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  coefs = [s["entropy_coef"] for s in steps]
  np.testing.assert_allclose(coefs, [0.015, 0.02, 0.025, 0.03], rtol=1e-12)
  applied = [0.0] + coefs[:-1]
  for metrics, coef, after in zip(run["logged"], applied, coefs, strict=True):
    assert metrics["entropy_coef"] == after  # train/entropy_coef
    np.testing.assert_allclose(metrics["loss"] - metrics["pg_loss"], -coef * metrics["entropy"],
                               rtol=1e-4, atol=1e-7)
  with Checkpointer(str(run["tmp"] / "rl" / "checkpoints")) as ckpt:
    saved = ckpt.metadata()
  assert saved["entropy_control"] == {"entropy_coef": coefs[-1],
                                      "last_entropy": steps[-1]["entropy"]}


def test_the_adaptive_kl_coefficient_moves_each_step_and_a_restart_goes_on_from_it(run):
  """loss.kl_target: step k applies the coefficient step k - 1 left (from kl_in_reward),
  moved by its reward_kl over its 16 samples; the checkpoint carries it, and a restarted
  trainer's step input is it, not loss.kl_in_reward."""
  from rlax_ps.train.rl_loss import LossConfig, adapt_kl_coef
  cfg = LossConfig(kl_in_reward=0.01, kl_estimator="k1", kl_target=1e-6, kl_horizon=16)
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  want = [0.01]
  for record in steps:
    want.append(adapt_kl_coef(want[-1], record["reward_kl"], 16, cfg))
  assert [s["kl_in_reward"] for s in steps] == pytest.approx(want[:-1], rel=1e-9)
  assert run["kl_beta"] == pytest.approx(want[-1], rel=1e-9) and abs(want[-1] - 0.01) > 1e-3
  restarted = run["restarted"]
  assert restarted["step"] == 4 and restarted["kl_beta"] == run["kl_beta"]
  assert restarted["kl_beta_input"] == pytest.approx(run["kl_beta"], rel=1e-6)


def test_the_reference_is_mixed_with_the_policy_every_ref_sync_steps_and_checkpointed(run):
  """rl.ref_sync_steps=3: after step 3 (not 1, not 4) the reference becomes 0.5 * policy +
  0.5 * reference (TRL's sync_ref_model); a restart takes the mixed one from the checkpoint,
  not the warm start."""
  ((step, before, policy, after),) = run["mixes"]
  assert step == 3
  for name in policy:
    np.testing.assert_allclose(after[name], 0.5 * policy[name] + 0.5 * before[name],
                               rtol=1e-6, atol=1e-7, err_msg=name)
  assert any(not np.array_equal(after[k], before[k]) for k in after)
  for name, value in run["restarted"]["ref_params"].items():
    np.testing.assert_array_equal(value, after[name], err_msg=name)


def test_each_steps_reward_parts_are_the_means_over_its_samples(run):
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  assert all(s["reward_parts"] == {"task": pytest.approx(s["reward_mean"]),
                                   "think_format": pytest.approx(0.25)} for s in steps)
  # One malformed value per group (4 a step), counted since the run began.
  assert [s["reward_parts_malformed"] for s in steps] == [4, 8, 12, 16]


def test_the_summary_has_the_runs_reward_part_means_and_malformed_count(run):
  s = run["summary"]
  assert s["reward_parts"] == {"task": pytest.approx(0.5), "think_format": pytest.approx(0.25)}
  assert s["reward_parts_malformed"] == 16


def test_a_groups_resumed_samples_are_read_from_its_metadata_and_junk_counts_none():
  from param_server.client import make_sample
  from param_server.protos import param_server_pb2 as pb
  from rlax_ps.tokenizers import CharTokenizer
  from rlax_ps.train.rl import group_of

  def taken(meta):
    return pb.TakenRollout(rollout_id=1, prompt=pb.Prompt(id="p", token_ids=[1, 2]),
                           group=pb.RolloutGroup(prompt_id="p", metadata=meta, samples=[
                               make_sample(np.array([5]), 1.0, logprobs=np.zeros(1))]))
  tok = CharTokenizer()
  assert group_of(taken({"resumed_samples": "3"}), tok).resumed == 3
  assert [group_of(taken(m), tok).resumed for m in ({}, {"resumed_samples": "x"},
                                                     {"resumed_samples": "-1"})] == [0, 0, 0]
  erred = taken({})
  erred.group.samples.extend([erred.group.samples[0]] * 2)
  erred.group.samples[0].metadata[SCORE_ERROR] = "1"
  erred.group.samples[2].metadata[SCORE_ERROR] = "0"
  assert group_of(erred, tok).score_errors == 1
  assert group_of(taken({}), tok).score_errors == 0


def test_samples_a_verifier_raised_on_are_warned_of_first_and_when_a_step_is_all_of_them(
    caplog):
  """The first such sample, and steps whose every sample is one (a broken verifier, not a
  hard task: 3 such steps, then every 100th), are warned of; all are counted."""
  trainer = types.SimpleNamespace(score_errors=0, _all_erred_steps=0)
  with caplog.at_level("WARNING"):
    RLTrainer._count_score_errors(trainer, 1, 0, 16)
    assert not caplog.records and trainer.score_errors == 0
    RLTrainer._count_score_errors(trainer, 2, 3, 16)
    assert "step 2: 3 of 16 samples scored 0 because a worker's verifier raised" in caplog.text
    RLTrainer._count_score_errors(trainer, 3, 5, 16)  # some, not all: counted alone
    assert len(caplog.records) == 1 and trainer.score_errors == 8
    for step in range(4, 105):
      RLTrainer._count_score_errors(trainer, step, 16, 16)
  assert [r.getMessage().split(":")[1] for r in caplog.records[1:]] == [
      " step 4", " step 5", " step 6", " step 103"]
  assert "(100 steps so far)" in caplog.records[-1].getMessage()
  assert trainer.score_errors == 8 + 101 * 16


def test_every_taken_group_is_acknowledged_after_the_final_checkpoint(run):
  """All but the training groups the final evaluation on the workers took (it takes what
  comes until its held-out answers are in) and did not train: left for a rerun's first
  take, and counted in the summary."""
  assert run["stats"].rollouts_in_flight == run["summary"].get("groups_left_unacked", 0)
  meta = json.load(open(os.path.join(run["tmp"], "rl", "checkpoints", "4", "metadata",
                                     "metadata")))
  assert meta["step"] == 4 and meta["version"] == 4 and meta["trained_rollouts"] == 16
  # The takes of the last steps were pending when the checkpoint was written, acked after.
  assert {t["step"] for t in meta["pending_takes"]} <= {3, 4}


# ~6 s; test_local checks each worker's weights against the trainer's in the default suite
@pytest.mark.slow
def test_published_versions_decode_to_the_trainers_weights(run):
  versions = _lines(run["tmp"] / "rl" / "versions.jsonl")
  assert [v["version"] for v in versions] == [0, 1, 2, 3, 4]
  assert versions[0]["keyframe"] and not any(v["keyframe"] for v in versions[1:])
  held = None
  for u in run["updates"]:
    held = sync.apply(held, u)
  assert run["updates"][-1].version == 4
  want = sync.held_state(run["params"], "bf16")
  assert set(held) == set(want)
  for name in want:
    np.testing.assert_array_equal(held[name].view(np.uint16), want[name].view(np.uint16),
                                  err_msg=name)
  digest = sync.state_digest({k: sync.checksum(v) for k, v in held.items()})
  assert f"{digest:016x}" == versions[-1]["digest"]


def test_the_trained_policy_is_exported_in_hugging_face_format(run):
  path = run["tmp"] / "rl" / "hf"
  assert run["summary"]["export"] == str(path)
  assert not (run["tmp"] / "rl" / "hf.partial").exists()
  model = load_hf_checkpoint(str(path))
  exported = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  assert set(exported) == set(run["params"])
  for name, want in run["params"].items():  # the final step's weights, not the warm start's
    np.testing.assert_array_equal(exported[name], want, err_msg=name)
  char = make_tokenizer("char", "", run["config"].tokenizer.alphabet)
  hf = make_tokenizer("hf", str(path))  # the tokenizer.json written beside the weights
  assert hf.encode("12+34=") == char.encode("12+34=") and hf.eos_id == char.eos_id


def test_rlax_ps_export_of_the_run_writes_what_the_trainer_exported(run, tmp_path):
  """`rlax-ps export --workdir` of an RL run: it finds the checkpoints through the config the
  trainer recorded, and the latest step's export is the trainer's own, file for file."""
  from rlax_ps.train.export_main import checkpoints_of, export_checkpoint
  workdir = run["tmp"] / "rl"
  saved = json.load(open(workdir / "run_config.json"))
  assert saved["checkpoint"]["directory"] == run["config"].checkpoint.directory
  assert checkpoints_of(str(workdir)) == str(workdir / "checkpoints")
  step, out = export_checkpoint(str(workdir), out=str(tmp_path / "exported"))
  assert step == 4
  trainer = workdir / "hf"
  for name in os.listdir(trainer):
    assert (trainer / name).read_bytes() == open(os.path.join(out, name), "rb").read(), name


def test_periodic_exports_past_max_to_keep_go_oldest_first_by_step_not_by_name(tmp_path):
  from rlax_ps.train.run import prune_exports
  names = ["step_000009", "step_000010", "step_1000000", "step_000100", "notes", "step_x"]
  for name in names:
    os.makedirs(tmp_path / name)
  assert prune_exports(str(tmp_path), 0) == [] and sorted(os.listdir(tmp_path)) == sorted(names)
  gone = prune_exports(str(tmp_path), 2)
  assert gone == [str(tmp_path / "step_000009"), str(tmp_path / "step_000010")]
  assert sorted(os.listdir(tmp_path)) == ["notes", "step_000100", "step_1000000", "step_x"]
  assert prune_exports(str(tmp_path / "none"), 1) == []


def test_export_every_steps_writes_the_weights_of_that_step(run):
  exports = run["tmp"] / "rl" / "exports"
  # Step 4 is the final export, in hf/; export.max_to_keep=1 deleted the older one, not the
  # folder that is no export.
  assert sorted(os.listdir(exports)) == ["mine", "step_000002"]
  assert sorted(run["exported_at"]) == ["hf", "step_000002"]
  model = load_hf_checkpoint(str(exports / "step_000002"))
  got = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  want = run["exported_at"]["step_000002"]
  assert any(not np.array_equal(want[k], run["params"][k]) for k in want)  # trained on since
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_with_async_saves_a_take_is_acked_only_once_a_durable_checkpoint_holds_it(tmp_path):
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  config = _config(steps=6)
  config.checkpoint.async_save, config.checkpoint.every_steps = True, 1
  acks = []  # (take's step, saving at the time, latest durable step)
  trained = []  # (take's step, the trainer's step when it was acked)
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                           tc) as tr:
      ack = tc.ack

      def checked_ack(take_id):
        step = next(t.step for t in tr.pending if t.take_id == take_id)
        acks.append((step, tr.checkpointer.saving(), tr.checkpointer.latest_step()))
        trained.append((step, tr.step))
        return ack(take_id)

      tc.ack = checked_ack
      tr.train()
    with client(server.address, "viewer") as vc:
      assert vc.stats().rollouts_in_flight == 0
  finally:
    worker.stop()
    server.stop(grace=0)
  assert {step for step, _, _ in acks} == {1, 2, 3, 4, 5, 6}  # several takes a step
  assert all(not saving and step <= durable for step, saving, durable in acks)
  # Each save waits for the one before and acks its takes: not all at the end of the run
  # (a save always still running at the next step's take left every take unacked).
  assert all(at <= step + 1 for step, at in trained), trained


def test_a_line_a_kill_tore_at_the_end_of_a_log_is_ended_and_passed_over(tmp_path):
  """versions.jsonl torn by a kill mid-line: the next publication's line is whole on a line
  of its own, and the summary's and restart's readers pass the torn one over (it ended a
  whole run's finish in an error)."""
  path = tmp_path / "rl" / "versions.jsonl"
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    path.write_text('{"version": 0, "step": 0, "keyframe": true, "bytes": 10, "seconds": 0.5}'
                    '\n{"version": 1, "st')
    with open_jsonl(str(path)) as f:
      f.write(json.dumps({"version": 2, "step": 1, "keyframe": False, "bytes": 3,
                          "seconds": 0.1}) + "\n")
    assert path.read_text().endswith('{"version": 1, "st\n{"version": 2, "step": 1, '
                                     '"keyframe": false, "bytes": 3, "seconds": 0.1}\n')
    assert [r["version"] for r in tr._versions_log()] == [0, 2]
    assert tr._published_before() == 2
  open_jsonl(str(path)).close()  # a whole last line: nothing added
  assert len(read_jsonl(str(path))) == 2 and path.read_text().count("\n") == 3


def _taken_group(rollout_id, version, prompt_id="p-1"):
  return pb.TakenRollout(rollout_id=rollout_id, prompt=pb.Prompt(
      id=prompt_id, text="1+1=", task="addition", token_ids=[1, 20, 15, 20, 33]),
      group=pb.RolloutGroup(prompt_id=prompt_id, policy_version=version, samples=[
          make_sample([5, 6], float(j % 2), logprobs=[-1.0, -1.0]) for j in range(4)]))


def test_a_group_that_comes_back_counts_once_and_the_restart_floor_ends_with_the_restart(
    tmp_path):
  """A group the checkpoint trained on that comes back (skip_ids), or one whose take expired
  before its checkpoint (taken before), was counted when first taken: the prompts taken
  (which pace the feed) do not count it again. A restart's staleness floor (the lost steps'
  groups may be older than max_staleness allows) ends with the first group of the restored
  weights' version, though the trainer has published newer ones since."""
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.skip_ids = {7}
    assert tr._valid_groups([_taken_group(7, 0), _taken_group(8, 0, "p-2")],
                            taken_before={"p-2": 8}) == []
    assert tr.consumed == 0 and tr.came_back == 2
    assert len(tr._valid_groups([_taken_group(9, 0)])) == 1 and tr.consumed == 1
    tr._restart_floor, tr._restart_version, tr.publisher.version = 2, 5, 7
    tr._valid_groups([_taken_group(10, 4)])
    assert tr._restart_floor == 2 and tr._min_version() == 2
    tr._valid_groups([_taken_group(11, 5)])
    assert tr._restart_floor is None and tr._min_version() == 7 - tr.max_staleness


def test_an_expired_takes_prompt_sampled_again_after_a_stale_drop_is_skipped(tmp_path):
  """The server requeues an expired take's groups and drops them as stale at the next take,
  feeding their prompts again: the trainer skipped the old rollout ids, which never came,
  and trained the prompts a second time under new ones."""
  import grpc
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.store_id = "s1"
    tr.client = types.SimpleNamespace(
        ack=mock.Mock(side_effect=ParamServerError("AckRollouts", grpc.StatusCode.NOT_FOUND,
                                                   "no take t1")),
        version_info=lambda: types.SimpleNamespace(store_id="s1"))
    tr.pending = [PendingTake("t1", [7, 8], 1, ["p-1", "p-2"])]
    with mock.patch.object(tr.checkpointer, "latest_step", return_value=3):
      tr._ack_durable()  # expired: both groups trained on, to skip
    assert tr.pending == [] and tr.skip_ids == {7, 8}
    assert tr.skip_prompts == {"p-1": 7, "p-2": 8}
    tr.outstanding = {}
    before = tr._take_bookkeeping()
    # p-1 sampled anew (rollout 12), rollout 8 back as it was, p-3 new
    got = tr._valid_groups([_taken_group(12, 2, "p-1"), _taken_group(8, 0, "p-2"),
                            _taken_group(13, 2, "p-3")])
    assert [g.rollout_id for g in got] == [13] and tr.came_back == 2 and tr.consumed == 1
    assert tr.skip_ids == set() and tr.skip_prompts == {}
    assert tr.metadata()["skip_prompts"] == []
    tr._undo_take_bookkeeping(before)  # a stop mid-round: both to skip again
    assert tr.skip_ids == {7, 8} and tr.skip_prompts == {"p-1": 7, "p-2": 8}
    assert tr.metadata()["skip_prompts"] == [("p-1", 7), ("p-2", 8)]
    tr._journal = None


def test_a_prompt_of_a_take_not_yet_acknowledged_sampled_again_is_skipped(tmp_path):
  """The server requeued an expiring take's group and dropped it as stale at a later take,
  feeding its prompt again, while the trainer still held the take for its checkpoint: the
  prompt's new group (another rollout id) was trained a second time."""
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.outstanding = {}
    tr.pending = [PendingTake("t1", [7, 8], 1, ["p-1", "p-2"])]
    got = tr._valid_groups([_taken_group(12, 2, "p-1"), _taken_group(13, 2, "p-3")],
                           tr._pending_prompts())
    assert [g.rollout_id for g in got] == [13] and tr.came_back == 1 and tr.consumed == 1


def test_an_ack_deadline_past_the_servers_limit_is_named_as_the_config_field(tmp_path):
  """The server caps ack deadlines (--max_lease_deadline_s): a longer rl.ack_deadline_s was a
  traceback of the server's ack_deadline_s at the first take, naming no field of the run."""
  import grpc
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.config.rl.ack_deadline_s = 5000.0
    tr.client = types.SimpleNamespace(
        address="127.0.0.1:1", enqueue_prompts=lambda prompts: None,
        version_info=lambda: pb.VersionInfo(), take_rollouts=mock.Mock(side_effect=ParamServerError(
            "TakeRollouts", grpc.StatusCode.INVALID_ARGUMENT,
            "ack_deadline_s: expected in (0, 3600.0], got 5000.0")))
    with pytest.raises(ValueError, match=r"rl.ack_deadline_s: 5000.0 is past what the server "
                                         r"at 127.0.0.1:1 allows .*--max_lease_deadline_s"):
      tr._take_round()


def test_a_checkpoint_is_written_when_the_server_cannot_take_its_acknowledgements(tmp_path):
  """A checkpoint first acknowledges the takes the last one trained on: a server out of reach
  raised there, and the checkpoint (every step since the last) was lost with the run."""
  import grpc
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.client = types.SimpleNamespace(address="127.0.0.1:1", ack=mock.Mock(
        side_effect=ParamServerError("AckRollouts", grpc.StatusCode.UNAVAILABLE, "refused")))
    tr.state = tr.state.replace(step=tr.state.step + 1)
    tr.pending = [PendingTake("t1", [7, 8], 1, ["p-1", "p-2"])]
    tr.save()
    tr.state = tr.state.replace(step=tr.state.step + 1)
    tr.save()
    tr.checkpointer.wait()
    assert tr.checkpointer.latest_step() == 2 and tr.client.ack.called
    assert [t.take_id for t in tr.pending] == ["t1"]  # acknowledged at the next start
    assert [t["take_id"] for t in tr.checkpointer.latest_metadata()["pending_takes"]] == ["t1"]
    # A refusal (not a server out of reach) ends the run, once the checkpoint is written.
    tr.client.ack.side_effect = ParamServerError("AckRollouts",
                                                 grpc.StatusCode.PERMISSION_DENIED, "token")
    tr.state = tr.state.replace(step=tr.state.step + 1)
    with pytest.raises(ParamServerError, match="PERMISSION_DENIED"):
      tr.save()
    tr.checkpointer.wait()
    assert tr.checkpointer.latest_step() == 3


def test_a_resumed_run_is_checked_for_another_init_from_hf(tmp_path):
  """The RL trainer says what the SFT trainer says (test_sft_hf_init) when init_from_hf names
  another checkpoint than the one its checkpoint's run started from."""
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.save()
    tr.checkpointer.wait()
  with mock.patch.object(RLTrainer, "note_resumed_init") as note:
    with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
      assert tr.checkpointer.latest_step() == 0  # (it resumed that checkpoint)
  assert note.call_args.args[0]["step"] == 0 and "config" in note.call_args.args[0]


def test_a_take_round_cut_short_puts_back_what_its_groups_changed(tmp_path):
  """A stop mid-round: the records' streaks, the prompts outstanding, the groups to skip and
  the counts are as they were before the round (its groups come again after the restart)."""
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.selective, tr.streaks = True, {1: 2}
    tr.outstanding = {"p-1": (0, 1), "p-5": (1, 5)}
    tr.skip_ids = {7}
    before = tr._take_bookkeeping()
    taken = [_taken_group(7, 0, "p-1"), _taken_group(8, 0, "p-1"), _taken_group(9, 0, "p-5")]
    for t, record in zip(taken, ("1", "1", "5")):
      t.prompt.metadata["record"] = record
      for s in t.group.samples:
        s.reward = 1.0  # solved: the streaks move
    assert len(tr._valid_groups(taken)) == 2
    assert (tr.streaks, tr.outstanding, tr.skip_ids, tr.consumed) != ({1: 2}, {
        "p-1": (0, 1), "p-5": (1, 5)}, {7}, 0)
    tr.dropped_stale = 3  # the server drops those for good: they stay counted
    tr.reward_parts_malformed = 2  # (counted again when the groups come again)
    tr._undo_take_bookkeeping(before)
    assert tr.reward_parts_malformed == 0
    assert tr.streaks == {1: 2} and tr.skip_ids == {7} and tr.consumed == 0
    assert tr.outstanding == {"p-1": (0, 1), "p-5": (1, 5)} and tr.came_back == 0
    assert tr.dropped_stale == 3
    # This run's prompts (their records' streaks move): a streak the round began, of a record
    # that had none, goes too (kept, the restart's take of the group counted it twice).
    before = tr._take_bookkeeping()
    taken = [_taken_group(10, 0, tr._prompt_id(0)), _taken_group(11, 0, tr._prompt_id(1))]
    for t, record in zip(taken, ("1", "5")):
      t.prompt.metadata["record"] = record
      for s in t.group.samples:
        s.reward = 1.0
    tr._valid_groups(taken)
    assert tr.streaks == {1: 3, 5: 1}
    tr._undo_take_bookkeeping(before)
    assert tr.streaks == {1: 2}


def test_takes_are_not_acked_on_a_checkpoint_whose_async_write_failed(tmp_path):
  """orbax lists a step from save() on; its background write failing shows at the next
  wait. The takes it would hold are not acknowledged (lost for good: the restart resumes
  from the step before), and the failure stops the run."""
  acked = []

  class Failed:
    def saving(self):
      return False

    def latest_step(self):
      return 5  # listed, never written

    def wait(self):
      raise OSError(28, "No space left on device")

  with RLTrainer(_config(), str(tmp_path / "rl"), types.SimpleNamespace(
      ack=acked.append)) as tr:
    checkpointer, tr.checkpointer = tr.checkpointer, Failed()
    tr.pending = [PendingTake("t1", [1, 2], 5)]
    try:
      with pytest.raises(OSError, match="No space left"):
        tr._ack_durable()
    finally:
      tr.checkpointer = checkpointer
  assert acked == [] and [t.take_id for t in tr.pending] == ["t1"]


@pytest.mark.parametrize("micro,correction", [(3, "none"), (2, "m2po")])
def test_micro_batches_that_cannot_be_exact_are_refused_naming_the_field(tmp_path, micro,
                                                                        correction):
  config = _config(micro_batches=micro)
  config.loss.correction = correction
  with pytest.raises(ValueError, match="rl.micro_batches"):
    RLTrainer(config, str(tmp_path), object())


def test_export_dtype_writes_bfloat16_weights(tmp_path):
  import ml_dtypes
  config = _config()
  config.export.dtype = "bfloat16"
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    path = tr.export_hf(str(tmp_path / "bf16"))
    params = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
  assert json.load(open(os.path.join(path, "config.json")))["torch_dtype"] == "bfloat16"
  got = {k: np.asarray(v) for k, v in flatten_params(
      load_hf_checkpoint(path, dtype="bfloat16")).items()}
  for name, want in params.items():
    assert got[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[name], want.astype(ml_dtypes.bfloat16), err_msg=name)
  # export.quantization=fp8: the projections in block-scaled FP8, the rest in export.dtype.
  tr.config.export.quantization = "fp8"
  path = tr.export_hf(str(tmp_path / "fp8"))
  written = json.load(open(os.path.join(path, "config.json")))
  assert written["quantization_config"]["quant_method"] == "fp8"
  assert written["torch_dtype"] == "bfloat16"
  fp8 = load_hf_checkpoint(path)  # dequantized: near the trained weights, not equal
  q = "layers.0.attn.q_proj.kernel"
  err = np.abs(np.asarray(flatten_params(fp8)[q]) - params[q])
  assert 0 < err.max() <= np.abs(params[q]).max() / 16


def test_an_export_setting_it_cannot_write_is_refused_before_the_run(tmp_path):
  for field, value, message in (
      ("quantization", "int8", "expected one of"), ("dtype", "float16", "expected"),
      ("quantization", "mxfp4", "'mxfp4' writes gpt-oss's experts .* this model is 'llama'")):
    config = _config()
    config.export[field] = value
    with pytest.raises(ValueError, match=f"export.{field}: {message}"):
      RLTrainer(config, str(tmp_path / field), object())


def test_held_out_rounds_on_the_workers_are_logged_whole_and_never_trained(run):
  """eval.on_workers: each round of held-out prompts goes to the workers, for one greedy
  answer each and again for 2 sampled ones (eval.rounds_pass_k); a round whole is logged at
  the step that fed it, scored by the answers' verdicts (the fake worker passes the even
  half of each set, greedy, and the first of their 2 samples), and no answer is trained on."""
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  rounds = [(s["heldout_step"], s["heldout"]) for s in steps if "heldout_step" in s]
  assert rounds and all(fed < s for (fed, _), s in zip(rounds, [
      s["step"] for s in steps if "heldout_step" in s]))
  assert all(result == {"addition": 0.5, "reversal": 0.5, "all": 0.5} for _, result in rounds)
  assert all(s["heldout_pass"] == {"pass@1": 0.25, "pass@2": 0.5}
             for s in steps if "heldout_step" in s)
  trained = {i for s in steps for i in s["rollout_ids"]}
  assert run["worker"].evaluated and not trained & set(run["worker"].evaluated)


def _answer_held_out(server, n, passed):
  """A worker's answers to `n` held-out prompts leased from `server` (eval_samples of them
  where asked, else one), answer j passed where `passed(prompt id, j)`: returns the ids."""
  with client(server.address, "worker") as wc:
    wc.register("w")
    lease = wc.lease(n, 60.0, wait_s=2.0)
    version = wc.latest_version()
    for p in lease.prompts:
      ok = [passed(p.id, j) for j in range(int(p.metadata.get("eval_samples", 1)))]
      wc.submit_rollouts(lease.lease_id, RolloutGroup(prompt_id=p.id, policy_version=version,
                                                      samples=[make_sample(
          [5, 6], float(x), logprobs=[-1.0, -1.0], metadata={"passed": str(int(x))})
          for x in ok]))
    return [p.id for p in lease.prompts]


def test_a_held_out_prompt_no_worker_could_sample_scores_0_and_is_said(tmp_path, caplog):
  """eval.on_workers: a held-out prompt a worker refuses (too long for the model) scores 0,
  and the trainer's log says why (the worker's alone did)."""
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr._eval_rounds = {"3": {"step": 3, "left": {"x": ("addition", 0, 0)}, "waited": True,
                             "passes": [], "scores": collections.defaultdict(list),
                             "versions": []}}
    taken = pb.TakenRollout(
        prompt=pb.Prompt(id="x", metadata={"eval": "3", "eval_set": "addition"}),
        group=RolloutGroup(prompt_id="x", failure="prompt length 99 + max_new_tokens 6 "
                           "exceeds max_position_embeddings=64", metadata={"worker": "w1"}))
    with caplog.at_level("WARNING"):
      tr._eval_group(taken)
    assert tr._eval_rounds["3"]["done"][0] == {"addition": 0.0, "all": 0.0}
  assert "held-out prompt x could not be sampled by worker 'w1' (prompt length 99" in (
      caplog.text)


def test_built_in_task_prompts_too_long_for_the_bound_are_refused_at_the_start(tmp_path):
  """Reversal's prompts reach 12 tokens here (11 characters and bos): a bound of 10 is
  refused naming it before anything starts, not at the first long prompt drawn."""
  config = _config()
  config.rl.max_prompt_tokens = 10
  with pytest.raises(ValueError, match=r"^rl\.max_prompt_tokens: 10 tokens may not hold the "
                                       r"prompts of task 'reversal' \(up to 12\)"):
    RLTrainer(config, str(tmp_path / "rl"), object())


def _score_taken(tr, tc):
  """The trainer takes what is submitted (nothing to train on here) and scores it."""
  tr._valid_groups(tc.take_rollouts(0, 64, wait_s=2.0).rollouts)


def test_a_held_out_round_not_whole_at_a_checkpoint_is_finished_after_a_restart(tmp_path,
                                                                                 caplog):
  """eval.on_workers: a round's scores so far and its prompts not yet answered are in the
  checkpoint. A trainer restarted against a server that lost its queues feeds those prompts
  again (the same ids, nothing else), scores their answers and logs the round whole with
  the scores from before the restart: greedy exact match, and pass@1 and pass@2 of the
  prompts sampled twice (eval.rounds_pass_k)."""
  config = _config()
  config.eval.on_workers, config.eval.rounds_pass_k = True, 2
  workdir = str(tmp_path / "rl")
  first = start_server(tmp_path / "ps1")
  try:
    with client(first.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      tr.start()
      tr._feed_eval(3)
      fed = set(tr._eval_rounds["3"]["left"])
      early = _answer_held_out(first, 4, lambda i, j: True)  # the first set's, all passed
      _score_taken(tr, tc)
      assert len(fed) == 8 and tr._eval_rounds["3"]["left"].keys() == fed - set(early)
      assert not tr._evals_done  # half a round: not logged
      tr.save()
      tr.checkpointer.wait()
  finally:
    first.stop(grace=0)
  second = start_server(tmp_path / "ps2")  # another storage folder: nothing fed is there
  try:
    with client(second.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      assert tr.restored and tr._eval_rounds["3"]["left"].keys() == fed - set(early)
      tr.start()
      assert tr.servers_lost == 1
      # The second set's: the first example's greedy and first sampled answers pass.
      late = _answer_held_out(second, 16, lambda i, j: i.endswith("-0") and j == 0)
      assert sorted(late) == sorted(fed - set(early))
      _score_taken(tr, tc)
      assert tr._evals_done == [(3, {"addition": 1.0, "reversal": 0.5, "all": 0.75},
                                 {"pass@1": (1 + 1 + 0.5 + 0) / 4, "pass@2": 0.75})]
      assert not tr._eval_rounds
      # A checkpoint's round asking for a held-out example this run does not have.
      tr._load_eval_rounds([{"step": 5, "left": [["x", "addition", 2, 0]], "scores": {},
                             "passes": [], "versions": []}])
      assert not tr._eval_rounds and "round fed at step 5 is not logged" in caplog.text
  finally:
    second.stop(grace=0)


def test_a_round_the_final_evaluation_makes_whole_is_scored_again_by_a_rerun(tmp_path):
  """eval.on_workers: a periodic round's answers taken by the final evaluation are scored
  (the round logged whole) and left unacknowledged, so a rerun from the checkpoint (which
  holds the round unfinished) is served them again, by its own final evaluation's first
  take (a run killed in its final evaluation is rerun straight into it), and finishes it:
  they are of the version before the restart's keyframe, so their prompts are asked again
  (the fake worker's verdicts), as the final evaluation's own stale answers are."""
  config = _config()
  config.eval.on_workers, config.export.hf = True, False
  workdir = str(tmp_path / "rl")
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4)
  whole = (3, {"addition": 1.0, "reversal": 0.0, "all": 0.5}, None)
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      tr.start()
      tr._feed_eval(3)
      tr.save()
      tr.checkpointer.wait()
      assert len(_answer_held_out(server, 16, lambda i, j: "-addition-" in i)) == 4
      worker.start()  # it answers the final evaluation's prompts
      summary = tr.finish(1.0, 0)
      assert tr._evals_done == [whole]
    assert summary["heldout_exact_match"] == {"addition": 0.5, "reversal": 0.5, "all": 0.5}
    assert summary["groups_left_unacked"] >= 4  # (and final answers taken with them)
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      assert len(tr._eval_rounds["3"]["left"]) == 4
      tr.start()
      tr._fleet_evaluation("final", 0)
      assert tr._evals_done == [(3, {"addition": 0.5, "reversal": 0.5, "all": 0.5}, None)]
      assert not tr._eval_rounds
  finally:
    worker.stop()
    server.stop(grace=0)


def test_a_stop_during_the_workers_final_evaluation_leaves_the_run_to_a_rerun(tmp_path, caplog):
  """eval.on_workers: a SIGTERM while the workers answered the final evaluation wrote a
  finished summary without held-out figures (and exported): `rlax-ps local` then said
  "nothing to train" and the evaluation after RL was never made."""
  import threading

  from rlax_ps import local
  config = _config()
  config.eval.on_workers = True
  workdir = str(tmp_path / "rl")
  server = start_server(tmp_path / "ps")
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      tr.start()
      tr.total_steps = tr.step  # trained; no worker answers its final evaluation
      threading.Timer(1.0, tr.request_stop, (signal.SIGTERM,)).start()
      summary = tr.finish(1.0, 0)
  finally:
    server.stop(grace=0)
  assert summary["stopped"] == signal.SIGTERM and summary["export"] is None
  assert "heldout_exact_match" not in summary
  assert "the final evaluation of v0 was stopped with 8 of its prompts" in caplog.text
  assert local.finished_summary(workdir, tr.total_steps) is None  # a rerun evaluates


def test_rounds_wait_for_a_publication_and_none_go_out_without_held_out_examples(tmp_path):
  """eval.on_workers with eval.every_steps=1 and rl.publish_every=2: a round evaluates
  weights the workers can hold, so steps 1 and 3 feed none (step 2 feeds one; step 4's is
  the final evaluation); without held-out examples no round is fed at all (one would never
  be whole, and stay in every checkpoint)."""
  for examples, want in ((2, [2]), (0, [])):
    config = _config(steps=4, publish_every=2, max_staleness=2)
    config.eval.on_workers, config.eval.every_steps = True, 1
    config.eval.num_examples = examples
    fed = []
    with fake_fleet(tmp_path / str(examples)) as (tc, _):
      with RLTrainer(config, str(tmp_path / str(examples) / "rl"), tc) as tr:
        feed = tr._feed_eval
        tr._feed_eval = lambda step: (fed.append(step), feed(step))
        tr.train()
    assert fed == want


def test_a_stop_while_a_round_is_queued_drops_the_round(tmp_path, caplog):
  """A stop (SIGTERM, the server gone too) that ends the calls queueing a held-out round
  leaves no round (none the workers could finish) and no error: the step is checkpointed."""
  config = _config()
  config.eval.on_workers = True
  server = start_server(tmp_path / "ps")
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                            tc) as tr:
      tr.start()
      server.stop(grace=0)
      tr.request_stop(signal.SIGTERM)
      tr._feed_eval(3)
      assert not tr._eval_rounds and "held-out round of 3 left to the next start" in caplog.text
  finally:
    server.stop(grace=0)


def test_the_workers_evaluate_the_final_weights_published_for_them(tmp_path):
  """eval.on_workers with rl.publish_every=3 and 2 steps: no step published, so the final
  weights are published before the workers' final evaluation, which takes answers of that
  version alone."""
  config = _config(steps=2, publish_every=3, max_staleness=4)
  config.eval.on_workers = True
  with fake_fleet(tmp_path) as (tc, _):
    with RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      summary = tr.train()
  versions = _lines(tmp_path / "rl" / "versions.jsonl")
  assert [(v["version"], v["step"]) for v in versions] == [(0, 0), (1, 2)]
  assert summary["warm_start"] == summary["heldout_exact_match"] == {
      "addition": 0.5, "reversal": 0.5, "all": 0.5}


def test_prompts_are_paced_by_the_staleness_bound(run):
  config = run["config"]
  bound = config.rl.groups_per_step * max(config.rl.max_staleness, 1)
  # Never more than `bound` prompts outstanding beyond those already consumed.
  assert run["enqueued"] <= run["summary"]["rollout_groups_trained"] + bound


def test_summary_reports_warm_start_and_final_evaluation(run):
  """eval.on_workers: the workers answer the warm start's and the final evaluation too (the
  fake worker: the even half of each set, greedy, and the first of their eval.pass_k=2
  samples), each of the version it evaluates (answers of older ones are dropped)."""
  s = run["summary"]
  assert s["warm_start"] == s["heldout_exact_match"] == {"addition": 0.5, "reversal": 0.5,
                                                         "all": 0.5}
  assert s["heldout_pass"] == {"pass@1": 0.25, "pass@2": 0.5}
  # pass@k sampled as the workers do: the config's top_p, WorkerConfig's other defaults.
  assert s["pass_sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": pytest.approx(0.95),
                                "min_p": 0.0}
  assert s["sync"]["versions"] == 5 and s["sync"]["delta_bytes_mean"] > 0


def test_a_restart_resumes_and_republishes_a_keyframe_of_the_next_version(run):
  config = _config(steps=5)
  _adaptive_entropy(config)
  _kl_control(config, str(run["tmp"] / "warm"))
  with open(run["tmp"] / "rl" / "steps.jsonl", "a") as f:  # a step 5 a kill -9 undid
    f.write(json.dumps({"step": 5, "version": 99, "rollout_ids": [-1]}) + "\n")
  worker = FakeWorker(run["server"].address, samples=4, seed=1).start()  # no reward parts
  try:
    with client(run["server"].address, "trainer") as tc, \
         RLTrainer(config, str(run["tmp"] / "rl"), tc) as tr:
      assert tr.restored and tr.step == 4 and tr.feed.position == run["enqueued"]
      # The reward parts' run totals, as the first run left them (16 groups of 4 samples).
      assert tr.reward_parts_malformed == 16
      assert tr.reward_parts_totals == {"task": [32.0, 64], "think_format": [16.0, 64]}
      before = _lines(run["tmp"] / "rl" / "steps.jsonl")[-2]  # step 4's
      assert (tr.entropy_coef, tr.last_entropy) == (before["entropy_coef"], before["entropy"])
      summary = tr.train()
  finally:
    worker.stop()
  versions = _lines(run["tmp"] / "rl" / "versions.jsonl")
  assert [v["version"] for v in versions] == [0, 1, 2, 3, 4, 5, 6]
  assert versions[5]["keyframe"] and versions[5]["step"] == 4
  # TensorBoard: one sync point a step; the restart's keyframe, at the restored step 4,
  # would have stood beside the first run's there (a full model's bytes at a delta's step)
  synced = [step for step, _ in tb_scalars(str(run["tmp"] / "rl" / "tb"), "sync/version")]
  assert synced == [0, 1, 2, 3, 4, 5], synced
  steps = _lines(run["tmp"] / "rl" / "steps.jsonl")
  assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]  # the undone step's line dropped
  assert steps[-1]["step"] == 5 and steps[-1]["version"] == 6
  assert steps[-1]["entropy_coef"] == pytest.approx(0.035)  # on from the restored 0.03
  # Counted since the run began: 16 before the restart, and one for each group left queued
  # by the first run's worker that step 5 trained on (this worker sends no reward parts).
  old = len(set(steps[-1]["rollout_ids"]) & set(run["worker"].submitted))
  assert steps[-1]["reward_parts_malformed"] == summary["reward_parts_malformed"] == 16 + old
  assert summary["reward_parts"] == {"task": pytest.approx(0.5),
                                     "think_format": pytest.approx(0.25)}


def test_a_new_run_against_a_server_holding_another_runs_versions_is_refused(run, tmp_path):
  """Another workdir against the module run's server: it would take over the workers and
  train on that run's prompts; refused at its first publication, nothing published."""
  with client(run["server"].address, "trainer") as tc:
    latest = tc.latest_version()
    with RLTrainer(_config(), str(tmp_path / "other"), tc) as tr:
      with pytest.raises(ParamServerError, match=r"FAILED_PRECONDITION: run: this server "
                         r"holds the versions of another run \(\w+, up to v\d+\)"):
        tr.start()
    assert tc.latest_version() == latest


def test_mismatched_worker_format_is_refused_naming_the_field(run, tmp_path):
  config = _config()
  config.publish.format = "int8"
  with client(run["server"].address, "trainer") as tc:
    with pytest.raises(ValueError, match="worker.weights_format"):
      RLTrainer(config, str(tmp_path / "x"), tc)


# ~14 s a case: the int8 codec is test_sync_int8's, an int8 worker's logits test_moe's.
@pytest.mark.slow
@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
def test_int8_recipe_publishes_the_quantized_trainer_weights(tmp_path, experts):
  config = rl_config("tiny", "configs/rl_int8_tis.py")
  config.rl.steps = 2
  if experts:  # per-expert scales; routers stay bf16
    with config.unlocked():
      config.model.update(architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=config.model.intermediate_size,
                          norm_topk_prob=True)
  config.eval.num_examples = 0
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc, \
         RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      tr.train()
      params = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
      fields = tr.model_config.forward_fields()
    with client(server.address, "worker") as wc:
      updates = [sync.Update.from_bytes(bytes(b)) for b in wc.pull(None)]
  finally:
    worker.stop()
    server.stop(grace=0)
  held = None
  for u in updates:
    held = sync.apply(held, u)
  assert updates[-1].fmt == "int8" and updates[-1].version == 2
  # The keyframe names the trainer's model: a worker of another model refuses it.
  assert updates[0].is_keyframe and updates[0].model == fields and fields["num_heads"]
  want = sync.quantize_params(params)
  assert set(held) == set(want)
  for name in want:
    np.testing.assert_array_equal(held[name], want[name], err_msg=name)
  if experts:
    assert held["layers.0.mlp.experts.up_proj.scale"].shape == (4, config.model.intermediate_size)
    assert held["layers.0.mlp.router.kernel"].dtype == BF16


def test_a_stop_mid_batch_leaves_the_partial_take_to_be_trained_after_restart(tmp_path):
  config = _config(steps=3)
  config.eval.num_examples = 0
  config.rl.max_staleness = 20  # the fake worker submits ahead: nothing is stale here
  config.rl.take_timeout_s = 20.0  # a lost group shows as a trainer left waiting
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=6).start()  # a step and a half
  workdir = str(tmp_path / "rl")
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:

      def stop_once_half_taken():
        # A take for step 2 means step 1 is done (tr.step reads a buffer the step donates,
        # so this thread must not read it).
        while not any(t.step == 2 for t in list(tr.pending)):
          time.sleep(0.05)
        time.sleep(0.5)  # the trainer now waits for the rest of step 2's groups
        tr.request_stop()

      threading.Thread(target=stop_once_half_taken, daemon=True).start()
      stopped = tr.train()
      assert tr.step == 1
      # Stopped before rl.steps: checkpointed, no final evaluation or export (a rerun goes on).
      assert stopped["stopped"] is True and stopped["export"] is None
      assert not os.path.exists(os.path.join(workdir, "hf"))
      # Step 2's groups taken before the stop are not counted in the checkpoint: its restart
      # takes them again (they pace the feed; counted twice, the feed ran ahead).
      assert tr.consumed == 4 and tr.checkpointer.metadata(1)["consumed"] == 4
    worker.limit = 12
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      summary = tr.train()
      assert tr.step == 3 and tr.consumed == 12
      assert "stopped" not in summary and summary["export"] == os.path.join(workdir, "hf")
      # The summary's sync figures cover both runs' publications, not the restart's alone.
      published = _lines(tmp_path / "rl" / "versions.jsonl")
      assert summary["sync"]["versions"] == len(published)
      assert published[0]["version"] == 0 and len(published) > tr.version - tr._restart_version
  finally:
    worker.stop()
    server.stop(grace=0)
  effective = {}
  for r in _lines(tmp_path / "rl" / "steps.jsonl"):
    effective[r["step"]] = r["rollout_ids"]
  trained = [i for s in sorted(effective) for i in effective[s]]
  assert sorted(trained) == sorted(worker.submitted) and len(set(trained)) == 12


def test_dynamic_sampling_leaves_out_uniform_groups_and_fills_at_the_cap(tmp_path, caplog):
  """rl.dynamic_sampling: groups whose rewards are all equal are not trained on while ones
  that vary can fill the step; at the cap the step is filled with the first ones left out,
  and the warning names the setting that raises the cap; every taken group is
  acknowledged."""
  config = _config(steps=3, dynamic_sampling=True, dynamic_sampling_max_factor=1.5)
  config.eval.num_examples = 0
  config.rl.max_staleness = 20  # nothing dropped as stale: takes alternate as submitted
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, uniform_every=2).start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                            tc) as tr:
      summary = tr.train()
    with client(server.address, "viewer") as vc:
      stats = vc.stats()
  finally:
    worker.stop()
    server.stop(grace=0)
  # The cap is 1.5 * 4 = 6 groups a step; 6 alternating groups hold 3 that vary, so each
  # step trains those 3 and the first of the 3 left out.
  steps = _lines(tmp_path / "rl" / "steps.jsonl")
  assert [s["step"] for s in steps] == [1, 2, 3]
  for i, s in enumerate(steps, 1):
    ids = s["rollout_ids"]
    assert len(ids) == 4 and sum(x in worker.uniform for x in ids) == 1, s
    (fill,) = [x for x in ids if x in worker.uniform]
    assert fill == min(ids)  # the first left out (taken first)
    assert (s["filtered"], s["filled"]) == (2 * i, i)
    # The policy's reward is over all 6 groups taken (3 of [1, 0, 1, 0], 3 of zeros), not
    # over the 4 trained, which dynamic sampling chose for varying
    assert (s["reward_mean"], s["reward_mean_trained"]) == (0.25, 0.375), s
  assert (summary["filtered"], summary["filled"]) == (6, 3)
  assert stats.rollouts_in_flight == 0  # those left out were acknowledged with their step
  capped = [r.getMessage() for r in caplog.records if "informative groups" in r.getMessage()]
  assert len(capped) == 3 and all("Raise rl.dynamic_sampling_max_factor," in m for m in capped)


@pytest.mark.slow  # ~8 s; test_rl_loss holds the distillation loss in the default suite
def test_on_policy_distillation_trains_on_the_teachers_log_probs(tmp_path):
  """loss.advantage="opd": each step the teacher (another tiny model) scores the sampled
  tokens; the reverse KL the step logs is the fake worker's -1.5 a token less the teacher's
  log-probs, near uniform over the tokenizer's ids."""
  with pytest.raises(ValueError, match="teacher.path: expected an HF checkpoint folder with "
                                       "loss.advantage='opd' or loss.distill_topk > 0 "
                                       r"\(or worker.teacher: the teacher on the workers\) and "
                                       "none without"):
    bad = _config()
    bad.loss.advantage = "opd"
    RLTrainer(bad, str(tmp_path / "bad"), object())
  save_warm_start(tmp_path / "teacher", seed=5)
  config = _config(steps=2)
  config.eval.num_examples = 0
  config.loss.advantage, config.teacher.path = "opd", str(tmp_path / "teacher")
  config.loss.distill_topk = 2  # and its top tokens at each sampled position
  logged = []
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                            tc) as tr:
      log_step = tr._log_step
      tr._log_step = lambda record, metrics: (logged.append(dict(metrics)),
                                              log_step(record, metrics))
      summary = tr.train()
      vocab = tr.tokenizer.vocab_size
  finally:
    worker.stop()
    server.stop(grace=0)
  assert summary["step"] == 2 and len(logged) == 2
  for m in logged:
    assert abs(m["teacher_kl"] - (np.log(vocab) - 1.5)) < 0.5, m["teacher_kl"]
    assert m["distill_kl"] > 0
  steps = _lines(tmp_path / "rl" / "steps.jsonl")  # and each step's line shows it
  assert [s["teacher_kl"] for s in steps] == pytest.approx([m["teacher_kl"] for m in logged])
  # With the teacher on the workers (worker.teacher) the trainer loads none: each group
  # brings the teacher's scores the loss takes (tests/inference_workers/test_worker_teacher).
  config.worker.teacher, config.worker.teacher_topk = config.teacher.path, 2
  config.teacher.path = ""
  with RLTrainer(config, str(tmp_path / "rl_workers"), object()) as tr:
    assert tr.teacher is None
    assert (tr.shape.teacher_logp, tr.shape.teacher_topk) == (True, 2)
  # A teacher whose folder ships another tokenizer would score other ids: refused.
  shutil.copytree(tmp_path / "teacher", tmp_path / "other")
  shutil.copy(os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer", "tokenizer.json"),
              tmp_path / "other")
  config.teacher.path, config.worker.teacher, config.worker.teacher_topk = (
      str(tmp_path / "other"), "", 0)
  with pytest.raises(ValueError, match=r"teacher.path: .* gives other ids than the policy's "
                                       r"\(99 tokens\); .*or teacher.tokenizer set"):
    RLTrainer(config, str(tmp_path / "rl_other"), object())


@pytest.mark.slow  # ~10 s; test_worker_teacher's cross-tokenizer case stays in the default suite
def test_a_teacher_of_another_tokenizer_on_the_trainer_scores_each_responses_text(tmp_path):
  """teacher.tokenizer: the trainer's teacher of a byte-level tokenizer scores the text of
  the step's responses (a forward pass per micro-batch of its groups), as score_retokenized
  does group by group, and the loss takes it: the reverse KL logged is the fake worker's
  -1.5 a token less a near-uniform model's log-prob of a byte, about log(257) - 1.5 (its
  scores missing: -1.5). Refused: top tokens with it, and a folder without a tokenizer."""
  from tokenizer_testlib import save_byte_level_tokenizer
  from flax import nnx

  from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
  own = save_byte_level_tokenizer(tmp_path / "teacher")
  save_hf_checkpoint(Transformer(ModelConfig(vocab_size=own.vocab_size, hidden_size=32,
                                             intermediate_size=64, num_layers=1, num_heads=4,
                                             num_kv_heads=2, max_position_embeddings=64),
                                 rngs=nnx.Rngs(5)), str(tmp_path / "teacher"))
  config = _config(steps=2)
  config.eval.num_examples = 0
  config.loss.advantage = "opd"
  config.teacher.path = config.teacher.tokenizer = str(tmp_path / "teacher")
  config.rl.micro_batches = 2  # the teacher's pass too: 2 groups of the step's 4 at a time
  logged, scored, passes = [], [], []
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                            tc) as tr:
      log_step, retokenized = tr._log_step, tr._retokenized_scores
      tr._log_step = lambda record, metrics: (logged.append(dict(metrics)),
                                              log_step(record, metrics))
      tr._retokenized_scores = lambda groups: scored.append(retokenized(groups)) or scored[-1]
      score_groups = tr.teacher.score_groups
      tr.teacher.score_groups = lambda prompts, *a, **k: (
          passes.append(len(prompts)), score_groups(prompts, *a, **k))[1]
      step_for = tr._step_for

      def spied(batch):  # the step's teacher_logp, as placed on the devices
        step = step_for(batch)
        return lambda state, placed, *rest: (
            taken.append(np.asarray(jax.device_get(placed["teacher_logp"]))),
            step(state, placed, *rest))[1]
      taken = []
      tr._step_for = spied
      tr.train()
      policy = tr.tokenizer
  finally:
    worker.stop()
    server.stop(grace=0)
  assert len(logged) == len(scored) == 2
  assert passes == [4, 2, 2] * 2, passes  # each step's 4 groups, in 2 passes of 2 rows
  for m in logged:
    assert abs(m["teacher_kl"] - (np.log(own.vocab_size) - 1.5)) < 0.5, m["teacher_kl"]
  # A group whose prompt the teacher cannot read (a conversation; it has no chat template)
  # is rejected as it is taken, naming it, not when its step is built.
  chat = pb.TakenRollout(rollout_id=99, prompt=pb.Prompt(
      id="p-chat", text="hi", task="addition", token_ids=policy.encode_prompt("hi"),
      metadata={"prompt": json.dumps([{"role": "user", "content": "hi"}])}),
      group=pb.RolloutGroup(prompt_id="p-chat", policy_version=0, samples=[
          make_sample([5, 6], float(j % 2), logprobs=[-1.0, -1.0]) for j in range(4)]))
  rejected = tr.rejected
  assert tr._valid_groups([chat]) == [] and tr.rejected == rejected + 1
  assert tr.last_rejection.startswith("prompt p-chat: teacher.tokenizer: the teacher cannot "
                                      "read it: prompt: a list of messages needs")
  alone = Teacher(str(tmp_path / "teacher"), None, vocab_size=own.vocab_size,
                  dtype=tr.model_config.dtype)
  for groups, placed in zip(scored, taken):
    for row, g in enumerate(groups):
      want, = score_retokenized(alone, policy, own, [g.teacher_prompt], [g.responses],
                                [g.behaviour_logp], [[False] * len(g.responses)], 4)
      for slot, ((got, _, _), w, r) in enumerate(zip(g.teacher, want, g.responses)):
        assert len(got) == len(r)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(placed[row, slot, :len(r)], got)
  config.loss.distill_topk = 2
  with pytest.raises(ValueError, match=r"teacher.tokenizer: expected '' without teacher.path "
                                       r"or with loss.distill_topk > 0"):
    RLTrainer(config, str(tmp_path / "topk"), object())
  config.loss.distill_topk, config.teacher.tokenizer = 0, str(tmp_path / "none")
  with pytest.raises(ValueError, match=r"teacher.tokenizer: .*none"):
    RLTrainer(config, str(tmp_path / "none"), object())
  config.teacher.tokenizer = str(tmp_path / "teacher")  # the leader alone has the texts
  with mock.patch.object(jax, "process_count", return_value=2), pytest.raises(
      ValueError, match=r"teacher.tokenizer: a trainer of 2 processes cannot score responses "
                        r"as text; .*worker.teacher_tokenizer"):
    RLTrainer(config, str(tmp_path / "hosts"), object())


def test_dynamic_sampling_is_refused_with_vigor_naming_the_field(tmp_path):
  config = _config(dynamic_sampling=True)
  config.worker.allocator = "vigor"
  with pytest.raises(ValueError, match="rl.dynamic_sampling: needs worker.allocator='fixed'"):
    RLTrainer(config, str(tmp_path / "rl"), object())


def test_jsonl_prompts_and_heldout_records_are_scored_by_a_users_verifiers(tmp_path, caplog):
  """data.jsonl / data.heldout_jsonl with tasks that worker.verifiers registers: evaluation
  scores each held-out task with its verifier; a task nothing knows is refused, naming the
  field, the file and the line. Held-out prompts also trained on are said (by the trainer
  and by the checks `rlax-ps local` runs first)."""
  def write(name, records):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)

  config = _config()
  config.worker.verifiers = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                         "fixtures", "user_verifiers.py")
  config.data.jsonl = write("train.jsonl", [{"prompt": "1+2=", "answer": "3",
                                             "task": "fixture_contains"}])
  config.data.heldout_jsonl = write("heldout.jsonl", [
      *({"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "fixture_any"} for i in range(3)),
      *({"prompt": f"{i}+0=", "answer": "987654321", "task": "addition"} for i in range(2))])
  with caplog.at_level("WARNING"), RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    assert [r["task"] for _, r in tr.feed.take(2)] == ["fixture_contains"] * 2
    assert tr.evaluate() == {"addition": 0.0, "fixture_any": 1.0, "all": 0.6}
  assert "are also in data.jsonl" not in caplog.text
  config.data.jsonl = write("overlap.jsonl", [{"prompt": "1+2=", "answer": "3"},
                                              {"prompt": "2+2=", "answer": "4"},
                                              {"prompt": "1+0=", "answer": "1"}])
  overlap = ("data.heldout_jsonl: 2 of its 4 prompts are also in data.jsonl (e.g. '1+0='): "
             "their held-out score is a training score")
  with caplog.at_level("WARNING"), RLTrainer(config, str(tmp_path / "rl3"), object()):
    assert overlap in caplog.text
  caplog.clear()
  from rlax_ps.train.rl_checks import check_rl_config
  with caplog.at_level("WARNING"):
    check_rl_config(config)
  assert overlap in caplog.text
  config.data.jsonl = write("bad.jsonl", [{"prompt": "a", "answer": "b"},
                                          {"prompt": "c", "answer": "d", "task": "nope"}])
  with pytest.raises(ValueError, match="data.jsonl .*bad.jsonl:2: field 'task': expected a "
                                       "built-in task or a registered verifier \\(.*"
                                       "fixture_contains.*\\), got 'nope'"):
    RLTrainer(config, str(tmp_path / "rl2"), object())


def test_records_whose_groups_stay_uniform_are_fed_less_and_the_checkpoint_keeps_them(tmp_path):
  """Selective rollouts: rl.revisit_solved=0 retires a record answered all correct; with
  rl.revisit_failed=0.5 one answered all wrong comes back about half as often, and as before
  once a group of it carries a signal; the streaks are checkpointed; a whole epoch passed
  over is fed anyway rather than stall."""
  from param_server.protos import param_server_pb2 as pb
  (tmp_path / "d.jsonl").write_text("".join(
      json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "addition"}) + "\n"
      for i in range(8)))
  config = _config(revisit_solved=0.0, revisit_failed=0.5)
  config.data.jsonl = str(tmp_path / "d.jsonl")
  sent = []

  class Queue:
    def enqueue_prompts(self, prompts):
      sent.extend(prompts)

    def version_info(self):
      return pb.VersionInfo()

  def taken(prompt, rewards):
    return pb.TakenRollout(rollout_id=len(sent), prompt=prompt, group=pb.RolloutGroup(
        prompt_id=prompt.id, samples=[pb.Sample(token_ids=[1], reward=r) for r in rewards]))

  def record(prompt):
    return int(prompt.metadata["record"])

  with RLTrainer(config, str(tmp_path / "rl"), Queue()) as tr:
    solved, failed, mixed = 0, 1, 2  # records
    outcome = {solved: [1.0, 1.0], failed: [0.0, 0.0]}
    for _ in range(40):  # 40 steps' groups, about 10 epochs
      done = len(sent)
      tr._feed_prompts()
      tr._valid_groups([taken(p, outcome.get(record(p), [1.0, 0.0])) for p in sent[done:]])
    fed = collections.Counter(record(p) for p in sent)
    assert fed[solved] == 1  # retired after its first group
    assert 1 <= fed[failed] < fed[mixed] / 2  # 1/2, 1/4, ... of its turns
    assert tr.streaks[solved] == 1 and tr.streaks[failed] <= -2 and mixed not in tr.streaks
    assert tr.metadata()["streaks"] == sorted(tr.streaks.items())
    assert tr.metadata()["retired"] == tr.retired > 0
    again = taken(sent[-1], [0.0, 0.0])
    tr.skip_ids.add(again.rollout_id)  # trained before a restart: counted in the checkpoint
    before = dict(tr.streaks)
    tr._valid_groups([again])
    assert tr.streaks == before
    tr._valid_groups([taken(sent[-1], [1.0, 0.0]) for _ in [0]])  # a signal ends a streak
    assert record(sent[-1]) not in tr.streaks
    tr.streaks = {r: 1 for r in range(8)}  # all retired: fed anyway, not a stalled run
    tr.consumed = tr.feed.position - tr.retired
    before = len(sent)
    tr._feed_prompts()
    assert len(sent) - before == tr.shape.groups
    saved = tr.metadata()
  with RLTrainer(config, str(tmp_path / "rl2"), Queue()) as again:
    again._load_metadata(saved)
    assert again.streaks == {r: 1 for r in range(8)}
  with pytest.raises(ValueError, match="rl.revisit_solved, rl.revisit_failed: expected "
                                       "data.jsonl"):
    RLTrainer(_config(revisit_failed=0.5), str(tmp_path / "b"), object())
  with pytest.raises(ValueError, match="rl.revisit_failed: expected a probability"):
    RLTrainer(_config(revisit_failed=1.5), str(tmp_path / "c"), object())
  with pytest.raises(ValueError, match="rl.retire_solved: replaced by rl.revisit_solved"):
    RLTrainer(_config(retire_solved=True), str(tmp_path / "d"), object())


def test_a_step_whose_compile_ahead_failed_or_is_queued_compiles_when_taken():
  import concurrent.futures
  tr = RLTrainer.__new__(RLTrainer)  # only the step choice: no run needed
  tr.rl_step, tr.precompiled_steps = "jitted", 0
  failed, queued, done = (concurrent.futures.Future() for _ in range(3))
  failed.set_running_or_notify_cancel()
  failed.set_exception(RuntimeError("out of memory while compiling"))
  done.set_running_or_notify_cancel()
  done.set_result("compiled")
  tr._compiles = {(4, 8): failed, (4, 16): queued, (4, 32): done}

  def batch(capacity):
    return {"row_group": np.zeros(4), "response_tokens": np.zeros((4, 2, capacity))}

  assert tr._step_for(batch(8)) == "jitted"  # the failure is logged, the step compiles
  assert tr._step_for(batch(16)) == "jitted" and queued.cancelled()  # not waited for
  assert tr._step_for(batch(32)) == "compiled" and tr.precompiled_steps == 1
  assert tr._step_for(batch(64)) == "jitted"  # a shape not compiled ahead
  assert set(tr._compiles) == {(4, 32)}


class _Overlong(FakeWorker):
  """A worker sampling with a larger budget than the trainer's: every group is refused."""

  def group(self, prompt_id, version, uniform=False):
    toks = np.full(self.max_len, 5)
    return RolloutGroup(prompt_id=prompt_id, policy_version=version, samples=[
        make_sample(toks, float(j % 2), logprobs=np.full(len(toks), -1.5))
        for j in range(self.samples)])


class _CannotSample(FakeWorker):
  """A worker whose model cannot sample the prompts: each is answered with the reason."""

  def group(self, prompt_id, version, uniform=False):
    return RolloutGroup(prompt_id=prompt_id, policy_version=version, metadata={"worker": "w7"},
                        failure="prompt length 70 + max_new_tokens 8 exceeds "
                                "max_position_embeddings=64")


class _TooMany(FakeWorker):
  """A worker started with twice the trainer's worker.samples_per_prompt."""

  def group(self, prompt_id, version, uniform=False):
    self.samples, self.max_len = 8, 2  # (responses within the budget)
    return super().group(prompt_id, version, uniform)


def _rejected_fleet(tmp_path, worker_kind, take_timeout_s):
  """A 2-step config (no held-out set), a server, and a started `worker_kind` worker (its
  responses one token past the budget, where it samples any)."""
  config = _config(steps=2)
  config.eval.num_examples = 0
  config.rl.take_timeout_s = take_timeout_s
  server = start_server(tmp_path / "ps")
  worker = worker_kind(server.address, samples=4,
                       max_len=int(config.worker.max_new_tokens) + 1).start()
  return config, server, worker


@pytest.mark.parametrize("worker_kind, why", [
    (_Overlong, r"more than worker.max_new_tokens=\d+"),
    (_TooMany, r"8 samples, more than this trainer's worker.samples_per_prompt=4"),
    pytest.param(_CannotSample,
                 r"prompt \S+ could not be sampled by worker 'w7': prompt length 70 ",
                 marks=pytest.mark.slow),
])
def test_groups_it_cannot_train_on_end_the_run_soon_naming_why(tmp_path, worker_kind, why,
                                                                monkeypatch):
  """Rejected groups (and prompts a worker could not sample) do not count as arrivals: with
  only those coming, the run ends after REFUSED_IN_A_ROW of them and REFUSED_WAIT_S (here
  1 s) with the reason, instead of a trainer that waits forever at step 0, or fed the fleet
  hundreds of prompts a second for rl.take_timeout_s. Restarted with a fleet that runs its
  settings, it trains: the groups the first start left (rejected again) do not end it."""
  monkeypatch.setattr(rl_module, "REFUSED_WAIT_S", 1.0)
  config, server, worker = _rejected_fleet(tmp_path, worker_kind, take_timeout_s=600.0)
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      with pytest.raises(TakeTimeout, match=(
          r"rl: the fleet's last \d+ groups were all rejected \(none to train on for 1s\), "
          r"the last: .*" + why +
          r".*; the workers cannot serve this run's prompts: start them with this trainer's "
          r"--config and its --config.\* overrides")):
        tr.train()
      # The run ends as a stop does: its checkpoint first, the round's groups (answered, not
      # counted) to be taken again by the next start
      assert tr.step == 0 and tr.checkpointer.latest_step() == 0
      assert tr.consumed == tr.rejected == 0
      assert sum(len(t.rollout_ids) for t in tr.pending) >= 64
    if worker_kind is not _Overlong:
      return
    worker.stop()
    worker = FakeWorker(server.address, samples=4).start()
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      tr.train()
      assert tr.step == 2 and tr.rejected >= 64
  finally:
    worker.stop()
    server.stop(grace=0)


class _Slow(FakeWorker):
  """A worker of the trainer's settings, 0.3 s a group (a real model's: seconds), whose
  first group waits for `peer` to have sent 80 groups."""
  peer = None

  def group(self, prompt_id, version, uniform=False):
    if self.peer is not None:  # (10 s at most)
      deadline = time.monotonic() + 10
      while len(self.peer.submitted) < 80 and time.monotonic() < deadline:
        time.sleep(0.01)
      self.peer = None
    time.sleep(0.3)
    return super().group(prompt_id, version, uniform)


def test_a_worker_of_other_settings_beside_a_good_slower_one_stops_nothing(tmp_path,
                                                                           monkeypatch):
  """The bad worker answers its prompts in a blink, many more than REFUSED_IN_A_ROW between
  two of the good one's groups; these keep coming within REFUSED_WAIT_S: the run trains."""
  monkeypatch.setattr(rl_module, "REFUSED_WAIT_S", 5.0)
  config = _config(steps=1)
  config.eval.num_examples = 0
  server = start_server(tmp_path / "ps")
  bad = _CannotSample(server.address, samples=4).start()
  good = _Slow(server.address, samples=4)
  good.peer = bad
  good.start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      tr.train()
      assert tr.step == 1 and tr.rejected >= 80 > rl_module.REFUSED_IN_A_ROW
  finally:
    good.stop()
    bad.stop()
    server.stop(grace=0)


def test_rejected_groups_coming_slower_than_refused_in_a_row_end_the_run_at_take_timeout(
    tmp_path, monkeypatch):
  monkeypatch.setattr(rl_module, "REFUSED_IN_A_ROW", 10 ** 6)
  config, server, worker = _rejected_fleet(tmp_path, _Overlong, take_timeout_s=2.0)
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      with pytest.raises(TakeTimeout, match=(
          r"rl.take_timeout_s: no usable rollout group for 2.0s; \d+ groups rejected, the "
          r"last: .*more than worker.max_new_tokens=\d+.* \(do the workers run this")):
        tr.train()
  finally:
    worker.stop()
    server.stop(grace=0)


def test_a_fleet_gone_past_take_timeout_ends_the_run_with_its_steps_checkpointed(tmp_path):
  """Every worker gone (a preempted fleet) for rl.take_timeout_s: the TimeoutError ended the
  run before its checkpoint, losing every step since the last one."""
  config = _config(steps=6)
  config.eval.num_examples = 0
  config.rl.max_staleness = 20  # the fake worker submits ahead: nothing is stale here
  config.rl.take_timeout_s = 2.0
  config.checkpoint.every_steps = 100
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=8).start()  # two steps' groups
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      with pytest.raises(TakeTimeout, match="rl.take_timeout_s: no usable rollout group"):
        tr.train()
      assert tr.step == 2 and tr.checkpointer.latest_step() == 2
  finally:
    worker.stop()
    server.stop(grace=0)


def test_a_take_that_expires_before_its_checkpoint_is_trained_on_once(tmp_path):
  """rl.ack_deadline_s shorter than the checkpoint interval: the server serves an expired
  take's groups again while the trainer holds them unacknowledged; they are skipped (no
  group in two steps), and the failed acknowledgements do not stop the run."""
  config = _config(steps=4)
  config.eval.num_examples = 0
  config.rl.max_staleness = 20  # the returned groups are not too stale to be taken again
  config.rl.ack_deadline_s = 0.2  # the first take expires while the first step compiles
  config.checkpoint.every_steps = 100  # only the last step is checkpointed
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      tr.train()
      came_back = tr.came_back
      assert tr.step == 4
  finally:
    worker.stop()
    server.stop(grace=0)
  trained = [i for s in _lines(tmp_path / "rl" / "steps.jsonl") for i in s["rollout_ids"]]
  assert len(trained) == 16 and len(set(trained)) == 16
  assert came_back >= 1  # the case arose: an expired take's groups came again


def test_a_stop_with_the_server_gone_ends_at_once_and_a_restart_trains_every_group_once(
    tmp_path):
  """The supervisor killed: its server is gone and the trainer gets a SIGTERM. It must not
  retry the server for the client's whole deadline (holding the workdir that a rerun
  wants): it checkpoints, leaves the acknowledgements to the next start and returns."""
  config = _config(steps=4)
  config.eval.num_examples = 0
  config.rl.max_staleness = 20  # the fake worker submits ahead: nothing is stale here
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=10).start()  # two steps and a half
  workdir = str(tmp_path / "rl")
  slow = ParamServerClient(server.address, token=TOKENS["trainer"], role="trainer",
                           timeout_s=10.0, retry=RetryPolicy(deadline_s=60.0))
  with slow as tc, RLTrainer(config, workdir, tc) as tr:

    def kill_server_then_stop():
      while not any(t.step == 3 for t in list(tr.pending)):  # steps 1 and 2 are done
        time.sleep(0.05)
      worker.stop()
      server.stop(grace=0)
      time.sleep(1.0)  # the trainer is retrying its take
      tr.request_stop(signal.SIGTERM)

    threading.Thread(target=kill_server_then_stop, daemon=True).start()
    t0 = time.monotonic()
    tr.train()
    assert time.monotonic() - t0 < 30, "the stop waited for the dead server"
    assert tr.step == 2 and tr.checkpointer.latest_step() == 2
  server = start_server(tmp_path / "ps")
  worker2 = FakeWorker(server.address, samples=4, limit=6, seed=1).start()
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, workdir, tc) as tr:
      tr.train()
      assert tr.step == 4
  finally:
    worker2.stop()
    server.stop(grace=0)
  trained = [i for r in _lines(tmp_path / "rl" / "steps.jsonl") for i in r["rollout_ids"]]
  assert len(trained) == len(set(trained)) == 16
  assert sorted(trained) == sorted(worker.submitted + worker2.submitted)


def test_the_summarys_group_counts_are_run_totals_across_restarts(run):
  """dropped_stale, rejected, filtered and filled are kept in the checkpoint as
  rollout_groups_trained is: a restart's summary counts every run, not its own alone."""
  from rlax_ps.checkpoint import Checkpointer
  from rlax_ps.train import rl as rl_lib
  with Checkpointer(str(run["tmp"] / "rl" / "checkpoints")) as ckpt:
    saved = ckpt.metadata()
  malformed = _lines(run["tmp"] / "rl" / "steps.jsonl")[-1]["reward_parts_malformed"]
  assert saved["counts"] == {**{name: 0 for name in rl_lib.COUNTS},
                             "reward_parts_malformed": malformed}  # the fake worker's (run)
  before = RLTrainer.__new__(RLTrainer)
  before.restore_counts({})
  assert before.counts() == {name: 0 for name in rl_lib.COUNTS}
  before.dropped_stale, before.rejected, before.filtered, before.filled = 5, 2, 3, 1
  after = RLTrainer.__new__(RLTrainer)
  after.restore_counts(json.loads(json.dumps(before.counts())))
  assert (after.dropped_stale, after.rejected, after.filtered, after.filled) == (5, 2, 3, 1)


def test_the_trainer_waits_for_a_server_as_long_as_for_rollouts():
  # `rlax-ps train` retries a server that does not answer for rl.take_timeout_s (a server
  # restarted after 80 s ended the trainer at the client's default 60 s).
  config = rl_config()
  config.rl.take_timeout_s = 321.0
  assert server_retry(config).deadline_s == 321.0


def test_groups_the_devices_cannot_split_are_named_before_any_step(tmp_path, caplog):
  # One packed row per group: 4 groups on data 8 are not split, and the devices repeat one
  # another's work; said when the trainer is built.
  config = rl_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  with RLTrainer(config, str(tmp_path / "rl"), object()) as trainer:
    assert trainer.mesh.shape["data"] == 8
  assert ("rl.groups_per_step=4, rl.micro_batches=1: 4 rows a micro-batch are not a multiple "
          "of mesh data*fsdp = 8" in caplog.text)
  assert "a multiple of 8 uses every device" in caplog.text


def test_updates_with_non_finite_gradients_are_skipped_and_too_many_stop_the_run(tmp_path,
                                                                                 caplog):
  """From step 2 on every batch's behaviour log-probs are NaN: each update is skipped (the
  weights keep step 1's: nothing NaN reaches a checkpoint or a publication), and the second
  in a row (optimizer.max_nonfinite_steps) stops the run before its checkpoint."""
  config = _config(steps=6)
  config.optimizer.max_nonfinite_steps = 2
  config.checkpoint.every_steps, config.checkpoint.async_save = 1, False
  kept = {}  # the weights after step 1
  with fake_fleet(tmp_path) as (tc, _), RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
    step_for = tr._step_for

    def poisoned(batch):
      fn = step_for(batch)
      if tr.step < 1:
        return fn
      kept.update(kept or {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()})
      return lambda state, placed, *rest: fn(
          state, {**placed, "behaviour_logp": placed["behaviour_logp"] * np.nan}, *rest)

    tr._step_for = poisoned
    with caplog.at_level("WARNING"), pytest.raises(
        FloatingPointError, match=r"last 2 updates \(step 3\).*max_nonfinite_steps=2"):
      tr.train()
    params = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
    assert tr.checkpointer.latest_step() == 2  # (step 2's update skipped, its state saved)
  assert kept and kept.keys() == params.keys()
  for name, value in kept.items():  # step 1's weights, kept since
    np.testing.assert_array_equal(value, params[name], name)
  assert "step 2: the update was skipped: its gradients are not finite" in caplog.text


def test_a_checkpoint_keeps_the_skipped_groups_and_the_run_id_of_its_prompts(tmp_path,
                                                                             monkeypatch):
  """The groups of a take whose ack came too late (the server requeued them; they were
  trained on) were skipped only by the process that saw it: a rerun from its checkpoint
  trained them again. A run resumed in a moved workdir keyed its outstanding prompts by
  the new folder's id, so none ever matched the prompts the server held. Prompts go to the
  server in calls of ENQUEUE_BATCH (one call of everything was refused past 10,000)."""
  from rlax_ps.train import rl as rl_lib
  with RLTrainer(_config(), str(tmp_path / "rl"), object()) as tr:
    tr.skip_ids = {3, 9}
    saved = json.loads(json.dumps(tr.metadata()))
    saved["run_id"], saved["outstanding"] = "moved-run", [[7, 2]]
    tr.skip_ids = set()
    tr._load_metadata(saved)
    assert tr.skip_ids == {3, 9}
    assert tr.outstanding == {"moved-run-7": (7, 2)} and tr.publisher.run == "moved-run"

    class Recording:
      calls = []

      def enqueue_prompts(self, prompts):
        self.calls.append(len(prompts))

      def version_info(self):
        return pb.VersionInfo()

    monkeypatch.setattr(rl_lib, "ENQUEUE_BATCH", 3)
    tr.client, tr.consumed = Recording(), tr.feed.position - tr.retired
    want = 8 + tr.shape.groups * tr.max_staleness + 1  # (one more: a last short call)
    tr._feed_prompts(want=want - tr.shape.groups * tr.max_staleness)
    assert Recording.calls == [3] * (want // 3) + [want % 3], Recording.calls
