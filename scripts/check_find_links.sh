#!/usr/bin/env bash
# Checks that each variant folder scripts/build_wheels.sh wrote installs its own wheel with one pip command.
#
#   scripts/check_find_links.sh DIST        (DIST/cpu, DIST/cu130, DIST/cu124: the --find-links folders)
#
# For each folder: a fresh venv, `pip install --no-index --no-deps --find-links DIST/VARIANT gradacc_ext`
# (--no-index: nothing but the folder can answer; --no-deps: torch is the user's, not the point here), then
# the installed version's local label must be the folder's (none for cpu). Last, the reason for the folders:
# pip offered every wheel at once picks +cu130 whatever the machine, so that is asserted too.
set -euo pipefail
dist="$(realpath "${1:?usage: scripts/check_find_links.sh DIST}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

installed_version() {  # installed_version FIND_LINKS...: the version a fresh venv installs from those folders
  local venv="$work/venv-$RANDOM" links=()
  for dir in "$@"; do links+=(--find-links "$dir"); done
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps "${links[@]}" gradacc_ext >&2
  "$venv/bin/python" -I -c 'import importlib.metadata as m; print(m.version("gradacc_ext"))'  # -I: not the cwd's metadata
  rm -rf "$venv"
}

folders=()
for dir in "$dist"/*/; do
  variant="$(basename "$dir")"
  folders+=("$dir")
  version="$(installed_version "$dir")"
  label="${version#*+}"; [[ $version == *+* ]] || label=cpu
  [[ $label == "$variant" ]] || { echo "error: $dir installed $version, not the $variant variant" >&2; exit 1; }
  echo "pip install --find-links $dir gradacc_ext -> gradacc_ext $version"
done
[[ ${#folders[@]} -gt 1 ]] || { echo "error: $dist holds fewer than two variant folders" >&2; exit 1; }
all="$(installed_version "${folders[@]}")"
newest="$(cd "$dist" && ls -d cu* | sort -V | tail -n1)"
[[ $all == *"+$newest" ]] || { echo "error: every folder at once gave $all, expected +$newest (pip's order)" >&2; exit 1; }
echo "every folder at once -> gradacc_ext $all: pip takes the highest local version, hence one folder per variant"
