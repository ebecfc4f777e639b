"""The `rlax-ps` command: one console script, one subcommand per job.

Each subcommand lives in its own module that defines its absl flags and a
`main(argv)`; only the chosen module is imported, so flags never collide and
`rlax-ps status` does not pay for importing JAX.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

# Set by `rlax-ps local` in its children's environment: the supervisor's pid.
STOP_WITH_PARENT = "RLAX_PS_STOP_WITH_PARENT"

# name -> (module with main(argv), one-line help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "local": ("rlax_ps.local_main", "the whole RL loop on this machine: server, trainer, workers"),
    "train": ("rlax_ps.train.rl_main", "the RL trainer against a parameter server"),
    "sft": ("rlax_ps.train.sft_main", "supervised warm start on the built-in tasks or your records"),
    "eval": ("rlax_ps.train.eval_main", "held-out accuracy of Hugging Face checkpoints, side by side"),
    "export": ("rlax_ps.train.export_main", "any checkpoint of a run as a Hugging Face checkpoint"),
    "serve": ("param_server.serve_main", "run the parameter server (gRPC)"),
    "relay": ("param_server.relay_main", "a weight relay for a group of workers: each version "
              "crosses from the server once"),
    "status": ("param_server.status_main", "print a parameter server's versions, queues and workers"),
    "worker": ("inference_workers.cli", "run an inference worker: pull weights, lease, sample, submit"),
}


def usage() -> str:
  lines = ["usage: rlax-ps <subcommand> [--flags]", "", "subcommands:"]
  width = max(len(n) for n in SUBCOMMANDS)
  for name, (_, help_text) in sorted(SUBCOMMANDS.items()):
    lines.append(f"  {name:<{width}}  {help_text}")
  lines.append("")
  lines.append("`rlax-ps <subcommand> --help` lists a subcommand's flags.")
  return "\n".join(lines)


_RAN: list[str] = []  # the subcommand this process runs (its module's flags defined once)


def main(argv: list[str] | None = None) -> None:
  """`rlax-ps SUBCOMMAND --flags`, from sys.argv or `argv` (["rlax-ps", "local", ...]: a
  notebook's call in its own process, again and again, of one subcommand: each defines its
  own --config; `local` leaves that process's JAX on the CPU, as its supervisor's is:
  `!rlax-ps local` where the kernel uses the accelerator itself)."""
  if argv is None:
    return _main(list(sys.argv))
  kept = sys.argv
  sys.argv = list(argv)  # ml_collections reads `--config.a.b=` overrides from sys.argv
  try:
    return _main(list(argv))
  finally:
    sys.argv = kept


def _main(argv: list[str]) -> None:
  prog = "rlax-ps"
  parent = os.environ.pop(STOP_WITH_PARENT, "")
  if parent:  # a child of `rlax-ps local`: it stops when its supervisor dies
    from rlax_ps.local import stop_with_parent
    stop_with_parent(int(parent))
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage())
    sys.exit(0 if len(argv) >= 2 else 2)
  name = argv[1]
  if name not in SUBCOMMANDS:
    print(f"rlax-ps: unknown subcommand {name!r}; expected one of "
          f"{', '.join(sorted(SUBCOMMANDS))}\n", file=sys.stderr)
    print(usage(), file=sys.stderr)
    sys.exit(2)
  if _RAN and _RAN[0] != name:
    print(f"{prog} {name}: this process ran `{prog} {_RAN[0]}`; it runs one subcommand (each "
          f"defines its own --config): in a notebook, `!{prog} {name} ...`", file=sys.stderr)
    sys.exit(2)
  _RAN[:] = [name]
  module = importlib.import_module(SUBCOMMANDS[name][0])
  from absl import app, flags  # imported late: keeps `rlax-ps --help` instant.
  _unparse(flags.FLAGS)
  # `rlax-ps <name> --help` shows the subcommand's docstring and its key flags: its own and
  # those it adopts (where to connect, the token, TLS, a config dataclass's settings).
  sys.modules["__main__"].__doc__ = module.__doc__
  for flag in flags.FLAGS.get_key_flags_for_module(module.__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  from rlax_ps.config_files import with_shipped_recipes
  app.run(reporting_errors(module.main, f"{prog} {name}"),
          argv=[f"{prog} {name}"] + with_shipped_recipes(argv[2:], f"{prog} {name}"),
          flags_parser=parse_flags)


def _unparse(flag_values) -> None:
  """A process's second command (a notebook's cell run again) starts from the defaults: the
  last one's values and its `--config.a.b=` override flags (ml_collections defines one per
  override as it parses, and would refuse it defined twice) go."""
  if not flag_values.is_parsed():
    return
  for name in [n for n in flag_values
               if type(flag_values[n]).__name__ == "_ConfigFieldFlag"]:
    delattr(flag_values, name)
  flag_values.unparse_flags()


# Errors a user mends (a token, a token file, a server that refused a call, a storage folder
# or workdir another process holds, a port taken, a fleet that sent nothing to train on):
# one line on stderr and exit status 1, not a traceback. Checked by name, so `rlax-ps --help`
# need not import gRPC: an error of a module never imported cannot have been raised.
USER_ERRORS = (("param_server.client", "ParamServerError"),
               ("param_server.connect_flags", "TokenFileError"),
               ("rlax_ps.folder_lock", "FolderInUse"),
               ("param_server.server", "CannotListen"),
               ("param_server.wal", "DamagedLog"),
               ("rlax_ps.train.rl", "TakeTimeout"))


def _user_error_types() -> tuple[type, ...]:
  return tuple(getattr(sys.modules[m], n) for m, n in USER_ERRORS if m in sys.modules)


def reporting_errors(main_fn, prog: str):
  """`main_fn`, with a usage error (a bad setting, an argument that is no flag) in one line
  as a bad flag is (exit 2), user errors in one line (exit 1), Ctrl-C in one line (exit 130)
  and a closed stdout (`| head`) ending the command quietly, as SIGPIPE would (exit 141)."""
  from absl import app

  def run(argv):
    try:
      if len(argv) > 1:  # every subcommand takes flags alone
        raise app.UsageError(f"unexpected arguments {argv[1:]}; flags are --name=value")
      return main_fn(argv)
    except app.UsageError as e:
      print(f"{prog}: {e}", file=sys.stderr)
      print(f"`{prog} --help` lists the flags.", file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the command's own handlers (a token file
      print(f"{prog}: interrupted", file=sys.stderr, flush=True)  # waited for): no traceback
      sys.exit(130)
    except BrokenPipeError:
      devnull = os.open(os.devnull, os.O_WRONLY)  # nothing left to flush at exit
      os.dup2(devnull, sys.stdout.fileno())
      sys.exit(141)
    except Exception as e:  # noqa: BLE001: re-raised unless a user error
      if not isinstance(e, _user_error_types()):
        if not _multihost():
          raise
        traceback.print_exc()
      else:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
      if _multihost():  # jax.distributed.shutdown would wait 5 minutes for the peers, which
        from rlax_ps.hard_exit import exit_now  # wait for this process in a collective
        exit_now(1)
      sys.exit(1)
  return run


def _multihost() -> bool:
  """Whether this process joined a multi-host job (never imports JAX)."""
  distributed = sys.modules.get("rlax_ps.distributed")
  return distributed is not None and distributed.joined_others()


def _innermost_message(e: BaseException) -> str:
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  return str(e.args[0]) if e.args else str(e)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing that turns every bad flag (including a `--config.a.b=` override of a
  field the config lacks) into one line on stderr and exit status 2, not a traceback."""
  from absl import flags
  try:
    rest = flags.FLAGS(argv)
    message = _unloaded_config_file(flags.FLAGS)
    if not message:
      return rest
  except SystemExit as e:  # absl's --help/--helpfull print usage, then exit 1; help is no error.
    asked = {"-h", "--help", "-?", "--helpshort", "--helpfull", "--helpxml"} & set(argv[1:])
    sys.exit(0 if asked else e.code)
  except flags.Error as e:
    message = _without_traceback(str(e))
  except OSError as e:  # an override of a config file that did not load
    given = [a for a in argv[1:] if a.startswith("--config=")]
    message = f"{given[-1] if given else '--config'}: {_load_failure(e)}"
  except SyntaxError as e:  # a config file (or one it loads) that is not Python
    given = [a for a in argv[1:] if a.startswith("--config=")]
    message = (f"{given[-1] if given else '--config'}: {e.filename}, line {e.lineno}: "
               f"{e.msg}")
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    lines = _innermost_message(e).replace("\\n", "\n").split("\n")
    field = lines[0].strip("'\"")
    message = " ".join(lines)
    culprit = [a for a in argv[1:] if a.startswith("--") and f".{field}" in a.split("=")[0]]
    if culprit:  # ml_collections: a `--config.a.b=` override of a field the config lacks.
      message = f"{culprit[0]}: no such config field {field!r}. " + " ".join(lines[1:])
  print(f"{argv[0]}: bad flags: {message.strip()}", file=sys.stderr)
  print(f"`{argv[0]} --help` lists the flags.", file=sys.stderr)
  sys.exit(2)


def _without_traceback(message: str) -> str:
  """A flag's error with the traceback that ml_collections puts in it (a config file's
  get_config raised) cut to its last line, the error itself."""
  head, trace, rest = message.partition("Traceback (most recent call last):")
  if not trace:
    return message
  last = [line for line in rest.splitlines() if line.strip()][-1]
  return f"{head.split(': Error whilst parsing')[0].strip()}: {last.strip()}"


def _unloaded_config_file(parsed) -> str:
  """'--config=PATH: why' for a config-file flag whose file did not load (ml_collections
  defers that error to the config's first use, deep in a command), else ''."""
  for name in parsed:
    flag = parsed[name]
    if type(flag.value).__name__ != "_ErrorConfig":  # ml_collections' failed config file
      continue
    try:
      flag.value.lock()
    except OSError as e:
      return f"--{name}={getattr(flag, 'config_filename', '')}: {_load_failure(e)}"
  return ""


def _load_failure(error: OSError) -> str:
  """Why ml_collections could not load a config file: the last line of its report (the
  path tried and the error, e.g. no such file)."""
  lines = [line.strip() for line in str(error.__cause__ or error).splitlines() if line.strip()]
  return lines[-1] if lines else str(error)


if __name__ == "__main__":
  main()
