"""`rlax-ps status`: print a parameter server's versions, queues, leases, workers and relays.

  rlax-ps status --address=127.0.0.1:50051 [--token=... | $RLAX_PS_VIEWER_TOKEN | --token_file=runs/ps/tokens.json]
"""

from __future__ import annotations

import sys

from absl import flags

from param_server import connect_flags
from param_server.client import ParamServerError, RetryPolicy
from param_server.protos import param_server_pb2 as pb
from rlax_ps.sizes import human_bytes

flags.adopt_module_key_flags(connect_flags)
_TIMEOUT = flags.DEFINE_float("timeout_s", 10.0, "give up after this long")
flags.register_validator("timeout_s", lambda s: s > 0,
                         "--timeout_s: expected a positive number of seconds")


def time_columns(t: pb.WorkerTime) -> str:
  """A worker's busy, slots, wait prompts and wait weights columns ('-': not reported)."""
  if t.total_s <= 0:
    return f"{'-':>5} {'-':>5} {'-':>12} {'-':>12}"
  share = lambda seconds, of: f"{seconds / of:.0%}" if of > 0 else "-"
  return (f"{share(t.decoding_s, t.total_s):>5} {share(t.slot_s, t.decoding_s):>5} "
          f"{share(t.waiting_prompts_s, t.total_s):>12} "
          f"{share(t.waiting_weights_s, t.total_s):>12}")


def format_stats(s: pb.Stats) -> str:
  """A readable table of one Stats message."""
  v = s.versions
  rows = [
      ("latest version", "none" if v.latest_version < 0 else f"v{v.latest_version} ({v.fmt})"),
      ("keyframe", "none" if v.keyframe_version < 0 else f"v{v.keyframe_version}, {human_bytes(v.keyframe_bytes)}"),
      ("delta chain", f"{human_bytes(v.delta_chain_bytes)}; deltas reach back to v{v.oldest_delta_base}"),
      ("prompts queued", s.prompts_queued),
      ("prompts leased", f"{s.prompts_leased} in {s.leases_active} leases"),
      ("leases expired", s.leases_expired),
      ("prompts resumed", f"{s.prompts_resumed} ({s.samples_resumed} begun samples, "
                           f"{s.tokens_resumed} tokens continued)"),
      ("rollouts ready", s.rollouts_ready),
      ("rollouts in flight", f"{s.rollouts_in_flight} (taken, not acked)"),
      ("takes requeued", f"{s.takes_requeued} (given back unacked: trainer restart or "
                         "ack deadline)"),
      ("rollouts accepted", f"{s.rollouts_accepted} (+{s.rollouts_duplicate} duplicate submissions acked)"),
      ("stale rollouts dropped", s.rollouts_stale_dropped),
      ("bytes served", f"{human_bytes(s.bytes_served)} in {s.pulls_served} pulls "
                       f"({s.pulls_busy} asked to come back: every pull slot busy)"),
      ("streams open", f"{s.streams_open} (pulls and watches now)"),
      ("rejected requests", s.errors),
      ("workers alive", f"{s.workers_alive} of {s.workers_known}"
                        + (f" ({s.workers_unlisted} not listed below: the most recently heard "
                           f"are)" if s.workers_unlisted else "")),
      ("uptime", f"{s.uptime_s:,.0f} s"),
      ("storage id", v.store_id or "-"),  # another one after a restart: a new --storage_dir
  ]
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {val}" for k, val in rows]
  workers = sorted((w for w in s.workers if not w.kind), key=lambda w: w.worker_id)
  relays = sorted((w for w in s.workers if w.kind == "relay"), key=lambda w: w.worker_id)
  if workers:
    lines += ["", f"{'worker':<28} {'version':>7} {'tok/s':>9} {'leases':>6} {'busy':>5} "
                  f"{'slots':>5} {'wait prompts':>12} {'wait weights':>12} {'last seen':>9}"]
    for w in workers:
      lines.append(f"{w.worker_id:<28} {w.version:>7} {w.tokens_per_s:>9.1f} {w.leases:>6} "
                   f"{time_columns(w.time)} {w.seconds_since_heartbeat:>8.1f}s")
    lines += ["(busy: share of its time decoding; slots: of its decode slots full meanwhile; "
              "wait: share asking for prompts, or checking, pulling, applying weights)"]
  if relays:
    lines += ["", f"{'weight relay':<28} {'version':>7} {'behind':>9} {'last seen':>16}"]
    for r in relays:
      behind = max(0, v.latest_version - r.version) if r.version >= 0 else "-"
      lines.append(f"{r.worker_id:<28} {r.version:>7} {behind:>9} "
                   f"{r.seconds_since_heartbeat:>15.1f}s")
  return "\n".join(lines)


def main(argv) -> None:
  with connect_flags.connect("viewer", retry=RetryPolicy(deadline_s=_TIMEOUT.value),
                             timeout_s=_TIMEOUT.value) as client:
    try:
      stats = client.stats()
    except ParamServerError as e:
      print(f"rlax-ps status: {e}", file=sys.stderr)
      sys.exit(1)
    print(f"parameter server {client.address}")
    print(format_stats(stats), flush=True)  # `| head` closing early: a BrokenPipeError here
