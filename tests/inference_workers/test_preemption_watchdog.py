"""The watchdog turns a metadata-server preemption notice into SIGTERM, then SIGKILL."""

import http.server
import socket
import sys
import threading
import time
import urllib.parse

import pytest

from inference_workers.preemption_watchdog import PreemptionWatchdog, poll_preempted


class FakeMetadata:
  """A local stand-in for GCE's `instance/preempted` endpoint: a plain GET answers at once
  with the value and its ETag; wait_for_change=true waits while the value's ETag is the
  request's last_etag (without one: until the value changes; here a short timeout)."""

  def __init__(self):
    self.preempted = False
    self.requests, self.queries = 0, []
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        outer.requests += 1
        query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        outer.queries.append(query)
        if self.headers.get("Metadata-Flavor") != "Google":
          self.send_response(403)
          self.end_headers()
          return
        if "wait_for_change" in query:
          seen = query.get("last_etag", [None])[0]
          start = outer.etag()
          for _ in range(20):  # a short long-poll (timeout_sec, shortened)
            if outer.etag() != (seen or start):
              break
            time.sleep(0.05)
        body = b"TRUE" if outer.preempted else b"FALSE"
        self.send_response(200)
        self.send_header("ETag", outer.etag())
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        del args

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/preempted"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def etag(self) -> str:
    return "e-true" if self.preempted else "e-false"

  def close(self):
    self.server.shutdown()
    self.server.server_close()


@pytest.fixture
def metadata():
  fake = FakeMetadata()
  yield fake
  fake.close()


CHILD = """
import signal, sys, time
marker = sys.argv[1]
def on_term(*_):
  if sys.argv[2] == "obey":
    open(marker, "w").write("released")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(marker + ".started", "w").write("1")
time.sleep(60)
"""


def _start(watchdog):
  result = {}
  thread = threading.Thread(target=lambda: result.setdefault("rc", watchdog.run()), daemon=True)
  thread.start()
  return thread, result


def _wait_for(path, timeout=20):
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.05)


def test_notice_sends_sigterm_and_child_exits_cleanly(metadata, tmp_path):
  marker = tmp_path / "child"
  watchdog = PreemptionWatchdog([sys.executable, "-c", CHILD, str(marker), "obey"],
                                url=metadata.url, poll_timeout_s=1, grace_s=10)
  thread, result = _start(watchdog)
  _wait_for(tmp_path / "child.started")
  assert not watchdog.preempted.is_set()
  metadata.preempted = True
  thread.join(timeout=20)
  assert result.get("rc") == 0
  assert marker.read_text() == "released"
  assert watchdog.preempted.is_set()
  # Read at once first, then long-polls from the value last read.
  assert metadata.queries[0] == {} and all(q["last_etag"] for q in metadata.queries[1:])


def test_child_ignoring_sigterm_is_killed_after_grace(metadata, tmp_path):
  marker = tmp_path / "child"
  watchdog = PreemptionWatchdog([sys.executable, "-c", CHILD, str(marker), "ignore"],
                                url=metadata.url, poll_timeout_s=1, grace_s=0.5)
  thread, result = _start(watchdog)
  _wait_for(tmp_path / "child.started")
  metadata.preempted = True
  thread.join(timeout=20)
  assert result.get("rc") == -9
  assert not marker.exists()


def test_poll_reports_unreachable_as_none():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  assert poll_preempted(f"http://127.0.0.1:{port}/preempted", timeout_s=1) == (None, None)


def test_poll_reads_state_at_once_then_waits_for_a_change_from_what_it_read(metadata):
  """A notice given between two polls is answered by the next at once: it waits for a value
  other than the one last read (its ETag), not for a change after it asks."""
  assert poll_preempted(metadata.url, timeout_s=1) == (False, "e-false")
  assert metadata.queries[-1] == {}  # read at once
  metadata.preempted = True  # between two polls
  assert poll_preempted(metadata.url, timeout_s=1, etag="e-false") == (True, "e-true")
  assert metadata.queries[-1]["last_etag"] == ["e-false"]


def test_empty_command_is_rejected_by_name():
  with pytest.raises(ValueError, match="command"):
    PreemptionWatchdog([])


def test_cli_forwards_its_own_sigterm_to_the_child(metadata, tmp_path):
  import signal
  import subprocess
  marker = tmp_path / "child"
  proc = subprocess.Popen([sys.executable, "-m", "inference_workers.preemption_watchdog",
                           f"--metadata_url={metadata.url}", "--poll_timeout_s=1", "--",
                           sys.executable, "-c", CHILD, str(marker), "obey"])
  try:
    _wait_for(tmp_path / "child.started")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert marker.read_text() == "released"
  finally:
    proc.kill()


FLAKY = """
import os, signal, sys, time
count = sys.argv[1]
n = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(n))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # a stop that ends in a failure code
if n <= int(sys.argv[2]):
  sys.exit(3)  # a crash
time.sleep(float(sys.argv[3]))
"""


def _flaky(tmp_path, fails, sleep_s, **kwargs):
  return PreemptionWatchdog([sys.executable, "-c", FLAKY, str(tmp_path / "count"), str(fails),
                             str(sleep_s)], url="http://127.0.0.1:9/none",
                            unreachable_backoff_s=0.05, backoff_s=0.05, **kwargs)


def test_with_restart_a_failing_child_is_started_again_until_it_succeeds(tmp_path):
  watchdog = _flaky(tmp_path, fails=2, sleep_s=0, restart=True)
  assert watchdog.run() == 0
  assert watchdog.starts == 3 and (tmp_path / "count").read_text() == "3"


def test_without_restart_the_first_failure_is_the_exit_code(tmp_path):
  watchdog = _flaky(tmp_path, fails=2, sleep_s=0)
  assert watchdog.run() == 3 and watchdog.starts == 1


def test_run_puts_back_the_signal_handlers_it_found(tmp_path):
  # It forwards SIGTERM and SIGINT while its child runs, not for the rest of the process.
  import signal

  def mine(*_):
    return None

  before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    assert _flaky(tmp_path, fails=0, sleep_s=0).run() == 0
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
  finally:
    for sig, handler in before.items():
      signal.signal(sig, handler)


def test_a_stopped_child_is_not_restarted_even_if_it_fails(tmp_path):
  watchdog = _flaky(tmp_path, fails=0, sleep_s=60, restart=True)
  thread, result = _start(watchdog)
  _wait_for(tmp_path / "count")
  time.sleep(0.2)  # its SIGTERM handler is installed
  watchdog.terminate()  # what our own SIGTERM does
  thread.join(20)
  assert result["rc"] == 7 and watchdog.starts == 1


def test_a_preempted_child_is_not_restarted(metadata, tmp_path):
  watchdog = PreemptionWatchdog([sys.executable, "-c", FLAKY, str(tmp_path / "count"), "0", "60"],
                                url=metadata.url, poll_timeout_s=1, restart=True,
                                backoff_s=0.05)
  thread, result = _start(watchdog)
  _wait_for(tmp_path / "count")
  time.sleep(0.2)
  metadata.preempted = True
  thread.join(20)
  assert result["rc"] == 7 and watchdog.starts == 1 and watchdog.preempted.is_set()


def test_a_child_refusing_its_flags_is_not_restarted(tmp_path):
  """Exit status 2 (a bad flag or setting: a typo in a launch script's TRAIN_ARGS) was
  restarted for ever, every VM in a loop of usage errors."""
  watchdog = PreemptionWatchdog([sys.executable, "-c", "import sys; sys.exit(2)"],
                                url="http://127.0.0.1:9/none", unreachable_backoff_s=0.05,
                                backoff_s=0.05, restart=True)
  assert watchdog.run() == 2 and watchdog.starts == 1


def _waits(watchdog, monkeypatch):
  """The restart delays `watchdog` waits, each returned at once (no stop)."""
  waited = []
  monkeypatch.setattr(watchdog.stopping, "wait", lambda s: waited.append(s) or False)
  return waited


def test_restart_delays_double_up_to_their_cap_and_start_over_after_a_long_run(
    tmp_path, monkeypatch):
  """A crash loop waits 1, 2, 4, 4 s (not 8, 16, ...: a spot VM idle for hours); a child
  that ran a while before failing is a new failure, waited for from the start."""
  watchdog = _flaky(tmp_path, fails=4, sleep_s=0, restart=True)
  watchdog.backoff_s, watchdog.max_backoff_s = 1.0, 4.0
  waited = _waits(watchdog, monkeypatch)
  assert watchdog.run() == 0 and watchdog.starts == 5 and waited == [1.0, 2.0, 4.0, 4.0]
  runs = tmp_path / "runs"  # each run fails after 0.5 s, past the 0.4 s cap; the third passes
  runs.mkdir()
  long_runs = PreemptionWatchdog(
      [sys.executable, "-c", "import os, sys, time; time.sleep(0.5); "
       f"n = len(os.listdir({str(runs)!r})); open(os.path.join({str(runs)!r}, "
       "str(n)), 'w').close(); sys.exit(3 if n < 2 else 0)"],
      url="http://127.0.0.1:9/none", unreachable_backoff_s=0.05, backoff_s=0.1,
      max_backoff_s=0.4, restart=True)
  waited = _waits(long_runs, monkeypatch)
  assert long_runs.run() == 0 and waited == [0.1, 0.1]


def test_a_stop_that_comes_before_the_child_starts_stops_it(tmp_path):
  watchdog = _flaky(tmp_path, fails=0, sleep_s=60, restart=True)
  watchdog.stopping.set()  # a SIGTERM while the watchdog was starting the child
  thread, result = _start(watchdog)
  thread.join(20)
  try:
    assert not thread.is_alive() and watchdog.starts == 1 and result["rc"] != 0
  finally:
    if watchdog._child is not None and watchdog._child.poll() is None:
      watchdog._child.kill()
