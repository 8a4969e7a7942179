"""`verl-npu k8s`: render a multi-node launch as a KubeRay RayJob or a Volcano Job; validate manifests.

    verl-npu k8s render rayjob --name glm5-2-grpo-1 --env-file examples/glm5_2/glm5_2.env \\
        --launch examples/glm5_2/run_glm5_2_grpo_a3.sh --commit <sha> --registry ghcr.io/<owner> \\
        --memory 960Gi --shm-size 64Gi -o glm5_2.rayjob.yaml -- trainer.total_training_steps=200
    verl-npu k8s render volcano ...   (same options; --queue)
    verl-npu k8s validate FILE...

Exit codes: 0 done; 1 a manifest does not validate, or the render's preflight refused the launch (a NO-GO, or a
memory request under the host RAM it needs); 2 a bad input (the message names it and the fix). Nothing is
written unless the exit code is 0.
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


def _count(option: str, maximum: int | None = None):
    """An argparse type: a positive count through verl_npu.inputs (its error, naming the option, is argparse's)."""

    def parse(text: str) -> int:
        from verl_npu import inputs

        try:
            return inputs.integer(option, text, minimum=1, maximum=maximum or inputs.MAX_DEVICES)
        except inputs.InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


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
        max_nodes=args.max_nodes,
        volumes=tuple(args.pvc) if args.pvc else defaults.DEFAULT_VOLUMES,
        pull_secrets=tuple(args.pull_secret) if args.pull_secret is not None else (defaults.DEFAULT_PULL_SECRET,),
        npu_resource=args.npu_resource,
        shm_size=args.shm_size,
        cpu=args.cpu,
        memory=args.memory,
        ray_start=Path(args.ray_start),
        deadline_s=args.deadline,
        step_time_s=args.step_time,
        startup_time_s=args.startup_time,
        ttl_s=args.ttl,
        namespace=args.namespace,
        queue=getattr(args, "queue", "default"),
        results_pod=args.results_pod,
        host_directories=_host_paths(args, args.host_path, defaults.DEFAULT_HOST_DIRECTORIES),
        host_files=_host_paths(args, args.host_file, defaults.DEFAULT_HOST_FILES),
        trainer_launch=Path(args.trainer_launch) if args.trainer_launch else None,
        model_config=args.model_config,
        preflight=not args.no_preflight,
        manifest=Path(args.manifest),
    )
    if args.output not in (None, "-") and Path(args.output).parent.is_dir():  # a missing directory is made later
        from verl_npu import atomic

        why = atomic.output_problem(args.output)  # before the render's preflight: a bad -o costs no work
        if why is not None:
            print(f"verl-npu k8s render: -o {args.output}: {why}", file=sys.stderr)
            return 2
    try:
        docs = render.render(request)
    except render.RenderError as exc:
        print(f"verl-npu k8s render: {exc}", file=sys.stderr)
        return 2
    except render.LaunchRefused as exc:
        print("verl-npu k8s render: NO-GO, nothing written:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    annotations = docs[1]["metadata"]["annotations"]  # what the render checked, and the deadline it set
    warning = "" if request.preflight else "WARNING: "
    print(f"verl-npu k8s render: {warning}preflight {annotations[render.PREFLIGHT_ANNOTATION]}", file=sys.stderr)
    print(f"verl-npu k8s render: deadline {annotations[render.DEADLINE_ANNOTATION]}", file=sys.stderr)
    text = render.dump(docs)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        from verl_npu.k8s.files import write_atomically

        try:
            write_atomically(Path(args.output), text)
        except (OSError, ValueError) as exc:  # ValueError: atomic.OutputPathError, the path changed kind meanwhile
            print(f"verl-npu k8s render: -o {args.output}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _host_paths(args: argparse.Namespace, given: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """Given paths replace the defaults of their kind (directories, files); --no-host-paths mounts none."""
    if args.no_host_paths:
        return ()
    return tuple(given) if given else default


def cmd_validate(args: argparse.Namespace) -> int:
    from verl_npu.k8s import validate

    failed = False
    for name in args.files:
        try:
            problems = validate.validate_file(Path(name), args.max_nodes)
        except validate.ManifestError as exc:
            print(f"verl-npu k8s validate: {exc}", file=sys.stderr)
            return 2
        for problem in problems:
            print(f"verl-npu k8s validate: {problem}", file=sys.stderr)
        failed |= bool(problems)
        if not problems:
            print(f"{name}: valid")
    return 1 if failed else 0


def _max_nodes_option(parser: argparse.ArgumentParser) -> None:
    from verl_npu.k8s import defaults

    # a Volcano pod's hostname <job>-worker-<index> has room for a 5-digit index (render._check_name)
    most = defaults.MAX_NODES_LIMIT
    parser.add_argument("--max-nodes", type=_count("--max-nodes", most), default=defaults.DEFAULT_MAX_NODES,
                        help="the most node pods (head included) a job may start: your cluster's nodes "
                        f"(default {defaults.DEFAULT_MAX_NODES}, Kubernetes' limit for one cluster)")  # fmt: skip


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
        p.add_argument("--nnodes", type=_count("--nnodes"),
                       help="nodes, head included (when the env file has no NNODES)")  # fmt: skip
        p.add_argument("--npus-per-node", type=_count("--npus-per-node"),
                       help="NPUs per node (when the env file has no NPUS_PER_NODE)")  # fmt: skip
        _max_nodes_option(p)
        p.add_argument("--pvc", action="append", type=_pvc, metavar="CLAIM=MOUNT",
                       help="ReadWriteMany claim mounted on every pod at MOUNT (repeatable; default "
                       "verl-npu-cache=/root/.cache)")  # fmt: skip
        p.add_argument("--pull-secret", action="append", metavar="NAME",
                       help=f"image pull secret (repeatable; default {defaults.DEFAULT_PULL_SECRET})")  # fmt: skip
        p.add_argument("--npu-resource", default=defaults.DEFAULT_NPU_RESOURCE, help="device plugin resource name")
        p.add_argument("--shm-size", default=defaults.DEFAULT_SHM_SIZE,
                       help="size limit of the memory-backed /dev/shm, part of --memory "
                       f"(default {defaults.DEFAULT_SHM_SIZE})")  # fmt: skip
        p.add_argument("--cpu", default=defaults.DEFAULT_CPU,
                       help=f"CPU of each node pod, requests = limits (default {defaults.DEFAULT_CPU})")  # fmt: skip
        p.add_argument("--memory", default=defaults.DEFAULT_MEMORY,
                       help="memory of each node pod, requests = limits, /dev/shm included; preflight's host RAM "
                       f"estimate of the busiest node must fit (default {defaults.DEFAULT_MEMORY})")  # fmt: skip
        p.add_argument(
            "--ray-start", default="examples/glm5_2/ray_start.sh", help="the script that starts Ray on a node"
        )
        p.add_argument("--deadline", metavar="SECONDS",
                       help="stop the run after this many seconds (default: no deadline)")  # fmt: skip
        p.add_argument("--step-time", metavar="SECONDS",
                       help="instead of --deadline: seconds per training step; the deadline is --startup-time plus "
                       "the launch's trainer.total_training_steps times this")  # fmt: skip
        p.add_argument("--startup-time", metavar="SECONDS",
                       help="with --step-time: seconds before the first step (default 2400: the nodes' start, image "
                       "pulls, Ray and the HCCL smoke test); add the model's load")  # fmt: skip
        p.add_argument("--ttl", metavar="SECONDS", default=600,
                       help="seconds the finished cluster stays for inspection (default 600)")  # fmt: skip
        p.add_argument("--namespace", help="namespace of the objects (default: kubectl's)")
        if kind == "volcano":
            p.add_argument("--queue", default="default", help="Volcano queue")
        p.add_argument(
            "--results-pod", action="store_true", help="add a pod mounting the shared storage, to copy results"
        )
        p.add_argument("--env", action="append", type=_env, metavar="NAME=VALUE",
                       help="a variable for every node and the launch, after the env file's (repeatable)")  # fmt: skip
        p.add_argument("--host-path", action="append", metavar="DIR",
                       help="host directory mounted read-only at the same path; the pod does not start where the node "
                       "lacks it (repeatable; replaces the default "
                       + ", ".join(defaults.DEFAULT_HOST_DIRECTORIES) + ")")  # fmt: skip
        p.add_argument("--host-file", action="append", metavar="FILE",
                       help="host file mounted read-only at the same path, e.g. npu-smi (repeatable; replaces the "
                       "default " + ", ".join(defaults.DEFAULT_HOST_FILES) + ")")  # fmt: skip
        p.add_argument("--no-host-paths", action="store_true",
                       help="mount no host paths (the device plugin and Ascend Docker Runtime do)")  # fmt: skip
        p.add_argument("--trainer-launch", metavar="SCRIPT",
                       help="the script in this repository that runs the verl trainer, when --launch runs it through "
                       "another (ci/nightly/run_job.sh runs ci/nightly/jobs/JOB.sh); preflight and --step-time read "
                       "it (default: --launch with the launch arguments)")  # fmt: skip
        p.add_argument("--model-config", metavar="PATH|ID|glm5",
                       help="the model's config for preflight (as `verl-npu preflight --model-config`)")  # fmt: skip
        p.add_argument("--no-preflight", action="store_true",
                       help="skip preflight (the host RAM is then not checked against --memory)")  # fmt: skip
        p.add_argument("-o", "--output", help="write the manifests here (atomically) instead of stdout")
        p.add_argument("launch_args", nargs="*", help="arguments of the launch script (after --)")
        p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="check manifests offline: Kubernetes' schemas, ours for RayJob / Volcano Job")
    p.add_argument("files", nargs="+")
    _max_nodes_option(p)
    p.set_defaults(func=cmd_validate)
