# The image ctxlaunch jobs run in (cluster.kubernetes.image): CUDA PyTorch 2.13.0 with
# ctxlaunch installed. Build and push it, then check it can start the trainer:
#
#   docker build -t REGISTRY/ctxlaunch:0.1.0 .
#   docker push REGISTRY/ctxlaunch:0.1.0
#   ctxlaunch image check JOB.yaml --set cluster.kubernetes.image=REGISTRY/ctxlaunch:0.1.0
#
# The base image is the one Kubeflow Trainer v2.3.0's stock torch-distributed runtime names,
# so torch is the project's pin (2.13.0, CUDA 13.0 build with NCCL) without reinstalling it;
# the install below is told to keep it (torch==2.13.0 on the same pip line).
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/ctxlaunch
# Everything the wheel is built from: the package, its templates, and the files it hands out
# (`ctxlaunch examples`, `dashboard`, `alerts`; pyproject.toml's force-include) and its license.
COPY pyproject.toml README.md LICENSE ./
COPY ctxlaunch ./ctxlaunch
COPY templates ./templates
COPY manifests ./manifests
COPY jobs ./jobs
RUN python3 -m pip install "torch==2.13.0" ".[train]" \
    && python3 -c "import torch, torch.distributed as d; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', d.is_nccl_available())"

# Jobs run as this user, never root: the pods' securityContext (cluster.kubernetes.run_as_user,
# default 1000) sets runAsNonRoot and this id. Its home is where caches go.
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin ctxlaunch
USER 1000:1000
ENV HOME=/home/ctxlaunch

# The probe `ctxlaunch image check` runs; a job's pods run `python3 -m ctxlaunch.runtime.podentry SPEC`
# (the rendered command), so the entry point is only the default for `docker run IMAGE`.
ENTRYPOINT ["ctxlaunch"]
CMD ["--help"]
