# The Kiln server image: `kiln serve` as a non-root user, the plan mounted read-only at
# /models/<plan>. Its one install step is scripts/setup.sh, the script the README's quick
# start (scripts/demo.sh) and CI (.ci/run -> scripts/test.sh) run: what CI tests is what
# this image runs. tests/unit/test_dockerfile.py keeps it that way.
#
#   docker build -t kiln-server:0.3.0 .          (the tag kiln deploy's chart uses)
#   docker run --read-only --tmpfs /tmp -p 8001:8001 -p 8002:8002 \
#     -v "$PWD/plans/smollm2-135m-int8-cpu:/models/smollm2-135m-int8-cpu:ro" \
#     kiln-server:0.3.0 serve /models/smollm2-135m-int8-cpu --host 0.0.0.0 \
#     --metrics-host 0.0.0.0
#
# Debian bookworm (the Debian the checks' tools come from) with Python 3.11.
FROM python:3.11-slim-bookworm

WORKDIR /opt/kiln
COPY . /opt/kiln
# As root, so setup.sh installs its Debian tools too; KILN_CHECK_TOOLS=0 leaves out those
# only the tests use (skopeo, umoci, nginx, the busybox .deb): the server runs none of them.
RUN KILN_CHECK_TOOLS=0 bash scripts/setup.sh

# The server's user: uid/gid 1000 as the chart's securityContext; HOME on /tmp, the one
# writable place (the chart mounts an emptyDir there under a read-only root filesystem).
RUN groupadd --gid 1000 kiln && \
    useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kiln
ENV PATH=/opt/kiln/.venv/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["kiln"]
CMD ["--help"]
