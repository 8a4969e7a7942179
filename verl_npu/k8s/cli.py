"""`verl-npu k8s`: render a multi-node launch as a KubeRay RayJob or a Volcano Job; validate manifests.

    verl-npu k8s render rayjob --name glm5-2-grpo-1 --env-file examples/glm5_2/glm5_2.env \\
        --launch examples/glm5_2/run_glm5_2_grpo_a3.sh --commit <sha> --registry ghcr.io/<owner> \\
        -o glm5_2.rayjob.yaml -- trainer.total_training_steps=200
    verl-npu k8s render volcano ...   (same options; --queue)
    verl-npu k8s validate FILE...

Exit codes: 0 done; 1 a manifest does not validate; 2 a bad input (the message names it and the fix),
in which case nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _pvc(text: str) -> tuple[str, str]:
    claim, sep, mount = text.partition("=")
    if not sep or not claim or not mount:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CLAIM=MOUNT, e.g. verl-npu-cache=/root/.cache")
    return claim, mount


def _env(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def cmd_render(args: argparse.Namespace) -> int:
    from verl_npu.k8s import defaults, render

    request = render.Request(
        kind=args.kind,
        name=args.name,
        env_file=Path(args.env_file),
        launch=Path(args.launch),
        launch_args=tuple(args.launch_args),
        extra_env=tuple(args.env or ()),
        image=args.image,
        commit=args.commit,
        registry=args.registry,
        chip=args.chip,
        nnodes=args.nnodes,
        npus_per_node=args.npus_per_node,
        volumes=tuple(args.pvc) if args.pvc else defaults.DEFAULT_VOLUMES,
        pull_secrets=tuple(args.pull_secret) if args.pull_secret is not None else (defaults.DEFAULT_PULL_SECRET,),
        npu_resource=args.npu_resource,
        shm_size=args.shm_size,
        cpu=args.cpu,
        memory=args.memory,
        ray_start=Path(args.ray_start),
        deadline_s=args.deadline,
        ttl_s=args.ttl,
        namespace=args.namespace,
        queue=getattr(args, "queue", "default"),
        results_pod=args.results_pod,
        host_paths=() if args.no_host_paths else tuple(args.host_path or defaults.DEFAULT_HOST_PATHS),
        manifest=Path(args.manifest),
    )
    try:
        text = render.dump(render.render(request))
    except render.RenderError as exc:
        print(f"verl-npu k8s render: {exc}", file=sys.stderr)
        return 2
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        from verl_npu.k8s.files import write_atomically

        try:
            write_atomically(Path(args.output), text)
        except OSError as exc:
            print(f"verl-npu k8s render: -o {args.output}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from verl_npu.k8s import validate

    failed = False
    for name in args.files:
        try:
            problems = validate.validate_file(Path(name))
        except validate.ManifestError as exc:
            print(f"verl-npu k8s validate: {exc}", file=sys.stderr)
            return 2
        for problem in problems:
            print(f"verl-npu k8s validate: {problem}", file=sys.stderr)
        failed |= bool(problems)
        if not problems:
            print(f"{name}: valid")
    return 1 if failed else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `k8s` command group to the verl-npu parser."""
    from verl_npu.k8s import defaults

    k8s = subparsers.add_parser(
        "k8s", help="Kubernetes: render a multi-node launch (KubeRay, Volcano); validate manifests"
    )
    sub = k8s.add_subparsers(dest="k8s_command", required=True)

    render_parser = sub.add_parser(
        "render",
        help="a launch + env file as a KubeRay RayJob or a Volcano Job (with its ConfigMap), validated",
    )
    kinds = render_parser.add_subparsers(dest="kind", required=True)
    # The kind is a sub-command, not a positional: argparse matches a positional kind together with the
    # launch arguments' nargs="*" and would then refuse launch arguments given after the options.
    for kind, what in (
        ("rayjob", "a KubeRay RayJob (ray.io/v1)"),
        ("volcano", "a Volcano Job (batch.volcano.sh/v1alpha1)"),
    ):
        p = kinds.add_parser(
            kind,
            help=what,
            description=f"Render a multi-node launch as {what} and its ConfigMap; arguments after -- go to the "
            "launch script.",
        )
        p.add_argument("--name", required=True, help="object name, unique per run attempt (DNS-1035 label)")
        p.add_argument("--env-file", required=True, help="the cluster's env file (NAME=VALUE lines)")
        p.add_argument("--launch", required=True, help="launch script in this repository, run on the head")
        p.add_argument("--image", help="the image: REGISTRY/verl-npu:<chip>-<manifest sha>-<commit>")
        p.add_argument("--commit", help="instead of --image: the commit the image was built from")
        p.add_argument("--registry", help="with --commit (default on GitHub Actions: ghcr.io/<repository owner>)")
        p.add_argument("--chip", default="a3", help="a2 or a3 (default a3)")
        p.add_argument("--nnodes", type=_positive, help="nodes, head included (when the env file has no NNODES)")
        p.add_argument("--npus-per-node", type=_positive, help="NPUs per node (when the env file has no NPUS_PER_NODE)")
        p.add_argument("--pvc", action="append", type=_pvc, metavar="CLAIM=MOUNT",
                       help="ReadWriteMany claim mounted on every pod at MOUNT (repeatable; default "
                       "verl-npu-cache=/root/.cache)")  # fmt: skip
        p.add_argument("--pull-secret", action="append", metavar="NAME",
                       help=f"image pull secret (repeatable; default {defaults.DEFAULT_PULL_SECRET})")  # fmt: skip
        p.add_argument("--npu-resource", default=defaults.DEFAULT_NPU_RESOURCE, help="device plugin resource name")
        p.add_argument("--shm-size", default="256Gi", help="size limit of the memory-backed /dev/shm")
        p.add_argument("--cpu", default="160", help="CPU of each node pod (requests = limits)")
        p.add_argument("--memory", default="1400Gi", help="memory of each node pod, /dev/shm included")
        p.add_argument(
            "--ray-start", default="examples/glm5_2/ray_start.sh", help="the script that starts Ray on a node"
        )
        p.add_argument("--deadline", type=_positive, default=3 * 3600, help="seconds before the run is stopped")
        p.add_argument("--ttl", type=_positive, default=600, help="seconds the finished cluster stays for inspection")
        p.add_argument("--namespace", help="namespace of the objects (default: kubectl's)")
        if kind == "volcano":
            p.add_argument("--queue", default="default", help="Volcano queue")
        p.add_argument(
            "--results-pod", action="store_true", help="add a pod mounting the shared storage, to copy results"
        )
        p.add_argument("--env", action="append", type=_env, metavar="NAME=VALUE",
                       help="a variable for every node and the launch, after the env file's (repeatable)")  # fmt: skip
        p.add_argument("--host-path", action="append", metavar="PATH",
                       help="host file or directory mounted read-only at the same path (repeatable; default: "
                       + ", ".join(defaults.DEFAULT_HOST_PATHS) + ")")  # fmt: skip
        p.add_argument("--no-host-paths", action="store_true", help="mount no host paths (the device plugin does)")
        p.add_argument("-o", "--output", help="write the manifests here (atomically) instead of stdout")
        p.add_argument("launch_args", nargs="*", help="arguments of the launch script (after --)")
        p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="check manifests offline: Kubernetes' schemas, ours for RayJob / Volcano Job")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=cmd_validate)
