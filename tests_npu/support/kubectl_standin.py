#!/usr/bin/env python3
"""A stand-in for kubectl (no cluster in CI), for the tests of the ci/k8s scripts; standard library only.

It records every call in $FAKE/calls and answers from files under $FAKE:
  claims         the claim names the server-side dry run lists (default: "shared", twice)
  modes          a claim's access modes (kubectl get pvc NAME -o jsonpath={.spec.accessModes})
  rayjob/NNN.*   successive answers to `kubectl get rayjob/NAME -o json`, one per call, the last repeated:
                 NNN.json is the RayJob object (support/kuberay_rayjob.py writes them); NNN.notfound answers as
                 kubectl does for an object that does not exist, NNN.unreachable as it does when the API server
                 does not answer (both exit 1)
  pod-ready      present: the results pod is Ready;  results-exist  present: the results directory exists
  can-i          "no": `kubectl auth can-i ...` answers no (exit 1); otherwise yes. $FAKE/kubeconfig-seen gets
                 the KUBECONFIG each such call ran with
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FAKE = Path(os.environ["FAKE"])


def rayjob_answer() -> Path:
    """This poll's answer file."""
    polls = FAKE / "polls"
    n = int(polls.read_text()) + 1 if polls.exists() else 1
    polls.write_text(str(n))
    answers = sorted((FAKE / "rayjob").iterdir())
    if not answers:
        sys.exit(f"kubectl stand-in: no answers under {FAKE / 'rayjob'}")
    return answers[min(n, len(answers)) - 1]


def get_rayjob(name: str) -> int:
    answer = rayjob_answer()
    if answer.suffix == ".notfound":
        print(f'Error from server (NotFound): rayjobs.ray.io "{name}" not found', file=sys.stderr)
        return 1
    if answer.suffix == ".unreachable":
        print("Unable to connect to the server: dial tcp 10.247.0.1:443: i/o timeout", file=sys.stderr)
        return 1
    sys.stdout.write(answer.read_text())
    return 0


def main(args: list[str]) -> int:
    with (FAKE / "calls").open("a") as calls:
        calls.write(" ".join(args) + "\n")
    line = " ".join(args)
    if "--dry-run=server" in args:
        if "-o" in args:  # the claim names the manifest mounts
            claims = FAKE / "claims"
            sys.stdout.write(claims.read_text() if claims.exists() else "shared\nshared\n")
        return 0
    match args:
        case ["auth", "can-i", *_]:
            (FAKE / "kubeconfig-seen").write_text(os.environ.get("KUBECONFIG", ""))
            answer = (FAKE / "can-i").read_text().strip() if (FAKE / "can-i").exists() else "yes"
            print(answer)
            return 0 if answer == "yes" else 1
        case ["get", "pvc", _, *_]:
            sys.stdout.write((FAKE / "modes").read_text())
        case ["get", rayjob, "-o", "json"] if rayjob.startswith("rayjob/"):
            return get_rayjob(rayjob.removeprefix("rayjob/"))
        case ["get", rayjob, "-o", "yaml"] if rayjob.startswith("rayjob/"):
            last = sorted((FAKE / "rayjob").glob("*.json"))
            sys.stdout.write(last[-1].read_text() if last else "")
        case ["get", "pods", *_]:
            print("No resources found in default namespace.", file=sys.stderr)
        case ["logs", job, *_] if job.startswith("job/"):
            print("step:15 - done")
        case ["wait", *_]:
            return 0 if (FAKE / "pod-ready").exists() else 1
        case ["get", pod] if pod.startswith("pod/"):
            return 0 if (FAKE / "pod-ready").exists() else 1
        case ["exec", *_] if "test -d" in line:
            return 0 if (FAKE / "results-exist").exists() else 1
        case ["cp", *_, dest]:
            Path(dest).mkdir(parents=True, exist_ok=True)
            (Path(dest) / "train.log").write_text("log\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
