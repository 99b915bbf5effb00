"""`make demo`: the whole product on this machine, from `helm install` to an OpenAI answer through the cluster.

It starts the local control plane with the fake GPU pool, installs the chart, serves a generated demo GGUF over a
local Range-capable HTTP server, applies `examples/tiny.yaml` (its model URL pointed at that server) with the real
kubectl, and runs every Strata pod (the chart's operator, the stages, the gateway) through the pod runner until
Ctrl-C. It prints what a person waits on as it happens, then `kubectl get modeldeployments`, one chat answer, and
three lines for scripts:

    OpenAI endpoint: http://HOST:PORT/v1
    KUBECONFIG=PATH
    KUBECTL=PATH

The end-to-end test runs this module exactly as `make demo` does.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from strata.gguf.testmodels import write_test_model
from strata.operator.names import LABEL_COMPONENT, LABEL_INSTANCE
from strata.operator.spec import GROUP, PLURAL, VERSION

from strata_testbed.controlplane import TESTBED_DIR, ControlPlane
from strata_testbed.gpu_pool import create_gpu_pool
from strata_testbed.helm import Helm
from strata_testbed.pod_runner import PodRunner
from strata_testbed.range_server import serve_directory

EXAMPLE = TESTBED_DIR.parent / "examples" / "tiny.yaml"
RELEASE, OPERATOR_NAMESPACE, NAMESPACE = "strata", "strata-system", "default"
DEMO_LAYERS = 4
READY_TIMEOUT_S = 600.0
QUESTION = "Say hello to Kubernetes."


class DemoFailed(RuntimeError):
    """A step did not finish in time; the message says which and what the pods logged."""


class Progress:
    """Lines a person can follow: each prefixed with the seconds since the demo started, repeats suppressed."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._last: dict[str, str] = {}

    def say(self, text: str, *, topic: str | None = None) -> None:
        if topic is not None:
            if self._last.get(topic) == text:
                return
            self._last[topic] = text
        print(f"[{time.monotonic() - self._start:6.1f}s] {text}", flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    for entry in (body.get("status") or {}).get("conditions", []):
        if entry["type"] == kind:
            return dict(entry)
    return {}


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def gateway_url(core: client.CoreV1Api, *, namespace: str, deployment: str) -> str | None:
    """The base URL of a ready gateway pod of `deployment` that answers /readyz, reached on its pod IP as
    `kubectl port-forward` would reach it (the pod runner runs it there)."""
    pods = core.list_namespaced_pod(
        namespace=namespace, label_selector=f"{LABEL_INSTANCE}={deployment},{LABEL_COMPONENT}=gateway"
    ).items
    for pod in pods:
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        if ready and pod.status.pod_ip:
            port = pod.spec.containers[0].ports[0].container_port
            url = f"http://{pod.status.pod_ip}:{port}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    return f"{url}/v1"
    return None


class Demo:
    def __init__(self, *, plane: ControlPlane, work: Path, progress: Progress) -> None:
        self.plane = plane
        self.work = work
        self.say = progress.say
        self.api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.objects = client.CustomObjectsApi(self.api)

    def kubectl(self, *args: str) -> str:
        argv = [str(self.plane.kubectl), "--kubeconfig", str(self.plane.kubeconfig), *args]
        result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
        if result.returncode != 0:
            raise DemoFailed(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def install_chart(self) -> None:
        self.core.create_namespace(body={"metadata": {"name": OPERATOR_NAMESPACE}})
        Helm.pinned(kubeconfig=self.plane.kubeconfig).install(release=RELEASE, namespace=OPERATOR_NAMESPACE)
        self.say(f"helm install {RELEASE} charts/strata --namespace {OPERATOR_NAMESPACE}")

    def apply_example(self, model_url: str) -> str:
        """Apply the example with two changes, both said aloud: the model is the local demo file, and the KV cache
        is f32, so the answer can be checked exactly against HF transformers (on GPUs the q8_0 default stays)."""
        manifest = yaml.safe_load(EXAMPLE.read_text())
        manifest["spec"]["model"]["url"] = model_url
        manifest["spec"] |= {"cacheTypeK": "f32", "cacheTypeV": "f32"}
        applied = self.work / EXAMPLE.name
        applied.write_text(yaml.safe_dump(manifest, sort_keys=False))
        self.kubectl("apply", "--namespace", NAMESPACE, "-f", str(applied))
        self.say(f"kubectl apply -f examples/{EXAMPLE.name} (model URL: {model_url}, KV cache f32 for an exact check)")
        return str(manifest["metadata"]["name"])

    def deployment(self, name: str) -> dict[str, Any]:
        return dict(
            self.objects.get_namespaced_custom_object(
                group=GROUP, version=VERSION, namespace=NAMESPACE, plural=PLURAL, name=name
            )
        )

    def wait_operator(self, runner: PodRunner) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pods = self.core.list_namespaced_pod(
                namespace=OPERATOR_NAMESPACE, label_selector=f"{LABEL_COMPONENT}=operator"
            ).items
            running = [p.metadata.name for p in pods if p.status.phase == "Running"]
            if running and any(key.startswith(f"{OPERATOR_NAMESPACE}/") for key in runner.processes()):
                self.say(f"operator: pod {running[0]} runs `strata operator` on its ServiceAccount's token")
                return
            time.sleep(0.5)
        raise DemoFailed(f"the operator pod did not start: {runner.errors[-3:]}")

    def wait_ready(self, name: str, runner: PodRunner) -> tuple[str, float]:
        """Follow the deployment until it is Ready and its gateway answers; (base URL, seconds from apply)."""
        applied = time.monotonic()
        deadline = applied + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            body = self.deployment(name)
            status = body.get("status") or {}
            planned = _condition(body, "Planned")
            if planned:
                self.say(f"{planned.get('reason')}: {planned.get('message')}", topic="plan")
            if status.get("shortfall"):
                self.say(f"shortfall: {status['shortfall']}", topic="shortfall")
            # A stage reports its total once it has read the model's header.
            for stage in (s for s in status.get("loadProgress", []) if s["bytesTotal"]):
                done, total = stage["bytesLoaded"], stage["bytesTotal"]
                self.say(
                    f"stage {stage['stage']}: {_megabytes(done)} of {_megabytes(total)} loaded",
                    topic=f"stage-{stage['stage']}",
                )
            gateway = _condition(body, "GatewayReady")
            if gateway:
                self.say(f"gateway: {gateway.get('message')}", topic="gateway")
            url = gateway_url(self.core, namespace=NAMESPACE, deployment=name)
            if _condition(body, "Ready").get("status") == "True" and url is not None:
                return url, time.monotonic() - applied
            for error in runner.errors:
                self.say(f"pod runner: {error}", topic=error)
            time.sleep(0.5)
        raise DemoFailed(f"{name} was not Ready within {READY_TIMEOUT_S:.0f} s; pod runner: {runner.errors[-3:]}")

    def ask(self, base_url: str, model: str) -> str:
        reply = httpx.post(
            f"{base_url}/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        reply.raise_for_status()
        return str(reply.json()["choices"][0]["message"]["content"])


@contextlib.contextmanager
def _work_dir(keep: bool) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="strata-demo-"))
    try:
        yield work
    finally:
        if keep:
            print(f"logs kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(*, keep_logs: bool) -> int:
    progress = Progress()
    signal.signal(signal.SIGTERM, _interrupt)
    with _work_dir(keep_logs) as work:
        progress.say("control plane: etcd, kube-apiserver, controller manager, scheduler and kwok on loopback")
        with ControlPlane(work_dir=work / "cluster", probe_readiness=True) as plane:
            demo = Demo(plane=plane, work=work, progress=progress)
            nodes = create_gpu_pool(demo.core)
            progress.say(f"GPU pool (kwok): {', '.join(nodes)}")
            demo.install_chart()
            models = work / "models"
            models.mkdir()
            model = write_test_model(models / "strata-demo.gguf", architecture="qwen2", block_count=DEMO_LAYERS).path
            with serve_directory(models) as server:
                url = f"{server.url}/{model.name}"
                progress.say(f"model: {model} ({_megabytes(model.stat().st_size)}) served with Range at {url}")
                with PodRunner(
                    core=demo.core,
                    namespaces=[OPERATOR_NAMESPACE, NAMESPACE],
                    log_dir=work / "pods",
                    api_server=plane.server,
                    ca=plane.pki.ca.cert,
                ) as runner:
                    demo.wait_operator(runner)
                    name = demo.apply_example(url)
                    base_url, seconds = demo.wait_ready(name, runner)
                    progress.say(f"{name} is Ready {seconds:.1f} s after kubectl apply")
                    print(demo.kubectl("get", "modeldeployments", "--namespace", NAMESPACE), end="", flush=True)
                    served = demo.deployment(name)["status"]["modelName"]
                    print(f"> {QUESTION}\n{demo.ask(base_url, served)}", flush=True)
                    print("(random weights: the words mean nothing; the path they took is the point)", flush=True)
                    print(f"OpenAI endpoint: {base_url}", flush=True)
                    print(f"KUBECONFIG={plane.kubeconfig}", flush=True)
                    print(f"KUBECTL={plane.kubectl}", flush=True)
                    progress.say("serving until Ctrl-C")
                    while True:
                        time.sleep(3600)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-logs", action="store_true", help="keep the work folder (cluster and pod logs)")
    args = parser.parse_args(argv)
    try:
        return run(keep_logs=args.keep_logs)
    except KeyboardInterrupt:
        print("stopped: every process of the demo has ended", flush=True)
        return 0
    except (DemoFailed, ApiException) as e:
        print(f"demo failed: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
