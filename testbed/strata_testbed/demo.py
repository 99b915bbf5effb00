"""`make demo`: the whole product on this machine, from `helm install` to an OpenAI answer through the cluster.

It starts the local control plane with the fake GPU pool, installs the chart, serves the demo model's GGUF over a
local Range-capable HTTP server, applies the model's example from `examples/` (its model URL pointed at that server)
with the real kubectl, and runs every Strata pod (the chart's operator, the stages, the gateway) through the pod
runner until Ctrl-C. `--model` (DEMO_MODEL in `make demo`) picks the model: `generated` (the default, a small
generated model with random weights, applied as `examples/tiny.yaml`) or `gemma3-270m` (the real Gemma 3 270M file
of the pinned test dependency, applied as `examples/gemma3-270m.yaml`). It prints what a person waits on as it
happens, then `kubectl get modeldeployments`, one answer, and three lines for scripts:

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
from strata.operator.names import LABEL_COMPONENT, LABEL_INSTANCE
from strata.operator.spec import GROUP, PLURAL, VERSION

from strata_testbed.controlplane import ControlPlane
from strata_testbed.demo_models import DEFAULT_MODEL, DEMO_MODELS, DemoModel, ModelUnavailable, demo_manifest
from strata_testbed.gpu_pool import create_gpu_pool
from strata_testbed.helm import Helm
from strata_testbed.pod_runner import PodRunner
from strata_testbed.range_server import serve_directory

RELEASE, OPERATOR_NAMESPACE, NAMESPACE = "strata", "strata-system", "default"
READY_TIMEOUT_S = 600.0
ASK_TIMEOUT_S = 120.0


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

    def apply_example(self, model: DemoModel, model_url: str) -> str:
        """Apply the model's example with the demo's changes, all said aloud: the model URL is the local server's,
        and the model's overrides."""
        manifest = demo_manifest(model, url=model_url)
        applied = self.work / model.example
        applied.write_text(yaml.safe_dump(manifest, sort_keys=False))
        self.kubectl("apply", "--namespace", NAMESPACE, "-f", str(applied))
        self.say(f"kubectl apply -f examples/{model.example} (model URL: {model_url}, {model.why})")
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

    def ask(self, base_url: str, *, served: str, model: DemoModel) -> str:
        endpoint = model.endpoint
        reply = httpx.post(
            f"{base_url}/{endpoint.value}",
            json=endpoint.body(model=served, prompt=model.prompt),
            timeout=ASK_TIMEOUT_S,
        )
        reply.raise_for_status()
        return endpoint.text(reply.json())


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


def run(*, model: DemoModel, keep_logs: bool) -> int:
    progress = Progress()
    signal.signal(signal.SIGTERM, _interrupt)
    with _work_dir(keep_logs) as work:
        # The file first: a model that cannot be had is refused before anything starts.
        models = work / "models"
        models.mkdir()
        path = model.file(models)
        progress.say("control plane: etcd, kube-apiserver, controller manager, scheduler and kwok on loopback")
        with ControlPlane(work_dir=work / "cluster", probe_readiness=True) as plane:
            demo = Demo(plane=plane, work=work, progress=progress)
            nodes = create_gpu_pool(demo.core)
            progress.say(f"GPU pool (kwok): {', '.join(nodes)}")
            demo.install_chart()
            with serve_directory(path.parent) as server:
                url = f"{server.url}/{path.name}"
                progress.say(f"model: {path} ({_megabytes(path.stat().st_size)}) served with Range at {url}")
                with PodRunner(
                    core=demo.core,
                    namespaces=[OPERATOR_NAMESPACE, NAMESPACE],
                    log_dir=work / "pods",
                    api_server=plane.server,
                    ca=plane.pki.ca.cert,
                ) as runner:
                    demo.wait_operator(runner)
                    name = demo.apply_example(model, url)
                    base_url, seconds = demo.wait_ready(name, runner)
                    progress.say(f"{name} is Ready {seconds:.1f} s after kubectl apply")
                    print(demo.kubectl("get", "modeldeployments", "--namespace", NAMESPACE), end="", flush=True)
                    served = demo.deployment(name)["status"]["modelName"]
                    print(f"> {model.prompt}\n{demo.ask(base_url, served=served, model=model)}", flush=True)
                    print(model.note, flush=True)
                    print(f"OpenAI endpoint: {base_url}", flush=True)
                    print(f"KUBECONFIG={plane.kubeconfig}", flush=True)
                    print(f"KUBECTL={plane.kubectl}", flush=True)
                    progress.say("serving until Ctrl-C")
                    while True:
                        time.sleep(3600)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=sorted(DEMO_MODELS),
        default=DEFAULT_MODEL,
        help=f"the model to serve (DEMO_MODEL in `make demo`; default {DEFAULT_MODEL})",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work folder (cluster and pod logs)")
    args = parser.parse_args(argv)
    try:
        return run(model=DEMO_MODELS[args.model], keep_logs=args.keep_logs)
    except KeyboardInterrupt:
        print("stopped: every process of the demo has ended", flush=True)
        return 0
    except (DemoFailed, ModelUnavailable, ApiException) as e:
        print(f"demo failed: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
