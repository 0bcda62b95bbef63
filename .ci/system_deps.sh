#!/usr/bin/env bash
# System libraries an optional test dependency loads, installed when this machine allows it:
# the Mooncake transfer engine's non-CUDA wheel (in k3[test]) needs libibverbs1 and librdmacm1
# (Debian packages). Best effort and bounded: it needs root and apt-get, each apt step is
# time-capped, and it never fails CI; where the libraries stay missing the Mooncake test
# skips naming what is missing (tests/unit/engine/test_pd_mooncake.py).
set -u
packages=(libibverbs1 librdmacm1)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "system libraries present: ${packages[*]}"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "::: not installing ${missing[*]} (needs root and apt-get): the Mooncake test will skip, naming them"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 180 apt-get update -qq > /dev/null 2>&1 \
        && timeout 300 apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null 2>&1; then
    echo "installed ${missing[*]}"
else
    echo "::: could not install ${missing[*]} through apt-get: the Mooncake test will skip, naming them"
fi
exit 0
