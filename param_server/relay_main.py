"""`rlax-ps relay`: a weight relay for a group of workers, in front of the parameter server.

  rlax-ps relay --address=SERVER:50051 --token_file=tokens.json --host=0.0.0.0 --port=50052

It pulls each version from the server once and serves the workers' pulls itself; their other
calls pass through. Workers behind it run `rlax-ps worker --address=RELAY:50052` with the
same worker token (the relay's own, from --token, $RLAX_PS_WORKER_TOKEN or --token_file).
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app, flags, logging

from param_server import connect_flags
from param_server.auth import check_tls_files
from param_server.relay import RelayConfig, UpstreamRefused, WeightRelay
from param_server.signals import wait_for_stop
from rlax_ps.dataclass_flags import define_flags, resolve

flags.adopt_module_key_flags(connect_flags)
define_flags(RelayConfig)
for _field in dataclasses.fields(RelayConfig):  # listed by `rlax-ps relay --help`
  flags.declare_key_flag(_field.name)


def main(argv) -> None:
  try:
    config = resolve(RelayConfig, None, "relay settings")
    check_tls_files(config.tls_cert, config.tls_key)
    token = connect_flags.token_for("worker", connect_flags.TOKEN.value,
                                    connect_flags.TOKEN_FILE.value)
  except (ValueError, TypeError, OSError) as e:
    raise app.UsageError(str(e)) from None
  if not token:
    raise app.UsageError("a worker token: --token, $RLAX_PS_WORKER_TOKEN or --token_file")
  try:
    relay = WeightRelay(config, connect_flags.connect("worker"), token).start()
  except UpstreamRefused as e:
    print(f"rlax-ps relay: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  except OSError as e:  # a read-only, full or misnamed folder
    print(f"rlax-ps relay: --storage_dir {config.storage_dir}: cannot use it: {e}",
          file=sys.stderr, flush=True)
    sys.exit(1)
  print(f"weight relay listening on {relay.address}, following {relay.upstream.address}",
        flush=True)
  if relay.metrics_port is not None:
    print(f"metrics on http://{config.host}:{relay.metrics_port}/metrics", flush=True)
  wait_for_stop()
  logging.info("relay: shutting down (%d updates fetched, %d bytes served)", relay.fetches,
               relay.servicer.bytes_served)
  relay.stop(grace=2.0)
