"""A worker that fails while an environment call hangs (worker.environment_timeout_s 0)
gives its leased prompts back at once and returns its error: the hung call is not waited
for, and the calls queued behind it never run."""

import threading
import time

import pytest

from inference_workers.continuous import ContinuousBatch
from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, ManyStops, client, enqueue_addition


# vigor slow (suite time): [fixed] holds the crash's release of the leases.
@pytest.mark.parametrize("allocator", ["fixed", pytest.param("vigor", marks=pytest.mark.slow)])
def test_a_crash_with_an_environment_call_hung_releases_the_leases_and_returns(
    server, versions, monkeypatch, allocator):
  from algorithms.environments import ENVIRONMENTS, register_environment
  calls, entered, unblock = [], threading.Event(), threading.Event()

  @register_environment("test_hangs")
  def hangs():
    def env(messages, reference):
      calls.append(len(messages))
      entered.set()
      unblock.wait(60)
      return None
    return env

  step = ContinuousBatch.step

  def failing_step(batch):  # the decode loop fails with a call hung and one queued behind it
    out = step(batch)
    if entered.wait(0.5) and len(batch._asking) >= 2:
      raise RuntimeError("a decode chunk failed")
    return out

  monkeypatch.setattr(ContinuousBatch, "step", failing_step)
  try:
    with client(server, "trainer") as trainer, client(server, "worker") as wc:
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
      enqueue_addition(trainer, 2)
      worker = Worker(wc, CONFIG, ManyStops(), WorkerConfig(
          max_leases=1, environment="addition=test_hangs", environment_timeout_s=0,
          environment_threads=1, max_turns=3, allocator=allocator,
          **dict(SMALL, max_new_tokens=24)))
      failed = []

      def run():
        try:
          worker.run()
        except RuntimeError as e:
          failed.append(e)

      runner = threading.Thread(target=run, daemon=True)
      start = time.monotonic()
      runner.start()
      runner.join(30)
      assert not runner.is_alive() and failed, "the worker waited for the hung call"
      assert time.monotonic() - start < 30
      st = trainer.stats()
      assert st.prompts_leased == 0 and st.prompts_queued == 2  # served again, at once
      assert worker.stats.prompts_released == 2
      assert not any(t.name == "worker-heartbeat" for t in threading.enumerate())
      unblock.set()
      time.sleep(0.5)
      assert len(calls) == 1  # the calls queued behind the hung one never ran
  finally:
    unblock.set()
    ENVIRONMENTS.pop("test_hangs")
