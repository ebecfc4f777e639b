"""Prometheus metrics of a running parameter server: what `rlax-ps status` shows, read from
the server's stats at each scrape, for dashboards, alerts and scaling workers on the queue;
and of a weight relay: the version it holds against the server's, what it fetched and served.

`serve_metrics(collector, host, port)` serves them over HTTP (`/metrics`) with
prometheus_client.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from param_server.protos import WORKER_ACTIVITIES
from param_server.protos import param_server_pb2 as pb

PREFIX = "rlax_ps_"
# Stats fields that only grow (counters) and those that go up and down (gauges).
COUNTERS = {
    "rollouts_accepted": "rollout groups accepted",
    "rollouts_duplicate": "duplicate submissions of accepted groups (acknowledged, not kept), since "
                          "this server started",
    "rollouts_stale_dropped": "groups dropped as older than the trainer's staleness floor",
    "leases_expired": "leases that expired, their prompts returned to the queue",
    "prompts_resumed": "prompts leased again with samples a stopped or killed worker began",
    "samples_resumed": "begun samples handed to the next worker to continue",
    "tokens_resumed": "tokens of those samples: decoding not done again",
    "takes_requeued": "trainer takes given back unacknowledged (a restarted trainer's, or "
                      "past their ack deadline), their groups delivered again",
    "bytes_served": "weight bytes sent to pulls",
    "pulls_served": "pulls served",
    "pulls_busy": "pulls refused while every pull slot was taken (max_pulls): flow control",
    "errors": "requests rejected (bad input or auth)",
}
GAUGES = {
    "prompts_queued": "prompts waiting for a lease",
    "prompts_leased": "prompts leased to workers",
    "leases_active": "leases held by workers",
    "rollouts_ready": "groups waiting for the trainer",
    "rollouts_in_flight": "groups taken by the trainer, not yet acknowledged",
    "workers_alive": "workers heard from within three heartbeats",
    "streams_open": "Pull and Watch streams being served",
    "uptime_s": "seconds since the server started",
}
VERSIONS = {
    "latest_version": "newest published version (-1: none)",
    "keyframe_version": "version of the stored keyframe",
    "keyframe_bytes": "bytes of the stored keyframe",
    "delta_chain_bytes": "bytes of the deltas after the keyframe",
}


class StatsCollector:
  """A prometheus_client collector over `stats()`, a function returning a pb.Stats."""

  def __init__(self, stats: Callable[[], pb.Stats]):
    self._stats = stats

  def collect(self) -> Iterator[Metric]:
    s = self._stats()
    for field, help_text in COUNTERS.items():
      yield CounterMetricFamily(PREFIX + field, help_text, value=getattr(s, field))
    for field, help_text in GAUGES.items():  # uptime_s -> rlax_ps_uptime_seconds
      name = field[:-2] + "_seconds" if field.endswith("_s") else field
      yield GaugeMetricFamily(PREFIX + name, help_text, value=getattr(s, field))
    for field, help_text in VERSIONS.items():
      yield GaugeMetricFamily(PREFIX + field, help_text, value=getattr(s.versions, field))
    # kind "worker" or "relay" (a weight relay heartbeats as workers do, generating nothing):
    # a fleet's sum or mean of tokens per second selects kind="worker".
    labels = ["worker_id", "name", "kind"]
    version = GaugeMetricFamily(PREFIX + "worker_version",
                                "version a worker or relay holds (-1: none)", labels=labels)
    speed = GaugeMetricFamily(PREFIX + "worker_tokens_per_second",
                              "a worker's generation speed (tokens per second; relays 0)",
                              labels=labels)
    seen = GaugeMetricFamily(PREFIX + "worker_seconds_since_heartbeat",
                             "seconds since a worker or relay was heard from", labels=labels)
    # Where each worker's time went (rate() of it: the share of a second), by activity;
    # "other" is the rest of its time; slot seconds: decoding weighted by the slots full.
    spent = CounterMetricFamily(PREFIX + "worker_seconds",
                                "seconds of a worker's decode loop, by activity",
                                labels=labels + ["activity"])
    slots = CounterMetricFamily(PREFIX + "worker_slot_seconds",
                                "a worker's decoding seconds times the fraction of its decode "
                                "slots in use", labels=labels)
    for w in s.workers:
      values = [w.worker_id, w.name, w.kind or "worker"]
      version.add_metric(values, w.version)
      speed.add_metric(values, w.tokens_per_s)
      seen.add_metric(values, w.seconds_since_heartbeat)
      if w.HasField("time"):
        t, counted = w.time, 0.0
        for activity in WORKER_ACTIVITIES:
          counted += getattr(t, activity + "_s")
          spent.add_metric(values + [activity], getattr(t, activity + "_s"))
        spent.add_metric(values + ["other"], max(0.0, t.total_s - counted))
        slots.add_metric(values, t.slot_s)
    yield from (version, speed, seen, spent, slots)


class RelayCollector:
  """A weight relay's metrics (`param_server.relay.WeightRelay`), read at each scrape."""

  def __init__(self, relay):
    self._relay = relay

  def collect(self) -> Iterator[Metric]:
    r = self._relay
    yield GaugeMetricFamily(PREFIX + "relay_version", "newest version the relay holds (-1: none)",
                            value=r.weights.latest)
    yield GaugeMetricFamily(PREFIX + "relay_server_version",
                            "newest version the server announced (-1: none)",
                            value=r.server_latest)
    yield CounterMetricFamily(PREFIX + "relay_updates_fetched", "updates pulled from the server",
                              value=r.fetches)
    yield CounterMetricFamily(PREFIX + "relay_bytes_fetched", "weight bytes pulled from the server",
                              value=r.bytes_fetched)
    yield CounterMetricFamily(PREFIX + "relay_bytes_served", "weight bytes sent to pulls",
                              value=r.servicer.bytes_served)
    yield CounterMetricFamily(PREFIX + "relay_pulls_served", "pulls served",
                              value=r.servicer.pulls_served)
    yield CounterMetricFamily(PREFIX + "relay_pulls_cut_through",
                              "pulls served (in part) from an update still arriving",
                              value=r.pulls_cut_through)
    yield CounterMetricFamily(PREFIX + "relay_bytes_resumed",
                              "bytes of broken streams from the server not sent again",
                              value=r.bytes_resumed)


def serve_metrics(collector, host: str, port: int):
  """Serve a collector's metrics (`StatsCollector`, `RelayCollector`) on
  http://host:port/metrics in a daemon thread (port 0 picks a free one); returns the HTTP
  server (`server_port`, `shutdown()`); CannotListen naming the flags when it cannot bind."""
  registry = CollectorRegistry(auto_describe=False)
  registry.register(collector)
  try:
    server, _ = start_http_server(port, addr=host, registry=registry)
  except OSError as e:  # the port is taken, or the host is not this machine's
    from param_server.server import CannotListen
    raise CannotListen(f"--host {host} --metrics_port {port}: cannot serve metrics there "
                       f"({e.strerror or e}); is another server on that port?") from None
  return server
