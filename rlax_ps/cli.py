"""The `rlax-ps` command: one console script, one subcommand per job.

Each subcommand lives in its own module that defines its absl flags and a
`main(argv)`; only the chosen module is imported, so flags never collide and
`rlax-ps status` does not pay for importing JAX.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv), one-line help). Later issues add theirs here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("rlax_ps.train.sft_main", "supervised warm start on a built-in task"),
    "serve": ("param_server.serve_main", "run the parameter server (gRPC)"),
    "status": ("param_server.status_main", "print a parameter server's versions, queues and workers"),
}


def usage() -> str:
  lines = ["usage: rlax-ps <subcommand> [--flags]", "", "subcommands:"]
  width = max(len(n) for n in SUBCOMMANDS)
  for name, (_, help_text) in sorted(SUBCOMMANDS.items()):
    lines.append(f"  {name:<{width}}  {help_text}")
  lines.append("")
  lines.append("`rlax-ps <subcommand> --help` lists a subcommand's flags.")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv if argv is None else argv)
  prog = "rlax-ps"
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage())
    sys.exit(0 if len(argv) >= 2 else 2)
  name = argv[1]
  if name not in SUBCOMMANDS:
    print(f"rlax-ps: unknown subcommand {name!r}; expected one of "
          f"{', '.join(sorted(SUBCOMMANDS))}\n", file=sys.stderr)
    print(usage(), file=sys.stderr)
    sys.exit(2)
  module = importlib.import_module(SUBCOMMANDS[name][0])
  from absl import app  # imported late: keeps `rlax-ps --help` instant.
  app.run(module.main, argv=[f"{prog} {name}"] + argv[2:])


if __name__ == "__main__":
  main()
