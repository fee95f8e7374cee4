# kvroute: the gateway (`kvroute serve`) and the simulated engine (`kvroute engine`)
# share this image; docker-compose.yml picks the subcommand.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# An unprivileged user with a fixed uid, so mounted config files only need to be world-readable.
RUN groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid kvroute --home-dir /home/kvroute --create-home \
      --shell /usr/sbin/nologin kvroute

WORKDIR /opt/kvroute
# Only what `pip install .` needs (see .dockerignore), and the pinned versions CI tests with.
COPY pyproject.toml README.md constraints.txt ./
COPY proxy ./proxy
COPY loadtest ./loadtest
# The source is not needed once installed (a regular, non-editable install). No extras: the
# simulator's plotting stack (kvroute[sim]) and locust (kvroute[loadtest]) stay out of the
# image. Installed size: docs/operations.md ("Image").
RUN pip install -c constraints.txt . \
 && cd / && rm -rf /opt/kvroute

# On SIGTERM, streams in flight may finish for shutdown.drain_s (default 600 s; the
# KVROUTE_DRAIN_S variable or --drain-s override it), then end with an SSE error event.
# Give the container longer than that to stop: docker stop -t 610, Compose
# stop_grace_period 610s, Kubernetes terminationGracePeriodSeconds 630 (with its preStop).
LABEL io.kvroute.shutdown.drain-seconds="600"
STOPSIGNAL SIGTERM

USER kvroute:kvroute
WORKDIR /home/kvroute
EXPOSE 8000
# Ready: serving and not shutting down (GET /ready; 503 once a drain begins). The engines
# that share this image (`kvroute engine`) set their own check (docker-compose.yml).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('KVROUTE_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["kvroute"]
# --reload-on-hup: no terminal in a container, and `docker kill -s HUP` means reload.
CMD ["serve", "--config", "/etc/kvroute/kvroute.yaml", "--reload-on-hup"]
