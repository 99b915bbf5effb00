# syntax=docker/dockerfile:1
# One image for the three roles: `strata operator`, `strata stage-worker` and `strata gateway`.
#
#   docker build --build-arg VARIANT=cpu  -t strata:0.1.0 .        # the operator, and stages on CPU
#   docker build --build-arg VARIANT=cuda -t strata:0.1.0-cuda .   # stage and gateway pods on NVIDIA GPUs
#
# The variants differ only in the torch wheel: PyPI's torch bundles the CUDA runtime (the node supplies the
# driver); the CPU variant takes torch from PyTorch's CPU index and is about 4 GB smaller. Every other dependency
# is pinned by constraints.txt, exactly as in development.

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ARG VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/strata
ENV PATH=/opt/strata/bin:$PATH
WORKDIR /src
# Dependencies first, in their own layer: source edits do not reinstall torch.
COPY constraints.txt ./
RUN case "$VARIANT" in \
      cpu) index="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple" ;; \
      cuda) index="" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac \
    && pip install $index -c constraints.txt torch \
    && pip install -c constraints.txt grpcio-tools
COPY pyproject.toml README.md ./
COPY core core
COPY operator operator
COPY stage_worker stage_worker
COPY gateway gateway
COPY protos protos
RUN pip install -c constraints.txt . \
    # Protos compile straight into the installed package: the generated code is never committed.
    && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && python -m grpc_tools.protoc -Iprotos --python_out="$site" --pyi_out="$site" --grpc_python_out="$site" \
         $(find protos -name '*.proto') \
    && pip uninstall --yes grpcio-tools \
    && python -c 'import strata.rpc.v1.stage_pb2, strata.cli'

FROM python:${PYTHON_VERSION}-slim AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="strata" \
      org.opencontainers.image.description="Strata: GGUF models split layer-wise across GPUs (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.strata.variant="${VARIANT}"
# 10001 is RUN_AS_USER in strata/operator/children.py and runAsUser in the chart: the pods' securityContext.
RUN groupadd --system --gid 10001 strata \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin strata
COPY --from=build /opt/strata /opt/strata
ENV PATH=/opt/strata/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
ENTRYPOINT ["strata"]
CMD ["--help"]
