# The GPU image: Ray's own CUDA image at the Ray release pyproject.toml pins, with this package
# (and the cuDNN attention extra) installed. Serves configs/gpu.yaml by default.
#   docker build -t vlm-encoder-serve:gpu .
#   docker run --gpus all --shm-size=16g -p 8000:8000 vlm-encoder-serve:gpu
# Another config: append e.g. `serve run configs/multi-gpu.yaml`. Real weights without network:
# mount the checkpoint directory (-v /models/qwen3-vl-8b:/models/qwen3-vl-8b:ro) and set
# model.path (and llm.path) to it in a config of your own, mounted or copied into configs/.
# `serve deploy` onto a running cluster instead: build FROM this image for every node.
ARG RAY_IMAGE_TAG=2.60.0-py312-cu128
FROM rayproject/ray:${RAY_IMAGE_TAG}

WORKDIR /home/ray/vlm-encoder-serve
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users models ./models
COPY --chown=ray:users encoder_graphs ./encoder_graphs
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users configs ./configs
# torch comes from the package index as a CUDA build; Ray stays at the image's release (pinned alike).
RUN pip install --no-cache-dir ".[cudnn]" \
    && python -c "import deployments.app, ray; print('ray', ray.__version__)"

# 8000: HTTP (configs/*.yaml); 8265: Ray's dashboard.
EXPOSE 8000 8265
CMD ["serve", "run", "configs/gpu.yaml"]
