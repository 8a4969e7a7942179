#!/usr/bin/env bash
# Make room for a CANN image on a hosted runner: the CANN base image, the toolchains install.sh builds with
# and the exported layers need far more than the ~14 GB a fresh runner has free. Removes preinstalled SDKs
# that no image build uses, then the runner's cached docker images.
#   bash ci/images/free_disk.sh
set -euo pipefail

df -h /
unused=(
  /usr/share/dotnet /usr/local/lib/android /opt/ghc /usr/local/.ghcup /opt/hostedtoolcache/CodeQL
  /usr/local/share/boost /usr/share/swift /usr/local/share/powershell /usr/local/julia* /opt/microsoft
)
sudo rm -rf "${unused[@]}"
docker system prune --all --force
df -h /
