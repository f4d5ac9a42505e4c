"""`serve manifests`: Kubernetes manifests for one engine, from deploy/'s templates.

The templates (deploy/deployment.yaml for one host, deploy/leaderworkerset.yaml for
several, deploy/inferencepool.yaml for an inference gateway) hold `${NAME}` placeholders;
this fills them from the engine's manifest and the flags:

- resources per pod: the ranks it runs (TP / hosts) times one rank's need, which is its
  weight files (read once into a private verified copy, then loaded: twice their size),
  the KV cache asked for, and the runtime's own memory (torch, the process, buffers);
  one GPU per rank for a CUDA engine;
- terminationGracePeriodSeconds: --drain-timeout plus the launcher's grace beyond it
  (serve/launcher.py: cutting requests, closing HTTP, finalizing MPI) plus its kill wait,
  so the kubelet never SIGKILLs a drain the server would have finished;
- the engine by reference (`--engine-ref s3://bucket/prefix/model:tag`): each pod pulls
  it at start-up (`serve launch --engine s3://...`), so an image holds no engine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from contract.errors import BuildError
from contract.manifest import Manifest, read_manifest
from serve.launcher import GRACE_S, KILL_WAIT_S

TEMPLATES = Path(__file__).resolve().parents[1] / "deploy"
RUNTIME_BYTES = 3 << 29  # 1.5 GiB a rank: torch, the interpreter, the HTTP and step buffers
SSH_PORT = 2222


@dataclass(frozen=True, slots=True)
class DeployConfig:
    name: str
    image: str
    engine_ref: str
    hosts: int = 1
    port: int = 8000
    drain_timeout: float = 30.0
    kv_cache_gib: float = 1.0
    cpus_per_rank: float = 2.0
    inference_pool: bool = False

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c == "-" for c in self.name):
            raise ValueError(f"--name must be a DNS label (letters, digits, '-'), got {self.name!r}")
        if self.hosts < 1:
            raise ValueError(f"--hosts must be at least 1, got {self.hosts}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be 1..65535, got {self.port}")
        if self.drain_timeout < 0 or self.kv_cache_gib < 0 or self.cpus_per_rank <= 0:
            raise ValueError("--drain-timeout and --kv-cache-gib must be >= 0, --cpus-per-rank > 0")


def grace_seconds(drain_timeout: float) -> int:
    """The pod's terminationGracePeriodSeconds for a server draining up to `drain_timeout`."""
    return math.ceil(drain_timeout + GRACE_S + KILL_WAIT_S) + 5  # 5: the kubelet's own margin


def rank_bytes(m: Manifest, kv_cache_gib: float) -> int:
    """Memory one rank needs: its largest share of the files twice, KV cache, runtime."""
    weights = max(sum(f.size for f in m.rank_files(r)) for r in range(m.tp))
    return 2 * weights + int(kv_cache_gib * 2**30) + RUNTIME_BYTES


def resources(m: Manifest, cfg: DeployConfig) -> dict[str, dict[str, str]]:
    """One pod's requests and limits: memory requested is its limit (the ranks must not be
    the first evicted); CPU requested only (a limit throttles the collectives)."""
    ranks = m.tp // cfg.hosts
    mem = f"{math.ceil(ranks * rank_bytes(m, cfg.kv_cache_gib) / 2**20)}Mi"
    out = {"requests": {"cpu": f"{ranks * cfg.cpus_per_rank:g}", "memory": mem},
           "limits": {"memory": mem}}
    if m.target.device == "cuda":
        out["limits"]["nvidia.com/gpu"] = out["requests"]["nvidia.com/gpu"] = str(ranks)
    return out


def render(engine: Path, cfg: DeployConfig, templates: Path = TEMPLATES) -> str:
    """The manifests, as one multi-document YAML text. Raises ValueError on a bad choice."""
    m = read_manifest(engine)
    if m.tp % cfg.hosts:
        raise ValueError(f"the engine has TP={m.tp}: --hosts must divide it, got {cfg.hosts}")
    leader = {"app": cfg.name} if cfg.hosts == 1 else {"app": cfg.name, "role": "leader"}
    values = {
        "NAME": cfg.name, "IMAGE": cfg.image, "ENGINE_REF": cfg.engine_ref, "TP": m.tp,
        "PORT": cfg.port, "DRAIN_TIMEOUT": f"{cfg.drain_timeout:g}",
        "GRACE_S": grace_seconds(cfg.drain_timeout), "GROUP_SIZE": cfg.hosts,
        "RANKS_PER_HOST": m.tp // cfg.hosts, "SSH_PORT": SSH_PORT,
        # JSON is YAML's flow style: one line fits where a mapping goes.
        "RESOURCES": json.dumps(resources(m, cfg)), "POOL_LABELS": json.dumps(leader),
    }
    names = ["deployment.yaml" if cfg.hosts == 1 else "leaderworkerset.yaml"]
    if cfg.inference_pool:
        names.append("inferencepool.yaml")
    docs = [Template((templates / n).read_text()).substitute(values) for n in names]
    return "---\n".join(d if d.endswith("\n") else d + "\n" for d in docs)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="serve manifests",
        description="Print Kubernetes manifests that serve ENGINE (a built engine directory, "
        "read for its TP, sizes and target) pulled from --engine-ref.")
    p.add_argument("--engine", required=True, type=Path, help="the engine directory")
    p.add_argument("--engine-ref", required=True,
                   help="where the pods pull it from, e.g. s3://models/tiny-chat:v1")
    p.add_argument("--image", required=True, help="the container image with `serve` installed")
    p.add_argument("--name", default="llm", help="the workload's name (default llm)")
    p.add_argument("--hosts", type=int, default=1,
                   help="pods per replica: 1 is a Deployment, more a LeaderWorkerSet (default 1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="serve launch --drain-timeout; sets terminationGracePeriodSeconds")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache memory a rank is given room for (default 1)")
    p.add_argument("--cpus-per-rank", type=float, default=2.0)
    p.add_argument("--inference-pool", action="store_true",
                   help="add an InferencePool and its endpoint picker (Gateway API Inference "
                   "Extension)")
    ns = p.parse_args(argv)
    try:
        cfg = DeployConfig(ns.name, ns.image, ns.engine_ref, ns.hosts, ns.port, ns.drain_timeout,
                           ns.kv_cache_gib, ns.cpus_per_rank, ns.inference_pool)
        sys.stdout.write(render(ns.engine, cfg))
    except (ValueError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 0
