"""A cluster's env file (``NAME=VALUE`` lines, as ``ray_start.sh`` sources it), read without a shell.

Kept free of heavy imports: `verl-npu k8s render` reads env files, and the runtime patch that
forwards their variables to Ray workers (verl_npu.runtime_patches.ray_runtime_env, which re-exports
``env_file_variables``) lives in a package that imports torch.
"""

from __future__ import annotations

from pathlib import Path


def env_file_variables(path: str) -> dict[str, str]:
    """``KEY=VALUE`` / ``export KEY=VALUE`` lines of a shell env file (quotes stripped, no expansion)."""
    variables = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        name, sep, value = line.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"{path}:{number}: expected NAME=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        variables[name] = value
    return variables
