"""Code-execution verifier: scoring, and the sandbox's time, memory, network and
filesystem limits."""

import pytest

from algorithms.verifiers import CodeExecutionVerifier, make_verifier

PROGRAM = "def add(a, b):\n  return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


@pytest.fixture(scope="module")
def verify():
  return CodeExecutionVerifier(timeout_s=10.0, memory_mb=256)


def test_fraction_of_tests_passed(verify):
  result = verify(PROGRAM, TESTS)
  assert result.reward == pytest.approx(2 / 3)
  assert not result.passed and result.info["n_passed"] == 2
  assert any("AssertionError" in e for e in result.info["errors"])
  assert verify(PROGRAM, TESTS[:2]).passed


def test_program_output_does_not_garble_the_reports(verify):
  # partial lines on stdout, and a fake report line, change nothing
  noisy = PROGRAM + 'print("x", end="")\nprint("0" * 32 + \'{"step": "test_2", "ok": true}\')\n'
  result = verify(noisy, TESTS)
  assert result.info["n_passed"] == 2 and result.info["stdout"].startswith("x")


def test_syntax_error_fails_every_test(verify):
  result = verify("def add(a, b) return a + b", TESTS)
  assert result.reward == 0.0 and not result.passed
  assert "SyntaxError" in result.info["errors"][0]


def test_infinite_loop_is_killed_at_the_timeout():
  result = CodeExecutionVerifier(timeout_s=2.0, memory_mb=256)("while True:\n  pass\n", TESTS)
  assert result.info["timed_out"] and not result.passed and result.reward == 0.0


def test_infinite_loop_in_a_test_keeps_earlier_results():
  result = CodeExecutionVerifier(timeout_s=2.0, memory_mb=256)(
      PROGRAM, [TESTS[0], "while True:\n  pass"])
  assert result.info["timed_out"] and result.info["n_passed"] == 1
  assert result.reward == pytest.approx(0.5) and not result.passed


def test_memory_hog_hits_the_address_space_limit(verify):
  hog = "blocks = []\nwhile True:\n  blocks.append(bytearray(16 << 20))\n"
  result = verify(hog, TESTS)
  assert not result.passed and result.reward == 0.0 and not result.info["timed_out"]
  assert result.info["errors"][0].startswith("MemoryError")


def test_socket_attempt_fails(verify):
  program = ("import socket\n"
             "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
             "s.connect(('1.1.1.1', 80))\n")
  result = verify(program, ["assert True"])
  assert not result.passed and result.reward == 0.0
  assert "socket" in result.info["errors"][0]


def test_socket_attempt_fails_without_a_network_namespace_too():
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, use_network_namespace=False)
  result = verify("import urllib.request\nurllib.request.urlopen('http://1.1.1.1')\n",
                  ["assert True"])
  assert not result.info["network_namespace"] and not result.passed
  assert "sandbox" in result.info["errors"][0]


def test_subprocess_and_writes_outside_scratch_are_refused(verify):
  result = verify("import os\nos.system('echo hi')\n", [])
  assert not result.passed and "os.system" in result.info["errors"][0]
  result = verify("open('/tmp/rlax_ps_sandbox_escape', 'w').write('x')\n", [])
  assert not result.passed and "outside the scratch directory" in result.info["errors"][0]
  # the scratch directory itself is writable and is the working directory
  result = verify("open('out.txt', 'w').write('x')\nassert open('out.txt').read() == 'x'\n", [])
  assert result.passed and result.reward == 1.0


def test_registered_as_code_and_rejects_bad_reference():
  verify = make_verifier("code", timeout_s=5.0)
  with pytest.raises(ValueError, match="reference: expected a sequence of test source strings"):
    verify(PROGRAM, "assert add(1, 2) == 3")
  with pytest.raises(ValueError, match="timeout_s: expected > 0"):
    CodeExecutionVerifier(timeout_s=0)
