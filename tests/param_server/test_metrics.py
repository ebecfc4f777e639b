"""Prometheus metrics: with metrics_port set, /metrics serves the numbers GetStats returns,
without a token; off by default; a bad port is refused naming the field."""

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from param_server.metrics import StatsCollector
from param_server.protos import param_server_pb2 as pb
from param_server.server import ServerConfig
from ps_testlib import client_for, publish_chain


def scrape(port: int) -> dict:
  """{(name, labels as sorted items): value} of every sample at /metrics."""
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
    text = r.read().decode()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_report_what_the_stats_say(start_server):
  server = start_server(metrics_port=0)
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker, \
       client_for(server, "viewer") as viewer:
    publish_chain(trainer, 3)
    trainer.enqueue_prompts([pb.Prompt(id=f"p{i}", text="1+1=") for i in range(5)])
    worker_id = worker.register("gpu-7")
    worker.lease(2, 60.0)
    worker.heartbeat(version=2, tokens_per_s=123.5)
    worker.pull(None)
    got, stats = scrape(server.metrics_port), viewer.stats()
  assert got[("rlax_ps_latest_version", ())] == stats.versions.latest_version == 2
  assert got[("rlax_ps_prompts_queued", ())] == stats.prompts_queued == 3
  assert got[("rlax_ps_prompts_leased", ())] == stats.prompts_leased == 2
  assert got[("rlax_ps_bytes_served_total", ())] == stats.bytes_served > 0
  assert got[("rlax_ps_prompts_resumed_total", ())] == stats.prompts_resumed == 0
  assert got[("rlax_ps_tokens_resumed_total", ())] == stats.tokens_resumed == 0
  assert got[("rlax_ps_takes_requeued_total", ())] == stats.takes_requeued == 0
  assert got[("rlax_ps_keyframe_bytes", ())] == stats.versions.keyframe_bytes > 0
  assert got[("rlax_ps_workers_alive", ())] == 1
  assert 0 < got[("rlax_ps_uptime_seconds", ())] <= stats.uptime_s
  labels = (("kind", "worker"), ("name", "gpu-7"), ("worker_id", worker_id))
  assert got[("rlax_ps_worker_version", labels)] == 2
  assert got[("rlax_ps_worker_tokens_per_second", labels)] == 123.5
  server.stop(grace=0)
  with pytest.raises((urllib.error.URLError, ConnectionError)):
    scrape(server.metrics_port)  # stopped with the server


def test_metrics_are_off_by_default_and_a_bad_port_names_the_field(start_server):
  assert start_server().metrics_port is None
  with pytest.raises(ValueError, match="ServerConfig.metrics_port"):
    ServerConfig(metrics_port=-2)


def test_a_relays_heartbeat_is_labelled_apart_from_the_workers():
  """A relay heartbeats as a worker does: its series carry kind="relay", so a fleet's
  tokens per second or count of workers can leave it out."""
  stats = pb.Stats(workers=[pb.WorkerStats(worker_id="w1", name="gpu-7", version=3,
                                           tokens_per_s=100.0),
                            pb.WorkerStats(worker_id="relay@zone-a:50052", name="r", version=3,
                                           kind="relay")])
  speeds = {tuple(sorted(s.labels.items())): s.value
            for family in StatsCollector(lambda: stats).collect()
            if family.name == "rlax_ps_worker_tokens_per_second" for s in family.samples}
  assert speeds == {(("kind", "worker"), ("name", "gpu-7"), ("worker_id", "w1")): 100.0,
                    (("kind", "relay"), ("name", "r"), ("worker_id", "relay@zone-a:50052")): 0.0}


def test_a_metrics_port_taken_leaves_nothing_started(tmp_path):
  """CannotListen, and neither the gRPC port nor the storage folder is held after it: a
  server started again on that folder (another metrics port) serves."""
  import socket

  from param_server.server import CannotListen, ParamServer
  from ps_testlib import small_config
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    config = small_config(storage_dir=tmp_path / "ps", metrics_port=taken.getsockname()[1])
    with pytest.raises(CannotListen, match="--metrics_port"):
      ParamServer(config).start()
  with ParamServer(small_config(storage_dir=tmp_path / "ps", metrics_port=0)) as server:
    assert scrape(server.metrics_port)
