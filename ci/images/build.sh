#!/usr/bin/env bash
# The image pipeline of .github/workflows/images.yml, one subcommand per job. Tags come from
# python -m verl_npu.ci.images (<chip>-<stack.toml sha256>-<commit>, never "latest"); the registry
# from the repository owner, so forks push to and pull from their own.
#   bash ci/images/build.sh plan OWNER COMMIT                 registry, a2 and a3 tags -> $GITHUB_OUTPUT
#   bash ci/images/build.sh build CHIP ARCH COMMIT REGISTRY   build on a native ARCH runner, verify, push <tag>-ARCH
#   bash ci/images/build.sh merge CHIP COMMIT REGISTRY        <tag> = the multi-arch image over <tag>-amd64, -arm64
#   bash ci/images/build.sh verify CHIP ARCH COMMIT REGISTRY  pull <tag> for ARCH on a native runner and verify it
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ARCHES=(amd64 arm64)
die() { echo "build.sh: $*" >&2; exit 2; }
usage() { echo "build.sh: wrong arguments; usage:" >&2; sed -n 's/^#   //p' "$0" >&2; exit 2; }
tag() { python3 -m verl_npu.ci.images "$@"; }

native_arch() { # the runner's docker architecture; ARCH must match it: these images are never emulated
  case "$(uname -m)" in
    x86_64) echo amd64 ;;
    aarch64 | arm64) echo arm64 ;;
    *) die "unknown machine $(uname -m)" ;;
  esac
}

require_native() {
  local native
  native="$(native_arch)"
  [[ "$1" == "$native" ]] || die "asked for $1 on this $native runner: build and verify each architecture on its own runner (ubuntu-24.04 for amd64, ubuntu-24.04-arm for arm64); emulation is not used"
}

verify_in() { # verify_in IMAGE ARCH CHIP: the image is for ARCH and its build manifest matches the stack it carries
  local arch
  arch="$(docker image inspect --format '{{.Architecture}}' "$1")"
  [[ "$arch" == "$2" ]] || die "$1 is a $arch image, expected $2"
  docker run --rm --platform "linux/$2" --entrypoint python3 "$1" -m verl_npu.stack.build_manifest verify --target "$3"
}

command="${1:-}"
shift || true
case "$command" in
  plan)
    [[ $# -eq 2 ]] || usage
    a2="$(tag --chip a2 --commit "$2" --owner "$1")"
    a3="$(tag --chip a3 --commit "$2" --owner "$1")"
    printf 'registry=%s\na2=%s\na3=%s\n' "${a2%/verl-npu:*}" "$a2" "$a3" | tee -a "${GITHUB_OUTPUT:-/dev/null}"
    ;;
  build)
    [[ $# -eq 4 ]] || usage
    chip="$1" arch="$2"
    require_native "$arch"
    image="$(tag --chip "$chip" --commit "$3" --registry "$4" --arch "$arch")"
    # the tag names the commit and stack.toml, and is pushed only after its verification passed
    if docker buildx imagetools inspect "$image" >/dev/null 2>&1; then
      echo "$image: already built and verified by an earlier run"
    else
      echo "building $image"
      docker build --platform "linux/$arch" -f "docker/Dockerfile.$chip" -t "$image" .
      verify_in "$image" "$arch" "$chip"
      docker push "$image"
    fi
    echo "image=$image" >>"${GITHUB_OUTPUT:-/dev/null}"
    ;;
  merge)
    [[ $# -eq 3 ]] || usage
    image="$(tag --chip "$1" --commit "$2" --registry "$3")"
    sources=()
    for arch in "${ARCHES[@]}"; do
      sources+=("$(tag --chip "$1" --commit "$2" --registry "$3" --arch "$arch")")
    done
    docker buildx imagetools create -t "$image" "${sources[@]}"
    docker buildx imagetools inspect "$image"
    echo "image=$image" >>"${GITHUB_OUTPUT:-/dev/null}"
    ;;
  verify)
    [[ $# -eq 4 ]] || usage
    chip="$1" arch="$2"
    require_native "$arch"
    image="$(tag --chip "$chip" --commit "$3" --registry "$4")"
    docker pull --platform "linux/$arch" "$image"
    verify_in "$image" "$arch" "$chip"
    ;;
  *)
    die "unknown subcommand '$command': plan, build, merge or verify (see the top of ci/images/build.sh)"
    ;;
esac
