"""deploy/'s manifests, rendered for an engine (serve manifests), against Kubernetes' own
schemas (kubernetes-validate, strict: an unknown field is an error). The custom resources
(LeaderWorkerSet, InferencePool) have no schema there: their pod templates are checked as
core PodTemplates and their own fields against the shape their CRDs define."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from contract.manifest import Manifest, Source, hash_engine_files, write_manifest
from contract.profile import BuildProfile
from contract.target import Target
from serve.deploy import DeployConfig, grace_seconds, rank_bytes, render
from tests.conftest import REPO, subprocess_env

K8S_VERSION = "1.33"
REF = "s3://models/tiny-chat:v1"
SHARD = 3 << 20  # bytes of each rank's weights


def make_engine(d: Path, tp: int = 2, device: str = "cpu") -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model": {}}\n')
    for r in range(tp):
        (d / f"rank{r}.safetensors").write_bytes(b"\x01" * SHARD)
    target = (Target(device="cpu", arch="x86_64", isa="baseline") if device == "cpu"
              else Target(device="cuda", sm="sm_90"))
    write_manifest(d, Manifest(
        engine_id="0123456789abcdef", model_name="tiny-chat",
        source=Source(uri="/ckpt/tiny", revision=None, digest="d" * 64), backend="eager",
        target=target, tp=tp, dtype="float32", profile=BuildProfile(),
        toolchain={"python": "3.11", "torch": "2.13"}, files=hash_engine_files(d)))
    return d


def _validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _validate_pod_template(template: dict[str, Any], name: str) -> None:
    _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
               "template": template})


def _docs(text: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    by_kind = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    assert len(by_kind) == len(docs), "two documents of one kind and name"
    return by_kind


def _probes(container: dict[str, Any]) -> dict[str, str]:
    return {k: container[k]["httpGet"]["path"] for k in
            ("startupProbe", "readinessProbe", "livenessProbe") if "httpGet" in container.get(k, {})}


def test_one_host_deployment_validates_with_probes_grace_and_sizes(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "e")
    cfg = DeployConfig("tiny", "ghcr.io/example/serve:1", REF, drain_timeout=45, kv_cache_gib=0.5)
    docs = _docs(render(engine, cfg))
    assert set(docs) == {"Deployment/tiny", "Service/tiny"}
    for doc in docs.values():
        _validate(doc)
    pod = docs["Deployment/tiny"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert _probes(c) == {"startupProbe": "/health/ready", "readinessProbe": "/health/ready",
                          "livenessProbe": "/health/live"}
    # The kubelet waits for the whole drain and the launcher's grace after it.
    assert pod["terminationGracePeriodSeconds"] == grace_seconds(45) > 45 + 15
    assert c["command"][:4] == ["serve", "launch", "--engine", REF]
    assert c["command"][c["command"].index("--drain-timeout") + 1] == "45"
    # Two ranks, each: its shard (and the small shared files) twice, 0.5 GiB of KV cache,
    # 1.5 GiB of runtime.
    mem = c["resources"]["requests"]["memory"]
    assert mem == c["resources"]["limits"]["memory"]
    got, want = int(mem.removesuffix("Mi")) << 20, 2 * (2 * SHARD + (1 << 29) + (3 << 29))
    assert want <= got < want + (2 << 20), (got, want)
    assert c["resources"]["requests"]["cpu"] == "4"


def test_several_hosts_leaderworkerset_validates_each_pod_and_the_group(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "e", tp=4, device="cuda")
    cfg = DeployConfig("big", "ghcr.io/example/serve:1", REF, hosts=2, drain_timeout=60,
                       inference_pool=True)
    docs = _docs(render(engine, cfg))
    lws = docs["LeaderWorkerSet/big"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert tmpl["size"] == 2
    assert set(lws["spec"]) <= {"replicas", "leaderWorkerTemplate", "startupPolicy",
                                "rolloutStrategy", "networkConfig"}
    assert set(tmpl) <= {"size", "leaderTemplate", "workerTemplate", "restartPolicy",
                         "subGroupPolicy"}
    assert tmpl["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    for role in ("leaderTemplate", "workerTemplate"):
        _validate_pod_template(tmpl[role], f"big-{role}")
        spec = tmpl[role]["spec"]
        assert spec["terminationGracePeriodSeconds"] == grace_seconds(60)
        (c,) = spec["containers"]
        # Two ranks a pod, one GPU each.
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert int(c["resources"]["limits"]["memory"].removesuffix("Mi")) << 20 >= \
            2 * rank_bytes(_manifest(engine), 1.0)
    leader = tmpl["leaderTemplate"]["spec"]["containers"][0]
    assert _probes(leader) == {"startupProbe": "/health/ready", "readinessProbe": "/health/ready",
                               "livenessProbe": "/health/live"}
    script = leader["command"][-1]
    assert "--hostfile /tmp/hostfile" in script and REF in script and "slots=2" in script
    assert "${LWS_LEADER_ADDRESS%%.*}" in script  # the shell's, not the template's
    worker = tmpl["workerTemplate"]["spec"]["containers"][0]
    assert worker["command"][:4] == ["serve", "rank-host", "--drain-timeout", "60"]
    for key in ("Service/big-http", "Deployment/big-epp", "Service/big-epp",
                "ServiceAccount/big-epp", "Role/big-epp", "RoleBinding/big-epp"):
        _validate(docs[key])
    pool = docs["InferencePool/big"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool["spec"]) == {"selector", "targetPorts", "endpointPickerRef"}
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "big", "role": "leader"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    epp = docs["Deployment/big-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-cache-usage-percentage-metric=vllm:kv_cache_usage_perc" in epp["args"]
    assert "--pool-namespace=$(POD_NAMESPACE)" in epp["args"]


def _manifest(engine: Path) -> Manifest:
    from contract.manifest import read_manifest

    return read_manifest(engine)


def test_the_schema_check_catches_a_broken_manifest(tmp_path: Path) -> None:
    """The validation is not vacuous: a misspelt probe field fails it."""
    engine = make_engine(tmp_path / "e")
    doc = _docs(render(engine, DeployConfig("tiny", "img", REF)))["Deployment/tiny"]
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


def test_cli_refuses_hosts_that_do_not_divide_tp_in_one_line(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "e", tp=2)
    proc = subprocess.run(
        [sys.executable, "-m", "serve", "manifests", "--engine", str(engine), "--engine-ref", REF,
         "--image", "img", "--hosts", "3"], cwd=REPO, env=subprocess_env(),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: the engine has TP=2: --hosts must divide it, got 3"
    ok = subprocess.run(
        [sys.executable, "-m", "serve", "manifests", "--engine", str(engine), "--engine-ref", REF,
         "--image", "img"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
        timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "kind: Deployment" in ok.stdout
