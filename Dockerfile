# One image for every Flywheel role: `docker run flywheel <role>` (api, streams, trainer,
# controller, replica, db upgrade, ...). Dependencies are pinned by requirements.lock.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLYWHEEL_DATA_DIR=/var/lib/flywheel FLYWHEEL_PROFILE=production

# gcc: kernels/fixed_order.py compiles its GEMM for the CPU it runs on, at first use
RUN apt-get update && apt-get install -y --no-install-recommends curl gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 flywheel && mkdir -p /var/lib/flywheel && chown flywheel /var/lib/flywheel

WORKDIR /srv/flywheel
COPY requirements.lock pyproject.toml README.md ./
RUN pip install -r requirements.lock
COPY app app
COPY streams streams
COPY trainer trainer
COPY policy policy
COPY kernels kernels
COPY migrations migrations
COPY deploy deploy
COPY alembic.ini ./
RUN pip install --no-deps -e .

USER flywheel
ENTRYPOINT ["flywheel"]
CMD ["--help"]
