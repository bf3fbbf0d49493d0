#!/usr/bin/env bash
# Headless Chromium for the report's browser test (tests/test_report_browser.py): Debian's `chromium` package,
# installed with apt-get when no `chromium` is on PATH. Nothing else is downloaded. Safe to re-run.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no chromium on PATH and no apt-get to install Debian's package" >&2
  exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install_browser: installing chromium needs root (or sudo)" >&2; exit 1; }
  SUDO=(sudo -n)
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium
command -v chromium >/dev/null 2>&1 || { echo "install_browser: chromium is still not on PATH" >&2; exit 1; }
chromium --version
