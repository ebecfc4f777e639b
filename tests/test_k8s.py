"""The Kubernetes manifests in k8s/, rendered by the real `kubectl kustomize`, checked against
the Kubernetes API schemas, and their commands parsed by the real `rlax-ps` flags."""

import atexit
import functools
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import kubernetes_validate
import pytest
import yaml

from child_env import child_env
from param_server import auth
from ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
KUBECTL = shutil.which("kubectl")
OVERLAYS = ["base", "overlays/gke-tpu", "overlays/gke-tpu-multihost"]
SECRET = "rlax-ps-tokens"
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


# A user's overlay that adds components: its resource, then its components in order, relative
# to k8s/.
COMPOSED = {"base+hf-checkpoint": ("base", "components/hf-checkpoint"),
            "gke-tpu+hf-checkpoint": ("overlays/gke-tpu", "components/hf-checkpoint"),
            "gke-tpu+weight-relay": ("overlays/gke-tpu", "components/weight-relay"),
            "base+weight-relay": ("base", "components/weight-relay"),
            "gke-tpu+multihost-workers": ("overlays/gke-tpu", "components/multihost-workers"),
            "gke-tpu-multihost+multihost-workers": ("overlays/gke-tpu-multihost",
                                                    "components/multihost-workers"),
            "gke-tpu+multihost-workers+hf-checkpoint": (
                "overlays/gke-tpu", "components/multihost-workers", "components/hf-checkpoint"),
            "gke-tpu+multihost-workers+weight-relay": (
                "overlays/gke-tpu", "components/multihost-workers", "components/weight-relay"),
            "gke-tpu+weight-relay+multihost-workers": (
                "overlays/gke-tpu", "components/weight-relay", "components/multihost-workers")}
RENDERED = OVERLAYS + list(COMPOSED)
# Each render with multi-host workers -> the same render with the Deployment of workers.
SINGLE_HOST_WORKERS = {"gke-tpu+multihost-workers": "overlays/gke-tpu",
                       "gke-tpu-multihost+multihost-workers": "overlays/gke-tpu-multihost",
                       "gke-tpu+multihost-workers+hf-checkpoint": "gke-tpu+hf-checkpoint",
                       "gke-tpu+multihost-workers+weight-relay": "gke-tpu+weight-relay",
                       "gke-tpu+weight-relay+multihost-workers": "gke-tpu+weight-relay"}


def write_overlay(root: pathlib.Path, k8s: pathlib.Path, parts: tuple[str, ...]) -> pathlib.Path:
  """A user's overlay in `root`: the resource and components `parts` of the tree `k8s`."""
  root.mkdir(parents=True, exist_ok=True)
  resource, *components = (os.path.relpath(k8s / p, root) for p in parts)
  (root / "kustomization.yaml").write_text(
      f"resources: [{resource}]\ncomponents: [{', '.join(components)}]\n")
  return root


@functools.cache
def overlay_dir(name: str) -> pathlib.Path:
  if name not in COMPOSED:
    return K8S / name
  root = tempfile.mkdtemp(prefix="rlax-ps-k8s-")
  atexit.register(shutil.rmtree, root, True)  # (cached for the session: gone at its end)
  return write_overlay(pathlib.Path(root), K8S, COMPOSED[name])


def kustomize(root: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run([KUBECTL, "kustomize", str(root)], capture_output=True, text=True,
                        timeout=60)


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
  out = kustomize(overlay_dir(overlay))
  assert out.returncode == 0, out.stderr
  return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def by_kind(docs, kind: str) -> dict[str, dict]:
  return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def job_spec(doc: dict) -> dict:
  """A Job's spec, or that of a JobSet's one replicated Job (a slice's hosts)."""
  if doc["kind"] == "JobSet":
    (replicated,) = doc["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]
  return doc["spec"]


def pod_spec(doc: dict) -> dict:
  return job_spec(doc)["template"]["spec"]


def containers(doc: dict) -> list[dict]:
  spec = pod_spec(doc)
  return spec.get("initContainers", []) + spec["containers"]


def chips(spec: dict) -> int:
  """The chips of the TPU topology a pod spec selects, e.g. 2x4 -> 8."""
  return math.prod(int(d) for d in spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
                   .split("x"))


def flag(args: list[str], name: str) -> str:
  values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
  assert len(values) == 1, (name, args)
  return values[0]


def from_your_checkpoint(overlay: str) -> bool:
  """Whether the trainer and workers start from your checkpoint (hf-checkpoint) instead of
  the warm start."""
  return "hf-checkpoint" in overlay or "gke-tpu-multihost" in overlay


def workloads(overlay: str) -> dict[str, dict]:
  docs = render(overlay)
  found = {**by_kind(docs, "StatefulSet"), **by_kind(docs, "Job"), **by_kind(docs, "JobSet"),
           **by_kind(docs, "Deployment")}
  relay = {"rlax-ps-relay"} if "weight-relay" in overlay else set()
  assert set(found) == {"rlax-ps-server", "rlax-ps-trainer", "rlax-ps-worker"} | relay
  return found


@pytest.mark.parametrize("overlay", RENDERED)
def test_manifests_match_the_kubernetes_api_schemas(overlay):
  docs = render(overlay)
  assert {d["kind"] for d in docs} >= {"Service", "StatefulSet", "PersistentVolumeClaim"}
  found = workloads(overlay)  # the trainer and the workers: on one host, or a slice's hosts
  assert found["rlax-ps-trainer"]["kind"] in {"Job", "JobSet"}
  assert found["rlax-ps-worker"]["kind"] in {"Deployment", "JobSet"}
  version = kubernetes_validate.latest_version()
  for doc in docs:  # strict: an unknown or misspelt field fails too
    if doc["kind"] == "JobSet":  # a custom resource: its Job template is checked as a Job
      assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
      doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice"},
             "spec": job_spec(doc)}
    if doc["kind"] == "PodMonitoring":  # GKE's custom resource; checked in the metrics test
      assert doc["apiVersion"] == "monitoring.googleapis.com/v1"
      continue
    kubernetes_validate.validate(doc, version, strict=True)


# Parses one container's argv with the flags of its `rlax-ps` subcommand, then builds the
# settings objects the subcommand would build from them (their own checks run there).
PARSE = r"""
import importlib, json, sys
from absl import flags
from rlax_ps.cli import SUBCOMMANDS
name, argv = sys.argv[1], json.loads(sys.argv[2])
module = importlib.import_module(SUBCOMMANDS[name][0])
sys.argv = ["rlax-ps " + name] + argv  # config_flags defines --config.a.b overrides from it
flags.FLAGS(sys.argv)
if name == "serve":
  module.config_from_flags()
if name == "worker":
  module.worker_config_from(module._CONFIG.value.get("worker"))
if "coordinator_address" in flags.FLAGS:  # train, sft, worker: one host or a slice's hosts
  from rlax_ps import distributed
  distributed.check_flags(*(flags.FLAGS[f].value for f in
                            ("coordinator_address", "num_processes", "process_id")))
if name == "relay":
  module.resolve(module.RelayConfig, None, "relay settings")
"""


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_container_command_parses_with_the_real_flags(overlay):
  for doc in workloads(overlay).values():
    env = {e["name"] for c in containers(doc) for e in c.get("env", [])}
    for c in containers(doc):
      name, *argv = c["args"]
      # Kubernetes expands $(VAR) from the container's env; each one named must be defined.
      for var in re.findall(r"\$\((\w+)\)", " ".join(argv)):
        assert var in {e["name"] for e in c.get("env", [])}, (c["name"], var, env)
      argv = [re.sub(r"\$\(\w+\)", "pod-0", a) for a in argv]
      assert c["image"].split(":")[0] == "rlax-ps"
      assert not any(a.startswith(("--token=", "--token_file=")) for a in argv)
      code, err = parse(name, tuple(argv))
      assert code == 0, (c["name"], argv, err[-2000:])


@functools.cache
def parse(name: str, argv: tuple[str, ...]) -> tuple[int, str]:
  """(exit code, stderr) of PARSE on one command; the renders share most commands."""
  out = subprocess.run([sys.executable, "-c", PARSE, name, json.dumps(list(argv))], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  return out.returncode, out.stderr


@pytest.mark.parametrize("overlay", RENDERED)
def test_clients_reach_the_server_service_with_their_role_tokens_from_the_secret(overlay):
  found = workloads(overlay)
  service = by_kind(render(overlay), "Service")["rlax-ps-server"]
  server = found["rlax-ps-server"]
  (serve,) = pod_spec(server)["containers"]
  port = int(flag(serve["args"], "port"))
  assert flag(serve["args"], "host") == "0.0.0.0"
  (sp,) = service["spec"]["ports"]
  named = {p["name"]: p["containerPort"] for p in serve["ports"]}
  assert named[sp["targetPort"]] == port
  assert service["spec"]["selector"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
  for probe in ("readinessProbe", "livenessProbe"):  # the token-free gRPC health service
    assert serve[probe]["grpc"]["port"] == port

  def tokens(c):
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}

  assert tokens(serve) == {auth.env_var(r): {"name": SECRET, "key": r} for r in auth.ROLES}
  server_address = f"{service['metadata']['name']}:{sp['port']}"
  clients = [("rlax-ps-trainer", "trainer", server_address)]
  if "rlax-ps-relay" in found:  # the workers reach the server through the relay
    relay = found["rlax-ps-relay"]
    relay_service = by_kind(render(overlay), "Service")["rlax-ps-relay"]
    (rp,) = relay_service["spec"]["ports"]
    (rc,) = pod_spec(relay)["containers"]
    assert {p["name"]: p["containerPort"] for p in rc["ports"]}[rp["targetPort"]] == int(
        flag(rc["args"], "port"))
    assert relay_service["spec"]["selector"].items() <= (
        relay["spec"]["template"]["metadata"]["labels"].items())
    clients += [("rlax-ps-relay", "worker", server_address),
                ("rlax-ps-worker", "worker", f"rlax-ps-relay:{rp['port']}")]
  else:
    clients.append(("rlax-ps-worker", "worker", server_address))
  for workload, role, address in clients:
    (client,) = pod_spec(found[workload])["containers"]
    assert flag(client["args"], "address") == address
    assert tokens(client) == {auth.env_var(role): {"name": SECRET, "key": role}}


@pytest.mark.parametrize("overlay", RENDERED)
def test_server_metrics_are_served_on_the_named_port_and_scraped_on_gke(overlay):
  docs = render(overlay)
  server = workloads(overlay)["rlax-ps-server"]
  (serve,) = pod_spec(server)["containers"]
  ports = {p["name"]: p["containerPort"] for p in serve["ports"]}
  assert int(flag(serve["args"], "metrics_port")) == ports["metrics"]
  monitors = by_kind(docs, "PodMonitoring")
  if "gke" not in overlay:
    assert not monitors
    return
  (monitor,) = monitors.values()
  labels = server["spec"]["template"]["metadata"]["labels"]
  assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
  assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


@pytest.mark.parametrize("overlay", RENDERED)
def test_server_and_trainer_state_is_on_persistent_volumes(overlay):
  found = workloads(overlay)
  server = found["rlax-ps-server"]
  (serve,) = pod_spec(server)["containers"]
  claims = {t["metadata"]["name"] for t in server["spec"]["volumeClaimTemplates"]}
  mounts = {m["mountPath"]: m["name"] for m in serve["volumeMounts"]}
  assert mounts[flag(serve["args"], "storage_dir")] in claims

  trainer = found["rlax-ps-trainer"]
  spec = pod_spec(trainer)
  if trainer["kind"] == "Job":  # restarted in place, resuming, again and again
    assert spec["restartPolicy"] == "OnFailure" and trainer["spec"]["backoffLimit"] >= 10
  else:  # a slice restarts as a whole: one host's failure fails the set, which restarts
    assert job_spec(trainer)["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
    assert trainer["spec"]["failurePolicy"]["maxRestarts"] >= 10
  pvc = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
         if "persistentVolumeClaim" in v}
  # Every claim is rendered, but the one you make for your checkpoint (hf-checkpoint).
  assert set(pvc.values()) - {"rlax-ps-model"} <= set(by_kind(render(overlay),
                                                               "PersistentVolumeClaim"))

  def on_pvc(c, path):
    return any((path + "/").startswith(m["mountPath"] + "/") and m["name"] in pvc
               for m in c["volumeMounts"])

  (train,) = spec["containers"]
  assert train["args"][0] == "train" and on_pvc(train, flag(train["args"], "workdir"))
  for c in spec.get("initContainers", []) + [train]:  # a restart reuses the compiles
    (cache,) = [e["value"] for e in c["env"] if e["name"] == "RLAX_PS_JAX_CACHE"]
    assert on_pvc(c, cache)
  if job_spec(trainer).get("parallelism", 1) > 1:  # every host reads and writes the workdir
    claims = by_kind(render(overlay), "PersistentVolumeClaim")
    (workdir,) = [m["name"] for m in train["volumeMounts"]
                  if (flag(train["args"], "workdir") + "/").startswith(m["mountPath"] + "/")]
    assert "ReadWriteMany" in claims[pvc[workdir]]["spec"]["accessModes"]
    # of a class that can be (GKE's default, persistent disks, cannot: it stays Pending)
    assert claims[pvc[workdir]]["spec"]["storageClassName"] == "standard-rwx"
  start = flag(train["args"], "config.init_from_hf")
  if not from_your_checkpoint(overlay):
    # The trainer starts from the warm start's Hugging Face export, on the same volume.
    (warm,) = spec["initContainers"]
    assert warm["args"][0] == "sft" and on_pvc(warm, flag(warm["args"], "workdir"))
    assert start == flag(warm["args"], "workdir") + "/hf" and on_pvc(train, start)
    return
  # Your checkpoint, read-only from its claim, for the trainer and every worker alike.
  assert "initContainers" not in spec and on_pvc(train, start)
  (worker,) = pod_spec(found["rlax-ps-worker"])["containers"]
  for c, pod in ((train, spec), (worker, pod_spec(found["rlax-ps-worker"]))):
    assert flag(c["args"], "config.init_from_hf") == start
    assert flag(c["args"], "config.tokenizer.kind") == "hf"
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == start]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] and volume["persistentVolumeClaim"] == {
        "claimName": "rlax-ps-model", "readOnly": True}


@pytest.mark.parametrize("overlay", RENDERED)
def test_workers_finish_within_the_pods_termination_grace(overlay):
  worker = workloads(overlay)["rlax-ps-worker"]
  (c,) = pod_spec(worker)["containers"]
  grace = pod_spec(worker)["terminationGracePeriodSeconds"]
  assert float(flag(c["args"], "grace_s")) + 3 <= grace


@pytest.mark.parametrize("overlay", RENDERED)
def test_the_server_may_load_its_storage_for_30_minutes_before_its_liveness_probe(overlay):
  """The server's port opens once its write-ahead log is replayed and its weights read; the
  liveness probe alone would restart a slow restore again and again."""
  (serve,) = pod_spec(workloads(overlay)["rlax-ps-server"])["containers"]
  startup = serve["startupProbe"]
  assert startup["grpc"] == serve["livenessProbe"]["grpc"]
  assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


@pytest.mark.parametrize("overlay", RENDERED)
def test_workers_decode_on_every_tpu_chip_of_their_pod(overlay):
  worker = workloads(overlay)["rlax-ps-worker"]
  (c,) = pod_spec(worker)["containers"]
  requested = int(c["resources"].get("limits", {}).get("google.com/tpu", 0))
  if "gke-tpu" in overlay:
    assert requested > 0
  if requested:  # WorkerConfig.devices: 0 is all the local chips
    assert int(flag(c["args"], "devices")) in (0, requested), c["args"]


def set_image(root: pathlib.Path, name: str, image: str) -> None:
  """What `kustomize edit set image NAME=IMAGE` does to ROOT/kustomization.yaml: NAME's entry
  under `images` (a new one if none) gets IMAGE's name and tag."""
  path = root / "kustomization.yaml"
  kustomization = yaml.safe_load(path.read_text())
  entries = kustomization.setdefault("images", [])
  entry = next((e for e in entries if e["name"] == name), None)
  if entry is None:
    entry = {"name": name}
    entries.append(entry)
  entry["newName"], entry["newTag"] = image.rsplit(":", 1)
  path.write_text(yaml.safe_dump(kustomization, sort_keys=False))


def readme_image_step() -> tuple[str, str]:
  """The README's step that names your image, done in the kustomization you then apply:
  `cd k8s/...`, `kustomize edit set image NAME=IMAGE:TAG`, `kubectl apply -k .` -> (NAME,
  IMAGE)."""
  readme = (ROOT / "README.md").read_text()
  step = re.search(r"^cd k8s/\S+.*\nkustomize edit set image ([\w-]+)=(\S+):\w+\b.*\n"
                   r"kubectl apply -k \.\s", readme, re.M)
  assert step, "README.md: no `cd k8s/...`, `kustomize edit set image`, `kubectl apply -k .`"
  return step.group(1), step.group(2)


def test_the_readmes_image_step_says_which_kustomize_edits():
  """`kubectl kustomize` has no `edit`: the step names the standalone binary, or the edit by
  hand."""
  readme = (ROOT / "README.md").read_text()
  step = next(l for l in readme.splitlines() if l.startswith("kustomize edit set image "))
  assert "standalone kustomize" in step and "images:" in step, step


@pytest.mark.parametrize("overlay", RENDERED)
def test_your_image_named_as_the_readme_says_runs_in_every_container(overlay, tmp_path):
  """The README's step in a copy of k8s/, in the kustomization applied (ours, or a user's
  overlay over ours): every container runs your image, the TPU build wherever an overlay
  puts TPUs."""
  name, image = readme_image_step()
  image = image.replace("REGISTRY", "us-docker.pkg.dev/project/repo")
  k8s = shutil.copytree(K8S, tmp_path / "k8s")
  applied = (write_overlay(tmp_path / "yours", k8s, COMPOSED[overlay]) if overlay in COMPOSED
             else k8s / overlay)
  tag = "tpu" if "gke-tpu" in overlay else "cpu"
  set_image(applied, name, f"{image}:{tag}")
  out = kustomize(applied)
  assert out.returncode == 0, out.stderr
  docs = [d for d in yaml.safe_load_all(out.stdout) if d]
  images = {c["image"] for d in docs if d["kind"] in {"StatefulSet", "Job", "JobSet", "Deployment"}
            for c in containers(d)}
  assert images == {f"{image}:{tag}"}


@pytest.mark.parametrize("named_in, applied", [("base", "overlays/gke-tpu"),
                                               ("base", "overlays/gke-tpu-multihost"),
                                               ("overlays/gke-tpu", "overlays/gke-tpu-multihost")])
def test_an_image_named_in_what_an_overlay_builds_on_stops_its_build(named_in, applied, tmp_path):
  """An overlay's `images` matches the name rlax-ps only: an image renamed in base would run
  its CPU build on the TPUs (a renamed gke-tpu image, a bare one in the multi-host trainer)."""
  k8s = shutil.copytree(K8S, tmp_path / "k8s")
  tag = "tpu" if "gke-tpu" in named_in else "cpu"
  set_image(k8s / named_in, "rlax-ps", f"us-docker.pkg.dev/project/repo/rlax-ps:{tag}")
  out = kustomize(k8s / applied)
  assert out.returncode != 0, out.stdout
  assert "/image" in out.stderr, out.stderr


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_container_runs_the_servers_image(overlay):
  """Also the relay's (components/weight-relay copies the server's): a bare `rlax-ps` there is
  an image nobody pushed."""
  found = workloads(overlay)
  (server,) = containers(found["rlax-ps-server"])
  assert {c["image"] for d in found.values() for c in containers(d)} == {server["image"]}


@pytest.mark.parametrize("named_in", ["base", "overlays/gke-tpu"])
def test_the_relay_runs_the_image_named_in_what_your_overlay_builds_on(named_in, tmp_path):
  """An image named in our kustomization (as its header says), a component added in yours:
  the relay it adds runs that image too."""
  k8s = shutil.copytree(K8S, tmp_path / "k8s")
  image = f"us-docker.pkg.dev/project/repo/rlax-ps:{'tpu' if 'tpu' in named_in else 'cpu'}"
  set_image(k8s / named_in, "rlax-ps", image)
  out = kustomize(write_overlay(tmp_path / "yours", k8s, (named_in, "components/weight-relay")))
  assert out.returncode == 0, out.stderr
  deployments = by_kind([d for d in yaml.safe_load_all(out.stdout) if d], "Deployment")
  assert [c["image"] for c in containers(deployments["rlax-ps-relay"])] == [image]


def test_the_gke_tpu_overlay_puts_the_trainer_on_a_slice_and_workers_on_spot_tpus():
  found = workloads("overlays/gke-tpu")
  trainer, worker = pod_spec(found["rlax-ps-trainer"]), pod_spec(found["rlax-ps-worker"])

  for c in trainer["initContainers"] + trainer["containers"]:
    for kind in ("requests", "limits"):
      assert int(c["resources"][kind]["google.com/tpu"]) == chips(trainer)
  (w,) = worker["containers"]
  assert int(w["resources"]["limits"]["google.com/tpu"]) == chips(worker)
  assert worker["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
  assert "cloud.google.com/gke-spot" not in trainer["nodeSelector"]
  assert worker["terminationGracePeriodSeconds"] <= 15  # what GKE gives a preempted pod
  server = pod_spec(found["rlax-ps-server"])
  assert "nodeSelector" not in server  # the server stays on a CPU node
  images = {c["image"] for d in found.values() for c in containers(d)}
  assert images == {"rlax-ps:tpu"}
  base_images = {c["image"] for d in workloads("base").values() for c in containers(d)}
  assert base_images == {"rlax-ps:cpu"}


def test_the_multihost_overlay_runs_one_jax_job_over_every_host_of_the_slice():
  found = workloads("overlays/gke-tpu-multihost")
  trainer = found["rlax-ps-trainer"]
  assert trainer["kind"] == "JobSet" and not by_kind(render("overlays/gke-tpu-multihost"), "Job")
  job, spec = job_spec(trainer), pod_spec(trainer)
  (c,) = spec["containers"]
  per_host = int(c["resources"]["limits"]["google.com/tpu"])
  # One process per host, all of them at once, the slice's chips in all.
  assert job["parallelism"] == job["completions"] == chips(spec) // per_host > 1
  assert flag(c["args"], "coordinator_address") == "auto"
  assert c["image"] == "rlax-ps:tpu"
  # The single-host trainer's volume went with it; the workers are gke-tpu's.
  assert "rlax-ps-trainer" not in by_kind(render("overlays/gke-tpu-multihost"),
                                          "PersistentVolumeClaim")
  assert pod_spec(found["rlax-ps-worker"]) == pod_spec(workloads("gke-tpu+hf-checkpoint")[
      "rlax-ps-worker"])


@pytest.mark.parametrize("overlay", SINGLE_HOST_WORKERS)
def test_the_multihost_workers_component_runs_each_worker_over_every_host_of_its_slice(overlay):
  worker = workloads(overlay)["rlax-ps-worker"]
  # It replaces the single-host workers: no Deployment of them remains.
  assert worker["kind"] == "JobSet" and "rlax-ps-worker" not in by_kind(render(overlay),
                                                                         "Deployment")
  job, spec = job_spec(worker), pod_spec(worker)
  (c,) = spec["containers"]
  per_host = int(c["resources"]["limits"]["google.com/tpu"])
  assert int(c["resources"]["requests"]["google.com/tpu"]) == per_host
  # One process per host, all of them at once, the slice's chips in all.
  assert job["parallelism"] == job["completions"] > 1
  assert job["parallelism"] * per_host == chips(spec)
  # The single-host workers' command, environment (token, pod name) and volumes on every
  # host, with what the components did to them (the model, the relay's address).
  single_pod = pod_spec(workloads(SINGLE_HOST_WORKERS[overlay])["rlax-ps-worker"])
  (single,) = single_pod["containers"]
  assert c["args"][0] == single["args"][0] == "worker"  # the flags in any order
  assert sorted(c["args"]) == sorted(single["args"] + ["--coordinator_address=auto"])
  assert c["env"] == single["env"] and c["image"] == single["image"] == "rlax-ps:tpu"
  assert c.get("volumeMounts") == single.get("volumeMounts")
  assert spec.get("volumes") == single_pod.get("volumes")
  # The multi-host trainer's slices, on spot nodes; one node pool per slice.
  trainer = workloads("overlays/gke-tpu-multihost")["rlax-ps-trainer"]
  selector = dict(spec["nodeSelector"])
  assert selector.pop("cloud.google.com/gke-spot") == "true"
  assert selector == pod_spec(trainer)["nodeSelector"]
  assert worker["metadata"]["annotations"] == trainer["metadata"]["annotations"]
  assert spec["terminationGracePeriodSeconds"] <= 15  # what GKE gives a preempted pod
  # A failed host fails its slice's Job and the set restarts; a preemption's failure (a pod
  # DisruptionTarget fails the Job by its pod failure policy) does not count.
  assert job["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
  assert worker["spec"]["failurePolicy"]["maxRestarts"] >= 10
  (rule,) = worker["spec"]["failurePolicy"]["rules"]
  assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts"
  assert rule["onJobFailureReasons"] == ["PodFailurePolicy"]
  assert job["podFailurePolicy"]["rules"] == [{"action": "FailJob", "onPodConditions": [
      {"type": "DisruptionTarget", "status": "True"}]}]


def test_the_image_installs_every_package_and_ships_the_recipes_the_manifests_name():
  import tomllib
  dockerfile = (K8S / "Dockerfile").read_text()
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
  packages = {p.split(".")[0] for p in project["tool"]["setuptools"]["packages"]}
  assert packages <= copied and "configs" in copied
  entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', dockerfile, re.M).group(1)
  assert entry in project["project"]["scripts"]
  extras = set(re.findall(r"EXTRA=(\w+)", dockerfile))
  assert extras and extras <= set(project["project"]["optional-dependencies"])
  install = re.search(r'^RUN pip install "\.\[(\w+)\$\{EXTRA', dockerfile, re.M)
  assert install and install.group(1) in project["project"]["optional-dependencies"]
  for overlay in OVERLAYS:
    for doc in workloads(overlay).values():
      for c in containers(doc):
        for a in c["args"]:
          if a.startswith("--config="):
            path = a.split("=", 1)[1].split(":")[0]
            assert path.split("/")[0] in copied and (ROOT / path).is_file(), a


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["base", "base+hf-checkpoint", "base+weight-relay"])
def test_the_manifests_commands_run_the_loop_as_local_processes(overlay, tmp_path):
  """What a cluster would run, with only volumes, the Services' addresses and the recipe's
  size rewritten: the server (tokens from the environment only), the warm start (or, with
  hf-checkpoint, a Hugging Face checkpoint on the model volume), then the trainer and a
  worker (with weight-relay, behind the relay), which finish the run and leave the worker
  holding its weights."""
  import time
  found = workloads(overlay)
  service = by_kind(render(overlay), "Service")["rlax-ps-server"]
  volumes = {}  # volume name -> the local folder it stands for, where not a fresh one
  if "hf-checkpoint" in overlay:  # your model: here a warm start exported beforehand
    sft = subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py:tiny",
                          f"--workdir={tmp_path / 'model'}", "--progress=false"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert sft.returncode == 0, sft.stderr[-3000:]
    volumes["model"] = tmp_path / "model" / "hf"
  port, metrics_port, relay_port = free_port(), free_port(), free_port()
  address = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
  tokens = {r: f"token-{r}" for r in auth.ROLES}
  procs = []

  def command(c, pod):
    mounts = {m["mountPath"]: volumes.get(m["name"], tmp_path / pod / m["name"])
              for m in c.get("volumeMounts", [])}
    def on_this_machine(text):  # a path on a volume -> the folder standing for it
      for path, local in mounts.items():
        text = re.sub(rf"(^|=){re.escape(path)}(?=/|$)", lambda m: m.group(1) + str(local), text)
      return text

    env = child_env(tokens=False)
    for e in c.get("env", []):
      source = e.get("valueFrom", {})
      if "secretKeyRef" in source:
        env[e["name"]] = tokens[source["secretKeyRef"]["key"]]
      elif "fieldRef" in source:
        env[e["name"]] = pod
      else:
        env[e["name"]] = on_this_machine(e["value"])
    argv = []
    for a in c["args"]:
      a = on_this_machine(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a))
      a = a.replace(f"--address={address}", f"--address=127.0.0.1:{port}")
      a = a.replace("--address=rlax-ps-relay:50052", f"--address=127.0.0.1:{relay_port}")
      a = a.replace("--port=50051", f"--port={port}").replace("--host=0.0.0.0", "--host=127.0.0.1")
      a = a.replace("--port=50052", f"--port={relay_port}")
      a = a.replace("--metrics_port=9090", f"--metrics_port={metrics_port}")
      a = re.sub(r"^--config=(configs/\w+\.py)$", r"--config=\1:tiny", a)
      argv.append(a)
    if argv[0] == "train":
      argv.append("--config.rl.steps=3")
    for local in mounts.values():
      local.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "rlax_ps", *argv], env

  def start(c, pod):
    argv, env = command(c, pod)
    log = open(tmp_path / f"{c['name']}.log", "w")
    procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs[-1]

  def log(name):
    return (tmp_path / f"{name}.log").read_text()

  try:
    (serve,) = pod_spec(found["rlax-ps-server"])["containers"]
    server = start(serve, "rlax-ps-server-0")
    relay = None
    if "rlax-ps-relay" in found:
      (rc,) = pod_spec(found["rlax-ps-relay"])["containers"]
      relay = start(rc, "rlax-ps-relay-abc")
    trainer_job = found["rlax-ps-trainer"]
    for warm in pod_spec(trainer_job).get("initContainers", []):
      assert start(warm, "rlax-ps-trainer-x").wait(300) == 0, log(warm["name"])[-3000:]
    (train,) = pod_spec(trainer_job)["containers"]
    trainer = start(train, "rlax-ps-trainer-x")
    (wc,) = pod_spec(found["rlax-ps-worker"])["containers"]
    worker = start(wc, "rlax-ps-worker-abc")
    deadline = time.monotonic() + 400
    while trainer.poll() is None and time.monotonic() < deadline:
      for p, name in ((server, "server"), (worker, "worker"), (relay, "relay")):
        assert p is None or p.poll() is None, log(name)[-3000:]
      time.sleep(0.5)
    assert trainer.returncode == 0, log("trainer")[-3000:]
    worker.terminate()  # the pod's SIGTERM: it releases what it holds and exits cleanly
    assert worker.wait(60) == 0, log("worker")[-3000:]
    # `kubectl exec statefulset/rlax-ps-server -- rlax-ps status`: the server container's
    # own environment holds the viewer token, and the default address is its port.
    argv, env = command(serve, "rlax-ps-server-0")
    status = subprocess.run([sys.executable, "-m", "rlax_ps", "status",
                             f"--address=127.0.0.1:{port}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr[-2000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
      metrics = r.read().decode()
  finally:
    for p in procs:
      if p.poll() is None:
        p.terminate()
        p.wait(30)
  summary = json.loads((tmp_path / "rlax-ps-trainer-x" / "workdir" / "rl" / "summary.json").read_text())
  assert summary["step"] == 3 and summary["rollout_groups_trained"] > 0
  assert re.search(rf"latest version\s+v{summary['version']} \(bf16\)", status.stdout)
  assert re.search(rf"^rlax_ps_latest_version {summary['version']}\.0$", metrics, re.M)
  assert int(re.search(r"(\d+) groups submitted", log("worker")).group(1)) > 0
  if relay is not None:  # the worker's weights came through the relay
    assert re.search(r"relay: holds v\d+", log("relay")), log("relay")[-3000:]
  # The trainer's compiles went to its volume, where a restarted pod finds them.
  assert any((tmp_path / "rlax-ps-trainer-x" / "workdir" / "jax_cache").iterdir())
  # The server took every role's token from the environment and wrote no token file.
  assert not (tmp_path / "rlax-ps-server-0" / "data" / auth.TOKEN_FILE).exists()


def test_the_image_build_context_alone_builds_a_complete_wheel(tmp_path):
  """What k8s/Dockerfile copies is enough to build rlax-ps: the wheel built from only those
  paths holds every module of the packages (pyproject lists them), the proto, the generated
  gRPC code and the recipes (as rlax_ps/configs, where an installed rlax-ps finds them)."""
  import zipfile
  dockerfile = (K8S / "Dockerfile").read_text()
  context = tmp_path / "context"
  for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
    *sources, dest = line.split()
    for src in sources:
      target = context / (src if dest.endswith("/") or dest == "./" else dest)
      if (ROOT / src).is_dir():
        shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
      else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / src, target)
  out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path / "dist"), str(context)],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  (wheel,) = (tmp_path / "dist").glob("rlax_ps-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  for package in ("rlax_ps", "param_server", "inference_workers", "algorithms"):
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / package).rglob("*.py")}
    assert modules <= names, sorted(modules - names)
  recipes = {f"rlax_ps/configs/{path.name}" for path in (ROOT / "configs").glob("*.py")}
  assert len(recipes) > 10 and recipes <= names, sorted(recipes - names)
  assert {"param_server/protos/param_server.proto", "param_server/protos/param_server_pb2.py",
          "rlax_ps/cli.py"} <= names
