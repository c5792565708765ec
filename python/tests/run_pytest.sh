#!/usr/bin/env bash
# ctest's runner of one pytest file: run_pytest.sh PYTHON FILE [pytest args].
# Exit code 77 (ctest's SKIP_RETURN_CODE) when PYTHON is unset or lacks torch or pytest, and when
# every test of the file skipped (e.g. the CUDA tests without a GPU), so ctest reports those as
# skipped rather than passed.
py=${1:-}
shift || true
if [ -z "$py" ]; then
  echo "skipped: no Python configured for the Python package's tests (./setup.sh --with-python sets KVCC_PYTHON)"
  exit 77
fi
if ! "$py" -c "import torch, pytest" >/dev/null 2>&1; then
  echo "skipped: $py cannot import torch and pytest (./setup.sh --with-python installs them)"
  exit 77
fi
report=$(mktemp)
trap 'rm -f "$report"' EXIT
"$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$report" "$@"
rc=$?
if [ $rc -eq 0 ] && "$py" - "$report" <<'PY'; then
import sys
import xml.etree.ElementTree as ET
suites = ET.parse(sys.argv[1]).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
tests = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
sys.exit(0 if tests > 0 and skipped == tests else 1)
PY
  echo "skipped: every test of this file skipped"
  exit 77
fi
exit $rc
