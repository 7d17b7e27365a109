# smart-epp: the endpoint picker as a container image.
#   docker build -t smart-epp:0.1.0 .
# Two stages: the build stage installs the package and its dependencies into a virtual
# environment; the final stage copies only that environment onto the same slim base, so no
# pip cache, sources or build tooling reach the image. Every dependency ships manylinux
# wheels, so no compiler is needed in either stage.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/smart-epp
WORKDIR /src
COPY pyproject.toml setup.py README.md __init__.py ./
COPY framework/ framework/
COPY epp/ epp/
COPY proto/ proto/
COPY scorers/ scorers/
COPY kv_index/ kv_index/
COPY benchmarks/ benchmarks/
# xds-protos ships an old copy of opentelemetry/proto/**; reinstalling opentelemetry-proto
# last puts the files the OTLP exporter imports back.
RUN /opt/smart-epp/bin/pip install . \
 && /opt/smart-epp/bin/pip install --force-reinstall --no-deps "opentelemetry-proto==$( \
      /opt/smart-epp/bin/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
 && /opt/smart-epp/bin/pip uninstall --yes pip setuptools wheel
# `epp envoy` renders this template from beside the installed package.
COPY deploy/envoy/envoy.yaml.j2 /opt/smart-epp/share/envoy.yaml.j2
RUN package=$(/opt/smart-epp/bin/python -c \
      "import pathlib, smart_epp.epp as e; print(pathlib.Path(e.__file__).parents[1])") \
 && mkdir -p "$package/deploy/envoy" \
 && mv /opt/smart-epp/share/envoy.yaml.j2 "$package/deploy/envoy/" \
 && rmdir /opt/smart-epp/share

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="smart-epp" \
      org.opencontainers.image.description="KV-cache-aware endpoint picker (Envoy ext_proc) for vLLM pools" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/smart-epp /opt/smart-epp
ENV PATH=/opt/smart-epp/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# An unprivileged user with no login shell and no home to write to.
RUN useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin smart-epp
USER 65532:65532
# ext_proc gRPC (TLS by default), gRPC health (plaintext, for kubelet probes), Prometheus.
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp"]
CMD ["serve"]
