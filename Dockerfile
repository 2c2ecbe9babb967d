# The ampwatch server image: FastAPI + SQLAlchemy + Alembic, no torch.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY client ./client
COPY migrations ./migrations
COPY agent ./agent
RUN pip install --no-cache-dir ".[server]"

RUN useradd --create-home ampwatch
USER ampwatch
EXPOSE 8000
ENV AMPWATCH_HOST=0.0.0.0 AMPWATCH_PORT=8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/api/v1/health')"
CMD ["ampwatch", "serve"]
