"""Does the RL loop learn? Held-out accuracy after a fixed wall time of RL, against the same
wall time of more supervised training from the same warm start, and int8 against bf16
publications at the same step count.

    python benchmarks/rl_learning.py                       # 10 min each, seed 0
    python benchmarks/rl_learning.py --minutes 2 --no-int8 # a quick look
    python benchmarks/rl_learning.py --minutes 5 --no-int8 --no-sft --losses=kl_cov,clip_cov
    python benchmarks/rl_learning.py --minutes 5 --no-int8 --no-sft --recipes=rl_gpg,rl_remax
    python benchmarks/rl_learning.py --minutes 5 --no-int8 --distill  # SFT more as teacher

The warm start is the unchanged `rlax-ps sft` default (configs/sft_tiny.py), trained once in
<workdir>/sft. Then, each from that warm start:
  RL bf16   `rlax-ps local --config=configs/rl_local.py` for --minutes of RL wall time;
  RL int8   configs/rl_int8_tis.py for the same number of steps as the bf16 run;
  RL PPO    (--ppo) configs/rl_ppo.py, PPO with a critic, for --minutes of RL wall time;
  RL <loss> (--losses) the bf16 recipe with that loss.policy_loss, for --minutes each;
  RL <recipe> (--recipes) configs/<recipe>.py, for --minutes each;
  SFT more  the SFT run continued (its checkpoint, a longer schedule) for --minutes;
  OPD       (--distill) configs/rl_distill.py for --minutes, the SFT-more model the teacher.
Columns: held-out exact match (greedy; per task and all), pass@1 and pass@8 (T=1),
optimizer steps and wall time; the last line gives the gains over the warm start.
Everything runs on this machine's CPUs (2 cores: about 3 x --minutes plus the warm start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rlax_ps.config_files import load, run_config_changes  # noqa: E402


def run_rl(workdir: str, recipe: str, warm: str, *extra: str) -> dict:
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  cmd = [sys.executable, "-m", "rlax_ps", "local", f"--config={os.path.join(REPO, recipe)}",
         f"--workdir={workdir}", f"--config.init_from_hf={warm}", "--progress=false", *extra]
  print("+", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True, cwd=REPO)
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def run_sft_more(sft_dir: str, workdir: str, seconds: float, pass_k: int) -> dict:
  """The warm start's SFT run continued for `seconds` (checkpoint copied, schedule made long
  enough never to end first), then evaluated like the RL runs."""
  from rlax_ps.train import evaluate as evaluate_lib
  from rlax_ps.train.sft import SFTTrainer
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  shutil.copytree(sft_dir, workdir)
  config = load(os.path.join(REPO, "configs", "sft_tiny.py"))
  config.train.steps = int(config.train.steps) + 100_000
  config.checkpoint.every_steps = 0
  t0 = time.time()
  with SFTTrainer(config, workdir) as trainer:
    start_step = trainer.step  # the warm start's, as restored
    trainer.config.train.log_every = 1_000_000
    while time.time() - t0 < seconds:
      trainer.train(until=trainer.step + 50, progress=False)
    result = trainer.evaluate()
    passes = evaluate_lib.pass_at_k(trainer.graphdef, trainer.state.params, trainer.tokenizer,
                                    trainer.heldout.tasks, trainer.heldout.examples, k=pass_k,
                                    temperature=1.0,
                                    seed=int(config.eval.seed),
                                    batch_size=int(config.eval.batch_size))
    trainer.export_hf()  # <workdir>/hf: the teacher of --distill
    return {"step": trainer.step - start_step, "seconds": time.time() - t0,
            "heldout_exact_match": result, "heldout_pass": passes}


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:5.1f}%"


def table(warm: dict, runs: dict[str, dict], pass_k: int) -> str:
  names = list(runs)
  rows = [["", "warm start"] + names]
  for task in ("addition", "reversal", "all"):
    rows.append([f"exact match {task}", _pct(warm.get(task))] + [
        _pct(runs[n]["heldout_exact_match"].get(task)) for n in names])
  for key in ("pass@1", f"pass@{pass_k}"):
    rows.append([f"{key} (T=1)", "-"] + [_pct(runs[n].get("heldout_pass", {}).get(key))
                                          for n in names])
  rows.append(["optimizer steps", "-"] + [str(runs[n]["step"]) for n in names])
  rows.append(["wall time (s)", "-"] + [f"{runs[n]['seconds']:.0f}" for n in names])
  rows.append(["gain, all (points)", "-"] + [
      f"{100 * (runs[n]['heldout_exact_match']['all'] - warm['all']):+.1f}" for n in names])
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                             enumerate(zip(r, widths))) for r in rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--minutes", type=float, default=10.0, help="RL and SFT wall time each")
  parser.add_argument("--workdir", default=os.path.join(REPO, "runs", "rl_learning"))
  parser.add_argument("--seed", type=int, default=0, help="config seed of the RL runs")
  parser.add_argument("--no-int8", dest="int8", action="store_false",
                      help="skip the int8 run")
  parser.add_argument("--no-sft", dest="sft", action="store_false",
                      help="skip the SFT baseline")
  parser.add_argument("--ppo", action="store_true",
                      help="also PPO with a critic (configs/rl_ppo.py) for --minutes")
  parser.add_argument("--losses", default="", help="comma-separated loss.policy_loss values "
                      "(e.g. kl_cov,clip_cov): the bf16 recipe with each, for --minutes")
  parser.add_argument("--recipes", default="", help="comma-separated recipes of configs/ "
                      "(e.g. rl_gpg,rl_dapo): each for --minutes")
  parser.add_argument("--distill", action="store_true",
                      help="also on-policy distillation (configs/rl_distill.py) for --minutes, "
                      "the SFT-more run's model its teacher (implies the SFT baseline)")
  args = parser.parse_args()
  seconds = 60.0 * args.minutes
  sft_dir = os.path.join(args.workdir, "sft")
  warm = os.path.join(sft_dir, "hf")
  changes = run_config_changes(sft_dir, load(os.path.join(REPO, "configs", "sft_tiny.py")))
  if changes:  # a warm start of another config (an older run's): trained anew
    print(f"warm start in {sft_dir} was trained with another config ({'; '.join(changes[:3])}"
          f"): training it anew", flush=True)
    shutil.rmtree(sft_dir)
  if not os.path.exists(os.path.join(sft_dir, "summary.json")):
    subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py",
                    f"--workdir={sft_dir}", "--progress=false"], check=True, cwd=REPO)
  pass_k = int(load(os.path.join(REPO, "configs", "rl_local.py")).eval.pass_k)
  seed = f"--config.seed={args.seed}"
  runs = {}
  runs["RL bf16"] = run_rl(os.path.join(args.workdir, "rl_bf16"), "configs/rl_local.py", warm,
                           f"--config.rl.max_seconds={seconds}", "--config.rl.steps=1000000",
                           seed)
  if args.int8:
    steps = runs["RL bf16"]["step"]
    runs["RL int8 (same steps)"] = run_rl(
        os.path.join(args.workdir, "rl_int8"), "configs/rl_int8_tis.py", warm,
        "--config.rl.max_seconds=0", f"--config.rl.steps={steps}", seed)
  if args.ppo:
    runs["RL PPO (critic)"] = run_rl(os.path.join(args.workdir, "rl_ppo"), "configs/rl_ppo.py",
                                     warm, f"--config.rl.max_seconds={seconds}",
                                     "--config.rl.steps=1000000", seed)
  for loss in filter(None, args.losses.split(",")):
    runs[f"RL {loss}"] = run_rl(os.path.join(args.workdir, f"rl_{loss}"), "configs/rl_local.py",
                                warm, f"--config.rl.max_seconds={seconds}",
                                "--config.rl.steps=1000000", f"--config.loss.policy_loss={loss}",
                                seed)
  for recipe in filter(None, args.recipes.split(",")):
    runs[f"RL {recipe}"] = run_rl(os.path.join(args.workdir, recipe), f"configs/{recipe}.py",
                                  warm, f"--config.rl.max_seconds={seconds}",
                                  "--config.rl.steps=1000000", seed)
  if args.sft or args.distill:
    runs["SFT more"] = run_sft_more(sft_dir, os.path.join(args.workdir, "sft_more"), seconds,
                                    pass_k)
  if args.distill:
    runs["OPD (SFT more teaches)"] = run_rl(
        os.path.join(args.workdir, "rl_distill"), "configs/rl_distill.py", warm,
        f"--config.rl.max_seconds={seconds}", "--config.rl.steps=1000000", seed,
        f"--config.teacher.path={os.path.join(args.workdir, 'sft_more', 'hf')}")
  print()
  print(f"held-out accuracy after {args.minutes:g} min (2 CPU cores share the server, the "
        f"trainer and the workers); seed {args.seed}")
  print(table(runs["RL bf16"]["warm_start"], runs, pass_k))
  for name in ("RL bf16", "RL int8 (same steps)"):
    if name in runs:
      s = runs[name]["sync"]
      print(f"{name}: sync {s['delta_bytes_mean']:,.0f} B and {s['delta_seconds_mean']:.3f} s "
            f"per delta, keyframe {s['keyframe_bytes']:,} B; {runs[name]['dropped_stale']} "
            f"stale groups dropped")


if __name__ == "__main__":
  main()
