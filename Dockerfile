# The inferq image of compose.yaml: the package and its `inferq` entry point, nothing else.
FROM python:3.11-slim
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
ENTRYPOINT ["inferq"]
