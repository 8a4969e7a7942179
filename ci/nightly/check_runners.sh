#!/usr/bin/env bash
# Fail at once, saying what the repository lacks, when it has not declared the self-hosted Ascend runners
# WORKFLOW's jobs run on: GitHub keeps a job whose runs-on no runner can take queued for 24 hours or more
# before it cancels it (ci/README.md, "Runners, variables and secrets"). Run by each workflow's `runners`
# job on a hosted runner; every Ascend job needs it.
#   bash ci/nightly/check_runners.sh WORKFLOW LABEL...
# LABELs: the runner scale sets WORKFLOW's jobs name in runs-on. The workflow passes the repository variables:
#   ASCEND_RUNNER_GROUP   the runner group that holds those scale sets and lets this repository use them
#   ASCEND_RUNNER_LABELS  the scale sets of that group this repository may use, separated by spaces
# Exit 0: all declared; 1: something is missing (one line per problem, and an ::error:: annotation on
# GitHub Actions); 2: bad arguments.
set -euo pipefail

usage="usage: check_runners.sh WORKFLOW LABEL..."
WORKFLOW="${1:?$usage}"
shift
(($# > 0)) || { echo "$usage" >&2; exit 2; }
for label in "$@"; do
  [[ "$label" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "check_runners.sh: '$label' is not a runner label" >&2; exit 2; }
done

GROUP="${ASCEND_RUNNER_GROUP:-}"
read -r -a declared <<<"${ASCEND_RUNNER_LABELS:-}"
missing=()
for label in "$@"; do
  [[ " ${declared[*]} " == *" $label "* ]] || missing+=("$label")
done

problems=()
if [[ -z "$GROUP" ]]; then
  problems+=("the repository variable ASCEND_RUNNER_GROUP is not set: set it to the runner group that holds the Ascend runner scale sets and gives this repository access to them")
fi
if ((${#missing[@]} > 0)); then
  problems+=("the repository variable ASCEND_RUNNER_LABELS (${ASCEND_RUNNER_LABELS:-not set}) does not list ${missing[*]}: add each once its runner scale set exists in the group and serves this repository")
fi
if ((${#problems[@]} == 0)); then
  echo "$WORKFLOW: runner group '$GROUP' has the runner scale sets $*"
  exit 0
fi

for problem in "${problems[@]}"; do
  [[ "${GITHUB_ACTIONS:-}" != true ]] || echo "::error title=$WORKFLOW needs Ascend runners::$problem"
  echo "check_runners.sh: $problem" >&2
done
echo "check_runners.sh: $WORKFLOW's jobs run on self-hosted Ascend runners named $* (Actions Runner Controller scale sets, as upstream verl's, which belong to the verl-project organisation and serve only its repositories). Rather than let those jobs queue for 24 hours, this run stops here. What a repository needs: ci/README.md, \"Runners, variables and secrets\"." >&2
exit 1
