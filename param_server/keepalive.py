"""HTTP/2 keepalive for the server's and clients' connections: a peer that vanished without
closing its connection (a preempted VM, a dropped route) is found within seconds, not after
the kernel's ~15 minutes of TCP retransmits. A client's calls on such a connection then fail
UNAVAILABLE and are retried on a new one (a pull had no deadline and hung); the server ends a
vanished worker's streams, freeing their handler threads."""

from __future__ import annotations

DEAD_AFTER_S = 20.0  # a ping unanswered this long closes the connection
LEAST_PING_S = 10.0  # gRPC pings no more often (clients); servers permit half of it


def _ping_ms(dead_after_s: float) -> int:
  """An idle connection is pinged every dead_after_s (at least LEAST_PING_S): a silent peer
  is found within twice dead_after_s."""
  return int(max(LEAST_PING_S, dead_after_s) * 1000)


def client_options(dead_after_s: float = DEAD_AFTER_S) -> list[tuple[str, int]]:
  ms = int(dead_after_s * 1000)
  return [("grpc.keepalive_time_ms", _ping_ms(dead_after_s)),
          ("grpc.keepalive_timeout_ms", ms),
          ("grpc.http2.ping_timeout_ms", ms),  # any ping's answer, not only keepalive's
          ("grpc.keepalive_permit_without_calls", 1),
          ("grpc.http2.max_pings_without_data", 0)]


def server_options(dead_after_s: float = DEAD_AFTER_S) -> list[tuple[str, int]]:
  ms = int(dead_after_s * 1000)
  return [("grpc.keepalive_time_ms", _ping_ms(dead_after_s)),
          ("grpc.keepalive_timeout_ms", ms),
          ("grpc.http2.ping_timeout_ms", ms),
          ("grpc.keepalive_permit_without_calls", 1),
          # Clients' pings as often as they send them are welcome (not answered by GOAWAY).
          ("grpc.http2.min_ping_interval_without_data_ms", int(LEAST_PING_S * 1000) // 2),
          ("grpc.http2.max_pings_without_data", 0)]
