"""The cluster packaging: the KubeRay RayJob's structure, the Ray runtime environment, the container image.
(That the RayJob's entrypoint passes --dry-run against a real multi-node cluster: test_cluster_jobs.py.)"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RAYJOB = ROOT / "deploy" / "k8s" / "rayjob.yaml"


def rayjob() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def pod_env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def entrypoint_argv(doc: dict, env: dict[str, str]) -> list[str]:
    """The RayJob's entrypoint as the job's shell runs it: variables from `env`, then split into words."""
    text = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], doc["spec"]["entrypoint"])
    return shlex.split(text)


def test_rayjob_structure():
    doc = rayjob()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    assert spec["submissionMode"] == "HTTPMode" and spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    import ray

    assert cluster["rayVersion"] == ray.__version__, "the image's Ray and the cluster's must match"
    head = cluster["headGroupSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout-cpu", "learner-gpu"}
    assert "num-gpus" not in groups["rollout-cpu"]["rayStartParams"]
    assert groups["learner-gpu"]["rayStartParams"]["num-gpus"] == "1"
    gpu_res = groups["learner-gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu_res["limits"]["nvidia.com/gpu"] == "1"
    for name, pod in [("head", head["template"]["spec"])] + [(g, groups[g]["template"]["spec"]) for g in groups]:
        c = pod["containers"][0]
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
        assert "persistentVolumeClaim" in vols[mounts["/shared"]], f"{name}: the run directory must be shared"
        env = pod_env(c)
        for var, key in [("POSTRAIN_CATALOG_URL", "catalog-url"), ("POSTRAIN_WAL_TOKEN", "wal-token"),
                         ("POSTRAIN_SANDBOX_TOKEN", "sandbox-token")]:
            assert env[var]["secretKeyRef"] == {"name": "postrain-secrets", "key": key}, (name, var)
        assert c["image"] == head["template"]["spec"]["containers"][0]["image"], "one image for every node"


def test_rayjob_entrypoint_is_a_postrain_command():
    from deploy.cli import build_parser

    doc = rayjob()
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {k: v if isinstance(v, str) else f"secret-{k}" for k, v in pod_env(head).items()}
    argv = entrypoint_argv(doc, env)
    assert argv[0] == "postrain"
    args = build_parser().parse_args(argv[1:])
    assert args.verb == "grpo" and args.cluster == "/app/configs/cluster.toml"
    assert args.out.startswith("/shared/"), "the run directory is on the shared volume"
    yaml.safe_load(doc["spec"]["runtimeEnvYAML"])


def test_runtime_env_is_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((ROOT / "deploy" / "ray" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # Ray's own validation of the fields
    assert env["working_dir"] == "." and {".git/", ".venv/", "runs/"} <= set(env["excludes"])
    assert (ROOT / env["env_vars"]["POSTRAIN_CLUSTER"]).is_file()


def test_dockerfile_pins_cuda_torch_and_installs_the_project():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]) and "/whl/cu" in args["TORCH_INDEX"]
    import ray

    assert args["RAY_VERSION"] == ray.__version__ == rayjob()["spec"]["rayClusterSpec"]["rayVersion"]
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url "\$\{TORCH_INDEX\}"', text)
    assert re.search(r'pip install -e "\.\[postgres\]"', text)
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages | {"configs"} <= copied, f"not in the image: {(packages | {'configs'}) - copied}"
