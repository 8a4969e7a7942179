"""Run pip's resolver as if on another Linux architecture: `cross_platform_pip.py ARCH pip-args...`.

pip's own `--platform` option only filters wheel tags: it still evaluates environment markers
(`platform_machine == "x86_64"`) against this machine and forbids source distributions, so an
aarch64 resolution from an x86_64 host pulls x86_64-only CUDA wheels and backtracks around
sdist-only packages (it picked hydra-core 0.11 for verl). Here both the marker environment and the
supported wheel tags describe ARCH, and sdists stay allowed, so the resolution is the one an
ARCH host would make. Use it only with `install --dry-run --ignore-installed --report FILE`.
"""

import platform
import sys


def main() -> int:
    machine, pip_args = sys.argv[1], sys.argv[2:]
    if "--dry-run" not in pip_args:
        print("cross_platform_pip.py only resolves: pass `install --dry-run`", file=sys.stderr)
        return 2
    platform.machine = lambda: machine

    # Patch before pip's other modules import get_supported by name.
    from pip._internal.utils import compatibility_tags

    original = compatibility_tags.get_supported

    def get_supported(version=None, platforms=None, impl=None, abis=None):
        if platforms is None:
            platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(28, 16, -1)]
            platforms += [f"manylinux2014_{machine}", f"linux_{machine}"]
        return original(version=version, platforms=platforms, impl=impl, abis=abis)

    compatibility_tags.get_supported = get_supported
    from pip._internal.cli.main import main as pip_main

    return pip_main(pip_args)


if __name__ == "__main__":
    sys.exit(main())
