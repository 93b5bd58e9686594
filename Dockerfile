# The bridge image: `docker compose up` runs it beside an apache/kafka broker (compose.yaml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bridge ./bridge
COPY handlers ./handlers
COPY localkafka ./localkafka
RUN pip install --no-cache-dir . && useradd --create-home rdq && mkdir -p /data && chown rdq /data
USER rdq
VOLUME ["/data"]
ENV RDQ_STORE__PATH=/data/rdq.db
ENTRYPOINT ["rdq"]
CMD ["run", "--config", "/config/bridge.yaml"]
