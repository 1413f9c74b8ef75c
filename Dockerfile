# CPU image: installs asyncrl the way the README does (make setup) and runs the demo by default.
FROM python:3.11-slim
# bubblewrap is the sandbox for model-written code (docs/algorithms/absolute_zero.md). Docker's default seccomp
# and AppArmor profiles may refuse the namespaces and mounts it makes; a code_o run then refuses to
# start and says why (docker run --security-opt seccomp=unconfined --security-opt apparmor=unconfined,
# or sandbox.isolation: remote).
RUN apt-get update && apt-get install -y --no-install-recommends make bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/asyncrl
COPY pyproject.toml setup.py Makefile README.md ./
COPY requirements ./requirements
COPY asyncrl ./asyncrl
COPY app ./app
COPY configs ./configs
COPY bench ./bench
COPY tests ./tests
COPY examples ./examples
COPY notebooks ./notebooks
COPY docs ./docs
# PyPI's default torch wheel for Linux is a CUDA build of several GB: take the CPU one.
RUN make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Build the embedded model at image build time so the demo starts training at once.
RUN .venv/bin/asyncrl init-model --config configs/quickstart.yaml
CMD ["make", "demo"]
