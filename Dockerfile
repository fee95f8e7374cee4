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
# Only what `pip install .` needs (see .dockerignore). Without a lock file the package and
# its dependencies install in one step.
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY loadtest ./loadtest
# The source is not needed once installed (a regular, non-editable install). No extras: the
# simulator's plotting stack (kvroute[sim]) and locust (kvroute[loadtest]) stay out of the
# image (site-packages 94 MB instead of 267 MB, measured with `pip install .` in a venv).
RUN pip install . \
 && cd / && rm -rf /opt/kvroute

USER kvroute:kvroute
WORKDIR /home/kvroute
EXPOSE 8000
ENTRYPOINT ["kvroute"]
CMD ["serve", "--config", "/etc/kvroute/kvroute.yaml"]
