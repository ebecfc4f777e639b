"""Where a worker's time goes (decoding, waiting for prompts or weights, submitting,
scoring) as its heartbeats report it, `rlax-ps status` and the metrics show it."""

import threading

import grpc
import pytest

from inference_workers.loop import TimeSplit, Worker
from inference_workers.worker_config import WorkerConfig
from param_server.client import ParamServerError
from param_server.metrics import StatsCollector
from param_server.protos import param_server_pb2 as pb
from param_server.status_main import format_stats
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, client, enqueue_addition


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_time_split_counts_each_span_once_as_its_innermost_activity():
  clock = Clock()
  split = TimeSplit(clock)
  split.start()
  clock.now = 1.0
  with split.span("decoding", 0.5):
    clock.now = 2.0
    with split.span("submitting"):
      clock.now = 5.0
    clock.now = 6.0
    assert split.snapshot().decoding_s == 2.0  # an open span counts up to now
  other = threading.Thread(target=lambda: split.span("scoring").__enter__())
  other.start()  # another thread's spans are not the loop's time
  other.join()
  clock.now = 10.0
  t = split.snapshot()
  assert (t.total_s, t.decoding_s, t.submitting_s, t.scoring_s) == (10.0, 2.0, 3.0, 0.0)
  assert t.slot_s == 1.0  # decoding seconds x the share of slots full


def test_a_worker_reports_where_its_time_went(server, versions):
  asked, beats = [], []
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    lease, heartbeat = wc.lease, wc.heartbeat

    def counted_lease(n, *args, **kwargs):
      asked.append(n)
      got = lease(n, *args, **kwargs)
      if len(asked) == 1:  # more prompts come while the first one decodes
        trainer.enqueue_prompts([pb.Prompt(id=f"q{i}", text=f"{i}+{i}=", task="addition",
                                           extra=str(2 * i).encode()) for i in range(5)])
      return got

    def kept_heartbeat(*args, **kwargs):
      beats.append(kwargs.get("time"))
      return heartbeat(*args, **kwargs)

    wc.lease, wc.heartbeat = counted_lease, kept_heartbeat
    config = WorkerConfig(**{**SMALL, "prompts_per_lease": 4, "max_leases": 3,
                             "decode_chunk_steps": 1})
    stats = Worker(wc, CONFIG, TOKENIZER, config).run()
    after = trainer.stats()
  assert asked and stats.groups_submitted + after.prompts_queued == 6
  assert after.prompts_leased == 0
  t = stats.time.snapshot()
  assert t.decoding_s > 0 and 0 < t.slot_s < t.decoding_s  # one slot of two at first
  # (Scoring and submitting groups runs beside decoding; scoring_s counts the decode loop's
  # waits for it, when nothing else is left to do.)
  assert t.waiting_weights_s > 0 and t.submitting_s > 0
  assert sum(getattr(t, a + "_s") for a in ("decoding", "waiting_prompts", "waiting_weights",
                                            "submitting", "scoring")) <= t.total_s
  # Each heartbeat carries the split so far, but the last: the worker is leaving.
  assert len(beats) >= 2 and all(isinstance(b, pb.WorkerTime) for b in beats[:-1])


def test_the_server_keeps_a_heartbeat_time_and_refuses_a_bad_one(server):
  time = pb.WorkerTime(total_s=100.0, decoding_s=60.0, waiting_prompts_s=30.0, slot_s=45.0)
  with client(server, "worker") as wc, client(server, "viewer") as viewer:
    wc.register("w")
    wc.heartbeat(3, 12.5, time=time)
    with pytest.raises(ParamServerError, match=r"time\.waiting_weights_s") as e:
      wc.heartbeat(3, 12.5, time=pb.WorkerTime(total_s=1.0, waiting_weights_s=float("nan")))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    stats = viewer.stats()
  worker, = stats.workers
  assert worker.time == time
  table = format_stats(stats)
  row = next(line for line in table.splitlines() if line.startswith(worker.worker_id))
  assert row.split()[4:8] == ["60%", "75%", "30%", "0%"]  # busy, slots, wait prompts, weights
  metrics = {(m.name, tuple(sorted(s.labels.items()))): s.value
             for m in StatsCollector(lambda: stats).collect() for s in m.samples}
  labels = (("kind", "worker"), ("name", "w"), ("worker_id", worker.worker_id))
  assert metrics[("rlax_ps_worker_seconds", (("activity", "decoding"),) + labels)] == 60.0
  assert metrics[("rlax_ps_worker_seconds", (("activity", "other"),) + labels)] == 10.0
  assert metrics[("rlax_ps_worker_slot_seconds", labels)] == 45.0
