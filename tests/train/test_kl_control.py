"""loss.kl_target (verl's adaptive KL controller) in a real run: each step applies the
coefficient the last one left, moves it by the step's reward_kl, and a restarted trainer
goes on from the checkpointed coefficient, not loss.kl_in_reward."""

import json

import pytest

from rl_testlib import FakeWorker, client, rl_config, save_warm_start, start_server
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.rl_loss import adapt_kl_coef


@pytest.mark.slow
def test_the_kl_coefficient_adapts_each_step_and_survives_a_restart(tmp_path):
  warm = str(tmp_path / "warm")
  save_warm_start(warm)
  config = rl_config("tiny")
  config.init_from_hf = warm
  config.rl.steps = 2
  config.loss.advantage = "reinforce_pp_baseline"
  config.loss.kl_in_reward, config.loss.kl_estimator = 0.01, "k1"
  config.loss.kl_target, config.loss.kl_horizon = 1e-6, 16
  config.eval.num_examples = config.eval.batch_size = 2
  config.export.hf = False
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  try:
    with client(server.address, "trainer") as tc:
      with RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
        tr.train()
        beta = tr.kl_beta
      steps = [json.loads(line) for line in open(tmp_path / "rl" / "steps.jsonl")]
      cfg = tr.loss_cfg
      want = [0.01]
      for record in steps[:-1]:  # 16 samples a step: horizon 16 moves it by up to 20%
        want.append(adapt_kl_coef(want[-1], record["reward_kl"], 16, cfg))
      assert [s["kl_in_reward"] for s in steps] == pytest.approx(want, rel=1e-9)
      assert beta == pytest.approx(adapt_kl_coef(want[-1], steps[-1]["reward_kl"], 16, cfg))
      assert beta != pytest.approx(0.01)
      with RLTrainer(config, str(tmp_path / "rl"), tc) as again:
        assert again.step == 2 and again.kl_beta == beta
  finally:
    worker.stop()
    server.stop(grace=0)
