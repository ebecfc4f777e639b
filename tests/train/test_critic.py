"""PPO's critic (loss.advantage="gae"): GAE's advantages and returns and the clipped value loss
against verl's own code (tests/fixtures/verl/gae.json, made by
tests/fixtures/make_verl_fixtures.py); the value model on packed rows; its update whole and
micro-batched; the trainer training it beside the policy, and resuming it."""

import glob
import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from algorithms import losses
from rl_testlib import REPO, fake_fleet, rl_config, save_warm_start, verl_batch, verl_fixture
from rlax_ps.models import ModelConfig
from rlax_ps.models.value_model import ValueModel, critic_config, packed_values
from rlax_ps.train.critic import Critic, check_critic_config, check_critic_source, value_stats
from rlax_ps.train.rl_loss import LossConfig, gae_targets, group_advantages
from rlax_ps.train.trainable import split_as, split_trainable
from rlax_ps.sharding import make_mesh

DATA, B, G, N, REAL, T = verl_fixture("gae.json")  # verl sees the real samples alone


def _batch():
  """The fixture's batch as the trainer packs it, with the critic's values."""
  return verl_batch(B)


def _cfg(case):  # (the fixture's estimator, where a KL is estimated: else refused unused)
  kl = {"kl_estimator": case["kl_estimator"]} if case["kl_in_reward"] else {}
  return LossConfig(advantage="gae", gamma=case["gamma"], lam=case["lam"],
                    kl_in_reward=case["kl_in_reward"], **kl)


@pytest.mark.parametrize("case", DATA["cases"],
                         ids=[f"g{c['gamma']}-lam{c['lam']}-beta{c['kl_in_reward']}"
                              for c in DATA["cases"]])
def test_gae_advantages_and_returns_equal_verls(case):
  """Whitened advantages over the batch's drawn tokens (an environment's reply carries the
  next value through), and the returns the critic regresses on; with the KL-in-reward
  penalty in the token rewards."""
  batch, ref = _batch()
  adv, mask = group_advantages(batch, G, _cfg(case), ref)
  tokens = np.asarray(batch["policy_tokens"]).reshape(-1, T)[REAL] > 0
  np.testing.assert_allclose(np.asarray(adv)[REAL][tokens],
                             np.asarray(case["advantages"], np.float32)[tokens], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(mask, np.asarray(B["sample_mask"]))
  _, returns, _ = gae_targets(batch, _cfg(case), ref)
  np.testing.assert_allclose(np.asarray(returns)[REAL][tokens],
                             np.asarray(case["returns"], np.float32)[tokens], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("case", DATA["value_loss"], ids=lambda c: f"{c['clip']}-{c['agg']}")
def test_the_clipped_value_loss_equals_verls(case):
  real = np.asarray(B["values"], np.float32)[REAL]
  mask = jnp.asarray(np.asarray(B["policy_tokens"], np.float32)[REAL])
  loss, metrics = losses.value_loss(jnp.asarray(case["preds"]), jnp.asarray(real),
                                    jnp.asarray(case["returns"]), mask, clip=case["clip"],
                                    agg=case["agg"])
  np.testing.assert_allclose(float(loss), case["vf_loss"], rtol=1e-5)
  np.testing.assert_allclose(float(metrics["vf_clipfrac"]), case["vf_clipfrac"], rtol=1e-5)
  assert 0 < case["vf_clipfrac"] < 1  # the clip binds on some tokens, not all


def test_gae_needs_the_critics_values_and_its_knobs_are_checked():
  batch, ref = _batch()
  del batch["values"]
  with pytest.raises(ValueError, match="loss.advantage: 'gae' needs the critic's values"):
    group_advantages(batch, G, LossConfig(advantage="gae"), ref)
  for fields, message in ((dict(advantage="grpo", lam=0.9), "loss.lam: expected 1.0 with "
                           "advantage='grpo'"),
                          (dict(advantage="gae", lam=1.5), "loss.lam: expected a GAE lambda"),
                          (dict(advantage="gae", policy_loss="gspo"), "loss.policy_loss")):
    with pytest.raises(ValueError, match=message):
      LossConfig(**fields)
  assert LossConfig(advantage="gae", gamma=0.99, lam=0.95).lam == 0.95
  for block, message in (({"value_clip": -1.0}, "critic.value_clip: expected a clip range"),
                         ({"optimizer": {"lr": 0.0}}, "critic.optimizer.lr: expected > 0"),
                         ({"lr": 1e-5}, r"critic: unknown fields \['lr'\]"),
                         ({"warmup_steps": 10}, r"critic.warmup_steps: expected an int from 0 "
                          r"to rl.steps - 1 \(9\)"),
                         ({"warmup_steps": -1}, "critic.warmup_steps"),
                         ({"warmup_steps": 1.5}, "critic.warmup_steps")):
    with pytest.raises(ValueError, match=message):
      check_critic_config(block, 10)
  # A flag cannot give None (ml_collections reads a float field's "None" as an error): inf
  # is unclipped too.
  assert check_critic_config({"value_clip": float("inf")}, 10)["value_clip"] is None
  assert check_critic_config({"value_clip": None}, 10)["value_clip"] is None
  assert check_critic_config({"value_clip": 0.2}, 10)["value_clip"] == 0.2


CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)


def _packed_batch(rows=4, n=2, p=5, r=4, seed=0):
  rng = np.random.default_rng(seed)
  return {"prompt_tokens": jnp.asarray(rng.integers(1, 32, (rows, p)), jnp.int32),
          "prompt_lens": jnp.asarray(rng.integers(2, p + 1, rows), jnp.int32),
          "response_tokens": jnp.asarray(rng.integers(1, 32, (rows, n, r)), jnp.int32),
          "response_lens": jnp.asarray(rng.integers(1, r + 1, (rows, n)), jnp.int32),
          "sample_mask": jnp.ones((rows, n), jnp.float32),
          "rewards": jnp.asarray(rng.choice([0.0, 1.0], (rows, n)), jnp.float32),
          "row_group": jnp.arange(rows, dtype=jnp.int32),
          "values": jnp.asarray(rng.normal(0, 0.5, (rows, n, r)), jnp.float32),
          "returns": jnp.asarray(rng.normal(0.5, 0.5, (rows, n, r)), jnp.float32)}


def _one_device():
  return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def _each_alone(batch, width=9):
  """Each (prompt, response) of a _packed_batch alone, right-padded to `width` (causal:
  padding after a position changes nothing before it): tokens [rows * N, width] and each
  one's (row, sample, prompt length, response length)."""
  rows, n = batch["response_lens"].shape
  seqs, spans = np.zeros((rows * n, width), np.int32), []
  for row in range(rows):
    p = int(batch["prompt_lens"][row])
    for i in range(n):
      k = int(batch["response_lens"][row, i])
      seqs[len(spans), :p + k] = np.concatenate([batch["prompt_tokens"][row, :p],
                                                 batch["response_tokens"][row, i, :k]])
      spans.append((row, i, p, k))
  return seqs, spans


def test_packed_values_are_each_responses_own_forward():
  """One packed row per group (the prompt once) gives each response token the value of the
  state before it, as running prompt + that response alone would."""
  model = ValueModel(critic_config(CONFIG), rngs=nnx.Rngs(0))
  model.value_head[...] = jax.random.normal(jax.random.key(1), (16,))
  batch = _packed_batch()
  values = jax.jit(packed_values)(model, batch)
  seqs, spans = _each_alone(batch)  # in one forward
  alone = jax.jit(lambda m, s: m.values(m.body.hidden_states(s)[0]))(model, seqs)
  for j, (row, i, p, k) in enumerate(spans):
    np.testing.assert_allclose(values[row, i, :k], alone[j, p - 1:p + k - 1], atol=1e-5)
    assert not np.asarray(values[row, i, k:]).any()


def test_a_micro_batched_critic_update_equals_the_whole_batchs(tmp_path):
  """rl.micro_batches slices of rows give the whole batch's loss and gradient (each slice's
  share of the token mean), so the critic steps alike; it starts from the policy's body
  with a zero head, and its step moves its values toward the returns."""
  from rlax_ps.models import Transformer
  mesh = _one_device()
  policy = nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(3)), nnx.Param).to_pure_dict()
  block = {"optimizer": {"lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0}, "value_clip": 0.2}
  batch = _packed_batch(seed=1)
  critics = [Critic(CONFIG, block, mesh, total_steps=4, loss_cfg=LossConfig(advantage="gae"),
                    policy_graphdef=None, micro_batches=m) for m in (1, 2)]
  for critic in critics:
    critic.start(policy)
  body = critics[0].state.params["body"]
  np.testing.assert_array_equal(body["embed"]["embedding"], policy["embed"]["embedding"])
  assert "lm_head" in policy and "lm_head" not in body
  assert not np.asarray(critics[0].state.params["value_head"]).any()
  metrics = [critic.update(batch, policy) for critic in critics]
  for k in ("vf_loss", "vf_clipfrac", "critic_grad_norm"):
    np.testing.assert_allclose(metrics[0][k], metrics[1][k], rtol=1e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               critics[0].state.params, critics[1].state.params)
  # Its values, 0 before the step (a zero head), moved toward the returns.
  values, *_ = critics[0].targets(batch, policy, None)
  tokens = np.arange(4)[None, None, :] < np.asarray(batch["response_lens"])[..., None]
  returns = np.asarray(batch["returns"])
  assert (np.mean((np.asarray(values) - returns)[tokens] ** 2)
          < np.mean(returns[tokens] ** 2))


@pytest.mark.slow  # ~8 s
def test_a_lora_policys_critic_trains_its_own_adapters_and_head_over_the_policys_weights():
  """A LoRA policy's critic holds its adapters and value head alone (no copy of the frozen
  weights, whose values it reads from the policy's params at each call); both train, and
  the policy's params are left as they were."""
  from rlax_ps.models import Transformer
  from rlax_ps.train.critic import value_model
  config = CONFIG.replace(lora_rank=2, lora_alpha=4.0)
  mesh = _one_device()
  policy = nnx.state(Transformer(config, rngs=nnx.Rngs(3)), nnx.Param).to_pure_dict()
  policy = jax.tree_util.tree_map_with_path(  # trained adapters: B no longer zero
      lambda path, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(path) else x, policy)
  kept = jax.tree.map(np.asarray, policy)
  critic = Critic(config, {"optimizer": {"lr": 1e-2, "warmup_steps": 0}}, mesh, total_steps=4,
                  loss_cfg=LossConfig(advantage="gae"), policy_graphdef=None)
  critic.start(policy)
  assert critic.layout == "adapters"
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      critic.state.params["body"])}
  assert names and all("lora_" in n for n in names), names  # no frozen weight copied
  start = jax.tree.map(np.asarray, critic.state.params)
  jax.tree.map(np.testing.assert_array_equal, start["body"],  # the policy's adapters
               split_as(kept, start["body"])[0])
  batch = _packed_batch(seed=1)
  critic.update(batch, policy)
  critic.update(batch, policy)
  after = critic.state.params
  assert np.asarray(after["value_head"]).any()  # its head trains
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), after["body"],
                       start["body"])
  assert all(jax.tree.leaves(moved)), moved  # and every adapter
  jax.tree.map(np.testing.assert_array_equal, kept, jax.tree.map(np.asarray, policy))
  # Its values are its adapters' and head's over the policy's frozen weights.
  values, *_ = critic.targets(batch, policy, None)
  frozen = {k: v for k, v in split_trainable(policy)[1].items() if k != "lm_head"}
  model = value_model(critic.graphdef, jax.tree.map(np.asarray, after), frozen)
  np.testing.assert_allclose(values, jax.jit(packed_values)(model, batch), atol=1e-5)
  assert np.asarray(values).any()


HF = os.path.join(REPO, "tests", "fixtures", "hf")


@pytest.mark.slow  # ~25 s
def test_a_critic_from_a_reward_model_values_each_state_as_it_scores_it(tmp_path):
  """critic.init_from_hf naming a reward model: its body and its score head are the
  critic's, so each state's value is the reward model's score of the sequence up to it."""
  from rlax_ps.models.reward_model import load_reward_model
  from rlax_ps.tokenizers import CharTokenizer
  rm = os.path.join(HF, "qwen3_reward")
  mesh = _one_device()
  critic = Critic(CONFIG.replace(vocab_size=99), {"init_from_hf": rm}, mesh, total_steps=4,
                  loss_cfg=LossConfig(advantage="gae"), policy_graphdef=None,
                  tokenizer=CharTokenizer())
  critic.start(policy_params=None)
  assert critic.layout == "full" and critic.config.hidden_size == 32
  batch = _packed_batch(seed=2)
  values, *_ = critic.targets(batch, None, None)
  # Each (prompt, response) alone, scored by the reward model where its first and last
  # values lie.
  score = nnx.jit(lambda m, s, last: m(s, last)[:, 0])
  seqs, spans = _each_alone(batch)
  first, last = [p - 1 for _, _, p, _ in spans], [p + k - 2 for _, _, p, k in spans]
  at = [(row, i, k) for row, i, _, k in spans]
  model = load_reward_model(rm, "float32")
  firsts, lasts = (np.asarray(score(model, seqs, np.asarray(x))) for x in (first, last))
  for j, (row, i, k) in enumerate(at):
    np.testing.assert_allclose(np.asarray(values)[row, i, [0, k - 1]], [firsts[j], lasts[j]],
                               atol=1e-4)
  # A LoRA policy's: fresh adapters (B = 0: the same values) and the score head over the
  # reward model's weights, held frozen beside its state; its update moves those two alone,
  # and a restart reads the weights from the folder again.
  lora = CONFIG.replace(vocab_size=99, lora_rank=2, lora_alpha=4.0)
  make = lambda: Critic(lora, {"init_from_hf": rm, "optimizer": {"lr": 1e-2}}, mesh,  # noqa
                        total_steps=4, loss_cfg=LossConfig(advantage="gae"),
                        policy_graphdef=None, tokenizer=CharTokenizer())
  critic = make()
  critic.start(policy_params=None)
  assert critic.layout == "adapters over init_from_hf"
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      critic.state.params["body"])]
  assert names and all("lora_" in n for n in names), names  # no weight of the model's
  np.testing.assert_allclose(critic.targets(batch, None, None)[0], values, atol=1e-5)
  frozen = nnx.state(model.body, nnx.Param).to_pure_dict()
  start = jax.tree.map(np.asarray, critic.state.params)
  critic.update({**batch, "values": values}, None)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), critic.state.params,
                       start)
  assert all(jax.tree.leaves(moved["body"])) and moved["value_head"], moved
  jax.tree.map(np.testing.assert_array_equal, critic.base(None), frozen)
  trained = critic.targets(batch, None, None)[0]
  assert not np.allclose(trained, values, atol=1e-4)
  again = make()
  again.start(policy_params=None, restored=critic.state.to_tree())
  np.testing.assert_allclose(again.targets(batch, None, None)[0], trained, atol=1e-6)
  # A causal LM's body, without its LM head, and a zero value head.
  from types import SimpleNamespace
  from rlax_ps.models import load_hf_checkpoint
  lm = os.path.join(HF, "qwen3")
  critic = Critic(CONFIG, {"init_from_hf": lm}, mesh, total_steps=4,
                  loss_cfg=LossConfig(advantage="gae"), policy_graphdef=None,
                  tokenizer=SimpleNamespace(vocab_size=64))
  critic.start(policy_params=None)
  source = nnx.state(load_hf_checkpoint(lm), nnx.Param).to_pure_dict()
  assert "lm_head" in source and "lm_head" not in critic.state.params["body"]
  np.testing.assert_array_equal(critic.state.params["body"]["embed"]["embedding"],
                                source["embed"]["embedding"])
  assert not np.asarray(critic.state.params["value_head"]).any()


def test_a_critic_source_must_read_the_policys_ids(tmp_path):
  """A critic.init_from_hf folder whose vocabulary or shipped tokenizer is not the policy's
  is refused, naming the field; one shipping the policy's tokenizer is taken."""
  from types import SimpleNamespace
  from rlax_ps.tokenizers import CharTokenizer
  rm, tok = tmp_path / "rm", CharTokenizer()
  shutil.copytree(os.path.join(HF, "qwen3_reward"), rm)
  with pytest.raises(ValueError, match="critic.init_from_hf: .* has vocab_size 336, smaller "
                     "than the policy tokenizer's 1000"):
    check_critic_source(str(rm), SimpleNamespace(vocab_size=1000))
  shutil.copy(os.path.join(HF, "chat_tokenizer", "tokenizer.json"), rm)
  with pytest.raises(ValueError, match="critic.init_from_hf: .* ships a tokenizer that "
                     "encodes text otherwise than the policy's"):
    check_critic_source(str(rm), tok)
  tok.save(str(rm))
  assert check_critic_source(str(rm), tok).hidden_size == 32
  with pytest.raises(ValueError, match="critic.init_from_hf: no config.json"):
    check_critic_source(str(tmp_path), tok)
  with pytest.raises(ValueError, match="critic.init_from_hf: expected an HF checkpoint"):
    check_critic_config({"init_from_hf": 3}, 10)
  # A reward model of two labels has no one value head.
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(rm / "model.safetensors"))
  save_file({**tensors, "score.weight": np.tile(tensors["score.weight"], (2, 1))},
            str(rm / "model.safetensors"))
  mesh = _one_device()
  critic = Critic(CONFIG.replace(vocab_size=99), {"init_from_hf": str(rm)}, mesh,
                  total_steps=4, loss_cfg=LossConfig(advantage="gae"), policy_graphdef=None,
                  tokenizer=tok)
  with pytest.raises(ValueError, match="critic.init_from_hf: .* a reward model of 2 labels; "
                     "a critic's value head takes one"):
    critic.start(policy_params=None)


@pytest.mark.slow  # ~25 s; the critic's update is checked by the micro-batch test above
def test_the_trainer_trains_a_critic_beside_the_policy_and_resumes_it(tmp_path, monkeypatch,
                                                                      caplog):
  """configs/rl_ppo.py's GAE run, LoRA, with verl's KL in the reward: each step's line
  carries the critic's loss, its state is checkpointed, and a restart restores it (not the
  policy's weights again). A LoRA run's critic is adapters over the policy's weights, read
  from each step's new policy state; its targets run the reference, once a step.
  critic.warmup_steps' first steps train the critic alone, publishing nothing."""
  from rlax_ps.train import critic as critic_module, rl, rl_loss
  from rlax_ps.train.rl import RLTrainer
  runs, real = [], rl_loss.reference_logprobs

  def counted(*args, **kwargs):  # the reference's forward, counted as it runs
    jax.debug.callback(lambda: runs.append(1))
    return real(*args, **kwargs)

  for module in (critic_module, rl, rl_loss):
    monkeypatch.setattr(module, "reference_logprobs", counted)
  config = rl_config("tiny", "configs/rl_ppo.py")
  config.critic.warmup_steps = 1
  config.model.lora_rank, config.model.lora_alpha = 4, 8.0
  save_warm_start(tmp_path / "warm")
  config.init_from_hf, config.loss.kl_in_reward = str(tmp_path / "warm"), 0.05
  config.eval.num_examples = 0  # no held-out evaluation: its decoding is not what is tested
  config.rl.steps, config.checkpoint.every_steps = 2, 1
  config.critic.optimizer.min_lr_ratio = 0.1  # a decaying schedule: its horizon resumes
  config.worker.max_new_tokens, config.export.hf = 8, False
  with fake_fleet(tmp_path) as (tc, _):
    with RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      scalars, add = {}, tr.writer.add_scalar
      tr.writer.add_scalar = lambda k, v, step: (scalars.__setitem__((k, step), v),
                                                 add(k, v, step))[1]
      tr.train()
      # The policy's logged lr: its optimizer's, which counts the policy's own updates.
      assert ("train/lr", 1) not in scalars
      assert scalars[("train/lr", 2)] == pytest.approx(float(tr.schedule(0)))
      saved = jax.tree.map(np.asarray, tr.critic.state.params)
      assert int(tr.critic.state.step) == 2 and tr.critic.layout == "adapters"
      # Its programs were compiled ahead for the batch's shape, as the policy's step.
      assert tr.precompiled_critic_steps == 2 and tr.precompiled_steps == 1
      assert tr.version == 1  # a publication a policy step (and one at the start)
      jax.effects_barrier()  # once a step, in the critic's targets: the policy's takes those
      assert len(runs) == 2
      first = dict(tr.critic.schedule_settings)
    config.rl.steps = 3
    with RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
      assert int(tr.critic.state.step) == 2
      # rl.steps raised: the critic's lr goes on down its curve, as the policy's does
      assert tr.critic.schedule_settings == first and first["decay_steps"] == 2
      jax.tree.map(np.testing.assert_array_equal, saved,
                   jax.tree.map(np.asarray, tr.critic.state.params))
      assert np.asarray(saved["value_head"]).any()  # trained, not the fresh zero head
    # A checkpoint whose critic is laid out otherwise (full, as LoRA runs' were before):
    # refused, naming both.
    meta = glob.glob(str(tmp_path / "rl" / "**" / "2" / "metadata" / "*"), recursive=True)
    record = json.load(open(meta[0]))
    assert record["critic"] == "adapters"
    json.dump({**record, "critic": True}, open(meta[0], "w"))
    with pytest.raises(ValueError, match="holds a critic of layout 'full', this run's is "
                       "'adapters'"):
      RLTrainer(config, str(tmp_path / "rl"), tc)
    # critic.init_from_hf: the reward model's head, adapters over its body.
    config.critic.init_from_hf = os.path.join(HF, "qwen3_reward")
    with RLTrainer(config, str(tmp_path / "from_rm"), tc) as tr:
      head = np.asarray(tr.critic.state.params["value_head"])
      assert head.shape == (32,) and head.any()
      assert tr.critic.layout == "adapters over init_from_hf"
      tr.save()
      tr.checkpointer.wait()
    # Resumed over another critic.init_from_hf (a copy: its path alone differs): the adapters
    # resume over weights they were not trained over, which is said.
    other = shutil.copytree(config.critic.init_from_hf, tmp_path / "other_rm")
    config.critic.init_from_hf = str(other)
    with caplog.at_level(logging.WARNING), RLTrainer(config, str(tmp_path / "from_rm"), tc):
      assert re.search(r"critic.init_from_hf: '.*qwen3_reward' in the checkpoint \(step 0\), "
                       r"'.*other_rm' now: the critic's adapters and value head resume over",
                       caplog.text)
    config.critic.init_from_hf = ""
    config.loss.advantage = "grpo"  # its checkpoints hold a critic a GRPO run would drop
    with pytest.raises(ValueError, match="loss.advantage: the checkpoint in .* holds a critic"):
      RLTrainer(config, str(tmp_path / "rl"), tc)
  lines = [json.loads(line) for line in open(tmp_path / "rl" / "steps.jsonl")]
  assert [r["step"] for r in lines] == [1, 2]
  assert all(r["vf_loss"] > 0 and "value_explained_var" in r for r in lines)
  assert [r["loss"] is None for r in lines] == [True, False]  # step 1: the critic's alone
  assert ["sync_bytes" in r for r in lines] == [False, True]
  assert "reward_kl" in lines[1]


def test_a_resumed_critic_run_keeps_its_reference_warm_start_and_due_round(tmp_path):
  """Restarts of a GAE run with a KL reference: the restored critic counted as a mixed
  reference, so each later checkpoint carried the reference and later restarts read it from
  there, not from init_from_hf. A run resumed past step 0 with no warm-start figure took a
  later step's held-out figure for it; and eval.on_workers' round due at the next
  publication was not saved, so a restart before it dropped the round."""
  from rlax_ps.train.rl import RLTrainer
  from rlax_ps.train.state import hf_params
  config = rl_config("tiny", "configs/rl_ppo.py")
  config.eval.num_examples = 0  # (the first run: no held-out set)
  config.loss.kl_coef = 0.1
  for name, seed in (("a", 3), ("b", 4)):
    save_warm_start(tmp_path / name, seed=seed)
  config.init_from_hf = str(tmp_path / "a")
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    assert tr.ref_params is not None and not tr.mixed_reference
    tr.state = tr.state.replace(step=tr.state.step + 1)
    tr.save()
    tr.checkpointer.wait()
  config.eval.num_examples = 4
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    assert not tr.mixed_reference and not tr.metadata()["mixed_reference"]
    assert tr.heldout.size and tr.step == 1
    tr.evaluate = lambda: pytest.fail("a step-1 figure evaluated as the warm start's")
    tr._evaluate_warm_start()
    assert tr.warm_start_eval is None
    tr._round_due = True  # (as a round due at step 2 under rl.publish_every=2 leaves it)
    tr.state = tr.state.replace(step=tr.state.step + 1)
    tr.save()
    tr.checkpointer.wait()
  config.init_from_hf, config.eval.on_workers = str(tmp_path / "b"), True
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    assert tr._round_due
    leaf = lambda tree: np.asarray(jax.tree.leaves(tree)[0])
    np.testing.assert_array_equal(
        leaf(tr.ref_params), leaf(hf_params(tr.model_config, tr.mesh, str(tmp_path / "b"))))


def test_the_critics_clipping_turned_on_or_off_on_resume_is_refused_naming_it(tmp_path):
  """The critic's optimizer gains or loses a part as the policy's does: its restore failed
  deep in orbax, naming no field."""
  from rlax_ps.train.rl import RLTrainer
  config = rl_config("tiny", "configs/rl_ppo.py")
  config.eval.num_examples = 0
  with RLTrainer(config, str(tmp_path / "rl"), object()) as tr:
    tr.save()
    tr.checkpointer.wait()
  config.critic.optimizer.clip_norm = 0.0
  with pytest.raises(ValueError, match=r"critic.optimizer.clip_norm: 1.0 in the checkpoint at "
                                       r"step 0, 0.0 now: clipping turned off"):
    RLTrainer(config, str(tmp_path / "rl"), object())


def test_value_explained_var_is_one_less_the_residuals_share_of_the_returns_variance():
  returns = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
  values = np.array([[1.5, 1.5, 3.5, 3.5]], np.float32)
  batch = {"response_tokens": jnp.zeros((1, 1, 4), jnp.int32), "response_lens": jnp.array([[4]]),
           "sample_mask": jnp.ones((1, 1)), "values": jnp.asarray(values)[None],
           "returns": jnp.asarray(returns)[None]}
  stats = value_stats(batch)
  np.testing.assert_allclose(float(stats["value_explained_var"]), 1 - 0.25 / 1.25, rtol=1e-5)
  np.testing.assert_allclose(float(stats["value_mean"]), values.mean(), rtol=1e-6)
