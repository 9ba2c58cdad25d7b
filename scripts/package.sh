#!/usr/bin/env bash
# Builds the Debian package, build/cubetorchfs_<version>_amd64.deb, from the build tree (the
# one scripts/build.sh makes; BUILD_DIR overrides), and prints its path. Needs dpkg-dev
# (dpkg-shlibdeps declares the libraries' packages). packaging/CMakeLists.txt lists what it
# holds; tests/integration/test_package.py checks it with lintian, dpkg --root and dpkg -i.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
[ -f "$BUILD/CMakeCache.txt" ] || { echo "package: no build tree in $BUILD (run scripts/build.sh)" >&2; exit 2; }
cmake "$BUILD" >/dev/null  # picks up packaging/ in a tree configured before it existed
cmake --build "$BUILD" --target cubetorchfs cubetorch_io -j"$(nproc)" >/dev/null
(cd "$BUILD" && cpack -G DEB >/dev/null)
version=$(sed -n 's/^project(cubetorchfs VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
deb="$BUILD/cubetorchfs_${version}_$(dpkg --print-architecture).deb"
[ -f "$deb" ] || { echo "package: cpack made no $deb" >&2; exit 1; }
echo "$deb"
