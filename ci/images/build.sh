#!/usr/bin/env bash
# Build and push the image of one chip for amd64 and arm64 (buildx), tagged by the manifest hash
# and the commit (verl-npu ci image-tag; never "latest"), then check the image's build manifest.
#   bash ci/images/build.sh CHIP COMMIT [REGISTRY]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

CHIP="${1:?usage: build.sh a2|a3 COMMIT [REGISTRY]}"
COMMIT="${2:?usage: build.sh a2|a3 COMMIT [REGISTRY]}"
REGISTRY="${3:-ghcr.io/verl-npu}"
TAG="$(python3 -m verl_npu.ci.images --chip "$CHIP" --commit "$COMMIT" --registry "$REGISTRY")"
echo "building $TAG"
docker buildx build --platform linux/amd64,linux/arm64 -f "docker/Dockerfile.$CHIP" -t "$TAG" --push .
for platform in linux/amd64 linux/arm64; do
  docker run --rm --platform "$platform" --entrypoint python3 "$TAG" \
    -m verl_npu.stack.build_manifest verify --target "$CHIP"
done
echo "image=$TAG" >>"${GITHUB_OUTPUT:-/dev/null}"
