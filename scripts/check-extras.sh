#!/usr/bin/env bash
# Check that `pip install -e '.[EXTRA]'` resolves for every extra pyproject.toml declares (the ones the
# README and docs/ tell users to install), as on a machine where nothing is installed yet:
#
#   ./scripts/check-extras.sh            # every extra
#   ./scripts/check-extras.sh vllm ray   # only these
#
# `pip install --dry-run --ignore-installed` resolves from the packages' metadata and installs nothing, so
# a pin that can never be met (such as an extra wanting a torch that moeconvert's own cap excludes) fails
# here with pip's ResolutionImpossible instead of on a user's machine. Prints one line per extra with the
# versions of the packages that decide whether it serves (torch, vllm, ray, transformers); exits 1 if any
# extra does not resolve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ $# -gt 0 ]; then
  extras=("$@")
else
  mapfile -t extras < <("$PY" - <<'EOF'
import re
text = open("pyproject.toml").read()
try:
    import tomllib
    names = tomllib.loads(text)["project"]["optional-dependencies"]
except ImportError:  # Python 3.10: the section's keys, one `name = [...]` a line
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    names = re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.M)
print("\n".join(names))
EOF
)
fi
report=$(mktemp "${TMPDIR:-/tmp}/moeconvert-extras.XXXXXX")
trap 'rm -f "$report" "$report.log"' EXIT
failed=()
for extra in "${extras[@]}"; do
  if "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$report" -e ".[$extra]" >"$report.log" 2>&1; then
    "$PY" - "$report" "$extra" <<'EOF'
import json, sys
report, extra = sys.argv[1], sys.argv[2]
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(report))["install"]}
shown = ", ".join(f"{n} {got[n]}" for n in ("torch", "vllm", "ray", "transformers") if n in got)
print(f"extras: .[{extra}] resolves ({len(got)} packages: {shown})")
EOF
  else
    failed+=("$extra")
    echo "extras: .[$extra] does NOT resolve:" >&2
    sed 's/^/  /' "$report.log" >&2
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "extras: ${#failed[@]} of ${#extras[@]} do not resolve: ${failed[*]}" >&2
  exit 1
fi
