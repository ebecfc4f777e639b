"""exit_now: the worker's way out keeps its output and skips interpreter finalization."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from absl import logging
    from rlax_ps.hard_exit import exit_now
    logging.use_absl_handler()
    atexit.register(lambda: print("finalized", flush=True))
    logging.warning("a log line")
    sys.stdout.write("unflushed stdout")   # no newline: still in the buffer
    sys.stderr.write("unflushed stderr")
    exit_now(3)
    print("after exit_now")
    """)


def test_exit_now_flushes_output_and_skips_atexit():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 3, proc.stderr
  assert proc.stdout == "unflushed stdout", proc.stdout
  assert "a log line" in proc.stderr and "unflushed stderr" in proc.stderr
  assert "finalized" not in proc.stdout + proc.stderr
