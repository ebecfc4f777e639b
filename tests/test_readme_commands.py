"""What README.md and benchmarks/README.md tell a user to type exists as the code spells it:
each `rlax-ps` subcommand, config field, file, client credential and benchmark flag."""

import glob
import os
import re
import subprocess
import sys

import pytest

from rlax_ps.cli import SUBCOMMANDS
from rlax_ps.config_files import load

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()
BENCH_README = open(os.path.join(REPO, "benchmarks", "README.md")).read()
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
CLIENTS = ("train", "worker", "status", "relay")  # subcommands that call a server


def code_of(markdown: str) -> list[str]:
  """The fenced blocks and the inline code spans, with `\\`-continued lines joined."""
  fenced = re.findall(r"^```[a-z]*\n(.*?)^```", markdown, re.S | re.M)
  prose = re.sub(r"^```[a-z]*\n.*?^```", "", markdown, flags=re.S | re.M)
  spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose)]
  return [block.replace("\\\n", " ") for block in fenced] + spans


def commands(markdown: str) -> list[tuple[str, str]]:
  """(subcommand, its arguments) of every `rlax-ps SUB ...` in the code, one per line."""
  found = []
  for code in code_of(markdown):
    for m in re.finditer(r"rlax-ps\s+([a-z]+)([^\n#]*)", code):
      found.append((m.group(1), m.group(2)))
  return found


def has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def test_every_rlax_ps_subcommand_the_readme_names_exists():
  named = {sub for sub, _ in commands(README)}
  assert {"local", "eval", "serve", "train", "worker", "status", "relay", "sft"} <= named
  assert named <= set(SUBCOMMANDS), named - set(SUBCOMMANDS)


def test_every_config_field_the_readme_names_exists():
  """A `--config.a.b=` override exists in the config its command loads; a field named in
  prose (`rl.max_staleness`) exists in some recipe."""
  recipes = {os.path.relpath(p, REPO): load(p) for p in CONFIGS}
  sections = set(recipes["configs/rl_local.py"].keys())
  for _, args in commands(README):
    name = re.search(r"--config=(configs/\w+\.py)", args)
    config = recipes.get(name.group(1)) if name else recipes["configs/rl_local.py"]
    for field in re.findall(r"--config\.([\w.]+)=", args):
      assert has_field(config, field), f"--config.{field} ({name and name.group(1)})"
  prose = {m for code in code_of(README)
           for m in re.findall(r"^(?:--config\.)?([a-z_]+\.[\w.]+?)(?:=.*)?$", code)}
  named = {f for f in prose if f.split(".")[0] in sections} | set(
      re.findall(r"--config\.([\w.]+)=", README))
  assert len(named) > 40, sorted(named)
  missing = [f for f in sorted(named) if not any(has_field(c, f) for c in recipes.values())]
  assert not missing, missing


def test_every_file_the_readmes_name_exists():
  paths = set()
  for text in (README, BENCH_README):
    paths |= set(re.findall(
        r"(?<![\w/.~])((?:configs|benchmarks|tpu_scripts|k8s|notebooks|param_server|"
        r"algorithms|rlax_ps|inference_workers|tests)/[\w./-]*\w)", text))
  table = README.split("## Benchmarks")[1].split("\n## ")[0]
  paths |= {f"benchmarks/{n}" for n in re.findall(r"^\| `(\w+\.py)", table, re.M)}
  tpu = README.split("## TPU VMs")[1].split("\n## ")[0]
  paths |= {f"tpu_scripts/{n}" for n in re.findall(r"`(?:tpu_scripts/)?(\w+\.sh)\b", tpu)}
  assert len(paths) > 30, sorted(paths)
  missing = sorted(p for p in paths if not os.path.exists(os.path.join(REPO, p))
                   and not p.endswith("/NAME"))  # a placeholder
  assert not missing, missing


def test_every_client_command_in_the_readme_names_a_token():
  """The server always wants a token: a client command without one stops at its start."""
  clients = [(sub, args) for sub, args in commands(README)
             if sub in CLIENTS and "--address=" in args]
  assert {sub for sub, _ in clients} == set(CLIENTS)
  for sub, args in clients:
    assert re.search(r"--token(_file)?=", args), f"rlax-ps {sub}{args}"


def test_every_benchmark_flag_the_benchmarks_readme_names_exists():
  runs = re.findall(r"python benchmarks/(\w+\.py)([^\n]*)", BENCH_README)
  assert len(runs) >= 8
  shared = open(os.path.join(REPO, "benchmarks", "random_model.py")).read()
  for script, args in runs:
    source = open(os.path.join(REPO, "benchmarks", script)).read() + shared
    for flag in re.findall(r"--(\w+)", args):
      assert (f'"--{flag}"' in source or re.search(rf'DEFINE_\w+\(\s*"{flag}"', source)), (
          f"benchmarks/{script} --{flag}")


@pytest.mark.slow
@pytest.mark.parametrize("sub", sorted({s for s, args in commands(README)
                                         if re.search(r"--(\w+)(?![\w.])", args)}))
def test_every_flag_of_a_readme_command_is_its_subcommands(sub):
  """`rlax-ps SUB --helpfull` lists every `--flag` the README gives SUB."""
  named = {flag for s, args in commands(README) if s == sub
           for flag in re.findall(r"--(\w+)(?![\w.])", args)}
  rlax_ps = os.path.join(os.path.dirname(sys.executable), "rlax-ps")
  helpfull = subprocess.run([rlax_ps, sub, "--helpfull"], capture_output=True, text=True,
                            cwd=REPO, timeout=120).stdout
  flags = set(re.findall(r"^\s+--(?:\[no\])?(\w+):", helpfull, re.M)) | {"help", "helpfull"}
  assert named <= flags, sorted(named - flags)
